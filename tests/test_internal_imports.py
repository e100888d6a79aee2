"""Internals stay inside: no library module reaches for another module's underscore names.

The rule, checked on every ``.py`` under ``loka_tune/`` with :mod:`ast` (imports inside
functions included):

- no ``from <another loka_tune module> import _name`` (relative or absolute), and no
  ``<alias of another loka_tune module>._name`` attribute access; dunder names
  (``__version__``) are fine. What several modules share is a public name of the module
  where it belongs.
- a private module (a file or package whose own name starts with ``_``, e.g.
  ``tuner/_workers.py``) belongs to its package: it may be imported (its public names) only
  from inside the package that holds it (``loka_tune/_io.py``: anywhere in ``loka_tune``;
  ``tuner/_workers.py``: only from ``loka_tune.tuner``).

Tests are not library modules: they may import underscore names to test them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "loka_tune"

def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


@dataclass(frozen=True)
class Module:
    path: Path
    name: str  # dotted: loka_tune.tuner.build
    package: str  # the package its relative imports start from

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def _modules() -> dict[str, Module]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            package = ".".join(parts)
        else:
            package = ".".join(parts[:-1])
        mods[".".join(parts)] = Module(path, ".".join(parts), package)
    return mods


def _source(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute dotted module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = mod.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _holder_check(mod: Module, target: str) -> str | None:
    """Why importing module ``target`` from ``mod`` breaks the private-module rule, or None."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            holder = ".".join(parts[:i])
            if not (mod.name == holder or mod.name.startswith(holder + ".")):
                return f"private module {'.'.join(parts[: i + 1])} imported from outside {holder}"
    return None


def _offences(mod: Module, mods: dict[str, Module], text: str | None = None) -> list[tuple[str, str, str]]:
    """(file:line, offending dotted name, why) for one module (its file, or ``text``)."""
    tree = ast.parse(mod.path.read_text() if text is None else text, filename=str(mod.path))
    out: list[tuple[str, str, str]] = []
    aliases: dict[str, str] = {}  # a local name bound to a loka_tune module -> that module

    def offend(node: ast.AST, name: str, why: str) -> None:
        out.append((f"{mod.rel}:{getattr(node, 'lineno', 0)}", name, why))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source(mod, node)
            if src.split(".")[0] != "loka_tune":
                continue
            if (why := _holder_check(mod, src)) is not None:
                offend(node, src, why)
            for a in node.names:
                target = f"{src}.{a.name}"
                if target in mods:  # a submodule imported by name
                    aliases[a.asname or a.name] = target
                    if (why := _holder_check(mod, target)) is not None:
                        offend(node, target, why)
                elif _private(a.name) and src != mod.name:
                    offend(node, target, f"underscore name imported from {src}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "loka_tune":
                    continue
                if (why := _holder_check(mod, a.name)) is not None:
                    offend(node, a.name, why)
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases["loka_tune"] = "loka_tune"

    for node in ast.walk(tree):  # `alias._name` on a loka_tune module
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in aliases:
            continue
        chain.reverse()
        target = aliases[base.id]
        for attr in chain:
            if f"{target}.{attr}" in mods:
                target = f"{target}.{attr}"
                continue
            if _private(attr) and target != mod.name:
                offend(node, f"{target}.{attr}", f"underscore attribute of {target}")
            break
    return out


def _all_offences() -> list[tuple[str, str, str]]:
    mods = _modules()
    found = {o for m in mods.values() for o in _offences(m, mods)}  # a chain is walked once per node
    return sorted(found)


def test_checker_finds_what_it_should() -> None:
    """The checker itself: each kind of offence in a made-up module is found, and the allowed
    forms are not."""
    mods = _modules()
    src = (
        "from loka_tune.tuner.build import make_model, _hidden\n"
        "from .build import _rel\n"
        "from loka_tune.version import __version__\n"
        "import loka_tune.tuner.build as b\n"
        "from loka_tune.tuner import build\n"
        "from loka_tune.tuner._workers import anything\n"
        "def f():\n"
        "    from loka_tune.kernels import quant\n"
        "    return b._x, build.make_model, quant._y, build.__name__\n"
    )
    mod = Module(PKG / "commands" / "made_up.py", "loka_tune.commands.made_up", "loka_tune.commands")
    got = {name for _, name, _ in _offences(mod, mods, src)}
    assert got == {
        "loka_tune.tuner.build._hidden",
        "loka_tune.commands.build._rel",  # relative: resolved from the module's own package
        "loka_tune.tuner._workers",
        "loka_tune.tuner.build._x",
        "loka_tune.kernels.quant._y",
    }, got


def test_no_cross_module_underscore_imports() -> None:
    found = _all_offences()
    assert not found, "modules reaching into other modules' internals:\n" + "\n".join(
        f"  {where}: {name} ({why})" for where, name, why in found)
