"""The body of the GPU smoke suite (tests/test_gpu_smoke.py), as plain helpers.

Kept apart from the test module so that the same code runs on a CPU too
(tests/test_smoke_helpers.py: one tiny model, eager, the emulated backend): a typo or an API
drift in the smoke code then fails CI, not the first device call of the next session.

One :class:`SmokeCase` says where and how a model trains (device, compile, batch, steps, the
FP8 choice, the probe's candidates); :func:`run_variant` trains one *variant* of it through
the product's trainer (compiled runs under :func:`~loka_tune.objectives.compiled.strict_compile`,
as the tuner's own runs are) and returns a :class:`SmokeResult` whose :meth:`~SmokeResult.line`
is the summary line the suite prints. The variants (:data:`VARIANTS`):

- ``bf16``: the model as built (what a study's baseline trains);
- ``bf16_mods``: every Mods pass (No Bias, BlockNorm, Hard Swish);
- ``fp8_tensorwise``: the Mods, then tensorwise e4m3 (``case.fp8_choice``) on the sites that
  torchao's tensorwise size filter converts (``benchmarks/e2e.py``'s
  ``scaled_mm_tensorwise_filter``), or on every eligible site (``case.fp8_sites = "all"``);
- ``dispatch``: the Mods and the Dispatch plan (``recipe_config("dispatch")``) built from a
  probe report of the bf16 model (:func:`probe_report`).

:func:`probe_report` attaches the probe the way a study's baseline does it
(:func:`loka_tune.tuner.baseline.run_baseline`): in the case's regime, compiled with
``Probe(model, step_on="batch")`` (collections from a sub-batch of each step's batch on the
uncompiled module: the compiled graph never sees a hook), eager with ``step_on="manual"``, then
:func:`~loka_tune.probe.measure` prices the candidates with the cost model at ``COST_ROWS``
rows (a study's ``cost_batch_size``), so the plan is what a study's Dispatch start would be.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loka_tune.applier import apply
from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.data.base import model_inputs
from loka_tune.data.synthetic import SyntheticCTR
from loka_tune.models import build_model
from loka_tune.objectives.compiled import strict_compile
from loka_tune.objectives.trainer import TrainConfig, train

__all__ = ["VARIANTS", "MODELS", "ALL_MODS", "COST_ROWS", "SmokeCase", "SmokeResult", "make_source", "make_model",
           "variant_config", "probe_report", "run_variant", "learning_problem", "report_problem", "modeled_report", "record", "summary", "case_for", "run_study"]

MODELS = ("dlrm", "dcnv2", "wukong", "interformer")
VARIANTS = ("bf16", "bf16_mods", "fp8_tensorwise", "dispatch")
ALL_MODS = ModsConfig(no_bias=True, blocknorm=256, hardswish=True)
COST_ROWS = 65536  # rows the probe prices each GEMM at (a production batch, as a study's cost_batch_size)
HEAD = 5  # steps averaged at each end of the loss curve for the "decreasing" check
# 26 sparse features (Criteo's count) of mixed sizes: 63k table rows, small enough to build fast
CARDINALITIES = (10000, 5000, 2000, 1000, 500, 200, 100, 50, 20, 10, 10000, 5000, 2000, 1000, 500, 200, 100,
                 50, 20, 10, 1000, 1000, 100, 100, 10, 10)


@dataclass(frozen=True)
class SmokeCase:
    """Where and how one model's variants train (see the module docstring)."""

    model: str
    preset: str = "large"
    device: str = "cuda"
    compile: bool = True
    batch_size: int = 1024
    steps: int = 20
    seq_len: int = 16  # behaviour-sequence events (models with a sequence arm)
    fp8_choice: str = "e4m3.tensor.torch_scaled_mm"
    fp8_sites: str = "torchao"  # "torchao": torchao's tensorwise size filter; "all": every eligible site
    candidates: tuple[str, ...] = ("bf16", "e4m3.tensor.torch_scaled_mm", "e4m3.row.torch_scaled_mm")
    mods: ModsConfig = ALL_MODS
    probe_steps: int = 8
    probe_every: int = 4  # two collections in probe_steps
    probe_samples: int = 2
    resolve_emulated: bool = True  # Dispatch: emulated picks become real GPU backends (False on a CPU)
    cardinalities: tuple[int, ...] = CARDINALITIES
    num_dense: int = 13
    overrides: tuple[tuple[str, Any], ...] = ()  # model hyperparameters over the preset's
    # the H200 studies' rates (studies/wukong_h200.toml): Adam at 1e-3 from step 0 collapses the
    # large presets' wide layers to the base rate; 1e-4 with a short linear warm-up trains them
    lr_dense: float = 1e-4
    lr_warmup_steps: int = 5

    def train_config(self, *, compile: bool | None = None, steps: int | None = None) -> TrainConfig:
        steps = self.steps if steps is None else steps
        return TrainConfig(steps=steps, batch_size=self.batch_size, window=min(HEAD, steps),
                           warmup_steps=min(3, steps - 1), eval_batches=1, device=self.device,
                           compile=self.compile if compile is None else compile, log_every=steps, seed=0,
                           lr_dense=self.lr_dense, lr_warmup_steps=min(self.lr_warmup_steps, steps - 1))


@dataclass
class SmokeResult:
    """What one variant's run gave (``problem``: why it fails the smoke, None when it passes)."""

    case: SmokeCase
    variant: str
    status: str
    losses: tuple[float, ...]
    wall_s: float
    step_ms: float
    fp8_gemms: int
    gemms: int
    dynamo: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    notes: str = ""

    def line(self) -> str:
        """One compact summary line (what the suite prints per variant)."""
        c = self.case
        head = statistics.fmean(self.losses[:HEAD]) if self.losses else math.nan
        tail = statistics.fmean(self.losses[-HEAD:]) if self.losses else math.nan
        graphs = f" graphs {self.dynamo.get('unique_graphs', '?')}" if self.dynamo else ""
        verdict = "ok" if self.problem is None else f"FAIL: {self.problem}"
        return (f"[smoke] {c.model}/{c.preset} {self.variant:<14} {'compiled' if c.compile else 'eager'}"
                f"{graphs} fp8 {self.fp8_gemms}/{self.gemms} GEMMs, {len(self.losses)} steps loss"
                f" {head:.4f} -> {tail:.4f} (step 0: {self.losses[0] if self.losses else math.nan:.4f}),"
                f" {self.step_ms:.1f} ms/step, {self.wall_s:.1f} s {verdict}"
                + (f" ({self.notes})" if self.notes else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.case.model, "preset": self.case.preset, "variant": self.variant,
                "compile": self.case.compile, "status": self.status, "steps": len(self.losses),
                "loss_step0": self.losses[0] if self.losses else None, "loss_first": self.losses[:HEAD], "loss_last": self.losses[-HEAD:], "wall_s": round(self.wall_s, 2),
                "step_ms": round(self.step_ms, 3), "fp8_gemms": self.fp8_gemms, "gemms": self.gemms,
                "graphs": self.dynamo.get("unique_graphs"), "problem": self.problem, "notes": self.notes}


def make_source(case: SmokeCase) -> SyntheticCTR:
    """The synthetic rows the case trains on (sequences only for a model with a sequence arm)."""
    seq = case.seq_len if case.model == "interformer" else 0
    return SyntheticCTR(num_dense=case.num_dense, cardinalities=case.cardinalities, seq_len=seq,
                        eval_examples=case.batch_size)


def make_model(case: SmokeCase, source: SyntheticCTR, seed: int = 0) -> nn.Module:
    """A fresh model of the case, seeded, its head at the data's base rate, on the case's device."""
    torch.manual_seed(seed)
    model = build_model(case.model, case.preset, num_dense=source.num_dense,
                        cardinalities=list(source.cardinalities), base_rate=source.base_rate,
                        **dict(case.overrides))
    return model.to(case.device)


def _torchao_tensorwise_sites(model: nn.Module) -> set[str]:
    """The Linears torchao's tensorwise size filter converts (``benchmarks/e2e.py``'s filter)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe("tensorwise", filter_fqns=[])
    return {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)}


def variant_config(case: SmokeCase, variant: str, model: nn.Module, report: Any = None) -> PrecisionConfig:
    """The :class:`PrecisionConfig` of ``variant`` for ``model`` (see the module docstring)."""
    if variant == "bf16":
        return PrecisionConfig()
    if variant == "bf16_mods":
        return PrecisionConfig(mods=case.mods)
    if variant == "fp8_tensorwise":
        from loka_tune.kernels.linear import find_linears

        sites = set(find_linears(model)) if case.fp8_sites == "all" else _torchao_tensorwise_sites(model)
        site = SitePrecision.parse(case.fp8_choice)
        return PrecisionConfig(sites={name: site for name in sorted(sites)}, mods=case.mods)
    if variant == "dispatch":
        if report is None:
            raise ValueError("the dispatch variant needs a probe report: pass probe_report(case, ...)")
        from loka_tune.dispatch import recipe_config

        return recipe_config("dispatch", report=report, mods=case.mods, max_error=0.2, min_speedup=1.0,
                             resolve_emulated=case.resolve_emulated)
    raise ValueError(f"unknown smoke variant {variant!r}; choose one of {', '.join(VARIANTS)}")


def probe_report(case: SmokeCase, source: SyntheticCTR, out: Path | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(report, stats, info)``: the probe attached to a bf16 baseline as a study attaches it
    (see the module docstring), then measured; ``report.save(out)`` when ``out`` is given."""
    from loka_tune.probe import Probe, measure

    t0 = time.perf_counter()
    model = make_model(case, source)
    apply(model, PrecisionConfig())
    tcfg = case.train_config(steps=case.probe_steps)  # the probed run is in the regime, as in a study
    if tcfg.compile:
        probe = Probe(model, every=case.probe_every, step_on="batch")

        def side(_n: int, batch: Any) -> None:
            probe.step(*model_inputs(model, batch), target=batch.labels)

        with strict_compile(), probe:
            res = train(model, source, tcfg, on_batch=side, progress=False)
    else:
        with Probe(model, every=case.probe_every, step_on="manual") as probe:
            res = train(model, source, tcfg, after_step=lambda _n: probe.step(), progress=False)
    stats = probe.stats
    t1 = time.perf_counter()
    report = measure(stats, list(case.candidates), samples=case.probe_samples, device=case.device,
                     speed_row_scale=COST_ROWS / case.batch_size, max_error=0.2, min_speedup=1.0)
    if out is not None:
        report.save(out)
    info = {"status": res.status, "sites": len(stats.sites), "collections": stats.collections,
            "results": len(report.results), "collect_s": round(t1 - t0, 2),
            "measure_s": round(time.perf_counter() - t1, 2),
            "statistics": probe.graph_note if tcfg.compile else "in-step (eager)"}
    return report, stats, info


def modeled_report(case: SmokeCase, source: SyntheticCTR) -> list[dict[str, Any]]:
    """Dispatch records from the cost model alone (``benchmarks/modeled_plan.py``'s rule: errors
    not consulted, every e4m3 candidate counted safe), for each site of a fresh model at
    :data:`COST_ROWS` rows: the Dispatch plan's input when the probe could not form its report,
    so that the plan's compile and training are still checked."""
    from loka_tune.config import ROLES
    from loka_tune.data.base import model_inputs
    from loka_tune.errors import UnsupportedChoiceError
    from loka_tune.kernels.costmodel import modeled_speedup
    from loka_tune.space.sites import discover_sites

    model = make_model(case, source)
    batch = next(iter(source.batches("train", 64, seed=0, device=case.device)))
    records = []
    for site in discover_sites(model, *model_inputs(model, batch)):
        for role in ROLES:
            m, k, n = site.shape(role, COST_ROWS)
            for cid in case.candidates:
                if cid == "bf16":
                    continue
                try:
                    sp = modeled_speedup(cid, m, k, n, role, "h200")
                except UnsupportedChoiceError:
                    continue
                records.append({"site": site.name, "role": role.value, "choice": cid, "m": m, "k": k, "n": n,
                                "mere": 0.0, "speedup": sp, "time_source": "modeled"})
    return records


def report_problem(report: Any, stats: Any) -> str | None:
    """Why a probe report is not formed: no result, or a probed site neither measured nor
    reported as unprobed (a site the probe could not form statistics for is named, not lost)."""
    if not report.results:
        return "the probe report has no result"
    unprobed = getattr(report, "unprobed", None) or (getattr(report, "meta", None) or {}).get("unprobed") or ()
    covered = {r.site for r in report.results} | set(unprobed)
    missing = sorted(set(stats.sites) - covered)
    if missing:
        return f"{len(missing)} probed site(s) missing from the report: {', '.join(missing[:5])}"
    return None


def learning_problem(losses: tuple[float, ...], steps: int, status: str) -> str | None:
    """Why a run's loss curve fails the smoke: not finished, non-finite, or not decreasing
    (the mean of the last :data:`HEAD` steps must be below the mean of the first ones: one
    step's noise at these batch sizes is ~1% of the loss, the first steps' fall is more). It says
    the run trains, not that it learns: a curve that spikes early and settles back at its
    step-0 loss passes (the summary line shows step 0 beside the two means)."""
    if status != "ok":
        return f"status {status!r}"
    if len(losses) != steps:
        return f"{len(losses)} of {steps} steps ran"
    if not all(math.isfinite(x) for x in losses):
        return "non-finite loss"
    head, tail = statistics.fmean(losses[:HEAD]), statistics.fmean(losses[-HEAD:])
    if not tail < head:
        return f"loss did not decrease: mean of the first {HEAD} steps {head:.5f}, of the last {HEAD} {tail:.5f}"
    return None


def run_variant(case: SmokeCase, variant: str, source: SyntheticCTR, report: Any = None) -> SmokeResult:
    """Train ``variant`` of ``case`` for ``case.steps`` steps (compiled runs: strict) and judge it."""
    model = make_model(case, source)
    config = variant_config(case, variant, model, report)
    summary = apply(model, config, strict=False)  # a GEMM its backend cannot run stays bf16 (counted)
    fp8 = sum(n for c, n in summary.counts.items() if c != "bf16")
    gemms = 3 * len(summary.replaced) + 3 * len(summary.unchanged)
    notes = f"{sum(len(v) for v in summary.fallbacks.values())} GEMMs fell back to bf16" if summary.fallbacks else ""
    tcfg = case.train_config()
    t0 = time.perf_counter()
    dynamo: dict[str, Any] = {}
    if tcfg.compile:
        with strict_compile() as dynamo:  # fresh dynamo; a graph break or an eager fallback raises
            res = train(model, source, tcfg, progress=False)
    else:
        res = train(model, source, tcfg, progress=False)
    wall = time.perf_counter() - t0
    losses = tuple(float(x) for x in res.step_losses)
    return SmokeResult(case, variant, res.status, losses, wall, 1e3 * float(res.step_time_s), fp8, gemms,
                       dict(dynamo), learning_problem(losses, tcfg.steps, res.status), notes)


def run_study(study_file: Path, out_dir: Path, device: str) -> dict[str, Any]:
    """``loka-tune tune STUDY --device DEVICE --out-dir OUT`` then ``loka-tune export`` of it (the
    CLI, in this process), checked: 0 exit statuses, the trials of ``[trials] n_trials``
    finished, a ``probe_report.json``, an export confirmed on 2+ seeds, in the study's regime
    (compiled on CUDA: ``[regime] compile = "auto"``) and with the study's speed source. Returns
    the summary entry (``problem``: None when all of that holds)."""
    import optuna

    from loka_tune.cli import main
    from loka_tune.tuner.study import load_study

    cfg = load_study(study_file).with_output_dir(out_dir)
    t0 = time.perf_counter()
    rc = main(["tune", str(study_file), "--device", device, "--no-tracking", "--out-dir", str(out_dir)])
    tune_s = time.perf_counter() - t0
    best = out_dir / "best.json"
    rc_export = main(["export", cfg.name, "--storage", cfg.storage.url, "--out", str(best)]) if rc == 0 else None
    problems: list[str] = []
    prov: dict[str, Any] = {}
    finished = 0
    if rc != 0:
        problems.append(f"tune exited {rc}")
    elif rc_export != 0:
        problems.append(f"export exited {rc_export}")
    else:
        prov = json.loads(best.read_text())["provenance"]
        study = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)
        finished = sum(1 for t in study.trials if t.state.name in ("COMPLETE", "PRUNED"))
        if finished != cfg.trials.n_trials:
            problems.append(f"{finished} trials finished, {cfg.trials.n_trials} expected")
        speed = "measured" if cfg.objective.speed == "auto" and device.startswith("cuda") else cfg.objective.speed
        if cfg.objective.speed != "auto" and prov.get("speed_source") != speed:
            problems.append(f"the export's speed_source is {prov.get('speed_source')!r}, not {speed!r}")
        compiled = cfg.regime.compiled(device)
        if (prov.get("confirmed_regime") or {}).get("compile") != compiled:
            problems.append(f"the export was not confirmed {'compiled' if compiled else 'eager'}:"
                            f" {prov.get('confirmed_regime')}")
        if len(prov.get("confirmed_seeds") or []) < 2:
            problems.append(f"confirmed on seeds {prov.get('confirmed_seeds')}, 2 or more expected")
        if not (out_dir / "probe_report.json").is_file():
            problems.append("the study wrote no probe_report.json")
    return {"what": f"study {cfg.name}", "device": device, "tune_s": round(tune_s, 1), "trials": finished,
            "confirmed": prov.get("confirmed"), "speedup": prov.get("confirmed_speedup"),
            "rel_logloss_pct": prov.get("confirmed_rel_logloss_pct"), "problem": "; ".join(problems) or None}


def record(entry: dict[str, Any]) -> None:
    """Append ``entry`` as one JSON line to ``$LOKA_SMOKE_LOG`` (the device script's summary), if set."""
    path = os.environ.get("LOKA_SMOKE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def summary(path: str | Path) -> str:
    """The compact table of a ``$LOKA_SMOKE_LOG`` file: one line per recorded entry, then the count."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        if "variant" in r:
            ok = "ok" if r.get("problem") is None else f"FAIL {r['problem']}"
            first, last = r.get("loss_first") or [math.nan], r.get("loss_last") or [math.nan]
            out.append(f"{r['model']:<12} {r['preset']:<6} {r['variant']:<14} graphs {r.get('graphs')!s:<4}"
                       f" fp8 {r['fp8_gemms']:>3}/{r['gemms']:<3} loss {statistics.fmean(first):.4f} ->"
                       f" {statistics.fmean(last):.4f} (step 0 {r.get('loss_step0') or math.nan:.4f})"
                       f" {r['step_ms']:8.2f} ms/step {r['wall_s']:7.1f} s  {ok}")
        else:
            out.append(f"{r.get('what', '?'):<34} " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "what"))
    bad = sum(1 for r in rows if r.get("problem"))
    out.append(f"{len(rows)} entries, {bad} failing")
    return "\n".join(out)


def case_for(model: str, **overrides: Any) -> SmokeCase:
    """The GPU case of ``model`` (``$LOKA_SMOKE_PRESET`` overrides the preset, e.g. ``paper``)."""
    case = SmokeCase(model=model, preset=os.environ.get("LOKA_SMOKE_PRESET", "large"))
    return replace(case, **overrides)


if __name__ == "__main__":  # python tests/gpu_smoke.py LOG.jsonl: the device script's summary
    import sys

    print(summary(sys.argv[1]))
