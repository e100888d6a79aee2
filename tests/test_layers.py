"""The layers of ``../shared/docs/design.md`` hold for every import of ``loka_tune``.

The import graph is built with ``ast`` from every module, imports inside functions, ``if
TYPE_CHECKING:`` blocks and ``try`` blocks included (what a module may import at any time, not
only when it is loaded). Each module gets the rank of its layer in design.md's "Layers"
section (its numbered list; ``_ORDER`` below is checked against the file where ``../shared`` is
beside the repo, as in CI, and used alone where it is not); within layer 3
``applier.py`` and ``dispatch.py`` "sit on top of" ``mods/`` and ``kernels/``; ``cli.py`` and
``commands/`` are on top of ``tuner/``. Then:

- no import runs upward (a module never imports one of a higher rank);
- the graph has no cycle (between any two modules, counting every import);
- design.md's "Never" list: ``kernels`` -> ``space`` / ``objectives`` / ``tuner``, ``models`` ->
  ``kernels``, ``probe`` -> ``objectives``, ``tracking`` -> the loop, anything -> ``cli``.

A new top-level module must be given a layer here (``_PLACED``) or the test fails: every module
has a rank.
"""

from __future__ import annotations

import re

import pytest

from tests.test_tuner import PACKAGE, REPO, _all_imports, _module_name

DESIGN = REPO.parent / "shared" / "docs" / "design.md"

# the numbered "Layers" list of design.md: layer -> the modules / packages it names
_ORDER = {
    1: ("config", "errors", "layers"),
    2: ("kernels",),
    3: ("mods", "applier", "dispatch"),
    4: ("models", "data"),
    5: ("probe",),
    6: ("space",),
    7: ("objectives",),
    8: ("tuner", "cli", "commands"),
}
# where design.md names a module on top of others of its own layer: a half rank above them
_ON_TOP = {"applier": 3.5, "dispatch": 3.5, "cli": 8.5, "commands": 8.5}
# top-level modules design.md does not name, placed by what they are
_PLACED = {
    "config_file": 1, "mods_config": 1, "recipes": 1, "_io": 1, "_toml": 1, "_lazy": 1, "version": 1,  # plain data, helpers
    "serving": 3.5, "applying": 3.5,  # apply(..., serving=True) and the mechanics both share: beside applier
    "__main__": 9,  # python -m loka_tune: the CLI's entry
}


def _design_order() -> dict[int, tuple[str, ...]]:
    """The layer list as design.md states it (names in backticks per numbered item)."""
    text = DESIGN.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    order: dict[int, list[str]] = {}
    seen: set[str] = set()  # a module's layer is the item that first names it
    for m in re.finditer(r"^(\d)\.\s+(.*?)(?=^\d\.\s|^Never|\Z)", section, re.S | re.M):
        names = re.findall(r"`(?:loka_tune/)?([a-z_]+)(?:\.py|/)`", m.group(2))  # files and folders
        order[int(m.group(1))] = [n for n in dict.fromkeys(names) if n not in seen | {"studies", "benchmarks"}]
        seen.update(names)
    return {k: tuple(v) for k, v in order.items()}


def _rank(module: str) -> float:
    if module == "loka_tune":
        return 10.0  # the package's lazy faces: on top of everything
    top = module.split(".")[1]
    if top in _ON_TOP:
        return _ON_TOP[top]
    for layer, names in _ORDER.items():
        if top in names:
            return float(layer)
    if top in _PLACED:
        return float(_PLACED[top])
    raise AssertionError(f"{module}: no layer. Place it in design.md's order (tests/test_layers.py _ORDER) or _PLACED")


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _all_imports(p, set(paths)) for m, p in paths.items()}


@pytest.mark.skipif(not DESIGN.is_file(), reason="../shared/docs/design.md is not beside the repo")
def test_the_order_here_is_design_md_s() -> None:
    order = _design_order()
    assert set(order) == set(_ORDER), f"design.md's layers are {sorted(order)}, the test's {sorted(_ORDER)}"
    for layer, names in _ORDER.items():
        assert set(order[layer]) == set(names), f"layer {layer}: design.md names {sorted(order[layer])}, the test {sorted(names)}"


def test_every_module_has_a_layer_and_no_import_runs_upward() -> None:
    graph = _graph()
    up = sorted((m, d) for m, deps in graph.items() for d in deps if _rank(d) > _rank(m))
    assert not up, "imports running upward (module -> module of a higher layer): " + ", ".join(
        f"{m} ({_rank(m)}) -> {d} ({_rank(d)})" for m, d in up)


def test_no_import_cycle_counting_every_import() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles (in-function imports count): {cycles}"


def test_design_md_s_never_list() -> None:
    graph = _graph()

    def pkg(m: str) -> str:
        return m.split(".")[1] if "." in m else m

    never = {"kernels": {"space", "objectives", "tuner"}, "models": {"kernels"}, "probe": {"objectives"}}
    bad = sorted((m, d) for m, deps in graph.items() for d in deps if pkg(d) in never.get(pkg(m), set()))
    assert not bad, f"design.md's 'Never': {bad}"
    into_cli = sorted(m for m, deps in graph.items() if "loka_tune.cli" in deps and m not in ("loka_tune.__main__",))
    assert not into_cli, f"modules importing the CLI: {into_cli}"
    loop = {"loka_tune.tuner.loop", "loka_tune.tuner.prepare", "loka_tune.tuner.trial"}
    for m in ("loka_tune.tuner.tracking", "loka_tune.tuner.plots"):
        assert not graph.get(m, set()) & loop, f"{m} imports the loop: {sorted(graph[m] & loop)}"
