"""Command-line option types (numbers, ``KEY=VALUE`` model arguments), checked when the command
line is parsed: before any work.

Each function returns an argparse ``type=``: a bad value is a usage error (exit status 2) of one
line that quotes the value and names the accepted range, e.g.
``loka-tune tune: error: argument --timeout: expected seconds > 0, got '-1'``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

__all__ = ["integer", "number", "model_arg"]


def integer(what: str, *, minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum`` (``what`` names it in the error: "a number of steps")."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}, got {text!r}")
        return v

    parse.__name__ = "integer"
    return parse


def number(what: str, *, minimum: float, strict: bool = False) -> Callable[[str], float]:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    op = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected {what}, a finite number {op} {minimum:g}, got {text!r}")
        if v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"expected {what} {op} {minimum:g}, got {text!r}")
        return v

    parse.__name__ = "number"
    return parse


def model_arg(text: str) -> tuple[str, Any]:
    """``--model-arg KEY=VALUE``: ``(key, value)``, the value read as JSON (a list becomes a tuple), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. embedding_dim=16), got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value  # a bare string such as norm=layernorm
    if isinstance(parsed, list):
        parsed = tuple(parsed)
    return key.strip(), parsed
