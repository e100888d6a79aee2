"""Small file helpers shared by every layer (no loka_tune imports)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["atomic_write_text", "cwd_importable"]


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a crash or a concurrent writer never leaves half a
    file (the text goes to a per-process temporary file that then replaces ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def cwd_importable() -> None:
    """Put the working directory on the import path (last, after the installed packages), as
    ``python -m`` does: a user's ``module:function`` (model factory, data source) in the folder
    ``loka-tune`` runs from imports without PYTHONPATH."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
