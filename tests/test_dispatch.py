"""LoKA Dispatch on hand-built probe reports (CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from loka_tune.config import GemmRole, PrecisionConfig
from loka_tune.dispatch import build_plan, decide_gemm, plan_decisions
from loka_tune.errors import ConfigError


@dataclass
class Rec:  # the fields of probe.CandidateResult that dispatch reads
    site: str
    role: str
    choice: str
    m: int
    k: int
    n: int
    mere: float
    speedup: float
    time_source: str = "modeled"


@dataclass
class Report:
    results: list


def _recs(site: str, M: int, K: int, N: int, table: dict[str, dict[str, tuple[float, float]]]) -> list[Rec]:
    out = []
    for role, cands in table.items():
        m, k, n = GemmRole(role).shape(M, K, N)
        for choice, (mere, speedup) in cands.items():
            out.append(Rec(site, role, choice, m, k, n, mere, speedup))
    return out


def _report() -> Report:
    recs = []
    # big layer: FP8 fast and accurate, fastest row in fwd, tensor in dgrad; wgrad row too
    # inaccurate, tensor fast enough
    recs += _recs("mlp.0", 32768, 4096, 4096, {
        "fwd": {"e4m3.row.torch_scaled_mm": (0.04, 1.5), "e4m3.tensor.torch_scaled_mm": (0.05, 1.4),
                "e4m3.block.triton": (0.03, 1.2)},
        "dgrad": {"e4m3.row.torch_scaled_mm": (0.04, 1.3), "e4m3.tensor.torch_scaled_mm": (0.05, 1.45)},
        "wgrad": {"e4m3.row.torch_scaled_mm": (0.25, 1.6), "e4m3.tensor.triton": (0.10, 1.2)},
    })
    # small layer: FP8 slower (or barely faster) everywhere -> bf16
    recs += _recs("mlp.1", 8192, 256, 256, {
        "fwd": {"e4m3.row.torch_scaled_mm": (0.04, 0.5), "e4m3.tensor.triton": (0.05, 1.04)},
        "dgrad": {"e4m3.row.torch_scaled_mm": (0.04, 0.6)},
        "wgrad": {"e4m3.row.torch_scaled_mm": (0.04, 0.7)},
    })
    return Report(recs)


def test_fastest_safe_and_fast_candidate_per_gemm() -> None:
    plan = build_plan(_report(), max_error=0.2, min_speedup=1.05)
    assert isinstance(plan, PrecisionConfig)
    big = plan.resolve("mlp.0")
    assert big.fwd.short_str() == "e4m3.row.torch_scaled_mm"
    assert big.dgrad.short_str() == "e4m3.tensor.torch_scaled_mm"
    assert big.wgrad.short_str() == "e4m3.tensor.triton"  # row is faster but over the error bound
    small = plan.resolve("mlp.1")
    assert small.is_bf16  # 1.04x does not clear the 1.05 margin
    assert plan.resolve("not.a.site").is_bf16
    prov = plan.provenance
    assert prov["time_source"] == "modeled" and prov["fp8_gemms"] == 3 and prov["gemms"] == 6
    assert prov["per_gemm"]["mlp.0"]["wgrad"]["mere"] == pytest.approx(0.10)


def test_thresholds_move_the_plan() -> None:
    strict = build_plan(_report(), max_error=0.035, min_speedup=1.05)
    assert strict.resolve("mlp.0").fwd.short_str() == "e4m3.block.triton"
    assert strict.resolve("mlp.0").dgrad.is_bf16
    loose = build_plan(_report(), max_error=0.3, min_speedup=1.0)
    assert loose.resolve("mlp.0").wgrad.short_str() == "e4m3.row.torch_scaled_mm"
    assert loose.resolve("mlp.1").fwd.short_str() == "e4m3.tensor.triton"
    never = build_plan(_report(), max_error=0.3, min_speedup=10.0)
    assert all(never.resolve(s).is_bf16 for s in ("mlp.0", "mlp.1"))


def test_measured_timings_override_modeled_speedups() -> None:
    rep = _report()
    m, k, n = GemmRole.FWD.shape(32768, 4096, 4096)
    timings = {("bf16", m, k, n, "fwd"): 1.0e-3, ("e4m3.block.triton", m, k, n, "fwd"): 0.5e-3}
    plan = build_plan(rep, timings=timings)
    assert plan.resolve("mlp.0").fwd.short_str() == "e4m3.block.triton"  # measured 2.0x beats modeled 1.5x
    info = plan.provenance["per_gemm"]["mlp.0"]["fwd"]
    assert info["time_source"] == "measured" and info["speedup"] == pytest.approx(2.0)
    assert plan.provenance["time_source"] == "mixed"


def test_emulated_choices_resolve_to_a_real_backend() -> None:
    recs = _recs("big", 32768, 4096, 4096, {r: {"e4m3.row.emulated": (0.04, 1.5)} for r in ("fwd", "dgrad", "wgrad")})
    plan = build_plan(Report(recs))
    for role in ("fwd", "dgrad", "wgrad"):
        c = plan.resolve("big")[role]
        assert c.backend in ("torch_scaled_mm", "fbgemm", "triton", "torchao")
        assert c.granularity.value == "row"
    keep = build_plan(Report(recs), resolve_emulated=False)
    assert keep.resolve("big").fwd.backend == "emulated"


def test_plan_round_trips_through_json(tmp_path) -> None:
    plan = build_plan(_report())
    again = PrecisionConfig.load(plan.save(tmp_path / "plan.json"))
    assert again.resolve("mlp.0") == plan.resolve("mlp.0")
    assert again.provenance["per_gemm"] == plan.provenance["per_gemm"]


def test_dict_records_and_missing_roles() -> None:
    recs = [dict(site="a", role="fwd", choice="e4m3.row.triton", m=1, k=1, n=1, mere=0.01, speedup=2.0)]
    d = plan_decisions(recs)
    assert d["a"]["fwd"].choice.short_str() == "e4m3.row.triton"
    assert d["a"]["dgrad"].choice.is_bf16 and d["a"]["dgrad"].time_source == "none"
    nan = decide_gemm([dict(choice="e4m3.row.triton", mere=float("nan"), speedup=3.0)])
    assert nan.choice.is_bf16


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="max_error"):
        build_plan(_report(), max_error=0)
    with pytest.raises(ConfigError, match="report"):
        build_plan(object())


def test_build_plan_uses_only_the_primary_distribution_of_a_probe_report():
    """A report with learned and normal results plans on the learned ones only."""
    from loka_tune.dispatch import build_plan
    from loka_tune.probe.report import CandidateResult, ProbeReport

    fields = CandidateResult.__dataclass_fields__

    def rec(choice: str, mere: float, speedup: float, dist: str) -> CandidateResult:
        values = dict(site="a", role=GemmRole.FWD.value, choice=choice, m=4096, k=4096, n=4096, mere=mere,
                      mere_std=0.0, sqnr_db=30.0, sqnr_std=0.0, time_s=1.0 / speedup, bf16_time_s=1.0,
                      speedup=speedup, time_source="modeled", safe=mere <= 0.2, fast=speedup >= 1.05, dist=dist)
        return CandidateResult(**{k: v for k, v in values.items() if k in fields})

    learned = [rec("e4m3.row.torch_scaled_mm", 0.9, 1.5, "learned")]  # unsafe under the learned inputs
    normal = [rec("e4m3.row.torch_scaled_mm", 0.1, 1.5, "normal")]  # looks safe under normal inputs
    report = ProbeReport(learned + normal, [], 0.2, 1.05, {}, None)
    plan = build_plan(report, max_error=0.2, min_speedup=1.05, resolve_emulated=False)
    assert plan.resolve("a").fwd.is_bf16
