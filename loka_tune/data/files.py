"""The machinery shared by file-backed sources (Criteo, Avazu): reading, splitting, batching.

A :class:`FileSource` reads a text file (plain or gzip, detected by its magic bytes) through a
:class:`RowFormat` that turns one line into ``(label, dense values, sparse ids)``, plus the
row's behaviour sequence (item ids, oldest first) for a format with ``seq_len > 0``: those are
kept as the last ``seq_len`` events, left-padded, and batches carry ``seq`` / ``seq_mask``.

Reading, once, at construction: up to ``max_rows`` data rows are parsed and validated.

- If the whole file fits (the usual case for samples and for files up to a few million rows),
  it is held in memory as tensors (dense float32, ids int32, labels float32; about
  ``4 * (num_dense + num_sparse + 1)`` bytes per row), copied once to each device asked for.
- If the file has more than ``max_rows`` rows, the source *streams*: each pass re-reads the
  file; train batches are shuffled within consecutive blocks of ``shuffle_buffer`` rows,
  eval batches come in file order (at most ``max_eval_rows`` rows when set). Bad rows past
  the first ``max_rows`` surface (or are skipped) during iteration. ``base_rate`` is then
  the train-split mean label over the first ``max_rows`` rows.

Split: the row on 1-based line ``r`` is in eval when ``split_uniform([r])[0] < eval_fraction``
(a stable hash, see :mod:`loka_tune.data.hashing`): the same split every run, on every
machine, whatever rows get skipped. ``eval_fraction=None`` means 0.2 for files of fewer than
10,000 rows (a small eval split gives too noisy a log loss) and 0.1 otherwise.

Batches: ``"train"`` is an endless stream: the train rows in a random order drawn from
``(seed, epoch)``, epoch after epoch, cut into batches of exactly ``batch_size`` (a batch may
straddle two epochs; no row is dropped). ``"eval"`` is one pass in file order, the last
batch shorter when ``batch_size`` does not divide the eval rows. Batches are identical on
every device (permutations are drawn on the CPU).

Blank lines are ignored (they are not rows, but still count for line numbers).
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import zlib
from pathlib import Path
from typing import IO, Generator, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .base import Batch
from .hashing import mix_seed, split_uniform

__all__ = ["FileSource", "RowFormat", "RowError", "open_data_file"]

log = logging.getLogger("loka_tune.data")

_SPLIT_SALT = 0x10CA  # salt of the row -> split hash; changing it reshuffles every split
_SMALL_FILE_ROWS = 10_000  # below this, eval_fraction=None means 0.2, else 0.1
_CHUNK_ROWS = 65_536  # rows parsed per numpy chunk
_REPORT_SKIPS = 5  # line numbers quoted in the skipped-rows warning
_KEEP_SKIPS = 100  # (line, reason) pairs kept in `skipped_examples`


class RowError(ValueError):
    """One row is malformed; the source adds the file and line number."""


class RowFormat(Protocol):
    """Turns lines of one file format into row values."""

    kind: str  # "criteo", "avazu": used in names and messages
    has_header: bool
    dense_names: tuple[str, ...]
    sparse_names: tuple[str, ...]
    cardinalities: tuple[int, ...]
    # optional ``seq_len: int`` (read with getattr, 0 when absent): > 0 means parse() returns a
    # 4th item, the row's behaviour sequence (ids, oldest first)

    def read_header(self, line: str, path: str) -> None:
        """Validate (and learn from) the header line; raise :class:`DataError` if unusable."""
        ...

    def parse(self, line: str) -> tuple:
        """``(label, dense, ids)`` of one data line (no line ending), plus the list of sequence
        ids when ``seq_len > 0``; raise :class:`RowError`."""
        ...


def open_data_file(path: str | os.PathLike) -> IO[bytes]:
    """Open ``path`` for binary reading, through gzip when it starts with the gzip magic.

    Raises :class:`DataError` when the file is missing, a directory, unreadable or empty.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"file not found (resolved to {p.resolve()}); check the path, or download the "
            "dataset and point the data spec at it, e.g. 'criteo:/data/train.txt'",
            path=str(path),
        )
    if p.is_dir():
        raise DataError("is a directory, expected a data file", path=str(path))
    try:
        f = open(p, "rb")
    except OSError as e:
        raise DataError(f"cannot open: {e.strerror}", path=str(path)) from e
    magic = f.read(2)
    if magic == b"":
        f.close()
        raise DataError("empty file (0 bytes); expected CTR rows", path=str(path))
    if magic == b"\x1f\x8b":
        f.close()
        return gzip.open(p, "rb")  # type: ignore[return-value]
    f.seek(0)
    return f


class FileSource:
    """A :class:`~loka_tune.data.base.DataSource` over a file, parsed by a :class:`RowFormat`.

    Attributes: ``name``, ``path``, ``num_dense``, ``cardinalities``, ``dense_names``,
    ``sparse_names``, ``eval_fraction``, ``streaming``, ``num_train_rows`` /
    ``num_eval_rows`` (``None`` when streaming), ``base_rate`` (train mean label),
    ``skipped_rows`` and ``skipped_examples`` (first (line, reason) pairs).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fmt: RowFormat,
        *,
        name: str | None = None,
        eval_fraction: float | None = None,
        on_bad_row: str = "error",
        max_rows: int = 2_000_000,
        max_eval_rows: int | None = None,
        shuffle_buffer: int = 262_144,
    ) -> None:
        if on_bad_row not in ("error", "skip"):
            raise ConfigError(
                f"on_bad_row must be 'error' or 'skip', got {on_bad_row=!r}", key="on_bad_row"
            )
        if eval_fraction is not None and not 0.0 < eval_fraction < 1.0:
            raise ConfigError(f"must be in (0, 1) or None (auto), got {eval_fraction=}", key="eval_fraction")
        if max_rows < 1:
            raise ConfigError(f"must be >= 1, got {max_rows=}", key="max_rows")
        if max_eval_rows is not None and max_eval_rows < 1:
            raise ConfigError(f"must be >= 1 or None, got {max_eval_rows=}", key="max_eval_rows")
        if shuffle_buffer < 1:
            raise ConfigError(f"must be >= 1, got {shuffle_buffer=}", key="shuffle_buffer")
        self.path = str(path)
        self.fmt = fmt
        self.name = name or f"{fmt.kind}:{Path(path).name}"
        self.on_bad_row = on_bad_row
        self.max_rows = int(max_rows)
        self.max_eval_rows = max_eval_rows
        self.shuffle_buffer = int(shuffle_buffer)
        self.skipped_rows = 0
        self.skipped_examples: list[tuple[int, str]] = []
        self._counted_until = 0  # skips on lines <= this were already counted

        prefix = self._read_prefix()
        n = len(prefix["label"])
        self.streaming = n > self.max_rows
        if self.streaming:
            prefix = {k: v[: self.max_rows] for k, v in prefix.items()}
            n = self.max_rows
        if eval_fraction is None:
            eval_fraction = 0.2 if (not self.streaming and n < _SMALL_FILE_ROWS) else 0.1
        self.eval_fraction = float(eval_fraction)
        is_eval = self._is_eval(prefix["line"])
        n_eval = int(is_eval.sum())
        if n_eval == 0 or n_eval == n:
            which = "eval" if n_eval == 0 else "train"
            raise DataError(
                f"the {which} split is empty: {n} rows with eval_fraction={self.eval_fraction}; "
                "use a larger file or an eval_fraction that leaves rows on both sides",
                path=self.path,
            )
        train_labels = prefix["label"][~is_eval]
        self.base_rate = float(train_labels.mean())
        if self.streaming:
            self.num_train_rows: int | None = None
            self.num_eval_rows: int | None = None
            self._tables: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        else:
            self.num_train_rows = n - n_eval
            self.num_eval_rows = n_eval
            cpu = {
                split: _to_tensors({k: v[mask] for k, v in prefix.items()})
                for split, mask in (("train", ~is_eval), ("eval", is_eval))
            }
            self._tables = {"cpu": cpu}
        self._report_skips()

    # ------------------------------------------------------------------ protocol
    @property
    def num_dense(self) -> int:
        return len(self.fmt.dense_names)

    @property
    def num_sparse(self) -> int:
        return len(self.fmt.sparse_names)

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return self.fmt.cardinalities

    @property
    def seq_len(self) -> int:
        """Events kept per behaviour sequence (0: the format has none)."""
        return int(getattr(self.fmt, "seq_len", 0))

    @property
    def dense_names(self) -> tuple[str, ...]:
        return self.fmt.dense_names

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return self.fmt.sparse_names

    def batches(
        self,
        split: str,
        batch_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> Iterator[Batch]:
        """Yield batches of ``split``: "train" endless and reshuffled per epoch, "eval" one pass."""
        if split not in ("train", "eval"):
            raise ConfigError(f"split must be 'train' or 'eval', got {split=!r}", key="split")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size=!r}", key="batch_size")
        dev = torch.device(device)
        if self.streaming:
            if split == "train":
                return self._stream_train(batch_size, seed, dev)
            return self._stream_eval(batch_size, dev)
        if split == "train":
            return self._memory_train(batch_size, seed, dev)
        return self._memory_eval(batch_size, dev)

    def rows(self, split: str) -> dict[str, torch.Tensor]:
        """All rows of ``split`` on the CPU, in file order: ``line`` (1-based line numbers),
        ``label``, ``dense``, ``sparse`` (int64), and for a sequence format ``seq`` (int64,
        left-padded) and ``seq_count`` (events kept per row). Only for in-memory sources."""
        if self.streaming:
            raise DataError(
                f"rows() needs the file in memory; it has more than max_rows={self.max_rows} rows "
                "(raise max_rows, or iterate batches())",
                path=self.path,
            )
        if split not in ("train", "eval"):
            raise ConfigError(f"split must be 'train' or 'eval', got {split=!r}", key="split")
        t = self._tables["cpu"][split]
        out = {**t, "sparse": t["sparse"].long()}
        if "seq" in t:
            out["seq"] = t["seq"].long()
        return out

    def __repr__(self) -> str:
        rows = "streaming" if self.streaming else f"train={self.num_train_rows}, eval={self.num_eval_rows}"
        return (
            f"{type(self).__name__}(path={self.path!r}, {rows}, base_rate={self.base_rate:.4f}, "
            f"skipped_rows={self.skipped_rows})"
        )

    # ------------------------------------------------------------------ reading
    def _lines(self) -> Iterator[tuple[int, str]]:
        """(1-based line number, text without line ending) of every non-blank data line."""
        f = open_data_file(self.path)
        lineno = 0
        header_pending = self.fmt.has_header
        try:
            with f:
                for raw in f:
                    lineno += 1
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"not UTF-8 text ({e.reason} at byte {e.start}); is this a "
                            f"{self.fmt.kind} file?",
                            path=self.path,
                            line=lineno,
                        ) from e
                    text = text.rstrip("\r\n")
                    if not text.strip():
                        continue
                    if header_pending:
                        header_pending = False
                        self.fmt.read_header(text, self.path)
                        continue
                    yield lineno, text
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise DataError(
                f"cannot read past line {lineno}: {e}; the file may be truncated or corrupt",
                path=self.path,
                line=lineno + 1,
            ) from e

    def _chunks(self, chunk_rows: int) -> Generator[dict[str, np.ndarray], None, None]:
        """Parsed rows in numpy chunks of at most ``chunk_rows``: line, label, dense, sparse."""
        lines: list[int] = []
        labels: list[float] = []
        dense: list[float] = []  # flat, num_dense per row
        sparse: list[int] = []  # flat, num_sparse per row
        seqs: list[list[int]] = []  # per row: its sequence's ids (formats with seq_len > 0)
        parse = self.fmt.parse
        with_seq = self.seq_len > 0
        for lineno, text in self._lines():
            try:
                parsed = parse(text)
            except RowError as e:
                self._bad_row(lineno, str(e))
                continue
            lines.append(lineno)
            labels.append(parsed[0])
            dense.extend(parsed[1])
            sparse.extend(parsed[2])
            if with_seq:
                seqs.append(parsed[3])
            if len(lines) >= chunk_rows:
                yield self._pack(lines, labels, dense, sparse, seqs)
                lines, labels, dense, sparse, seqs = [], [], [], [], []
        if lines:
            yield self._pack(lines, labels, dense, sparse, seqs)

    def _pack(self, lines, labels, dense, sparse, seqs) -> dict[str, np.ndarray]:
        n = len(lines)
        assert len(dense) == n * self.num_dense and len(sparse) == n * self.num_sparse
        out: dict[str, np.ndarray] = {
            "line": np.asarray(lines, dtype=np.int64),
            "label": np.asarray(labels, dtype=np.float32),
            "dense": np.asarray(dense, dtype=np.float32).reshape(n, self.num_dense),
            "sparse": np.asarray(sparse, dtype=np.int64).reshape(n, self.num_sparse),
        }
        if self.seq_len > 0:
            L = self.seq_len
            seq = np.zeros((n, L), dtype=np.int64)  # left-padded with id 0: the most recent event last
            count = np.zeros(n, dtype=np.int64)
            for i, ids in enumerate(seqs):
                kept = ids[-L:]  # the last L events (oldest first in the file)
                if kept:
                    seq[i, L - len(kept):] = kept
                count[i] = len(kept)
            out["seq"], out["seq_count"] = seq, count
        return out

    def _bad_row(self, lineno: int, reason: str) -> None:
        if self.on_bad_row == "error":
            raise DataError(
                f"{reason} (pass on_bad_row='skip' to skip bad rows)", path=self.path, line=lineno
            )
        if lineno > self._counted_until:  # streaming passes re-read lines: count each once
            self.skipped_rows += 1
            if len(self.skipped_examples) < _KEEP_SKIPS:
                self.skipped_examples.append((lineno, reason))
            self._counted_until = lineno

    def _read_prefix(self) -> dict[str, np.ndarray]:
        """Up to ``max_rows + 1`` rows (one more tells that the file is larger)."""
        chunks, n = [], 0
        with contextlib.closing(self._chunks(min(_CHUNK_ROWS, self.max_rows + 1))) as it:
            for ch in it:
                chunks.append(ch)
                n += len(ch["line"])
                if n > self.max_rows:
                    break
        if n == 0:
            why = f" ({self.skipped_rows} bad rows skipped)" if self.skipped_rows else ""
            raise DataError(f"no data rows{why}; expected {self.fmt.kind} rows", path=self.path)
        self._counted_until = max(self._counted_until, int(chunks[-1]["line"][-1]))
        return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}

    def _report_skips(self) -> None:
        if self.skipped_rows:
            first = ", ".join(str(ln) for ln, _ in self.skipped_examples[:_REPORT_SKIPS])
            log.warning(
                "%s: skipped %d bad row(s) (lines %s%s; first: %s)",
                self.path,
                self.skipped_rows,
                first,
                ", ..." if self.skipped_rows > _REPORT_SKIPS else "",
                self.skipped_examples[0][1],
            )

    def _is_eval(self, lines: np.ndarray) -> np.ndarray:
        return split_uniform(lines, _SPLIT_SALT) < self.eval_fraction

    # ------------------------------------------------------------------ in memory
    def _table(self, split: str, dev: torch.device) -> dict[str, torch.Tensor]:
        key = str(dev)
        if key not in self._tables:
            self._tables[key] = {
                s: {k: v.to(dev) for k, v in t.items()} for s, t in self._tables["cpu"].items()
            }
        return self._tables[key][split]

    def _memory_train(self, batch_size: int, seed: int, dev: torch.device) -> Iterator[Batch]:
        t = self._table("train", dev)
        n = len(t["label"])
        epoch = 0
        pending = torch.empty(0, dtype=torch.int64)
        while True:
            while len(pending) < batch_size:
                g = torch.Generator().manual_seed(mix_seed(seed, "train-epoch", epoch))
                pending = torch.cat([pending, torch.randperm(n, generator=g)])
                epoch += 1
            idx, pending = pending[:batch_size], pending[batch_size:]
            yield _batch(t, idx.to(dev))

    def _memory_eval(self, batch_size: int, dev: torch.device) -> Iterator[Batch]:
        t = self._table("eval", dev)
        n = len(t["label"])
        if self.max_eval_rows is not None:
            n = min(n, self.max_eval_rows)
        for start in range(0, n, batch_size):
            sl = slice(start, min(start + batch_size, n))
            yield _batch(t, sl)

    # ------------------------------------------------------------------ streaming
    def _stream_train(self, batch_size: int, seed: int, dev: torch.device) -> Iterator[Batch]:
        carry: dict[str, np.ndarray] | None = None
        epoch = 0
        while True:
            got_any = False
            for block, ch in enumerate(self._chunks(self.shuffle_buffer)):
                ch = {k: v[~self._is_eval(ch["line"])] for k, v in ch.items()}
                if len(ch["line"]) == 0:
                    continue
                got_any = True
                g = torch.Generator().manual_seed(mix_seed(seed, "train-block", epoch, block))
                perm = torch.randperm(len(ch["line"]), generator=g).numpy()
                ch = {k: v[perm] for k, v in ch.items()}
                carry = ch if carry is None else {k: np.concatenate([carry[k], ch[k]]) for k in ch}
                while len(carry["line"]) >= batch_size:
                    head = {k: v[:batch_size] for k, v in carry.items()}
                    carry = {k: v[batch_size:] for k, v in carry.items()}
                    yield _batch(_to_tensors(head), None).to(dev)
            if not got_any:  # every row after the prefix was skipped and the prefix too
                raise DataError("no train rows left to stream", path=self.path)
            if epoch == 0:
                self._report_skips()
            epoch += 1

    def _stream_eval(self, batch_size: int, dev: torch.device) -> Iterator[Batch]:
        limit = self.max_eval_rows
        done = 0
        carry: dict[str, np.ndarray] | None = None
        with contextlib.closing(self._chunks(_CHUNK_ROWS)) as it:
            for ch in it:
                ch = {k: v[self._is_eval(ch["line"])] for k, v in ch.items()}
                if limit is not None:
                    ch = {k: v[: limit - done] for k, v in ch.items()}
                done += len(ch["line"])
                carry = ch if carry is None else {k: np.concatenate([carry[k], ch[k]]) for k in ch}
                while len(carry["line"]) >= batch_size:
                    head = {k: v[:batch_size] for k, v in carry.items()}
                    carry = {k: v[batch_size:] for k, v in carry.items()}
                    yield _batch(_to_tensors(head), None).to(dev)
                if limit is not None and done >= limit:
                    break
        if carry is not None and len(carry["line"]):
            yield _batch(_to_tensors(carry), None).to(dev)


def _to_tensors(rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """numpy rows -> tensors; ids kept as int32 in memory (cast to int64 per batch)."""
    sparse = rows["sparse"]
    small = sparse.size == 0 or int(sparse.max()) < 2**31
    out = {
        "line": torch.from_numpy(np.ascontiguousarray(rows["line"])),
        "label": torch.from_numpy(np.ascontiguousarray(rows["label"])),
        "dense": torch.from_numpy(np.ascontiguousarray(rows["dense"])),
        "sparse": torch.from_numpy(np.ascontiguousarray(sparse.astype(np.int32) if small else sparse)),
    }
    if "seq" in rows:
        seq = rows["seq"]
        small = seq.size == 0 or int(seq.max()) < 2**31
        out["seq"] = torch.from_numpy(np.ascontiguousarray(seq.astype(np.int32) if small else seq))
        out["seq_count"] = torch.from_numpy(np.ascontiguousarray(rows["seq_count"]))
    return out


def _batch(t: dict[str, torch.Tensor], idx: torch.Tensor | slice | None) -> Batch:
    def take(x: torch.Tensor) -> torch.Tensor:
        return x if idx is None else x[idx]

    if "seq" not in t:
        return Batch(take(t["dense"]), take(t["sparse"]).long(), take(t["label"]))
    seq, count = take(t["seq"]).long(), take(t["seq_count"])
    L = seq.shape[1]
    mask = torch.arange(L, device=seq.device)[None, :] >= (L - count)[:, None]  # (B, L) left-padded
    return Batch(take(t["dense"]), take(t["sparse"]).long(), take(t["label"]), seq, mask)


def resolve_hash_sizes(
    hash_size: int | Sequence[int] | dict[str, int], names: Sequence[str], default: int
) -> tuple[int, ...]:
    """Per-feature hash sizes from an int, a sequence (one per feature) or a {name: size} dict."""
    if isinstance(hash_size, int):
        sizes = [hash_size] * len(names)
    elif isinstance(hash_size, dict):
        unknown = sorted(set(hash_size) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown feature(s) {unknown}; known: {list(names)}", key="hash_size"
            )
        sizes = [int(hash_size.get(n, default)) for n in names]
    else:
        sizes = [int(h) for h in hash_size]
        if len(sizes) != len(names):
            raise ConfigError(
                f"needs one size per categorical feature ({len(names)}), got {len(sizes)}",
                key="hash_size",
            )
    bad = [s for s in sizes if s < 2]
    if bad:
        raise ConfigError(
            f"every hash size must be >= 2 (id 0 is reserved for missing), got {bad[0]}",
            key="hash_size",
        )
    return tuple(sizes)
