"""One feasibility rule (issue 24): :func:`loka_tune.tuner.results.within_budget` decides whether a
relative log loss is within the loss budget, everywhere it is decided: a trial's outcome, the
confirmation's rows, ``loka-tune export``'s note and the benchmarks' receipts. No other module
compares a relative log loss with a budget itself (an ``ast`` check below)."""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loka_tune.config import PrecisionConfig
from loka_tune.tuner.results import INFEASIBLE, constraint, within_budget

REPO = Path(__file__).resolve().parents[1]
RULE_FILE = REPO / "loka_tune" / "tuner" / "results.py"


# ------------------------------------------------------------------ the rule's edge cases
@pytest.mark.parametrize("rel,budget,want", [
    (0.5, 0.5, True),                                 # exactly at the budget: feasible (<=, not <)
    (math.nextafter(0.5, math.inf), 0.5, False),      # the next float above it: not
    (math.nextafter(0.5, -math.inf), 0.5, True),
    (0.0, 0.5, True), (-0.2, 0.5, True), (-100.0, 0.5, True),  # better than bf16 (negative) is feasible
    (0.0, 0.0, True), (1e-300, 0.0, False), (-1e-300, 0.0, True),
    (5e-324, 0.0, False),                             # a subnormal above a zero budget: still over it
    (3.0, 0.5, False),
    (None, 0.5, False), (math.nan, 0.5, False),       # unknown / unmeasured loss: infeasible
    (math.inf, 0.5, False), (-math.inf, 0.5, False),  # non-finite: a diverged run, never feasible
    (0.1, None, False), (None, None, False),          # unknown budget: nothing is feasible
    (0.1, math.nan, False),
    (1, 1, True), (2, 1, False),                      # ints are losses and budgets too
])
def test_within_budget(rel: float | None, budget: float | None, want: bool) -> None:
    assert within_budget(rel, budget) is want
    # the Optuna constraint is the same rule as a number: feasible exactly when <= 0
    assert (constraint(rel, budget) <= 0) is want
    if rel is None or not math.isfinite(rel) or budget is None:
        assert constraint(rel, budget) == INFEASIBLE


def test_within_budget_is_the_inline_comparison_it_replaced_on_finite_losses() -> None:
    """confirm.py decided ``mean <= budget`` and export.py ``rel is not None and budget is not None
    and rel <= budget``; trial.py ``constraint(rel, budget) <= 0``. On every finite loss (a relative
    log loss is >= -100%: a log loss is >= 0) they agree with the one rule, ties and neighbours
    of the budget included."""
    budgets = [0.0, 1e-12, 0.05, 0.5, 2.0, 3.0, 1e6]
    for b in budgets:
        rels = [b, math.nextafter(b, math.inf), math.nextafter(b, -math.inf), -b, b * 0.999, b * 1.001, b + 1e-9,
                b - 1e-9, -100.0, 0.0, 99.0]
        for rel in rels:
            old_export = rel is not None and b is not None and rel <= b
            assert within_budget(rel, b) is old_export is (rel <= b) is (constraint(rel, b) <= 0), (rel, b)


# ------------------------------------------------------------------ the call sites follow it
@pytest.mark.parametrize("status,rel,budget,want", [
    ("ok", 0.5, 0.5, True), ("ok", 0.6, 0.5, False), ("ok", math.nan, 0.5, False), ("ok", -math.inf, 0.5, False),
    ("pruned", 0.0, 0.5, False), ("failed", 0.0, 0.5, False),
])
def test_a_trial_outcome_is_feasible_by_the_rule(status: str, rel: float, budget: float, want: bool) -> None:
    from loka_tune.tuner.trial import TrialOutcome

    assert TrialOutcome(status, rel_logloss_pct=rel).feasible(budget) is want


def _confirm_row(monkeypatch: pytest.MonkeyPatch, runs: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """A confirmation row of a trial whose seeds' runs are ``runs`` (the runs themselves stubbed)."""
    from loka_tune.tuner import confirm

    it = iter(runs)
    monkeypatch.setattr(confirm, "_reused_run", lambda *a, **k: None)
    monkeypatch.setattr(confirm, "_kept_or_run", lambda *a, **k: next(it))  # run now, or kept from a cut one
    ctx = SimpleNamespace(cfg=SimpleNamespace(objective=SimpleNamespace(budget_pct=budget)),
                          baseline=SimpleNamespace(step_time_s=2.0, noise_floor_pct=0.1))
    trial = SimpleNamespace(number=7, value=1.0,
                            user_attrs={"config_key": "k", "config": json.loads(PrecisionConfig().to_json()),
                                        "rel_logloss_pct": 0.1, "speedup_vs_mods": 1.5, "speedup": 1.6})
    return confirm._confirm_one(ctx, trial, tuple(r["seed"] for r in runs))  # type: ignore[arg-type]


def _run(seed: int, rel: float, status: str = "ok") -> dict[str, Any]:
    if status != "ok":
        return {"seed": seed, "status": status, "reason": "nonfinite at step 3"}
    return {"seed": seed, "status": "ok", "rel_logloss_pct": rel, "step_time_s": 1.0, "ref_step_time_s": 1.5}


@pytest.mark.parametrize("rels,budget,want", [
    ((0.4, 0.6), 0.5, True),     # the mean over the seeds, exactly at the budget: feasible ...
    ((0.1, 0.9), 0.5, True),     # ... even with one seed over it (the confirmation's rule is the mean)
    ((0.5, 0.7), 0.5, False),    # mean 0.6 > 0.5
    ((-0.3, -0.1), 0.0, True),
])
def test_a_confirmation_row_is_feasible_by_the_rule_on_its_mean(monkeypatch: pytest.MonkeyPatch,
                                                                 rels: tuple[float, ...], budget: float,
                                                                 want: bool) -> None:
    row = _confirm_row(monkeypatch, [_run(s, r) for s, r in enumerate(rels)], budget)
    assert row["rel_logloss_pct"] == pytest.approx(sum(rels) / len(rels), abs=1e-15)
    assert row["feasible"] is want is within_budget(row["rel_logloss_pct"], budget)


def test_a_confirmation_row_with_a_failed_seed_is_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    row = _confirm_row(monkeypatch, [_run(0, 0.0), _run(1, 0.0, status="diverged")], 0.5)
    assert row["feasible"] is False and row["rel_logloss_pct"] is None and row["reason"].startswith("seed 1:")


@pytest.mark.parametrize("rel,budget,note", [
    (0.5, 0.5, False), (-0.1, 0.5, False), (0.51, 0.5, True), (None, 0.5, True), (0.1, None, True),
])
def test_export_says_not_feasible_by_the_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str], rel: float | None,
                                              budget: float | None, note: bool) -> None:
    from loka_tune.commands import export
    from loka_tune.tuner import results

    config = PrecisionConfig().with_provenance(trial=3, study="s", speedup=1.2, speed_source="modeled",
                                               rel_logloss_pct=rel, budget_pct=budget, noise_floor_pct=0.05,
                                               confirmed=False)
    monkeypatch.setattr(export, "open_existing", lambda study, storage: (None, None))
    monkeypatch.setattr(results, "export_best", lambda study, **kw: config)
    out = tmp_path / "best.json"
    assert export.run(argparse.Namespace(study="s.toml", storage=None, out=str(out), trial=None,
                                         unconfirmed=False)) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"wrote {out}: trial 3 of 's'")
    assert ("NOT feasible: over the loss budget" in line) is note is not within_budget(rel, budget)


# ------------------------------------------------------------------ no other module decides it inline
def _words(node: ast.AST) -> set[str]:
    """The identifiers an expression names: variables, attributes, string subscripts, called names."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            out.add(n.slice.value)
    return {w.lower() for w in out}


def _calls_constraint(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and ((isinstance(n.func, ast.Name) and n.func.id == "constraint")
                                            or (isinstance(n.func, ast.Attribute) and n.func.attr == "constraint"))
               for n in ast.walk(node))


_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def inline_feasibility(source: str) -> list[int]:
    """The lines of ``source`` that decide feasibility themselves: an ordering comparison of a
    loss (a name with "rel" or "loss" in it, or a ``mean``) with a budget (a name with "budget"
    in it), or of the constraint (``constraint(...) <= 0``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Compare) and any(isinstance(op, _ORDER) for op in node.ops)):
            continue
        words = _words(node)
        budget = any("budget" in w for w in words)
        loss = any("rel" in w or "loss" in w or w == "mean" for w in words)
        if (budget and loss) or _calls_constraint(node):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("snippet", [  # what confirm.py, export.py, trial.py and the benchmarks had
    "row.update(feasible=mean <= ctx.cfg.objective.budget_pct)",
    'feasible = p["rel_logloss_pct"] is not None and p["budget_pct"] is not None \\\n'
    '    and p["rel_logloss_pct"] <= p["budget_pct"]',
    'ok = self.status == "ok" and constraint(self.rel_logloss_pct, budget_pct) <= 0',
    "feasible = results.constraint(rel, world.budget_pct) <= 0",
    'truly = [r for r in recs if r["true_rel_logloss_pct"] <= budget_pct]',
    "bad = budget < rel_pct",
    "ok = rel - budget <= 0.0",
])
def test_the_check_finds_an_inline_rule(snippet: str) -> None:
    assert inline_feasibility(snippet)


@pytest.mark.parametrize("snippet", [  # comparisons with a budget that are not a trial's feasibility
    "if b < floor: pass",                                     # check_budget: the budget vs the noise floor
    "if m * budget_pct < out[-1]: pass",                      # proposals.capacities
    "if time.perf_counter() - t0 < budget_s: pass",           # a time budget
    "feasible = within_budget(mean, ctx.cfg.objective.budget_pct)",
])
def test_the_check_leaves_other_comparisons(snippet: str) -> None:
    assert inline_feasibility(snippet) == []


def _sources() -> list[Path]:
    files = [p for p in sorted((REPO / "loka_tune").rglob("*.py")) if "probe" not in p.relative_to(REPO).parts]
    return files + sorted((REPO / "benchmarks").glob("*.py"))


def test_feasibility_is_decided_only_in_results() -> None:
    files = _sources()
    assert REPO / "loka_tune" / "tuner" / "confirm.py" in files and REPO / "loka_tune" / "commands" / "export.py" in files
    found = {p.relative_to(REPO).as_posix(): inline_feasibility(p.read_text()) for p in files}
    # the rule itself is found where it lives (the check is not blind to the real code) ...
    rule = RULE_FILE.read_text().splitlines()
    assert [rule[n - 1].strip() for n in found.pop("loka_tune/tuner/results.py")] == [
        "return constraint(rel_logloss_pct, budget_pct) <= 0.0"]
    # ... and nowhere else
    assert {k: v for k, v in found.items() if v} == {}
