"""The tuner's progress lines, through one ``logging`` hierarchy: ``loka_tune``.

The library never prints: :func:`log` is an INFO record of ``logging.getLogger("loka_tune.tuner")``,
so a library user sees nothing unless they ask, with their own logging setup
(``logging.basicConfig(level=logging.INFO)``) or with :func:`to_stderr`, which prints the
``loka_tune`` records as the bare lines ``loka-tune`` shows. The CLI installs that handler before
any command runs; its ``-q`` shows warnings and errors only, ``-v`` debug records too.

    >>> import logging
    >>> from loka_tune.tuner.log import log, to_stderr
    >>> handler = to_stderr(logging.INFO)   # what the CLI does; a library is silent without it
    >>> log("[loka-tune] a progress line")  # doctest: +SKIP
    [loka-tune] a progress line
    >>> logging.getLogger("loka_tune").removeHandler(handler)
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["LOGGER", "log", "to_stderr"]

#: the root of the library's loggers (``loka_tune.tuner``: the tuner's progress lines)
LOGGER = logging.getLogger("loka_tune")
_TUNER = logging.getLogger("loka_tune.tuner")


def log(msg: str) -> None:
    """One progress line of the tuner: an INFO record of ``loka_tune.tuner`` (shown where a
    handler asks for it: the CLI's, :func:`to_stderr`, or the user's own)."""
    _TUNER.info(msg)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to the ``sys.stderr`` of the moment (a redirect, pytest's capture), as
    Python's own last-resort handler does, and flushes it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ sets it: sys.stderr is read at emit
        pass


def to_stderr(level: int = logging.INFO) -> logging.Handler:
    """Print the ``loka_tune`` records of ``level`` and above to stderr as bare lines (the CLI's
    output); replaces an earlier such handler, so calling it again only changes the level.
    Returns the handler (``logging.getLogger("loka_tune").removeHandler(h)`` undoes it)."""
    for h in list(LOGGER.handlers):
        if isinstance(h, _StderrHandler):
            LOGGER.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(level)
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    return handler
