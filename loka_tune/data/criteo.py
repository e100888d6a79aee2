"""Criteo click logs in the raw Kaggle / Terabyte layout.

One row per line, tab-separated, no header::

    label \\t I1 .. I13 \\t C1 .. C26

- ``label``: ``0`` or ``1``.
- ``I1 .. I13``: integer counts, possibly negative, possibly empty (missing). Transformed to
  ``log(1 + max(x, 0))``; missing -> 0.
- ``C1 .. C26``: categorical values (8 hex digits in the public data), possibly empty. Mapped
  to ids with :func:`loka_tune.data.hashing.stable_id` (feature names ``"C1"`` .. ``"C26"``)
  modulo a per-feature hash size (the source's ``cardinalities``); empty -> id 0.

Tolerated: plain or gzip files (by magic bytes), CRLF line endings, no final newline, blank
lines, and *truncated rows* whose trailing empty categorical fields were cut off (a writer
that strips trailing whitespace does this): a row with ``min_fields`` (default 27: the
label, the 13 integers and C1 .. C13) to 39 fields is read with the missing trailing fields
empty. Fewer fields than that is an error: such a line is far more likely a broken row (say,
one split by a stray newline) than a row whose last 14+ categorical fields were all empty,
which never happens in the Criteo data. More than 40 fields is an error too.

Errors (:class:`~loka_tune.errors.DataError` with the path and the 1-based line number): too
many or too few fields, a label other than 0/1, a non-integer in I1 .. I13, a file that is
missing, empty, not UTF-8 text or a corrupt gzip. With ``on_bad_row="skip"`` bad rows are
skipped, counted in ``skipped_rows`` and reported in one warning (logger ``loka_tune.data``).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from ..errors import ConfigError
from .files import FileSource, RowError, resolve_hash_sizes
from .hashing import IdCache

__all__ = ["CriteoSource", "CriteoFormat", "CRITEO_FIELDS"]

CRITEO_DENSE = tuple(f"I{j}" for j in range(1, 14))
CRITEO_SPARSE = tuple(f"C{j}" for j in range(1, 27))
CRITEO_FIELDS = 1 + len(CRITEO_DENSE) + len(CRITEO_SPARSE)  # 40
_CACHE_LIMIT = 1 << 16  # distinct integer texts cached before the cache is reset


class _DenseCache(dict):
    """integer text -> log(1 + max(x, 0)); "" -> 0.0; raises ValueError on a non-integer."""

    def __missing__(self, value: str) -> float:
        x = int(value) if value else 0
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        y = self[value] = math.log1p(x) if x > 0 else 0.0
        return y


class CriteoFormat:
    """Parses one Criteo line (see the module docstring)."""

    kind = "criteo"
    has_header = False
    dense_names = CRITEO_DENSE
    sparse_names = CRITEO_SPARSE

    def __init__(self, hash_sizes: Sequence[int], min_fields: int = 27) -> None:
        if not 1 + len(CRITEO_DENSE) <= min_fields <= CRITEO_FIELDS:
            raise ConfigError(
                f"must be in [14, 40] (label + 13 integers at least), got {min_fields=}",
                key="min_fields",
            )
        self.cardinalities = tuple(hash_sizes)
        self.min_fields = min_fields
        self._ids = [IdCache(name, size) for name, size in zip(CRITEO_SPARSE, self.cardinalities)]
        self._dense = _DenseCache()

    def read_header(self, line: str, path: str) -> None:  # no header in Criteo files
        pass

    def parse(self, line: str) -> tuple[float, list[float], list[int]]:
        fields = line.split("\t")
        n = len(fields)
        if n != CRITEO_FIELDS:
            self._check_count(n)
        lab = fields[0]
        if lab == "0":
            label = 0.0
        elif lab == "1":
            label = 1.0
        else:
            hint = ""
            if n == CRITEO_FIELDS - 1:
                hint = "; 39 fields and no label: this looks like the unlabeled Criteo test file"
            elif not lab.lstrip("-").isdigit():
                hint = "; raw Criteo files have no header line (remove it)"
            raise RowError(f"bad label {lab!r}: must be 0 or 1{hint}")
        try:
            dense = list(map(self._dense.__getitem__, fields[1:14]))
        except ValueError:
            bad = next(j for j in range(1, 14) if not _is_int(fields[j]))
            raise RowError(f"integer field I{bad} is {fields[bad]!r}, not an integer") from None
        ids = list(map(dict.__getitem__, self._ids, fields[14:]))
        if n < CRITEO_FIELDS:
            ids.extend([0] * (CRITEO_FIELDS - n))  # truncated row: cut fields were empty
        return label, dense, ids

    def _check_count(self, n: int) -> None:
        if n > CRITEO_FIELDS:
            raise RowError(
                f"too many fields: {n} tab-separated fields, a Criteo row has {CRITEO_FIELDS} "
                "(label, I1..I13, C1..C26)"
            )
        if n < self.min_fields:
            raise RowError(
                f"too few fields: {n} tab-separated fields, a Criteo row has {CRITEO_FIELDS} "
                f"(label, I1..I13, C1..C26); rows whose trailing empty fields were cut are "
                f"accepted down to {self.min_fields} fields"
            )


def _is_int(text: str) -> bool:
    if text == "":
        return True
    try:
        int(text)
    except ValueError:
        return False
    return True


class CriteoSource(FileSource):
    """Criteo click logs (Kaggle / Terabyte raw layout) from ``path`` (plain or .gz).

    ``hash_size``: ids per categorical feature, an int for all 26, a sequence of 26, or a
    ``{"C3": 1_000_000, ...}`` dict (others get 100,000); these are the ``cardinalities``.
    Reading, splitting and batching options are those of :class:`~loka_tune.data.files.FileSource`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        hash_size: int | Sequence[int] | dict[str, int] = 100_000,
        min_fields: int = 27,
        name: str | None = None,
        eval_fraction: float | None = None,
        on_bad_row: str = "error",
        max_rows: int = 2_000_000,
        max_eval_rows: int | None = None,
        shuffle_buffer: int = 262_144,
    ) -> None:
        fmt = CriteoFormat(resolve_hash_sizes(hash_size, CRITEO_SPARSE, 100_000), min_fields)
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
