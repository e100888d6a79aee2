"""Serving benchmark (issue 23): latency and throughput of a model's forward at serving batches,
bf16 + Mods vs the serving config vs torchao's float8 inference, all under the same CUDA graphs.

For one study's model and data (``--study``, default ``studies/wukong_h200.toml``: large Wukong;
``--preset`` overrides it), one model is built (seed 0, untrained: the numerics of the served
forward are what is compared), the config's Mods are applied (``--config``; without one: no
bias, BlockNorm 256, Hard Swish), and it is cast to bf16 (weights and inputs; no autocast).
Variants (``--variants``, comma list; each a copy of that model):

- ``bf16_mods``: the model as it is (bf16 + Mods): the reference;
- ``config``: the config served, ``loka_tune.apply(model, config, serving=True, batch=B)``: static
  FP8 weights, only the activations quantized per call, each site's fwd choice from the serving
  plan's bucket for ``B`` (``--plan``: ``modeled`` from the cost model with static weights,
  ``measured`` from per-site GPU timings under CUDA graphs (``--plan-budget`` seconds, the rest
  modeled), ``config`` the ``--config`` file's own ``serving`` section, ``none`` every site's own
  fwd choice at every batch). ``--verify`` then checks each bucket's per-site plan against
  whole-model alternatives (``--alternatives``: every FP8 site tensorwise, every site torchao's
  inference would take tensorwise, all bf16, ...), each served and timed as a whole, and keeps
  the fastest (:func:`loka_tune.serving.verify_serving_plan`; the plan's ``whole_model`` record).
  ``--calibrate N``: the config and ``loka_*`` rows (and each ``--verify`` alternative) serve
  their tensorwise sites with calibrated activation scales (:func:`loka_tune.serving.calibrate`
  over N eval batches of another seed than the timed inputs; ``calibrated_sites`` per row): an
  elementwise cast per call instead of an amax reduction and a cast. The priced config is written beside ``--out`` (``*_config.json``);
- ``config_dynamic``: the config's training form (``apply`` without ``serving``: weights quantized
  on every call), for comparison;
- ``torchao_rowwise`` / ``torchao_tensorwise``: torchao's float8 inference,
  ``torchao.quantization.quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=
  PerRow() | PerTensor()))`` on every ``nn.Linear`` it accepts (in and out features multiples of 16);
- ``torchao_static``: torchao's float8 inference with calibrated per-tensor activation scales
  (``Float8StaticActivationFloat8WeightConfig``: prepare, the ``--calibrate`` batches, convert) on
  the same sites: the like-for-like rival of our calibrated serving;
- ``loka_rowwise`` / ``loka_tensorwise``: our serving form on exactly those sites, every one
  ``e4m3.row.fa.torch_scaled_mm`` / ``e4m3.tensor.fa.torch_scaled_mm`` with a static FP8 weight (no
  plan): the kernels against torchao's on the same sites, apart from the plan's choice of sites.
  Both with fast accumulation, as torchao's inference GEMMs (its ``Float8MMConfig`` default on
  CUDA; the fifth session's tensorwise row without it served 7.76 ms to torchao's 8.07 p50, but
  6.56 ms back to back to our 7.35) (``--device cpu``: ``e4m3.row.emulated`` /
  ``e4m3.tensor.emulated``, the same sites).

Each (variant, batch) row: a fresh copy, ``torch.compile(mode=--compile-mode, dynamic=False)``
(default ``reduce-overhead``: CUDA graphs, static shapes; ``graph``: the product's
:meth:`loka_tune.serving.ServingBuckets.captured`, compiled in the default mode and captured as
one CUDA graph, each call copying the request into its static inputs and replaying, without
cudagraph trees' per-call Python: the fifth session's p50 at 8192 sat 0.26 ms (bf16), 0.40 ms
(ours) and 1.50 ms (torchao) above the back-to-back time) under
:func:`loka_tune.objectives.compiled.strict_compile` (a graph break or an eager fallback fails
the row), ``--warmup`` calls, then ``--reps`` calls each timed between two CUDA events after a
sync (``p50_ms``, ``p99_ms``, ``mean_ms``), and ``--reps`` calls back to back between two events
(``throughput``: rows per second); ``--rounds R`` keeps the rows of a batch built and times them
R times in turn, each round from the next variant, pooling their calls (``rounds_p50_ms``: each
round's p50; one-round runs of one H200 disagreed by up to 15% between calls). ``sqnr_db``: the logits' SQNR against ``bf16_mods`` at the same
batch (:func:`loka_tune.kernels.quant.sqnr_db`; ``null`` for the reference itself), and
``sqnr_centered_db`` the same with the reference's mean logit taken off both (an untrained model's
logits sit near ``logit(base rate)``, a constant that would flatter the plain SQNR). A row that
fails records its error and the run goes on; ``--budget`` seconds of wall time stop starting rows.
Each row runs with the inductor configuration it started with, restored afterwards:
torchao's ``quantize_`` turns on coordinate-descent tuning of every Triton kernel for the whole
process (``torchao.quantization.utils.recommended_inductor_config_setter``, hence its rows'
minutes of compile), which before 2026-12-02 leaked into every later row and gave torchao's
rows tuned kernels beside our untuned ones; ``inductor`` per row says what it compiled with.
``--autotune`` compiles every row with that tuning (``meta.autotune``); ``--no-torchao-tuning``
builds torchao's rows without it (``set_inductor_config=False``): every row untuned alike.
``--profile N`` then profiles N more calls of each row (``profile``: the GPU's busy time per call,
its GEMM part and the 40 largest kernels), to see where one variant's time goes against another's.
On a CPU (``--device cpu``) nothing is compiled (``--compile-mode none``) and torchao's variants
are skipped: the smoke mode that ``tests/test_serve_bench.py`` runs with ``--preset tiny``.

``--merge A.json B.json --out serve_h200.json`` runs nothing: it merges the receipts of earlier
runs of one setup (one device call per batch bucket: torchao's compile alone takes minutes a row)
into one (:func:`merge_receipts`).

Output: ``--out`` JSON with ``meta`` (device, versions, date, argv), ``rows`` of ``{variant, batch,
p50_ms, p99_ms, mean_ms, throughput, sqnr_db, fp8_sites, ...}``, ``plan`` (the serving plan used)
and ``summary`` (speed-ups vs ``bf16_mods`` per batch and issue 23's checks). The H200 command:

    python benchmarks/serve.py --config benchmarks/results/wukong_large_modeled_plan.json \\
        --plan measured --plan-budget 120 --budget 470 --out $OUT/serve_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import e2e  # noqa: E402  (benchmarks/e2e.py: the variants' preparation, shared)

from loka_tune.applier import apply  # noqa: E402
from loka_tune.config import ModsConfig, PrecisionConfig  # noqa: E402
from loka_tune.data.base import model_inputs  # noqa: E402
from loka_tune.kernels.quant import sqnr_db  # noqa: E402
from loka_tune.serving import ALL_ALTERNATIVES, WHOLE_MODEL_ALTERNATIVES, calibrate  # noqa: E402

VARIANTS = ("bf16_mods", "config", "config_dynamic", "torchao_rowwise", "torchao_tensorwise", "torchao_static",
            "loka_rowwise", "loka_tensorwise")
DEFAULT_VARIANTS = ("bf16_mods", "config", "loka_tensorwise", "torchao_tensorwise", "torchao_rowwise")
_LOKA = {"loka_rowwise": "e4m3.row.fa.torch_scaled_mm", "loka_tensorwise": "e4m3.tensor.fa.torch_scaled_mm"}
_LOKA_CPU = {"loka_rowwise": "e4m3.row.emulated", "loka_tensorwise": "e4m3.tensor.emulated"}
_GPU_ONLY = {"torchao_rowwise", "torchao_tensorwise", "torchao_static"}
DEFAULT_MODS = ModsConfig(no_bias=True, blocknorm=256, hardswish=True)
REF = "bf16_mods"


def torchao_inference(model: nn.Module, granularity: str, *, inductor_config: bool = True) -> dict[str, Any]:
    """torchao's float8 inference on every ``nn.Linear`` of ``model`` it accepts (in place);
    ``inductor_config=False``: without its ``set_inductor_config`` (the process-wide
    coordinate-descent tuning it otherwise turns on)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    try:
        from torchao.quantization import PerRow, PerTensor
    except ImportError:  # older torchao
        from torchao.quantization.granularity import PerRow, PerTensor
    seen: list[str] = []

    def accept(mod: nn.Module, fqn: str) -> bool:
        ok = isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        if ok:
            seen.append(fqn)
        return ok

    gran = PerRow() if granularity == "rowwise" else PerTensor()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=gran, set_inductor_config=inductor_config),
              filter_fn=accept)
    return {"fp8_sites": len(seen), "torchao_inductor_config": inductor_config}


def torchao_static_inference(model: nn.Module, calib: list[tuple[Any, ...]] | None, *,
                             inductor_config: bool = True) -> dict[str, Any]:
    """torchao's float8 inference with *static* (calibrated) per-tensor activation scales, on the
    Linears :func:`torchao_inference` takes: ``Float8StaticActivationFloat8WeightConfig``'s
    observer flow (prepare, run the calibration batches, convert; in place). The like-for-like
    rival of our calibrated tensorwise serving (``--calibrate N``)."""
    from torchao.quantization import Float8StaticActivationFloat8WeightConfig, quantize_

    if not calib:
        raise ValueError("torchao_static calibrates its activation scales: run with --calibrate N (N >= 1)")
    sites = set(torchao_sites(model))
    quantize_(model, Float8StaticActivationFloat8WeightConfig(step="prepare"),
              filter_fn=lambda mod, fqn: fqn in sites)
    with torch.no_grad():
        for b in calib:
            model(*b)
    quantize_(model, Float8StaticActivationFloat8WeightConfig(step="convert", set_inductor_config=inductor_config),
              filter_fn=lambda mod, fqn: type(mod).__name__ == "Float8ObservedLinear")
    return {"fp8_sites": len(sites), "torchao_inductor_config": inductor_config, "calibration_batches": len(calib)}


def torchao_sites(model: nn.Module) -> list[str]:
    """The Linears torchao's float8 inference accepts (in and out features multiples of 16)."""
    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0]


def uniform_serving(name: str, base: nn.Module, mods: ModsConfig, cuda: bool) -> PrecisionConfig:
    """``loka_*``: one fwd choice (a static FP8 weight) on every site torchao's inference takes, bf16 elsewhere."""
    choice = (_LOKA if cuda else _LOKA_CPU)[name]
    return PrecisionConfig.from_sites({fqn: f"{choice}|bf16|bf16" for fqn in torchao_sites(base)}, default="bf16",
                                      mods=mods, provenance={"recipe": f"{name}: torchao's inference sites"})


def build_variant(name: str, base: nn.Module, served: PrecisionConfig, config: PrecisionConfig, batch: int,
                  plan: str, torchao_tuning: bool = True,
                  calib: list[tuple[Any, ...]] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``base`` (bf16 + Mods) turned into variant ``name`` for ``batch`` rows."""
    from loka_tune.serving import shared_copy

    if name == "bf16_mods":
        return base, {"fp8_sites": 0}
    if name in _LOKA:
        model = shared_copy(base)
        cfg = uniform_serving(name, base, config.mods, next(base.parameters()).is_cuda)
        s = apply(model, cfg, serving=True, batch=None, strict=False)
        return model, {"fp8_sites": len(s.replaced), "fallbacks": {k: v.get("fwd", "") for k, v in s.fallbacks.items()},
                       "fused": list(s.fused)}
    if name == "config":
        model = shared_copy(base)
        s = apply(model, served, serving=True, batch=None if plan == "none" else batch, strict=False)
        return model, {"fp8_sites": len(s.replaced), "bucket": s.bucket, "served": dict(s.replaced),
                       "fallbacks": {k: v.get("fwd", "") for k, v in s.fallbacks.items()}, "fused": list(s.fused)}
    if name == "config_dynamic":
        model = copy.deepcopy(base)
        info = e2e.prepare("config", model, config)
        return model, info
    if name == "torchao_static":
        model = copy.deepcopy(base)
        return model, torchao_static_inference(model, calib, inductor_config=torchao_tuning)
    if name.startswith("torchao_"):
        model = copy.deepcopy(base)
        return model, torchao_inference(model, name.split("_", 1)[1], inductor_config=torchao_tuning)
    raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def _to_device_inputs(model: nn.Module, source: Any, batch: int, dev: torch.device, dtype: torch.dtype) -> tuple[Any, ...]:
    b = next(iter(source.batches("eval", batch, seed=0, device=dev)))
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in model_inputs(model, b))


def time_calls(fn: Callable[[], Any], dev: torch.device, *, warmup: int, reps: int) -> dict[str, Any]:
    """Per-call latencies (synced, CUDA events on a GPU; ``lat_s`` every one, sorted) and
    back-to-back throughput of ``fn``, with Python's garbage collector paused (as ``timeit``
    does: a collection inside one call is the process's noise, not the variant's)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _time_calls(fn, dev, warmup=warmup, reps=reps)
    finally:
        if enabled:
            gc.enable()


def _time_calls(fn: Callable[[], Any], dev: torch.device, *, warmup: int, reps: int) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    lat = []
    for _ in range(reps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            lat.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t0)
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        back = e0.elapsed_time(e1) / 1e3 / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        back = (time.perf_counter() - t0) / reps
    return {**latency_stats(lat), "back_to_back_s": back}


def _record_timing(row: dict[str, Any], tm: dict[str, Any]) -> None:
    """A row's latency keys (ms) and throughput (rows / s) from :func:`time_calls` or :func:`timed_rounds`."""
    batch = int(row["batch"])
    row.update(p50_ms=tm["p50_s"] * 1e3, p99_ms=tm["p99_s"] * 1e3, mean_ms=tm["mean_s"] * 1e3,
               back_to_back_ms=tm["back_to_back_s"] * 1e3, throughput=batch / tm["back_to_back_s"])
    if "rounds_p50_ms" in tm:
        row["rounds_p50_ms"] = tm["rounds_p50_ms"]


def latency_stats(lat: list[float]) -> dict[str, Any]:
    """p50 / p99 / mean of per-call latencies (seconds), and the latencies sorted (``lat_s``)."""
    lat = sorted(lat)
    p99 = lat[min(len(lat) - 1, max(0, math.ceil(0.99 * len(lat)) - 1))]
    return {"p50_s": statistics.median(lat), "p99_s": p99, "mean_s": statistics.fmean(lat), "lat_s": lat}


def timed_rounds(calls: dict[str, Callable[[], Any]], dev: torch.device, *, rounds: int, warmup: int,
                 reps: int) -> dict[str, dict[str, Any]]:
    """:func:`time_calls` of every variant of one batch, ``rounds`` times in turn (round r starts
    at the r-th variant: each takes every place in the order), so that a drift of the machine
    (clocks, heat, the host) is shared by all instead of landing on whoever ran last. Per variant:
    the statistics of all its calls pooled, ``back_to_back_s`` the mean over rounds and
    ``rounds_p50_ms`` each round's own p50 (their spread is the run's noise)."""
    names = list(calls)
    lat: dict[str, list[float]] = {n: [] for n in names}
    back: dict[str, list[float]] = {n: [] for n in names}
    p50s: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for n in names[k:] + names[:k]:
            tm = time_calls(calls[n], dev, warmup=warmup, reps=reps)
            lat[n] += tm["lat_s"]
            back[n].append(tm["back_to_back_s"])
            p50s[n].append(tm["p50_s"] * 1e3)
    return {n: {**latency_stats(lat[n]), "back_to_back_s": statistics.fmean(back[n]), "rounds_p50_ms": p50s[n]}
            for n in names}


def summarize(rows: list[dict[str, Any]], batches: list[int]) -> dict[str, Any]:
    """Speed-ups vs bf16_mods (p50) per batch, and issue 23's checks where the rows exist."""
    p50 = {(r["variant"], r["batch"]): r["p50_ms"] for r in rows if r.get("p50_ms")}
    speedup: dict[str, dict[str, float]] = {}
    for (v, b), t in p50.items():
        ref = p50.get((REF, b))
        if ref:
            speedup.setdefault(v, {})[str(b)] = ref / t
    checks: dict[str, Any] = {}
    cfg = speedup.get("config", {})
    if cfg:
        big, small = max(batches), [b for b in batches if b != max(batches)]
        checks[f"config >= 1.20x bf16_mods at {big}"] = cfg.get(str(big), 0.0) >= 1.20 if str(big) in cfg else None
        for b in small:
            checks[f"config >= 1.00x bf16_mods at {b}"] = cfg[str(b)] >= 1.0 if str(b) in cfg else None
        for b in batches:
            ao = [p50[(v, b)] for v in ("torchao_rowwise", "torchao_tensorwise") if (v, b) in p50]
            if ("config", b) in p50 and ao:
                checks[f"config at least as fast as torchao at {b}"] = p50[("config", b)] <= min(ao)
        for key, what in (("sqnr_db", "config logits SQNR >= 25 dB"),
                          ("sqnr_centered_db", "config centered logits SQNR >= 25 dB")):
            sq = [r[key] for r in rows if r["variant"] == "config" and r.get(key) is not None]
            checks[what] = min(sq) >= 25.0 if sq else None
    return {"speedup_vs_bf16_mods": speedup, "checks": checks}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | batch | p50 ms | p99 ms | rows/s | SQNR dB (centered) | FP8 sites | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error") or r.get("skipped") or ""
        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        lines.append(f"| {r['variant']} | {r['batch']} | {f(r.get('p50_ms'), '.3f')} | {f(r.get('p99_ms'), '.3f')} |"
                     f" {f(r.get('throughput'), '.3g')} | {f(r.get('sqnr_db'), '.1f')} ({f(r.get('sqnr_centered_db'), '.1f')}) |"
                     f" {r.get('fp8_sites', '-')} |"
                     f" {str(note)[:100]} |")
    return "\n".join(lines)


#: what receipts merged into one must share (rows timed otherwise do not compare)
_SAME = ("model", "preset", "mods", "compile_mode", "dtype", "device", "versions", "calibrate", "autotune",
         "torchao_tuning")
_UNSET = {"calibrate": 0, "autotune": False, "torchao_tuning": True}  # receipts written before the key existed


def _inductor_state() -> tuple[bytes, str]:
    return torch._inductor.config.save_config(), torch.get_float32_matmul_precision()


def _restore_inductor(state: tuple[bytes, str]) -> None:
    torch._inductor.config.load_config(state[0])
    torch.set_float32_matmul_precision(state[1])


def _inductor_settings() -> dict[str, Any]:
    """The inductor settings a row compiled with that move kernel speed (torchao's float8 inference
    turns on coordinate-descent tuning for the whole process: ``recommended_inductor_config_setter``)."""
    c = torch._inductor.config
    return {"coordinate_descent_tuning": bool(c.coordinate_descent_tuning),
            "coordinate_descent_check_all_directions": bool(c.coordinate_descent_check_all_directions),
            "max_autotune": bool(c.max_autotune), "float32_matmul_precision": torch.get_float32_matmul_precision()}


def profile_calls(fn: Callable[[], Any], dev: torch.device, calls: int) -> dict[str, Any]:
    """``calls`` calls of ``fn`` under ``torch.profiler``: per call, the GPU's busy time (``gpu_ms``), its
    GEMM part (``gemm_ms``), the kernel count and the 40 largest kernels
    (:class:`~loka_tune.objectives.profiling.StepProfiler`; on a CPU ``gpu_ms`` is None)."""
    from loka_tune.objectives.profiling import StepProfiler

    prof = StepProfiler(calls, dev, top=40)
    prof.start()
    try:
        for _ in range(calls):
            fn()
    finally:
        out = prof.stop()
    return out


def merge_receipts(paths: list[Path]) -> dict[str, Any]:
    """One receipt from several runs of this script (e.g. one device call per batch bucket): their
    rows in order (a later file's row replaces an earlier one of the same variant and batch), the
    serving plans' buckets and priced cells together, the summary over every batch. The runs must
    share :data:`_SAME` (model, Mods, compile mode, dtype, device, versions); each row keeps the
    SQNR of its own run's reference and names its run (``receipt``); ``meta`` is the first run's,
    with ``merged_from``, ``argv_each`` and ``rounds_each``."""
    if len(paths) < 2:
        raise SystemExit(f"--merge takes two or more receipts, got {len(paths)}")
    docs = []
    for p in paths:
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--merge: cannot read {p}: {e}") from None
        if not {"meta", "rows"} <= set(docs[-1]):
            raise SystemExit(f"--merge: {p} is not a serve.py receipt (no 'meta' and 'rows')")
    first = docs[0]["meta"]
    for p, d in zip(paths[1:], docs[1:]):
        meta = d["meta"]
        diff = [k for k in _SAME if meta.get(k, _UNSET.get(k)) != first.get(k, _UNSET.get(k))]
        if diff:
            what = ", ".join(f"{k}: {first.get(k)!r} vs {meta.get(k)!r}" for k in diff)
            raise SystemExit(f"--merge: {p} differs from {paths[0]} in {what}; merge only runs of one setup")
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    plan: dict[str, Any] | None = None
    for p, d in zip(paths, docs):
        for r in d["rows"]:
            rows[(r["variant"], int(r["batch"]))] = {**r, "receipt": str(p)}  # which run measured it
        pl = d.get("plan")
        if pl:
            if plan is None:
                plan = copy.deepcopy(pl)
            else:
                plan.setdefault("buckets", {}).update(pl.get("buckets", {}))
                cells = plan.setdefault("prices", {}).setdefault("cells", {})
                cells.update((pl.get("prices") or {}).get("cells", {}))
    batches = sorted({b for _, b in rows}, reverse=True)
    merged = sorted(rows.values(), key=lambda r: (-int(r["batch"]), r["variant"] != REF))
    meta = {**first, "batches": batches, "merged_from": [str(p) for p in paths],
            "argv_each": [d["meta"].get("argv") for d in docs],
            "rounds_each": [d["meta"].get("rounds", 1) for d in docs]}
    return {"meta": meta, "rows": merged, "plan": plan, "summary": summarize(merged, batches)}


def _versions() -> dict[str, str]:
    from loka_tune.kernels.timing import environment

    return dict(environment())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=HERE.parent / "studies" / "wukong_h200.toml",
                    help="study file: model, preset and data (default: large Wukong)")
    ap.add_argument("--preset", default=None, help="override the study's model preset (tiny: the CPU smoke)")
    ap.add_argument("--config", type=Path, default=None, help="the exported loka-tune config (JSON)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--batches", default="512,2048,8192", help="comma list of serving batch sizes")
    ap.add_argument("--plan", choices=("modeled", "measured", "config", "none"), default=None,
                    help="the serving plan of the config variant (default: measured on CUDA, modeled elsewhere)")
    ap.add_argument("--plan-budget", type=float, default=120.0, help="seconds of per-site GPU timing for --plan measured")
    ap.add_argument("--candidates", default="", help="comma list of extra fwd choices the plan may pick per site")
    ap.add_argument("--verify", action="store_true",
                    help="check each bucket's per-site plan against whole-model alternatives, each served and timed"
                         " as a whole (loka_tune.serving.verify_serving_plan), and keep the fastest")
    ap.add_argument("--alternatives", default=",".join(WHOLE_MODEL_ALTERNATIVES),
                    help="comma list of the whole-model alternatives --verify times (sites, tensor, row, tensor_all,"
                         " row_all, bf16)")
    ap.add_argument("--verify-budget", type=float, default=None,
                    help="seconds: --verify starts no alternative after this (default: no limit)")
    ap.add_argument("--autotune", action="store_true",
                    help="compile every row with inductor's coordinate-descent tuning of its Triton kernels (what"
                         " torchao's float8 inference turns on for its own rows; compiles take minutes a row)")
    ap.add_argument("--no-torchao-tuning", action="store_true",
                    help="torchao's rows without its set_inductor_config (no coordinate-descent tuning: every row"
                         " untuned alike, and torchao's compile in seconds, not minutes)")
    ap.add_argument("--calibrate", type=int, default=0, metavar="N",
                    help="serve the config and loka_* variants with calibrated activation scales on their tensorwise"
                         " sites (loka_tune.serving.calibrate over N eval batches of 512 rows, seed 1; the timed"
                         " inputs are seed 0), and calibrate each --verify alternative the same way (default 0: off)")
    ap.add_argument("--cost-device", default="h200", help="the cost model's device for a modeled plan")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default reduce-overhead on CUDA, none on a CPU: eager), or graph:"
                         " compiled without cudagraph trees, then one captured CUDA graph per row (CUDA only)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="time the rows of each batch R times in turn, each round from the next variant (all rows"
                         " of a batch stay built meanwhile), and pool their calls: a drift of the machine is shared"
                         " by every variant; rounds_p50_ms per row (default 1: each row timed once, as it is built)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile N more calls of each row: its GPU kernels per call (gpu_ms, gemm_ms,"
                         " kernels_per_step, the top 40 by time) in the row's 'profile'")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the served model's dtype")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds: start no new row after this")
    ap.add_argument("--out", type=Path, required=True, help="output JSON file")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="RECEIPT",
                    help="merge these receipts of earlier runs into --out (nothing is run): e.g. one device call at"
                         " 8192 and one at 2048,512")
    args = ap.parse_args(argv)
    if args.merge is not None:
        merged = merge_receipts(args.merge)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(merged, indent=1, default=str))
        print(table(merged["rows"]))
        for what, ok in merged["summary"]["checks"].items():
            print(f"check: {what}: {ok}")
        return 0

    from loka_tune.objectives.compiled import strict_compile
    from loka_tune.serving import ServingBuckets, plan_serving
    from loka_tune.tuner.build import make_model, make_source, resolve_device
    from loka_tune.tuner.study import load_study

    t_start = time.perf_counter()
    cfg = load_study(args.study)
    if args.preset:
        cfg = replace(cfg, model=replace(cfg.model, preset=args.preset))
    dev = torch.device(resolve_device(args.device))
    cuda = dev.type == "cuda"
    mode = args.compile_mode or ("reduce-overhead" if cuda else "none")
    if mode == "graph" and not cuda:
        raise SystemExit("--compile-mode graph captures CUDA graphs: it needs a CUDA device (--device cuda);"
                         " on a CPU use --compile-mode none or default")
    plan_kind = args.plan or ("measured" if cuda else "modeled")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    for flag, value in (("--calibrate", args.calibrate), ("--profile", args.profile)):
        if value < 0:
            raise SystemExit(f"{flag} {value}: give a count of batches / calls >= 0 (0: off)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give a count of timing rounds >= 1 (1: each row timed once)")
    alts = [a.strip() for a in args.alternatives.split(",") if a.strip()]
    bad_alts = [a for a in alts if a not in ALL_ALTERNATIVES]
    if bad_alts or not alts:
        raise SystemExit(f"--alternatives {args.alternatives!r}: unknown {bad_alts or 'empty list'}; choose from"
                         f" {', '.join(ALL_ALTERNATIVES)}")
    if "torchao_static" in args.variants and args.calibrate < 1:
        raise SystemExit("the torchao_static variant calibrates its activation scales: add --calibrate N (N >= 1)")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if REF in names:
        names = [REF] + [v for v in names if v != REF]  # the reference first: its logits are every row's SQNR reference
    if ({"config", "config_dynamic"} & set(names)) and args.config is None:
        raise SystemExit("the 'config' variants need --config best.json (loka-tune export STUDY --out best.json)")
    config = PrecisionConfig.load(args.config) if args.config else PrecisionConfig(mods=DEFAULT_MODS)
    if plan_kind == "config" and config.serving is None:
        raise SystemExit(f"--plan config: {args.config} has no serving section; use --plan modeled or measured")
    source = make_source(cfg)
    base = make_model(cfg, source, seed=0).to(dev)
    apply(base, PrecisionConfig(mods=config.mods))  # the Mods once: every variant is a copy of this model
    base = base.to(dtype).eval()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "study": str(args.study), "model": cfg.model.name, "preset": cfg.model.preset, "batches": batches,
        "variants": names, "config": str(args.config) if args.config else None, "mods": config.mods.short_str(),
        "plan": plan_kind, "compile_mode": mode, "dtype": args.dtype, "warmup": args.warmup, "reps": args.reps,
        "rounds": args.rounds,
        "device": torch.cuda.get_device_name(dev) if cuda else (platform.processor() or "cpu"),
        "versions": _versions(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:] if argv is None else argv}

    calib: list[tuple[Any, ...]] | None = None
    if args.calibrate > 0:
        it = source.batches("eval", 512, seed=1, device=dev)
        calib = []
        for _ in range(args.calibrate):
            b = next(it, None)
            if b is None:
                break
            calib.append(tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in model_inputs(base, b)))
    meta["calibrate"] = len(calib) if calib else 0
    meta["autotune"] = bool(args.autotune)
    meta["torchao_tuning"] = not args.no_torchao_tuning

    # ---- the serving plan of the config variant
    served = config
    plan_s = 0.0
    if "config" in names and plan_kind in ("modeled", "measured"):
        t0 = time.perf_counter()
        probe_inputs = _to_device_inputs(base, source, 8, dev, dtype)
        cache = None
        if plan_kind == "measured":
            from loka_tune.kernels.site_timing import SitePriceCache

            cache = SitePriceCache(args.out.with_name(args.out.stem + "_prices.json"), shipped=())
        cands = [c.strip() for c in args.candidates.split(",") if c.strip()]
        served = plan_serving(base, config, probe_inputs, buckets=batches, candidates=cands,
                              cost_device=args.cost_device, measure=plan_kind == "measured", device=str(dev),
                              cache=cache, budget_s=args.plan_budget,
                              progress=lambda msg: print(f"[plan] {msg}", flush=True), verify=args.verify,
                              alternatives=alts,
                              verify_budget_s=args.verify_budget, calibration=calib)
        plan_s = time.perf_counter() - t0
        served.save(args.out.with_name(args.out.stem + "_config.json"))
    meta["plan_s"] = plan_s
    plan_dict = served.serving.to_dict() if served.serving is not None else None

    rows: list[dict[str, Any]] = []
    ref_logits: dict[int, torch.Tensor] = {}
    failed = 0

    def dump() -> None:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "plan": plan_dict,
                                        "summary": summarize(rows, batches)}, indent=1, default=str))

    def show(row: dict[str, Any]) -> None:
        shown = {k: row[k] for k in ("p50_ms", "p99_ms", "sqnr_db", "fp8_sites", "skipped", "error") if k in row}
        print(f"[serve {time.perf_counter() - t_start:6.0f}s] {row['variant']} @ {row['batch']}: {shown}", flush=True)

    for batch in batches:
        inputs = _to_device_inputs(base, source, batch, dev, dtype)
        live: dict[str, tuple[dict[str, Any], Callable[[], Any]]] = {}  # --rounds > 1: built, not yet timed
        for name in names:
            row: dict[str, Any] = {"variant": name, "batch": batch}
            if time.perf_counter() - t_start > args.budget:
                row["skipped"] = "over the --budget"
            elif name in _GPU_ONLY and not cuda:
                row["skipped"] = "needs a CUDA GPU"
            else:
                guard = strict_compile() if mode != "none" else contextlib.nullcontext({})
                inductor = _inductor_state()  # torchao's quantize_ sets inductor's config process-wide: undone after
                try:
                    t0 = time.perf_counter()
                    tuned = (torch._inductor.config.patch(coordinate_descent_tuning=True,
                                                          coordinate_descent_check_all_directions=True)
                             if args.autotune else contextlib.nullcontext())
                    with guard as dynamo, tuned:
                        model, info = build_variant(name, base, served, config, batch, plan_kind,
                                                    torchao_tuning=not args.no_torchao_tuning, calib=calib)
                        row.update(info)
                        if calib and (name == "config" or name in _LOKA):
                            row["calibrated_sites"] = len(calibrate(model, calib, strict=False).amax)
                        with torch.no_grad():
                            if mode == "graph":  # the product's path: compiled, one CUDA graph per bucket
                                server = ServingBuckets({batch: model}).captured(*inputs)

                                def call(server: Any = server, inputs: tuple[Any, ...] = inputs) -> Any:
                                    return server(*inputs)  # bound now: --rounds keeps this closure past the row
                            else:
                                fn = model if mode == "none" else torch.compile(model, mode=mode, dynamic=False)

                                def call(fn: Any = fn, inputs: tuple[Any, ...] = inputs) -> Any:
                                    return fn(*inputs)
                            out = call().float().clone()  # compiles (and records the graph on later calls)
                            row["compile_s"] = time.perf_counter() - t0
                            row["inductor"] = _inductor_settings()  # what this row compiled with
                            if args.rounds == 1:
                                _record_timing(row, time_calls(call, dev, warmup=args.warmup, reps=args.reps))
                                if args.profile > 0:
                                    row["profile"] = profile_calls(call, dev, args.profile)
                            else:  # kept built: timed with the batch's other rows, in turns
                                live[name] = (row, call)
                    if mode != "none":
                        row["dynamo"] = dynamo
                    if name == REF:
                        ref_logits[batch] = out
                        row["sqnr_db"] = row["sqnr_centered_db"] = None
                    elif batch in ref_logits:
                        ref = ref_logits[batch]
                        s, c = sqnr_db(ref, out), sqnr_db(ref - ref.mean(), out - ref.mean())
                        row["sqnr_db"] = s if math.isfinite(s) else None
                        row["sqnr_centered_db"] = c if math.isfinite(c) else None
                        row["identical_to_ref"] = not math.isfinite(s)
                    del model
                    if name not in live:
                        del call
                except Exception as e:  # noqa: BLE001 - record it and go on: one broken row must not hide the rest
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                    failed += 1
                finally:
                    _restore_inductor(inductor)
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            dump()
            show(row)
        if live:
            try:
                timed = timed_rounds({n: c for n, (_, c) in live.items()}, dev, rounds=args.rounds,
                                     warmup=args.warmup, reps=args.reps)
                for n, (row, call) in live.items():
                    _record_timing(row, timed[n])
                    if args.profile > 0:
                        row["profile"] = profile_calls(call, dev, args.profile)
            except Exception as e:  # noqa: BLE001 - the rows keep their build; the error says why no times
                for row, _ in live.values():
                    row["error"] = f"timing rounds: {type(e).__name__}: {e}"[:400]
                failed += 1
            for row, _ in live.values():
                show(row)
            live.clear()
            if cuda:
                torch.cuda.empty_cache()
            dump()
    dump()
    print()
    print(table(rows))
    summary = summarize(rows, batches)
    for what, ok in summary["checks"].items():
        print(f"check: {what}: {ok}")
    if failed:
        print(f"\n{failed} row(s) failed (their rows say why)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
