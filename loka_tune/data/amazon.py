"""Amazon review CTR samples with user behaviour sequences, in the DIN / DIEN layout.

The public Amazon (Books, Electronics) CTR benchmarks of DIN and DIEN, which InterFormer's
paper also evaluates on, come as one example per line, tab-separated, no header::

    label \\t user_id \\t item_id \\t category \\t item_history \\t category_history

- ``label``: ``0`` or ``1`` (the target item was the user's next review, or a sampled negative).
- ``user_id``, ``item_id``, ``category``: categorical values (ASINs, user hashes, category
  names), hashed with :func:`loka_tune.data.hashing.stable_id` into the sparse features
  ``item``, ``user``, ``category``, in that order: ``item`` is sparse feature 0, the id space
  of the behaviour sequence (:class:`~loka_tune.data.base.Batch`).
- ``item_history``: the user's earlier items, oldest first, separated by ``hist_sep`` (``\\x02``
  in the DIEN files); hashed with the ``item`` feature's hash, so an item has the same id as
  a target and as an event. The last ``seq_len`` events are kept. Empty: no events.
- ``category_history``: the categories of those events; checked to have as many entries as
  ``item_history`` (a mismatch means a broken row), otherwise unused (one sequence per row).
- one dense feature, ``hist_len``: ``log(1 + number of events)`` over the whole history.

Errors (:class:`~loka_tune.errors.DataError` with the path and the 1-based line number): a
field count other than 6, a label other than 0/1, an empty item id, histories of different
lengths, an empty event inside a history; plus the file-level errors of every file source
(missing, empty, not UTF-8, corrupt gzip). With ``on_bad_row="skip"`` bad rows are skipped,
counted in ``skipped_rows`` and reported in one warning.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from ..errors import ConfigError
from .files import FileSource, RowError, resolve_hash_sizes
from .hashing import IdCache

__all__ = ["AmazonSource", "AmazonFormat", "AMAZON_FIELDS"]

AMAZON_FIELDS = ("label", "user_id", "item_id", "category", "item_history", "category_history")
AMAZON_SPARSE = ("item", "user", "category")  # item first: the sequence's id space
_MAX_SEQ_LEN = 4096


class AmazonFormat:
    """Parses one DIN / DIEN Amazon line (see the module docstring)."""

    kind = "amazon"
    has_header = False
    dense_names: tuple[str, ...] = ("hist_len",)
    sparse_names: tuple[str, ...] = AMAZON_SPARSE

    def __init__(self, hash_sizes: Sequence[int], seq_len: int = 50, hist_sep: str = "\x02") -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= _MAX_SEQ_LEN:
            raise ConfigError(f"must be an int in [1, {_MAX_SEQ_LEN}], got {seq_len=!r}", key="seq_len")
        if not isinstance(hist_sep, str) or not hist_sep or hist_sep == "\t":
            raise ConfigError(
                f"must be a non-empty separator other than a tab, got {hist_sep=!r} (DIEN files use '\\x02')",
                key="hist_sep",
            )
        self.cardinalities = tuple(hash_sizes)
        self.seq_len = int(seq_len)
        self.hist_sep = hist_sep
        self._ids = [IdCache(n, h) for n, h in zip(AMAZON_SPARSE, self.cardinalities)]

    def read_header(self, line: str, path: str) -> None:  # no header in these files
        pass

    def parse(self, line: str) -> tuple[float, list[float], list[int], list[int]]:
        fields = line.split("\t")
        if len(fields) != len(AMAZON_FIELDS):
            hint = ""
            if len(fields) == 1 and "," in line:
                hint = "; this looks like a CSV file, the DIN / DIEN layout is tab-separated"
            raise RowError(
                f"{len(fields)} tab-separated fields, a row has {len(AMAZON_FIELDS)} "
                f"({', '.join(AMAZON_FIELDS)}){hint}"
            )
        lab, user, item, cat, items, cats = fields
        if lab not in ("0", "1"):
            raise RowError(f"bad label {lab!r}: must be 0 or 1")
        if not item:
            raise RowError("empty item_id: every row needs its target item")
        hist = items.split(self.hist_sep) if items else []
        hist_cats = cats.split(self.hist_sep) if cats else []
        if len(hist) != len(hist_cats):
            raise RowError(
                f"item_history has {len(hist)} events but category_history {len(hist_cats)}: "
                f"they must pair up (events separated by {self.hist_sep!r})"
            )
        if "" in hist:
            raise RowError(f"item_history has an empty event at position {hist.index('')} (a doubled separator?)")
        item_ids = self._ids[0]
        ids = [item_ids[item], self._ids[1][user], self._ids[2][cat]]
        seq = [item_ids[v] for v in hist[-self.seq_len:]]
        return (1.0 if lab == "1" else 0.0), [math.log1p(len(hist))], ids, seq


class AmazonSource(FileSource):
    """Amazon review CTR rows with behaviour sequences (DIN / DIEN layout) from ``path``.

    ``seq_len``: events kept per row (the most recent ones). ``hash_size``: ids per
    categorical feature, an int for all three, a sequence of three, or a dict such as
    ``{"item": 400_000, "category": 2_000}`` (others get 100,000). ``hist_sep``: the history
    separator. Reading, splitting and batching options are those of
    :class:`~loka_tune.data.files.FileSource`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        seq_len: int = 50,
        hash_size: int | Sequence[int] | dict[str, int] = 100_000,
        hist_sep: str = "\x02",
        name: str | None = None,
        eval_fraction: float | None = None,
        on_bad_row: str = "error",
        max_rows: int = 2_000_000,
        max_eval_rows: int | None = None,
        shuffle_buffer: int = 262_144,
    ) -> None:
        fmt = AmazonFormat(resolve_hash_sizes(hash_size, AMAZON_SPARSE, 100_000), seq_len, hist_sep)
        super().__init__(
            path,
            fmt,
            name=name,
            eval_fraction=eval_fraction,
            on_bad_row=on_bad_row,
            max_rows=max_rows,
            max_eval_rows=max_eval_rows,
            shuffle_buffer=shuffle_buffer,
        )
