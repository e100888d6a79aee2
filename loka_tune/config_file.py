"""The precision-config file: its JSON envelope, and reading and writing it safely.

A precision config is one JSON object::

    {"schema_version": 1, "kind": "loka-tune.precision-config",
     "mods": {...}, "default": {...}, "sites": {name or "re:<regex>": {...}}, "provenance": {...},
     "serving": {...}}                                   # optional: the serving plan

This module owns the envelope: the schema version and kind (:func:`header`,
:func:`check_envelope`), JSON text parsed with duplicate keys rejected (:func:`parse_json`;
``json`` would silently keep the last), and files read with errors that name the fix
(:func:`read_text`). :class:`loka_tune.config.PrecisionConfig` builds itself from the checked
object (``from_dict`` / ``from_json`` / ``load``) and writes it (``to_dict`` / ``save``). Plain
data only (no loka_tune imports but the errors and the atomic writer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from loka_tune._io import atomic_write_text
from loka_tune.errors import ConfigError

__all__ = ["SCHEMA_VERSION", "KIND", "header", "check_envelope", "parse_json", "read_text", "write_text"]

SCHEMA_VERSION = 1  # bump on any incompatible change of the JSON layout
KIND = "loka-tune.precision-config"  # the "kind" field of a precision config file
_KEYS = ("schema_version", "kind", "mods", "default", "sites", "provenance", "serving")  # serving: optional


def header() -> dict[str, Any]:
    """The first two fields of every precision-config file (``schema_version``, ``kind``)."""
    return {"schema_version": SCHEMA_VERSION, "kind": KIND}


def check_envelope(obj: Any) -> Mapping[str, Any]:
    """``obj`` if it is a precision config of this schema version: a mapping with known keys,
    the right ``schema_version`` and ``kind``, ``sites`` and ``provenance`` objects. Raises
    :class:`ConfigError` naming the key otherwise. The fields inside are checked by their
    classes (``SitePrecision.from_obj``, ``ModsConfig.from_dict``)."""
    if not isinstance(obj, Mapping):
        raise ConfigError(f"got {type(obj).__name__}; a precision config is a JSON object", key="(top level)")
    unknown = set(obj) - set(_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}; valid keys: {sorted(_KEYS)}", key="(top level)")
    version = obj.get("schema_version")
    if version is None:
        raise ConfigError("missing; add \"schema_version\": 1", key="schema_version")
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise ConfigError(
            f"got {version!r}; this loka-tune reads schema version {SCHEMA_VERSION}"
            " (re-export the config with this version)",
            key="schema_version",
        )
    kind = obj.get("kind", KIND)
    if kind != KIND:
        raise ConfigError(f"got {kind!r}; a precision config has kind {KIND!r} (is this another file?)", key="kind")
    sites = obj.get("sites", {})
    if not isinstance(sites, Mapping):
        raise ConfigError(f"got {type(sites).__name__}; expected an object of name -> site", key="sites")
    prov = obj.get("provenance", {})
    if not isinstance(prov, Mapping):
        raise ConfigError(f"got {prov!r}; expected an object", key="provenance")
    return obj


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice in one object is an error (json keeps the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"the key {k!r} appears twice in one JSON object; keep one", key=k)
        out[k] = v
    return out


def parse_json(text: str, *, source: str = "<string>") -> Any:
    """``json.loads(text)``, rejecting a key given twice in one object; :class:`ConfigError`
    naming ``source`` and the line and column of a syntax error."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})", path=source) from None


def read_text(path: str | Path) -> str:
    """The text of the precision-config file ``path``; :class:`ConfigError` saying how to get
    one when it is missing, and why it cannot be read otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file; export one with `loka-tune export STUDY --out {path}`", path=str(path))
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read it as a UTF-8 JSON file: {e}", path=str(path)) from None


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a crash never leaves half a file); returns the path."""
    return atomic_write_text(path, text)
