"""Train-step time of a reference model on the GPU, where the time goes, and the probe's overhead.

Measures, for one model/preset at one batch size on synthetic data generated on the device:
  1. the step time (fwd + bwd + sparse row-wise Adagrad + dense Adam; bf16 autocast on CUDA),
     median and mean over a steady window, each step timed with CUDA events (``--compile``:
     the model wrapped in ``torch.compile``, the regime a study trains in);
  2. a breakdown of GPU kernel time by the aten op that launched it (torch.profiler, CUDA
     only): dense linear GEMMs (mm/addmm/_scaled_mm), other GEMMs (bmm: interactions),
     embeddings, optimizer, everything else; and the time to generate one batch;
  3. with ``--probe-every N``: the same loop with a ``loka_tune.Probe(model, every=N)``
     attached for ``--probe-steps`` steps. Eager, ``step_on="manual"`` (``Probe.step()`` after
     each step, no hook between collections; ``--probe-forward-hooks``: the forward-counting
     probe); ``--compile``, ``step_on="batch"`` (``Probe.step(*inputs, target=labels)`` after
     each step: a collection is the probe's own forward and backward of ``--probe-rows``
     examples of the step's batch on the uncompiled module, so the compiled graph never sees a
     hook; dynamo's counters before and after the probed steps are in the JSON, ``probe_recompiled``
     says whether anything compiled again). Each timed step includes the probe's work after it.
     Reported: the overhead on the mean step time against plain runs before and after it
     (``probe_overhead_mean_sequential``; ``plain_noise_mean_sequential`` is the two plain runs'
     difference, the run-to-run drift: 0.1-1.8% on the H200), then, as the headline
     ``probe_overhead_mean`` with ``plain_noise_mean`` beside it, ``--probe-pairs`` pairs of
     interleaved probed and plain blocks of N steps in ABBA order (``probe_paired``: a fresh
     probe, one collection per probed block, drift cancelled; ``plain_noise_mean`` is the
     same estimator between plain blocks), and directly the extra time of each collection step over the median of
     the other steps of the same run (``probe_collection_extra_ms``, per call; divided by N
     median steps: ``probe_overhead_steady``, the first collection left out). Then
     ``--probe-profile`` collections with ``Probe(profile=True)`` say where a collection's time
     goes (``probe_profile_ms``: the side forward/backward, X, dY and weight statistics per
     collection, device-synchronised) and how many aten ops one collection dispatches.

Example (the BENCHMARKS.md entries; issue 22, the compiled step with the probe, one H200, ~5 min):
    python benchmarks/train_step.py --model wukong --preset large --batch 8192 --steps 200 \
        --num-sparse 40 --cardinality 100000 --probe-every 100 --probe-steps 320 --compile \
        --out $OUT/probe_overhead_h200.json
A CPU smoke run (``tests/test_train_step_bench.py``): ``--device cpu --model dlrm --preset tiny``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_tune.data.base import model_inputs  # noqa: E402
from loka_tune.data.synthetic import SyntheticCTR  # noqa: E402
from loka_tune.models import build_model  # noqa: E402
from loka_tune.objectives.trainer import TrainConfig, build_optimizers  # noqa: E402

# aten op -> category of the GPU time it launches
CATEGORIES = {
    "aten::mm": "linear GEMMs",
    "aten::addmm": "linear GEMMs",
    "aten::_scaled_mm": "linear GEMMs",
    "aten::bmm": "interaction GEMMs (bmm)",
    "aten::baddbmm": "interaction GEMMs (bmm)",
    "aten::embedding_bag": "embeddings",
    "aten::_embedding_bag": "embeddings",
    "aten::_embedding_bag_backward": "embeddings",
    "aten::_embedding_bag_sparse_backward": "embeddings",
    "aten::_embedding_bag_dense_backward": "embeddings",
}


def autocast(dev: torch.device):
    """bf16 autocast on CUDA (the trainer's default there), none on the CPU."""
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(dev.type, enabled=False)


def make_step(model, optimizers, dev: torch.device | None = None):
    dev = dev or torch.device("cuda")

    def step(batch, marks: list | None = None) -> torch.Tensor:
        """One training step; with ``marks``, CUDA events after fwd, bwd and the optimizers."""

        def mark() -> None:
            if marks is not None:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)

        mark()
        with autocast(dev):
            logits = model(*model_inputs(model, batch))  # (B,)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        mark()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        mark()
        for opt in optimizers:
            opt.step()
        mark()
        return loss

    return step


def phase_times(step, batches, steps: int) -> dict[str, float]:
    """Median ms per step of forward, backward and optimizer phases (CUDA events)."""
    out: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps):
        marks: list = []
        step(next(batches), marks)
        marks[-1].synchronize()
        for i, k in enumerate(out):
            out[k].append(marks[i].elapsed_time(marks[i + 1]))
    return {k: statistics.median(v) for k, v in out.items()}


def timed_loop(step, batches, steps: int, after=None, dev: torch.device | None = None) -> list[float]:
    """Seconds of every step (CUDA events; wall time on the CPU), data generation excluded;
    ``after(batch)`` runs after each step and inside its timing: the probe's work (a manual
    probe's step count, or a side collection on the step's batch) is part of the step it follows."""
    cuda = dev is None or dev.type == "cuda"
    times = []
    for _ in range(steps):
        batch = next(batches)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        step(batch)
        if after is not None:
            after(batch)
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - t0)
    return times


def paired_blocks(step, batches, after, every: int, pairs: int, dev: torch.device) -> dict:
    """The probe's overhead free of run-to-run drift: after one probed step (the probe's start: its
    warm-up, reported apart), ``pairs`` pairs of blocks of ``every`` steps, one block with the
    probe stepped after each step (``P``: exactly one collection in it) and one without (``N``:
    the probe attached but idle, the plain step), in ABBA order (P N, N P, P N, ...) so that a
    linear drift of the GPU's speed cancels. ``overhead``: mean P step / mean N step - 1;
    ``noise``: the same estimator between the N blocks of even and odd pairs (what the design
    resolves); ``per_pair``: each pair's ratio - 1, ``se`` their standard error."""
    first = timed_loop(step, batches, 1, after=after, dev=dev)[0]
    p_blocks, n_blocks = [], []
    for k in range(pairs):
        for probed in ((True, False) if k % 2 == 0 else (False, True)):
            times = timed_loop(step, batches, every, after=after if probed else None, dev=dev)
            (p_blocks if probed else n_blocks).append(times)
    mean_p = statistics.fmean(t for b in p_blocks for t in b)
    mean_n = statistics.fmean(t for b in n_blocks for t in b)
    per_pair = [statistics.fmean(p) / statistics.fmean(n) - 1 for p, n in zip(p_blocks, n_blocks)]
    even = [t for b in n_blocks[0::2] for t in b]
    odd = [t for b in n_blocks[1::2] for t in b]
    extra = []  # each P block's collection step over the median of its other steps
    for b in p_blocks:
        med = statistics.median(b)
        extra.append((max(b) - med) * 1e3)
    return {
        "pairs": pairs, "every": every, "order": "ABBA (P N, N P, ...)",
        "overhead": mean_p / mean_n - 1,
        "se": statistics.stdev(per_pair) / len(per_pair) ** 0.5 if len(per_pair) > 1 else None,
        "per_pair": per_pair,
        "noise": abs(statistics.fmean(even) - statistics.fmean(odd)) / mean_n if even and odd else None,
        "mean_probed_ms": mean_p * 1e3, "mean_plain_ms": mean_n * 1e3,
        "median_plain_ms": statistics.median(t for b in n_blocks for t in b) * 1e3,
        "collection_extra_ms": extra,
        "first_step_ms": first * 1e3,
    }


def summarize(times: list[float], warmup: int) -> dict[str, float]:
    steady = times[warmup:]
    return {
        "median_ms": statistics.median(steady) * 1e3,
        "mean_ms": statistics.fmean(steady) * 1e3,
        "p90_ms": sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e3,
        "steps": len(steady),
    }


def profile_breakdown(step, batches, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step(next(batches))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(next(batches))
        torch.cuda.synchronize()
    per_cat: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = evt.self_cuda_time_total
        if dev_us <= 0:
            continue
        name = evt.key
        if name in CATEGORIES:
            cat = CATEGORIES[name]
        elif "_foreach" in name or "adam" in name.lower():
            cat = "optimizer (dense Adam)"
        elif name.startswith("aten::") or name.startswith("triton") or name.startswith("Optimizer"):
            cat = "other ops (norms, activations, copies, ...)"
        else:
            continue  # raw kernel rows: their time is already under the op that launched them
        per_cat[cat] += dev_us / 1e3 / steps  # ms per step
    return dict(per_cat)


def parse_mods(text: str):
    """'none' or a comma list of nobias, bn<block>, hswish, pad<multiple>, fused."""
    from loka_tune.config import ModsConfig

    kw: dict = {}
    for part in filter(None, text.split(",")):
        if part == "none":
            continue
        if part == "nobias":
            kw["no_bias"] = True
        elif part == "hswish":
            kw["hardswish"] = True
        elif part == "fused":  # the fused FP8 epilogue on Linear->BlockNorm->Hardswish chains (Triton FP8 sites)
            kw["fuse_epilogue"] = True
        elif part.startswith("bn"):
            kw["blocknorm"] = int(part[2:])
        elif part.startswith("pad"):
            kw["pad"] = int(part[3:])
        else:
            raise SystemExit(f"unknown mod {part!r} in {text!r}: use nobias, bn<block>, hswish, pad<multiple>, fused")
    return ModsConfig(**kw)


def variant_config(mods_text: str, precision: str):
    """A PrecisionConfig from a variant's mods and precision ('bf16', 'torchao:<recipe>',
    'uniform:<choice or fwd|dgrad|wgrad>', or a path to an exported config JSON)."""
    from dataclasses import replace

    from loka_tune.config import PrecisionConfig, SitePrecision

    mods = parse_mods("none" if mods_text == "config" else mods_text)
    if precision == "bf16":
        return PrecisionConfig(mods=mods)
    if precision.startswith("torchao:"):
        return PrecisionConfig.from_recipe(precision.split(":", 1)[1], backend="torchao", mods=mods)
    if precision.startswith("uniform:"):
        return PrecisionConfig(default=SitePrecision.parse(precision.split(":", 1)[1]), mods=mods)
    cfg = PrecisionConfig.load(precision)
    return cfg if mods_text == "config" else replace(cfg, mods=mods)


def run_variants(args, source, dev) -> list[dict]:
    """Time each --variant on a fresh model (same init seed): bf16 / Mods / FP8 policies."""
    from loka_tune.applier import apply

    rows = []
    for spec in args.variant:
        label, mods_text, precision = (spec.split("|") + ["none", "bf16"])[:3]
        try:  # a variant that fails (a kernel that refuses a shape) is recorded; the others still run
            torch.manual_seed(0)
            model = build_model(args.model, args.preset, num_dense=args.num_dense, cardinalities=source.cardinalities)
            model = model.to(dev)
            cfg = variant_config(mods_text, precision)
            summary = apply(model, cfg, strict=False)
            model = model.to(dev)
            fwd_model = torch.compile(model, backend=getattr(args, "compile_backend", "inductor")) if args.compile else model
            optimizers = build_optimizers(model, TrainConfig(batch_size=args.batch))
            step = make_step(fwd_model, optimizers, dev)
            batches = iter(source.batches("train", args.batch, seed=0, device=dev))
            times = timed_loop(step, batches, args.variant_steps)
            row = {"variant": label, "mods": cfg.mods.short_str(), "precision": precision,
                   "fp8_sites": len([s for s, c in summary.replaced.items()]),
                   "fallbacks": len(summary.fallbacks), **summarize(times, min(args.warmup, args.variant_steps // 3))}
            print(f"  {label:28s} {row['median_ms']:8.2f} ms  ({row['fp8_sites']} FP8 sites, {row['fallbacks']} bf16"
                  " fallbacks)", flush=True)
        except Exception as e:  # noqa: BLE001
            row = {"variant": label, "mods": mods_text, "precision": precision, "error": f"{type(e).__name__}: {e}"[:400]}
            print(f"  {label:28s} FAILED: {row['error']}", flush=True)
        rows.append(row)
        model = fwd_model = optimizers = step = None
        torch.cuda.empty_cache()
    base = rows[0].get("median_ms") if rows else None
    for r in rows:
        r["speedup_vs_first"] = base / r["median_ms"] if base and "median_ms" in r else None
    return rows


def print_variants(rows: list[dict], args) -> None:
    print(f"\n{args.model}/{args.preset} batch {args.batch}, {args.variant_steps} steps per variant"
          f"{' (compiled)' if args.compile else ' (eager)'}")
    print("| variant | mods | precision | FP8 sites | median ms | mean ms | speed-up vs first |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['mods']} | {r['precision']} | - | failed: {r['error'][:120]} | - | - |")
            continue
        print(f"| {r['variant']} | {r['mods']} | {r['precision']} | {r['fp8_sites']} | {r['median_ms']:.2f} |"
              f" {r['mean_ms']:.2f} | {r['speedup_vs_first']:.3f}x |")


def probe_after(probe, model, mode: str, dev: torch.device):
    """What runs after each timed step: ``Probe.step()`` (manual), ``Probe.step(*inputs,
    target=labels)`` under the step's autocast (batch: the side collection), nothing (forward)."""
    if mode == "forward":
        return None
    if mode == "manual":
        return lambda _batch: probe.step()

    def side(batch) -> None:
        with autocast(dev):
            probe.step(*model_inputs(model, batch), target=batch.labels)

    return side


def probe_precision(probe) -> str:
    """The products' precision the probe's streams resolved to (after its first step)."""
    site = next(iter(probe._sites.values()))
    return site.x.precision


def probe_trace(after, step, batches, dev: torch.device, top: int = 25) -> dict:
    """One side collection under torch.profiler (after a training step): its wall time, the GPU's
    busy time in it, and the aten ops that cost the most host time and the most GPU time (a
    collection is host-bound when the first is far above the second)."""
    from torch.profiler import ProfilerActivity, profile

    from loka_tune.kernels.timing import gpu_activity_us

    cuda = dev.type == "cuda"
    batch = next(batches)
    step(batch)
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        after(batch)
        if cuda:
            torch.cuda.synchronize(dev)
        wall = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    gpu_us = gpu_activity_us(prof.events())
    rows = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_gpu_ms": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1e3}
            for e in events]
    by_cpu = sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top]
    by_gpu = sorted(rows, key=lambda r: -r["self_gpu_ms"])[:top]
    return {"wall_ms": wall, "gpu_busy_ms": gpu_us / 1e3, "self_cpu_ms_total": sum(r["self_cpu_ms"] for r in rows),
            "top_by_cpu": by_cpu, "top_by_gpu": by_gpu}


def probe_profile(model, step, batches, args, mode: str, dev: torch.device) -> dict:
    """Where a collection's time goes: ``--probe-profile`` collections with ``Probe(profile=True)``
    (device-synchronised per part, so slower than the overhead run's), after a training step
    each; and the aten ops one collection dispatches (the host's launches on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from loka_tune.probe import Probe

    cuda = dev.type == "cuda"
    if mode == "forward":
        mode = "manual"  # the same collection, counted by hand here
    probe = Probe(model, every=1, step_on=mode, profile=True, sub_batch=args.probe_rows if mode == "batch" else None,
                  precision=args.probe_precision, weight_every=args.probe_weight_every)
    after = probe_after(probe, model, mode, dev)
    wall = []
    with probe:
        for i in range(args.probe_profile + 1):  # the first allocates the accumulators: left out
            batch = next(batches)
            if mode == "manual":
                probe.collect_next()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            step(batch)
            if cuda:
                torch.cuda.synchronize(dev)
            t1 = time.perf_counter()
            after(batch)
            if cuda:
                torch.cuda.synchronize(dev)
            wall.append((time.perf_counter() - t1) * 1e3 if mode == "batch" else (time.perf_counter() - t0) * 1e3)
            if i == 0:
                probe.timings.clear()
        n = max(args.probe_profile, 1)
        parts: dict[str, float] = defaultdict(float)  # side: forward_backward, weights, stats; in-step: x, dy, w
        sites: dict[str, float] = defaultdict(float)
        for key, sec in probe.timings.items():
            head, part = key.rsplit(".", 1)
            parts[part] += sec * 1e3 / n
            if head != "side":
                sites[head] += sec * 1e3 / n

        class Count(TorchDispatchMode):
            ops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.ops += 1
                return func(*args, **(kwargs or {}))

        probe.profile = False
        batch = next(batches)
        step(batch)
        if mode == "manual":
            probe.collect_next()
            with Count():
                step(batch)  # the collecting step (its training ops counted too)
        else:
            with Count():
                after(batch)
        syncs = None
        if cuda and mode == "batch":  # CUDA's sync debug mode warns at each synchronising call
            import warnings

            batch = next(batches)
            step(batch)
            torch.cuda.synchronize(dev)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    after(batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]
        trace = probe_trace(after, step, batches, dev) if cuda and mode == "batch" else None
    top = sorted(sites.items(), key=lambda kv: -kv[1])[:8]
    return {"trace": trace, "collections": args.probe_profile, "rows": args.probe_rows, "mode": mode, "precision": probe_precision(probe),
            "wall_ms_per_collection": wall[1:],
            "wall_what": "the side collection alone" if mode == "batch" else "the collecting training step", "parts_ms_per_collection": dict(parts),
            "top_sites_ms": dict(top), "aten_ops_per_collection": Count.ops,
            "host_syncs_per_collection": None if syncs is None else len(syncs), "host_syncs": (syncs or [])[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="large")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--num-sparse", type=int, default=40)
    ap.add_argument("--num-dense", type=int, default=13)
    ap.add_argument("--cardinality", type=int, default=100_000)
    ap.add_argument("--profile-steps", type=int, default=10, help="kernel-time breakdown steps (CUDA; 0: skip)")
    ap.add_argument("--probe-every", type=int, default=0, help="also measure the probe's overhead (0: skip)")
    ap.add_argument("--probe-forward-hooks", action="store_true",
                    help="count the probe's steps with root forward hooks (step_on='forward') instead of"
                         " Probe.step() after each step (the default: hook-free steps between collections)")
    ap.add_argument("--probe-steps", type=int, default=400,
                    help="steps with the probe attached (at least 2 x --probe-every)")
    ap.add_argument("--probe-pairs", type=int, default=3,
                    help="then pairs of interleaved blocks of --probe-every steps, probed and plain, in ABBA"
                         " order: probe_overhead_mean and plain_noise_mean in the JSON (0: only the"
                         " sequential runs, whose figures then stand there)")
    ap.add_argument("--probe-rows", type=int, default=None,
                    help="with --compile: examples of the step's batch a side collection runs on"
                         " (Probe(sub_batch=...); default: the probe's, 2048 on a GPU)")
    ap.add_argument("--probe-precision", default="auto",
                    help="Probe(precision=...): auto (tf32 for the compiled side collection on a GPU, float32 in"
                         " step), float32, tf32, float64")
    ap.add_argument("--probe-weight-every", type=int, default=None,
                    help="Probe(weight_every=...): the weight statistics at every k-th collection (default: the"
                         " probe's, 8 for a side collection on a GPU)")
    ap.add_argument("--probe-profile", type=int, default=3,
                    help="collections timed part by part after the overhead run (Probe(profile=True); 0: skip)")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL|MODS|PRECISION, repeatable: MODS = none or nobias,bn256,hswish,pad16,fused;"
                         " PRECISION = bf16, torchao:tensorwise, uniform:e4m3.row.fa.triton, or a config JSON"
                         " (MODS 'config' keeps that file's mods). Timed after the main measurement.")
    ap.add_argument("--variant-steps", type=int, default=60)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (the main measurement, the probe's run, the variants); the"
                         " probe then collects with step_on='batch' (its own forward/backward, uncompiled)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (CPU smoke: aot_eager)")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run: no kernel breakdown)")
    ap.add_argument("--skip-main", action="store_true", help="only time the variants")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    torch.manual_seed(0)
    source = SyntheticCTR(num_dense=args.num_dense, cardinalities=[args.cardinality] * args.num_sparse)
    model = build_model(
        args.model, args.preset, num_dense=args.num_dense, cardinalities=source.cardinalities
    ).to(dev)
    optimizers = build_optimizers(model, TrainConfig(batch_size=args.batch))
    fwd_model = model
    if args.compile:
        from loka_tune.objectives.compiled import allow_sparse_gradients

        allow_sparse_gradients()  # as TrainStep does before compiling (sparse embedding gradients)
        fwd_model = torch.compile(model, backend=args.compile_backend)
    step = make_step(fwd_model, optimizers, dev)
    batches = iter(source.batches("train", args.batch, seed=0, device=dev))

    # data generation time (not part of the step)
    next(batches)
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        next(batches)
    sync()
    data_ms = (time.perf_counter() - t0) / 20 * 1e3

    result: dict = {
        "model": args.model, "preset": args.preset, "batch": args.batch, "steps": args.steps,
        "num_sparse": args.num_sparse, "cardinality": args.cardinality, "compile": bool(args.compile),
        "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "data_gen_ms_per_batch": data_ms,
    }
    if args.skip_main:
        from loka_tune.kernels import ops

        ops.set_nonfinite_check(False)
        del model, optimizers, step
        result["variants"] = run_variants(args, source, dev)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
        print_variants(result["variants"], args)
        return 0
    t_first = time.perf_counter()
    plain = timed_loop(step, batches, args.steps, dev=dev)
    result["first_plain_run_wall_s"] = time.perf_counter() - t_first  # compilation included
    result["plain"] = summarize(plain, args.warmup)
    breakdown: dict[str, float] = {}
    total = 0.0
    if cuda and args.profile_steps:
        result["phases_ms"] = phase_times(step, batches, max(args.profile_steps, 10))
        breakdown = profile_breakdown(step, batches, args.profile_steps)
        total = sum(breakdown.values())
        result["breakdown_ms_per_step"] = breakdown
        result["gpu_kernel_ms_per_step"] = total
        result["share_outside_linear_gemms"] = 1 - breakdown.get("linear GEMMs", 0.0) / total if total else None

    if args.probe_every:
        from loka_tune.probe import Probe

        every = args.probe_every
        # eager, step_on="manual": no hook at all on the steps that do not collect (the hooks exist
        # for the collection's forward only); --probe-forward-hooks: the forward-counting probe;
        # compiled, step_on="batch": no hook on the compiled model ever, the collection is the
        # probe's own forward/backward of a sub-batch on the uncompiled module
        mode = "batch" if args.compile else ("forward" if args.probe_forward_hooks else "manual")
        dyn = None
        if args.compile:
            from loka_tune.objectives.compiled import dynamo_report

            dyn = dynamo_report()
        probe = Probe(model, every=every, step_on=mode, sub_batch=args.probe_rows if mode == "batch" else None,
                      precision=args.probe_precision, weight_every=args.probe_weight_every)
        with probe:
            probed = timed_loop(step, batches, max(args.probe_steps, 2 * every),
                                after=probe_after(probe, model, mode, dev), dev=dev)
        result["probe_step_on"] = mode
        if dyn is not None:
            after_dyn = dynamo_report()
            result["dynamo_before_probe"], result["dynamo_after_probe"] = dyn, after_dyn
            result["probe_recompiled"] = any(after_dyn[k] != dyn[k] for k in ("frames_total", "unique_graphs"))
        plain2 = timed_loop(step, batches, args.steps, dev=dev)
        result["probe"] = summarize(probed, args.warmup)
        result["plain_after"] = summarize(plain2, args.warmup)
        result["probe_collections"] = probe.collections
        result["probe_sub_batch"] = args.probe_rows
        result["probe_weight_every"] = args.probe_weight_every
        result["probe_precision"] = probe_precision(probe)
        base = (result["plain"]["mean_ms"] + result["plain_after"]["mean_ms"]) / 2
        result["probe_overhead_mean"] = result["probe"]["mean_ms"] / base - 1
        result["plain_noise_mean"] = abs(result["plain"]["mean_ms"] - result["plain_after"]["mean_ms"]) / base
        # Direct: the probe works only in its collection steps (steps every, 2 every, ...: the
        # i-th timed step is the probe's step i + 1); their extra time over the median of the
        # other steps of the same run is the cost of one collection, free of run-to-run drift.
        coll = [i for i in range(len(probed)) if (i + 1) % every == 0]
        other = [t for i, t in enumerate(probed) if (i + 1) % every and i >= args.warmup]
        med = statistics.median(other)
        extra = [probed[i] - med for i in coll]
        steady = extra[1:] or extra  # the first collection also allocates the accumulators
        result["probe_collection_extra_ms"] = [e * 1e3 for e in extra]
        result["probe_collection_ms_mean"] = statistics.fmean(extra) * 1e3
        # the probe's one-off start (step_on="batch" on a GPU: a discarded warm-up collection at
        # the first step; in the run's warm-up steps, as the plain runs' compilation is)
        result["probe_first_step_extra_ms"] = (probed[0] - med) * 1e3
        result["probe_noncollection_median_ms"] = med * 1e3
        result["probe_overhead_steady"] = statistics.fmean(steady) / (every * med)
        result["probe_overhead_first"] = extra[0] / (every * med)
        result["probe_hook_cost_noncollection"] = med * 1e3 / result["plain"]["median_ms"] - 1
        result["probe_graph"] = probe.graph_note
        # the headline: interleaved blocks (paired_blocks), free of the drift between the runs above
        result["probe_overhead_mean_sequential"] = result["probe_overhead_mean"]
        result["plain_noise_mean_sequential"] = result["plain_noise_mean"]
        del probe
        if args.probe_pairs:
            probe = Probe(model, every=every, step_on=mode, sub_batch=args.probe_rows if mode == "batch" else None,
                          precision=args.probe_precision, weight_every=args.probe_weight_every)
            with probe:
                paired = paired_blocks(step, batches, probe_after(probe, model, mode, dev), every, args.probe_pairs, dev)
            paired["collections"], paired["graph"] = probe.collections, probe.graph_note
            del probe
            result["probe_paired"] = paired
            result["probe_overhead_mean"] = paired["overhead"]
            result["plain_noise_mean"] = paired["noise"]
        if args.probe_profile:
            result["probe_profile"] = probe_profile(model, step, batches, args, mode, dev)

    def dump() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    dump()
    print(f"\n{args.model}/{args.preset} batch {args.batch} on {result['device']} (torch {torch.__version__},"
          f" {'compiled' if args.compile else 'eager'})")
    print(f"step time: median {result['plain']['median_ms']:.2f} ms, mean {result['plain']['mean_ms']:.2f} ms"
          f" over {result['plain']['steps']} steps; data generation {data_ms:.2f} ms/batch (not in the step)")
    if breakdown:
        print(f"{'category':48s} {'ms/step':>8s} {'share':>6s}")
        for cat, ms in sorted(breakdown.items(), key=lambda kv: -kv[1]):
            print(f"{cat:48s} {ms:8.2f} {ms / total:6.1%}")
        print(f"share of GPU kernel time outside the linear GEMMs: {result['share_outside_linear_gemms']:.1%}")
        print("phases (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in result["phases_ms"].items()))
    if args.probe_every:
        print(f"probe every {args.probe_every} ({result['probe_step_on']}), sequential runs: mean"
              f" {result['probe']['mean_ms']:.2f} ms vs {result['plain']['mean_ms']:.2f} /"
              f" {result['plain_after']['mean_ms']:.2f} ms plain -> overhead"
              f" {result['probe_overhead_mean_sequential']:+.2%} (plain-vs-plain noise"
              f" {result['plain_noise_mean_sequential']:.2%}; {result['probe_collections']} collections;"
              f" statistics: {result['probe_graph']})"
              + (f"; recompiled: {result['probe_recompiled']}" if "probe_recompiled" in result else ""))
        if "probe_paired" in result:
            pr = result["probe_paired"]
            print(f"probe, interleaved ({pr['pairs']} pairs of {pr['every']}-step blocks, ABBA): mean"
                  f" {pr['mean_probed_ms']:.2f} vs {pr['mean_plain_ms']:.2f} ms -> overhead {pr['overhead']:+.3%}"
                  + ("" if pr["se"] is None else f" (se {pr['se']:.3%})")
                  + ("" if pr["noise"] is None else f", plain-vs-plain {pr['noise']:.3%}")
                  + "; collections cost " + ", ".join(f"{e:+.1f}" for e in pr["collection_extra_ms"])
                  + f" ms; statistics: {pr['graph']}", flush=True)
        print("probe, direct: collection steps cost "
              + ", ".join(f"{e:+.1f}" for e in result["probe_collection_extra_ms"])
              + f" ms over the median other step ({result['probe_noncollection_median_ms']:.2f} ms);"
              f" overhead at every={args.probe_every}: steady {result['probe_overhead_steady']:+.3%},"
              f" first collection {result['probe_overhead_first']:+.3%}; the probe's first step"
              f" {result['probe_first_step_extra_ms']:+.1f} ms (one-off)", flush=True)
        if "probe_profile" in result:
            pp = result["probe_profile"]
            print("probe, profiled (ms per collection, synchronised): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in pp["parts_ms_per_collection"].items())
                  + f"; wall {', '.join(f'{w:.1f}' for w in pp['wall_ms_per_collection'])};"
                  f" {pp['aten_ops_per_collection']} aten ops per collection"
                  + ("" if pp["host_syncs_per_collection"] is None else f", {pp['host_syncs_per_collection']} host syncs"),
                  flush=True)
            if pp.get("trace"):
                tr = pp["trace"]
                print(f"probe, traced collection: wall {tr['wall_ms']:.1f} ms, GPU busy {tr['gpu_busy_ms']:.1f} ms,"
                      f" host self time {tr['self_cpu_ms_total']:.1f} ms; top host ops: "
                      + ", ".join(f"{r['op']} {r['calls']}x {r['self_cpu_ms']:.1f}" for r in tr["top_by_cpu"][:12])
                      + "; top GPU ops: "
                      + ", ".join(f"{r['op']} {r['calls']}x {r['self_gpu_ms']:.1f}" for r in tr["top_by_gpu"][:12]),
                      flush=True)
    if args.variant:
        del model, optimizers, step
        if cuda:
            torch.cuda.empty_cache()
        result["variants"] = run_variants(args, source, dev)
        dump()
        print_variants(result["variants"], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
