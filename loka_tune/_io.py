"""Small file helpers shared by every layer (no loka_tune imports)."""

from __future__ import annotations

import os
import sys
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
    """Why ``path`` (a file, or with ``is_dir`` a folder, created with its parents if missing)
    cannot be written, or ``None`` if it can: checked before the work that produces it."""
    path = Path(path)
    if path.exists():
        if is_dir and not path.is_dir():
            return f"{str(path)!r} is a file, not a folder"
        if not is_dir and path.is_dir():
            return f"{str(path)!r} is a folder; give a file name inside it, e.g. {str(path / 'out.json')!r}"
        target = path if is_dir else path.parent
    else:
        target = path.parent
    while not target.exists():  # the nearest existing folder: the missing ones will be created in it
        target = target.parent
    if not target.is_dir():
        return f"{str(target)!r} is a file, so no folder can be created under it"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"no permission to write in {str(target)!r}"
    return None


def cwd_importable() -> None:
    """Put the working directory on the import path (last, after the installed packages), as
    ``python -m`` does: a user's ``module:function`` (model factory, data source) in the folder
    ``loka-tune`` runs from imports without PYTHONPATH."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
