"""GPU smoke suite: every reference model compiles and trains on the GPU, the probe forms its
report, and one study runs end to end. The first thing every device call runs.

Every test is marked ``gpu`` (skipped without CUDA; on a CPU this whole file shows skipped).
The code it runs lives in ``tests/gpu_smoke.py``, which ``tests/test_smoke_helpers.py``
runs on a CPU (a tiny model, eager, emulated FP8), so that CI exercises it too.

- **Models x variants**: DLRM, DCNv2, Wukong and Interformer at the ``large`` preset (the
  widths where FP8 has work: torchao's tensorwise size filter keeps no Linear of the ``paper``
  DLRM or Interformer; ``LOKA_SMOKE_PRESET=paper`` runs that one instead; both have the same
  layers, so the compile time, which dominates, is about the same) x {``bf16``, ``bf16_mods``
  (No Bias, BlockNorm 256, Hard Swish), ``fp8_tensorwise`` (the Mods and tensorwise e4m3
  ``torch_scaled_mm`` on torchao's tensorwise-filter sites: ``benchmarks/e2e.py``'s
  ``scaled_mm_tensorwise_filter``), ``dispatch`` (the Mods and the Dispatch plan from the probe
  report, priced by the cost model at 65,536 rows)}: each compiled under ``strict_compile`` (a
  graph break, an eager fallback or a recompile-limit hit fails it), 20 training steps at
  batch 1,024 (26 sparse features; Interformer with 16-event sequences) through the real
  trainer; finite losses, and the mean of the last 5 steps below the mean of the first 5.
- **Probe**: per model, the probe attached to the bf16 baseline as a study attaches it (an
  eager run with ``Probe(step_on="manual")``, even in a compiled regime), 8 steps with 2
  collections, measured (2 draws, bf16 / tensorwise / rowwise ``torch_scaled_mm``); its
  report covers every probed site (or names it unprobed), saves and loads back. If the probe
  raises, its test fails with the traceback and the ``dispatch`` variant plans from the cost
  model alone (``modeled_report``; its line says so), so the plan's compile is still checked.
- **Study**: ``loka-tune tune studies/gpu_smoke.toml --device cuda`` (compiled regime, measured
  speed: 2 bf16 baselines with the probe, 2 trials, the confirmation) then ``export``; the
  exported config says it was confirmed in the compiled regime on 2 seeds.

Time on one H200 (measured 2026-12-01, BENCHMARKS.md): 24 passed in 246 s with
``pytest -n 8 --dist worksteal --timeout 240`` (``benchmarks/gpu_smoke_h200.sh``; pytest-xdist
on the H200 image, 16 cores, one GPU shared: an idle worker takes queued tests from a busy one,
the longest classes are first in the file, the study first of all). Cold compiles dominate:
10-97 s per variant under that sharing (Interformer's the longest), each probe 53-124 s of
setup (mostly its eager collection; a model's probe is computed on up to two workers, its own
test's and its Dispatch variant's), the study 74 s.

Output: each test prints one ``[smoke] ...`` line (model, variant, graphs, FP8 GEMMs, first
and last losses, ms per step, seconds) straight to the terminal, records it as a JUnit
property, and appends it to ``$LOKA_SMOKE_LOG`` (JSON lines) when that is set;
``python tests/gpu_smoke.py $LOKA_SMOKE_LOG`` prints the table.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
from gpu_smoke import (
    VARIANTS,
    case_for,
    make_source,
    modeled_report,
    probe_report,
    record,
    report_problem,
    run_study,
    run_variant,
)

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]


def _say(capsys: pytest.CaptureFixture[str], record_property: Callable[[str, Any], None], line: str) -> None:
    with capsys.disabled():
        print("\n" + line, flush=True)
    record_property("smoke", line)


class _ModelSmoke:
    """One model: its probe report, then each variant compiled and trained (see the module docstring)."""

    model = ""

    @pytest.fixture(scope="class")
    def setup(self) -> tuple[Any, Any]:
        case = case_for(self.model)
        return case, make_source(case)

    @pytest.fixture(scope="class")
    def probed(self, setup: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        """The probe's outcome, an exception included: the probe test reports it, and the
        Dispatch variant then plans from the cost model alone instead of erroring too."""
        case, source = setup
        out = tmp_path_factory.mktemp(f"probe_{self.model}") / "probe_report.json"
        try:
            report, stats, info = probe_report(case, source, out=out)
        except Exception as e:  # noqa: BLE001 - reported by test_probe_report_is_formed
            return {"error": e, "trace": traceback.format_exc()}
        return {"report": report, "stats": stats, "info": info, "out": out}

    def test_probe_report_is_formed(self, setup: tuple[Any, Any], probed: dict[str, Any],
                                    capsys: pytest.CaptureFixture[str],
                                    record_property: Callable[[str, Any], None]) -> None:
        from loka_tune.probe import ProbeReport

        case, _ = setup
        if "error" in probed:
            e = probed["error"]
            record({"what": f"probe {case.model}/{case.preset}", "problem": f"{type(e).__name__}: {e}"[:300]})
            _say(capsys, record_property, f"[smoke] probe {case.model}/{case.preset} FAIL: {type(e).__name__}: {e}")
            pytest.fail(f"the probe raised:\n{probed['trace']}", pytrace=False)
        report, stats, info, out = probed["report"], probed["stats"], probed["info"], probed["out"]
        problem = report_problem(report, stats)
        if problem is None and info["status"] != "ok":
            problem = f"the probed baseline run ended {info['status']!r}"
        if problem is None and len(ProbeReport.load(out).results) != len(report.results):
            problem = "the saved report does not load back whole"
        if problem is None and case.device == "cuda" and info["statistics"].startswith("eager"):
            # a compiled regime's side collections replay their statistics as a CUDA graph (issue 22)
            problem = f"the side collections' statistics ran {info['statistics']!r}, not as a CUDA graph"
        entry = {"what": f"probe {case.model}/{case.preset}", **info, "problem": problem}
        record(entry)
        _say(capsys, record_property, f"[smoke] probe {case.model}/{case.preset}: {info}"
             + ("" if problem is None else f" FAIL: {problem}"))
        assert problem is None, problem

    @pytest.mark.parametrize("variant", VARIANTS)
    def test_variant_compiles_and_trains(self, variant: str, setup: tuple[Any, Any], request: pytest.FixtureRequest,
                                         capsys: pytest.CaptureFixture[str],
                                         record_property: Callable[[str, Any], None]) -> None:
        case, source = setup
        report: Any = None
        if variant == "dispatch":
            probed = request.getfixturevalue("probed")
            report = probed.get("report") or modeled_report(case, source)  # probe failed: the cost model's plan
        try:
            result = run_variant(case, variant, source, report)
        except Exception as e:  # a compile or training error: in the summary too, then the traceback
            record({"what": f"{case.model}/{case.preset} {variant}", "problem": f"{type(e).__name__}: {e}"[:500]})
            raise
        if variant == "dispatch" and "error" in probed:
            result.notes = "; ".join(x for x in (result.notes, "planned from the cost model: the probe failed") if x)
        record(result.to_dict())
        _say(capsys, record_property, result.line())
        assert result.problem is None, result.line()
        if variant == "fp8_tensorwise":
            assert result.fp8_gemms > 0, f"no FP8 GEMM on torchao's filter sites at the {case.preset} preset"


class TestStudy:
    """``loka-tune tune`` of studies/gpu_smoke.toml on the GPU, then ``export``."""

    def test_tune_confirm_export(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 record_property: Callable[[str, Any], None]) -> None:
        entry = run_study(REPO / "studies" / "gpu_smoke.toml", tmp_path / "gpu_smoke", "cuda")
        record(entry)
        _say(capsys, record_property, f"[smoke] study gpu_smoke: {entry}")
        assert entry["problem"] is None, entry["problem"]


# the longest first (the study, then Interformer's compiles): pytest-xdist hands the tests to
# free workers in this order
class TestInterformer(_ModelSmoke):
    model = "interformer"


class TestWukong(_ModelSmoke):
    model = "wukong"


class TestDCNv2(_ModelSmoke):
    model = "dcnv2"


class TestDLRM(_ModelSmoke):
    model = "dlrm"
