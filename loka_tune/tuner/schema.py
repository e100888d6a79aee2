"""The study file's schema as documentation, generated from the sections themselves.

Every key of a study file is a field of its table's section dataclass
(:mod:`loka_tune.tuner.sections`, ``[regime]`` in :mod:`loka_tune.tuner.regime`), whose
metadata carries its doc; ``[training]``'s keys are the plain fields of
:class:`~loka_tune.objectives.trainer.TrainConfig`, documented in its docstring. The tables
are :class:`~loka_tune.tuner.study.StudyConfig`'s fields, in the order they are read.

:func:`schema_markdown` renders every table and key (``docs/study-schema.md``, and what
``loka-tune tune --help-schema`` prints), :func:`readme_table` the README's table of them.
``python -m loka_tune.tuner.schema --write`` rewrites both files from the code, ``--check``
says whether they are current (``tests/test_study_schema_doc.py`` checks it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Key", "tables", "section_keys", "schema_markdown", "readme_table", "replace_readme_block", "toml_literal",
           "README_BEGIN", "README_END", "SCHEMA_DOC", "REGENERATE", "main"]

#: the generated file, relative to the repository root
SCHEMA_DOC = "docs/study-schema.md"
#: the markers around the README's generated table
README_BEGIN = "<!-- schema:begin (generated: python -m loka_tune.tuner.schema --write) -->"
README_END = "<!-- schema:end -->"
REGENERATE = "python -m loka_tune.tuner.schema --write"

_INTRO = """\
A study file is TOML, one table per section below. Every table but `[model]` and `[data]` is
optional, and so is every key that has a default. An unknown table or key (a typo) or a bad
value stops the study when the file is read, with an error that names the dotted key
(`training.steps`), quotes the value and names the fix. Examples: `studies/quickstart.toml`
(a CPU study in minutes) and the other files in `studies/`.

A study remembers the settings it was made with: after an edit of {settings}, `loka-tune tune`
stops and says what changed (`--fresh` starts over, `--resume-anyway` goes on); {free} may
change freely."""


@dataclass(frozen=True)
class Key:
    """One key of a study-file table, as documented."""

    table: str
    name: str
    type: str  # in TOML's words: "string", "list of integers", "boolean or string", ...
    default: str  # a TOML value in backticks, or words
    doc: str
    choices: tuple[str, ...] = ()


def tables() -> dict[str, type]:
    """The study file's tables -> their section dataclasses, in the order they are read."""
    from loka_tune.tuner.study import StudyConfig

    hints = typing.get_type_hints(StudyConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(StudyConfig) if hasattr(hints[f.name], "from_table")}


def section_keys(table: str) -> list[Key]:
    """The documented keys of ``[table]``, in the order of its dataclass's fields."""
    from loka_tune.objectives.trainer import TrainConfig

    cls = tables()[table]
    hints = typing.get_type_hints(cls, localns={"TrainConfig": TrainConfig})
    keys = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "keys_of" in meta:  # a nested config whose plain fields are this table's keys
            keys += _nested_keys(table, _default_of(f), tuple(meta["keys_of"]))
            continue
        keys.append(Key(table, f.name, _type_words(hints[f.name]),
                        meta.get("default") or _toml_value(_default_of(f)),
                        meta.get("doc", ""), _choices(meta.get("choices", ()))))
    return keys


def _choices(spec: Any) -> tuple[str, ...]:
    """A field's ``choices``: the values, or ``"module:name"`` of them (a mapping: its sorted keys)."""
    if isinstance(spec, str):
        module, _, name = spec.partition(":")
        spec = getattr(importlib.import_module(module), name)
        if isinstance(spec, Mapping):
            spec = sorted(spec)
    return tuple(spec)


def _nested_keys(table: str, value: Any, exclude: tuple[str, ...]) -> list[Key]:
    from loka_tune._toml import plain_fields

    cls = type(value)
    docs = {**_docstring_fields(cls), **{f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}}
    return [Key(table, name, " or ".join(_type_words(k) for k in kinds if k is not type(None)),
                _toml_value(getattr(value, name)), docs.get(name, ""))
            for name, kinds in plain_fields(cls, exclude=exclude).items()]


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


_FIELD_LINE = re.compile(r"^([a-z_][a-z0-9_]*):\s+(\S.*)$")


def _docstring_fields(cls: type) -> dict[str, str]:
    """A class docstring's ``name: text`` lines (text continued on the more indented lines below)."""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        m = _FIELD_LINE.match(line)
        if m:
            current = docs.setdefault(m.group(1), [m.group(2)])
        elif current is not None and line[:1].isspace() and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {k: _markdown(" ".join(v)) for k, v in docs.items()}


def _markdown(text: str) -> str:
    """reST to markdown, as far as the docs need: ``code`` and :role:`~target` become `code`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"\s+", " ", text.replace("``", "`")).strip()


_WORDS = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "string"}


def _type_words(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args if a is not type(None))
    if origin is tuple:
        word = _type_words(args[0])
        return f"list of {'booleans' if word == 'boolean' else word + 's'}"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "table"
    return _WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _toml_value(v: Any) -> str:
    if v is None:
        return "unset"
    return f"`{toml_literal(v)}`"


def toml_literal(v: Any) -> str:
    """``v`` written as a TOML value (tuples as arrays)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k} = {toml_literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _summary(cls: type) -> str:
    """The first paragraph of a section's docstring."""
    return _markdown(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0])


def _intro() -> str:
    from loka_tune.tuner.study import SETTINGS_SECTIONS

    def listed(names: list[str]) -> str:
        return ", ".join(f"`[{n}]`" for n in names[:-1]) + f" or `[{names[-1]}]`"

    settings = [t for t in tables() if t in SETTINGS_SECTIONS]
    free = [t for t in tables() if t not in SETTINGS_SECTIONS]
    text = _INTRO.format(settings=listed(settings), free=listed(free).replace(" or ", " and "))
    return "\n\n".join(textwrap.fill(" ".join(p.split()), 96) for p in text.split("\n\n"))


def schema_markdown() -> str:
    """Every table of a study file and every key, its type, default and meaning, as markdown
    (``docs/study-schema.md``; ``loka-tune tune --help-schema`` prints it)."""
    out = ["# The study file", "",
           f"<!-- generated from loka_tune/tuner/sections.py and regime.py by `{REGENERATE}`: edit the"
           " fields' docs there, not this file -->", "", _intro()]
    for table, cls in tables().items():
        out += ["", f"## `[{table}]`", "", _summary(cls), ""]
        for k in section_keys(table):
            choices = f" Choices: {', '.join(f'`{toml_literal(c)}`' for c in k.choices)}." if k.choices else ""
            doc = k.doc if k.doc.endswith(".") else k.doc + "."
            default = "required" if k.default == "required" else f"default {k.default}"
            out.append(f"- `{k.name}` ({k.type}, {default}): {doc}{choices}")
    return "\n".join(out) + "\n"


def readme_table() -> str:
    """The README's table of a study file's tables (the first sentence of each section's doc) and
    their keys, as it stands between the README's schema markers."""
    rows = ["| table | what | keys |", "|---|---|---|"]
    for table, cls in tables().items():
        keys = ", ".join(f"`{k.name}`" for k in section_keys(table))
        first = re.split(r"(?<=\.)\s", _summary(cls), maxsplit=1)[0]
        rows.append(f"| `[{table}]` | {first.replace('|', '/')} | {keys} |")
    return "\n".join(rows) + "\n"


def replace_readme_block(readme: str, table: str) -> str:
    """``readme`` with the text between its schema markers replaced by ``table``."""
    try:
        head, rest = readme.split(README_BEGIN + "\n", 1)
        _, tail = rest.split(README_END, 1)
    except ValueError:
        raise ValueError(f"README.md lacks the markers {README_BEGIN!r} ... {README_END!r} (each on its own"
                         " line) around the study-file table") from None
    return f"{head}{README_BEGIN}\n{table}{README_END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loka_tune.tuner.schema [--write | --check] [--root DIR]``: print the schema,
    rewrite ``docs/study-schema.md`` and the README's table, or check that they are current."""
    parser = argparse.ArgumentParser(prog="python -m loka_tune.tuner.schema", description=main.__doc__)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"rewrite {SCHEMA_DOC} and README.md's table")
    what.add_argument("--check", action="store_true", help="exit 1 if either is not what the code generates")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the repository root (default: the one this package is in)")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(schema_markdown())
        return 0
    readme_path, doc_path = args.root / "README.md", args.root / SCHEMA_DOC
    if not readme_path.is_file():
        parser.error(f"no README.md in {str(args.root)!r}; give the repository root with --root")
    readme = readme_path.read_text()
    want = {doc_path: schema_markdown(), readme_path: replace_readme_block(readme, readme_table())}
    stale = [p for p, text in want.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            sys.stderr.write(f"{p} is not what the code generates; run `{REGENERATE}`\n")
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(want[p])
        sys.stdout.write(f"wrote {p}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
