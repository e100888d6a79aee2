"""The tuner's progress lines: one place that writes them (to stderr, flushed)."""

from __future__ import annotations

import sys

__all__ = ["log"]


def log(msg: str) -> None:
    """Write one progress line of the tuner to stderr, flushed at once."""
    print(msg, file=sys.stderr, flush=True)
