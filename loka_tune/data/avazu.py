"""Avazu click logs (the Kaggle CTR prediction ``train`` CSV).

Layout: a header line, then comma-separated rows (no quoting in the Avazu data)::

    id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,
    app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,..,C21

- ``click``: the label, ``0`` or ``1`` (required: the Avazu *test* file has no click column
  and cannot be used).
- ``hour``: ``YYMMDDHH`` (required), turned into two dense features in [0, 1]:
  ``hour_of_day / 23`` and ``day_of_week / 6`` (Monday = 0).
- ``id`` is ignored; every other column is categorical, hashed with
  :func:`loka_tune.data.hashing.stable_id` (feature name = the header name) modulo a
  per-column hash size; an empty value -> id 0.

Any CSV with ``click`` and ``hour`` columns is accepted; the categorical columns are the
others, in header order. Errors (:class:`~loka_tune.errors.DataError` with path and line):
a header without ``click`` or ``hour`` (naming the columns found), duplicate columns, a row
whose field count differs from the header's, a label other than 0/1, an ``hour`` that is not
a valid ``YYMMDDHH``; plus the file-level errors of every file source. With
``on_bad_row="skip"`` bad rows are counted in ``skipped_rows`` and reported in one warning.
"""

from __future__ import annotations

import datetime
import os
import zlib
from typing import Sequence

from ..errors import DataError
from .files import FileSource, RowError, open_data_file, resolve_hash_sizes
from .hashing import IdCache

__all__ = ["AvazuSource", "AvazuFormat", "AVAZU_COLUMNS"]

AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)  # fmt: skip
_NOT_CATEGORICAL = ("id", "click", "hour")


class AvazuFormat:
    """Parses Avazu CSV lines; the header fixes the columns (see the module docstring)."""

    kind = "avazu"
    has_header = True
    dense_names: tuple[str, ...] = ("hour_of_day", "day_of_week")

    def __init__(self, columns: Sequence[str], hash_size: int | Sequence[int] | dict[str, int]) -> None:
        self.columns = tuple(columns)
        self.sparse_names = tuple(c for c in self.columns if c not in _NOT_CATEGORICAL)
        self.cardinalities = resolve_hash_sizes(hash_size, self.sparse_names, 100_000)
        self._click = self.columns.index("click")
        self._hour = self.columns.index("hour")
        self._cat = [self.columns.index(c) for c in self.sparse_names]
        self._ids = [IdCache(n, h) for n, h in zip(self.sparse_names, self.cardinalities)]
        self._hours: dict[str, list[float]] = {}

    @staticmethod
    def header_columns(line: str, path: str, lineno: int = 1) -> tuple[str, ...]:
        """The validated column names of a header line."""
        cols = tuple(c.strip() for c in line.split(","))
        missing = [c for c in ("click", "hour") if c not in cols]
        if missing:
            shown = ",".join(cols[:30]) + (",..." if len(cols) > 30 else "")
            raise DataError(
                f"header lacks column(s) {missing}; columns found: {shown}. An Avazu train file "
                f"starts with 'id,click,hour,...' (the Avazu test file has no click column and "
                f"cannot be used for training)",
                path=path,
                line=lineno,
            )
        dups = sorted({c for c in cols if cols.count(c) > 1})
        if dups:
            raise DataError(f"duplicate column(s) {dups} in the header", path=path, line=lineno)
        return cols

    def read_header(self, line: str, path: str) -> None:
        cols = self.header_columns(line, path)
        if cols != self.columns:
            raise DataError(
                f"header changed while reading: {cols} instead of {self.columns}", path=path, line=1
            )

    def parse(self, line: str) -> tuple[float, list[float], list[int]]:
        fields = line.split(",")
        if len(fields) != len(self.columns):
            raise RowError(
                f"{len(fields)} comma-separated fields, the header has {len(self.columns)} columns"
            )
        lab = fields[self._click]
        if lab == "0":
            label = 0.0
        elif lab == "1":
            label = 1.0
        else:
            raise RowError(f"bad label: click is {lab!r}, must be 0 or 1")
        hour = fields[self._hour]
        dense = self._hours.get(hour)
        if dense is None:
            dense = _hour_features(hour)
            self._hours[hour] = dense
        ids = [cache[fields[col]] for cache, col in zip(self._ids, self._cat)]
        return label, dense, ids


def _hour_features(hour: str) -> list[float]:
    """[hour_of_day / 23, day_of_week / 6] of a ``YYMMDDHH`` string."""
    bad = RowError(f"hour is {hour!r}, expected YYMMDDHH (e.g. 14102100)")
    if len(hour) != 8 or not hour.isdigit():
        raise bad
    yy, mm, dd, hh = int(hour[:2]), int(hour[2:4]), int(hour[4:6]), int(hour[6:])
    if hh > 23:
        raise bad
    try:
        dow = datetime.date(2000 + yy, mm, dd).weekday()
    except ValueError:
        raise bad from None
    return [hh / 23.0, dow / 6.0]


def _read_header(path: str | os.PathLike) -> tuple[str, ...]:
    try:
        return _read_header_unchecked(path)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"cannot read the header: {e}", path=str(path), line=1) from e


def _read_header_unchecked(path: str | os.PathLike) -> tuple[str, ...]:
    with open_data_file(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"not UTF-8 text ({e.reason}); is this an Avazu CSV?", path=str(path), line=lineno
                ) from e
            if text.strip():
                return AvazuFormat.header_columns(text, str(path), lineno)
    raise DataError("empty file (no header line); expected an Avazu CSV", path=str(path))


class AvazuSource(FileSource):
    """Avazu click logs from ``path`` (CSV with a header, plain or .gz).

    ``hash_size``: ids per categorical column, an int for all, a sequence (one per
    categorical column, header order) or a ``{"device_ip": 1_000_000, ...}`` dict (others get
    100,000); these are the ``cardinalities``. Reading, splitting and batching options are
    those of :class:`~loka_tune.data.files.FileSource`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        hash_size: int | Sequence[int] | dict[str, int] = 100_000,
        name: str | None = None,
        eval_fraction: float | None = None,
        on_bad_row: str = "error",
        max_rows: int = 2_000_000,
        max_eval_rows: int | None = None,
        shuffle_buffer: int = 262_144,
    ) -> None:
        fmt = AvazuFormat(_read_header(path), hash_size)
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
