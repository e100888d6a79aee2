"""Small file helpers shared by every layer (no loka_tune imports)."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text", "cwd_importable", "output_problem"]


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a crash or a concurrent writer never leaves half a
    file (the text goes to a per-process temporary file that then replaces ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise
    return path


def output_problem(path: str | Path, *, is_dir: bool = False) -> str | None:
    """Why ``path`` (a file, or with ``is_dir`` a folder, created if missing) cannot be written,
    and what to do, or ``None`` if it can: checked before the work that produces it. Its parent folder must
    exist (nothing is created silently: the answer says how to make it), and a file must be
    creatable there: tried, not guessed from permission bits (root may "write" to ``/proc``)."""
    path = Path(path)
    if path.exists():
        if is_dir and not path.is_dir():
            return f"{str(path)!r} is a file, not a folder; choose another path"
        if not is_dir and path.is_dir():
            return (f"{str(path)!r} is a folder; give a file name inside it, e.g. {str(path / 'out.json')!r},"
                    " or choose another path")
        folder = path if is_dir else path.parent
    else:
        folder = path.parent
    if not folder.exists():
        return (f"its folder {str(folder)!r} does not exist; create it first (mkdir -p {shlex.quote(str(folder))})"
                " or choose another path")
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, so nothing can be written under it; choose another path"
    try:
        fd, probe = tempfile.mkstemp(prefix=".loka-write-test-", dir=folder)
    except OSError as e:
        return f"cannot create a file in {str(folder)!r} ({e.strerror or e}); choose another path"
    os.close(fd)
    os.unlink(probe)
    return None


def cwd_importable() -> None:
    """Put the working directory on the import path (last, after the installed packages), as
    ``python -m`` does: a user's ``module:function`` (model factory, data source) in the folder
    ``loka-tune`` runs from imports without PYTHONPATH."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
