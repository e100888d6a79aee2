"""A small validating reader of parsed TOML tables (study files).

:class:`Table` reads the typed keys of one table, remembering which it read; ``done()`` then
rejects every other key as a typo, naming the closest valid one. Every error is a
:class:`~loka_tune.errors.ConfigError` whose ``key`` is the dotted path (``"training.steps"``)
and whose message quotes the value and names the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, overload

from loka_tune.errors import ConfigError

__all__ = ["Table", "json_scalar_tree", "plain_fields", "read_plain", "rekeyed"]


class Table:
    """Reads typed keys of one TOML table, remembering which were read; ``done()`` rejects the rest."""

    def __init__(self, data: Any, prefix: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"got {data!r}; expected a table [{prefix}]", key=prefix)
        self.data = dict(data)
        self.prefix = prefix
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    @overload
    def string(self, name: str, default: str, *, choices: tuple[str, ...] | None = None,
               required: bool = False) -> str: ...
    @overload
    def string(self, name: str, default: None = None, *, choices: tuple[str, ...] | None = None,
               required: Literal[True]) -> str: ...
    @overload
    def string(self, name: str, default: str | None = None, *, choices: tuple[str, ...] | None = None,
               required: bool = False) -> str | None: ...

    def string(self, name: str, default: str | None = None, *, choices: tuple[str, ...] | None = None,
               required: bool = False) -> str | None:
        v = self.get(name, default)
        if v is None:
            if required:
                typo = difflib.get_close_matches(name, [k for k in self.data if k not in self.seen], n=1)
                if typo:
                    raise ConfigError(f"unknown key {typo[0]!r} in [{self.prefix}]; did you mean {name!r}?",
                                      key=self.key(typo[0]))
                raise ConfigError(f"missing; add {name} = \"...\" to [{self.prefix}]", key=self.key(name))
            return None
        if not isinstance(v, str):
            raise ConfigError(f"got {v!r}; expected a string", key=self.key(name))
        if choices is not None and v not in choices:
            raise ConfigError(f"got {v!r}; choose one of {', '.join(map(repr, choices))}", key=self.key(name))
        return v

    @overload
    def integer(self, name: str, default: int, *, minimum: int | None = None,
                allow_none: Literal[False] = False) -> int: ...
    @overload
    def integer(self, name: str, default: int | None, *, minimum: int | None = None,
                allow_none: bool = False) -> int | None: ...

    def integer(self, name: str, default: int | None, *, minimum: int | None = None,
                allow_none: bool = False) -> int | None:
        v = self.get(name, default)
        if v is None and (allow_none or default is None):
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"got {v!r}; expected an integer", key=self.key(name))
        if minimum is not None and v < minimum:
            raise ConfigError(f"got {v!r}; expected an integer >= {minimum}", key=self.key(name))
        return v

    @overload
    def number(self, name: str, default: float, *, minimum: float | None = None, maximum: float | None = None,
               strict_min: bool = False) -> float: ...
    @overload
    def number(self, name: str, default: float | None, *, minimum: float | None = None,
               maximum: float | None = None, strict_min: bool = False) -> float | None: ...

    def number(self, name: str, default: float | None, *, minimum: float | None = None,
               maximum: float | None = None, strict_min: bool = False) -> float | None:
        v = self.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"got {v!r}; expected a finite number", key=self.key(name))
        if minimum is not None and (v < minimum or (strict_min and v == minimum)):
            op = ">" if strict_min else ">="
            raise ConfigError(f"got {v!r}; expected a number {op} {minimum}", key=self.key(name))
        if maximum is not None and v > maximum:
            raise ConfigError(f"got {v!r}; expected a number <= {maximum}", key=self.key(name))
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise ConfigError(f"got {v!r}; expected true or false", key=self.key(name))
        return v

    def str_list(self, name: str, default: tuple[str, ...], *, choices: tuple[str, ...] | None = None,
                 allow_empty: bool = False) -> tuple[str, ...]:
        v = self.get(name, list(default))
        if isinstance(v, str) or not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"got {v!r}; expected a list of strings such as {list(default)!r}",
                              key=self.key(name))
        if not v and not allow_empty:
            raise ConfigError("got an empty list; give at least one entry", key=self.key(name))
        if choices is not None:
            bad = [x for x in v if x not in choices]
            if bad:
                raise ConfigError(f"got {bad!r}; each entry must be one of {', '.join(map(repr, choices))}",
                                  key=self.key(name))
        if len(set(v)) != len(v):
            raise ConfigError(f"got {v!r}; an entry is repeated", key=self.key(name))
        return tuple(v)

    def table(self, name: str) -> dict[str, Any]:
        v = self.get(name, {})
        if not isinstance(v, Mapping):
            raise ConfigError(f"got {v!r}; expected a table [{self.prefix}.{name}]", key=self.key(name))
        return dict(v)

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.seen]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, sorted(self.seen), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown key {k!r} in [{self.prefix}]{hint} (valid keys: {', '.join(sorted(self.seen))})",
                key=self.key(k),
            )


def json_scalar_tree(v: Any, key: str) -> Any:
    """Plain TOML values only (no dates: they do not serialize); ``key`` names the bad one."""
    if isinstance(v, Mapping):
        return {str(k): json_scalar_tree(x, f"{key}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [json_scalar_tree(x, f"{key}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, (str, int, float, bool)):
        return v
    raise ConfigError(f"got {v!r} ({type(v).__name__}); use strings, numbers, booleans, lists or tables",
                      key=key)


_PLAIN = (bool, int, float, str)
_WORDS = {bool: "true, false", int: "an integer", float: "a number", str: "a string"}


def plain_fields(cls: type, *, exclude: tuple[str, ...] = ()) -> dict[str, tuple[type, ...]]:
    """A dataclass's plain fields -> their types: those annotated bool, int, float or str, a union
    of them, or one of them or None (``NoneType`` then among the types)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        kinds = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        if f.name not in exclude and all(k in _PLAIN or k is type(None) for k in kinds):
            out[f.name] = kinds
    return out


def read_plain(t: Table, name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """Key ``name`` of ``t``, of one of the plain types ``kinds`` (with ``NoneType``: may be absent)."""
    optional = type(None) in kinds
    kinds = tuple(k for k in kinds if k is not type(None))
    if kinds == (int,):
        return t.integer(name, default, allow_none=optional)
    if kinds == (float,):
        return t.number(name, default)
    if kinds == (str,):
        return t.string(name, default)
    v = t.get(name, default)
    if v is None and optional:
        return None
    if kinds == (bool,):
        return t.boolean(name, default)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        words = [_WORDS[k] for k in kinds]
        raise ConfigError(f"got {v!r}; expected {', '.join(words[:-1])} or {words[-1]}", key=t.key(name))
    return v


def rekeyed(e: ConfigError, prefix: str) -> ConfigError:
    """``e`` (raised by a config object that names its own field) with its key under ``prefix``."""
    return ConfigError(e.message, key=f"{prefix}.{e.key}" if e.key else prefix, path=e.path)
