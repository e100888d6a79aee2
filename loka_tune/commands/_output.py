"""The commands' output files: checked before the work that fills them, and a failed write
after it reported as one line (exit status 2), never a traceback or a stray temporary file."""

from __future__ import annotations

from pathlib import Path

from loka_tune._io import output_problem
from loka_tune.errors import ConfigError

__all__ = ["check_output", "write_error"]


def check_output(path: str | Path, option: str, *, is_dir: bool = False) -> Path:
    """``path`` if it can be written (a file, or with ``is_dir`` a folder); else a
    :class:`ConfigError` naming ``option``, the path and the fix, before any work is done."""
    problem = output_problem(path, is_dir=is_dir)
    if problem is not None:
        raise ConfigError(f"cannot write {str(path)!r}: {problem}", key=option)
    return Path(path)


def write_error(path: str | Path, option: str, e: OSError, lost: str = "") -> ConfigError:
    """The one-line error of a write that failed after the work (``lost``: what the user lost, or
    where to find it)."""
    why = e.strerror or str(e)
    return ConfigError(f"could not write {str(path)!r} ({why})" + (f"; {lost}" if lost else ""), key=option)
