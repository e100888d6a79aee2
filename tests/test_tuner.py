"""The shape of ``loka_tune/tuner/``: one feasibility rule, the typed trial record, the compatibility
modules, no import cycle, light imports, and the size limits of issue 12."""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loka_tune.tuner.results import INFEASIBLE, TrialRecord, constraint

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "loka_tune"


# ------------------------------------------------------------------ feasibility and the trial record
@pytest.mark.parametrize("rel,budget,want", [
    (0.0, 0.5, -0.5), (0.5, 0.5, 0.0), (0.75, 0.5, 0.25), (-1.0, 0.5, -1.5),
    (None, 0.5, INFEASIBLE), (math.nan, 0.5, INFEASIBLE), (math.inf, 0.5, INFEASIBLE), (0.1, None, INFEASIBLE),
])
def test_constraint_is_the_one_feasibility_rule(rel: float | None, budget: float | None, want: float) -> None:
    from types import SimpleNamespace

    from loka_tune.tuner.optuna_setup import _constraints
    from loka_tune.tuner.trial import TrialOutcome

    assert constraint(rel, budget) == want
    attrs = {"rel_logloss_pct": rel, "budget_pct": budget}
    assert TrialRecord.from_attrs(attrs).constraint == want
    assert tuple(_constraints(SimpleNamespace(user_attrs=attrs))) == (want,)  # what TPE reads before Optuna 5
    if budget is not None:
        outcome = TrialOutcome("ok", rel_logloss_pct=math.nan if rel is None else rel)
        assert outcome.feasible(budget) == (want <= 0)
        assert not TrialOutcome("pruned", rel_logloss_pct=0.0).feasible(budget)


def test_trial_record_round_trips_the_attributes_the_loop_writes() -> None:
    from loka_tune.tuner.trial import TrialOutcome

    start = TrialRecord(config_key="k", config={"sites": {}}, budget_pct=0.5, worker="w:1", speed_source="modeled")
    assert start.start_attrs() == {"config_key": "k", "config": {"sites": {}}, "budget_pct": 0.5, "worker": "w:1",
                                   "speed_source": "modeled"}
    ok = TrialOutcome("ok", rel_logloss_pct=0.1, step_time_s=1e-3, speedup=1.2, steps_run=8, wall_s=2.0)
    end = TrialRecord(**ok.attrs(), feasible=ok.feasible(0.5), cache_hit=False)
    attrs = end.result_attrs()
    # the keys a finished evaluation always had; the optional ones only when set
    assert set(attrs) == set(ok.attrs()) | {"feasible", "cache_hit"}
    assert attrs["eval_ne"] is None and attrs["feasible"] is True  # not measured: None, as JSON
    failed = TrialRecord(**TrialOutcome("failed", reason="unsupported: x").attrs(), fail_reason="unsupported: x")
    assert failed.result_attrs()["fail_reason"] == "unsupported: x" and failed.counts and not end.counts
    stored = {**start.start_attrs(), **attrs, "seeded": "all-bf16", "some_future_key": 1}
    back = TrialRecord.from_attrs(stored)
    assert back.seeded == "all-bf16" and back.rel_logloss_pct == 0.1 and back.worker == "w:1"
    assert back.result_attrs() == attrs
    # how a completed run trained, and a compiled one's cache counts: kept where set
    ran = TrialOutcome("ok", rel_logloss_pct=0.1, step_time_s=1e-3, run={"seed": 0, "steps": 8},
                       compile_cache={"hits": 2, "misses": 0})
    attrs = TrialRecord(**ran.attrs(), feasible=True, cache_hit=False).result_attrs()
    assert attrs["run"] == {"seed": 0, "steps": 8} and attrs["compile_cache"] == {"hits": 2, "misses": 0}
    assert TrialRecord.from_attrs(attrs).result_attrs() == attrs


# ------------------------------------------------------------------ the package and its old names
def test_the_old_flat_modules_are_gone() -> None:
    """The study loop lives in loka_tune.tuner only: no second import path to keep in step."""
    import importlib.util

    from loka_tune import tuner

    for old in ("loka_tune.tune", "loka_tune.study", "loka_tune.tracking"):
        assert importlib.util.find_spec(old) is None, old
    for name in tuner.__all__:
        assert getattr(tuner, name) is not None


def test_tuner_imports_stay_light() -> None:
    code = (
        "import sys, loka_tune, loka_tune.tuner, loka_tune.tuner.study, loka_tune.tuner.results,"
        " loka_tune.tuner.tracking, loka_tune._toml;"
        "heavy = [m for m in ('torch', 'optuna', 'mlflow', 'matplotlib') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(node: ast.stmt, package: str) -> set[str]:
    """The dotted names an import statement brings in (relative imports resolved in ``package``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
    return {base, *(f"{base}.{a.name}" for a in node.names)}


def _imports_of(path: Path, modules: set[str], *, anywhere: bool) -> set[str]:
    """The loka_tune modules ``path`` imports: when it is imported (``anywhere`` False: module
    level, ``if TYPE_CHECKING:`` and try blocks included), or anywhere (inside functions too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_imported_names(node, package))
            elif isinstance(node, (ast.If, ast.Try)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    if anywhere:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_imported_names(node, package))
    else:
        visit(tree.body)
    out = set()
    for imported in found:
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            out.add(imported)
    return out


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    return _imports_of(path, modules, anywhere=False)


def test_no_import_cycle_at_module_level() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _module_level_imports(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [m, d]))
            if d not in state:
                walk(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    # tracking and its plots read results, never the loop (not even inside a function)
    for name in ("tracking.py", "plots.py"):
        text = (PACKAGE / "tuner" / name).read_text()
        assert not re.search(r"tuner\.(loop|prepare|trial)\b|loka_tune\.tune\b", text), name



def _all_imports(path: Path, modules: set[str]) -> set[str]:
    return _imports_of(path, modules, anywhere=True)


# the vocabulary (layer 1 of docs/design.md): plain data everyone shares; it imports only itself
_VOCABULARY = {"loka_tune.config", "loka_tune.config_file", "loka_tune.mods_config", "loka_tune.recipes",
               "loka_tune.errors", "loka_tune._io"}


def test_config_recipes_and_dispatch_import_only_downward() -> None:
    """config -> recipes (plain data) and dispatch -> config / recipes / kernels, never back: no
    import runs upward from the vocabulary, not even inside a function or through importlib."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    for m in sorted(_VOCABULARY):
        up = _all_imports(paths[m], set(paths)) - _VOCABULARY
        assert not up, f"{m} imports {sorted(up)}: upward from the vocabulary"
        assert "importlib" not in paths[m].read_text(), f"{m} imports by name (importlib): an import the check cannot see"
    assert _all_imports(paths["loka_tune.recipes"], set(paths)) == set(), "recipes is data: it imports nothing"
    dispatch = _all_imports(paths["loka_tune.dispatch"], set(paths))
    assert "importlib" not in paths["loka_tune.dispatch"].read_text()
    assert dispatch - _VOCABULARY <= {m for m in paths if m.startswith("loka_tune.kernels")}, sorted(dispatch)
    assert {"loka_tune.config", "loka_tune.recipes"} <= dispatch  # it builds the Dispatch recipe
    # no cycle among the three, counting every import (a function-level one too)
    trio = ("loka_tune.config", "loka_tune.recipes", "loka_tune.dispatch")
    reach = {m: _all_imports(paths[m], set(paths)) for m in paths}

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            for d in reach.get(m, ()):
                if d == b:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False

    for a in trio:
        for b in trio:
            if a != b and reaches(a, b):
                assert not reaches(b, a), f"import cycle through {a} and {b}"


# files of the tuner refactor (issue 12): modules <= 600 lines, functions <= 120 lines
_OWNED = [*sorted((PACKAGE / "tuner").glob("*.py")), PACKAGE / "_toml.py", PACKAGE / "objectives" / "speed.py",
          PACKAGE / "recipes.py", PACKAGE / "version.py", PACKAGE / "cli.py",
          *sorted((PACKAGE / "commands").glob("*.py"))]


@pytest.mark.parametrize("path", _OWNED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_sizes(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert len(lines) <= 600, f"{path.name}: {len(lines)} lines"
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert n <= 120, f"{path.name}:{node.lineno} {node.name}() is {n} lines"
