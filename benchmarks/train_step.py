"""Train-step time of a reference model on the GPU, where the time goes, and the probe's overhead.

Measures, for one model/preset at one batch size on synthetic data generated on the GPU:
  1. the step time (fwd + bwd + sparse row-wise Adagrad + dense Adam; bf16 autocast), median
     and mean over a steady window, each step timed with CUDA events;
  2. a breakdown of GPU kernel time by the aten op that launched it (torch.profiler, eager
     mode): dense linear GEMMs (mm/addmm/_scaled_mm), other GEMMs (bmm: interactions),
     embeddings, optimizer, everything else; and the time to generate one batch;
  3. with ``--probe-every N``: the same loop with a ``loka_tune.Probe(model, every=N,
     step_on="manual")`` (``Probe.step()`` after each step, no hook between collections;
     ``--probe-forward-hooks``: the forward-counting probe) attached for ``--probe-steps`` steps: its overhead on the mean step time against plain
     runs before and after it (their difference is the run-to-run noise), and directly: the
     extra time of each collection step over the median of the other steps of the same run,
     divided by N median steps (the steady figure leaves out the first collection; both are
     printed; the probe allocates its accumulators on its first step, not in a collection).

Example (the BENCHMARKS.md entries):
    python benchmarks/train_step.py --model wukong --preset large --batch 8192 --steps 200 \
        --num-sparse 40 --cardinality 100000 --probe-every 100 --out $OUT/train_step.json
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


def make_step(model, optimizers):
    def step(batch, marks: list | None = None) -> torch.Tensor:
        """One training step; with ``marks``, CUDA events after fwd, bwd and the optimizers."""

        def mark() -> None:
            if marks is not None:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)

        mark()
        with torch.autocast("cuda", dtype=torch.bfloat16):
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


def timed_loop(step, batches, steps: int, after=None) -> list[float]:
    """Seconds of every step (CUDA events), data generation excluded; ``after()`` runs after
    each step, outside its timing (a manual probe's step count)."""
    times = []
    for _ in range(steps):
        batch = next(batches)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        if after is not None:
            after()
    return times


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
            fwd_model = torch.compile(model) if args.compile else model
            optimizers = build_optimizers(model, TrainConfig(batch_size=args.batch))
            step = make_step(fwd_model, optimizers)
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
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--probe-every", type=int, default=0, help="also measure the probe's overhead (0: skip)")
    ap.add_argument("--probe-forward-hooks", action="store_true",
                    help="count the probe's steps with root forward hooks (step_on='forward') instead of"
                         " Probe.step() after each step (the default: hook-free steps between collections)")
    ap.add_argument("--probe-steps", type=int, default=400,
                    help="steps with the probe attached (at least 2 x --probe-every)")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL|MODS|PRECISION, repeatable: MODS = none or nobias,bn256,hswish,pad16,fused;"
                         " PRECISION = bf16, torchao:tensorwise, uniform:e4m3.row.fa.triton, or a config JSON"
                         " (MODS 'config' keeps that file's mods). Timed after the main measurement.")
    ap.add_argument("--variant-steps", type=int, default=60)
    ap.add_argument("--compile", action="store_true", help="torch.compile the variants' models")
    ap.add_argument("--skip-main", action="store_true", help="only time the variants")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    dev = torch.device("cuda")
    source = SyntheticCTR(num_dense=args.num_dense, cardinalities=[args.cardinality] * args.num_sparse)
    model = build_model(
        args.model, args.preset, num_dense=args.num_dense, cardinalities=source.cardinalities
    ).to(dev)
    optimizers = build_optimizers(model, TrainConfig(batch_size=args.batch))
    step = make_step(model, optimizers)
    batches = iter(source.batches("train", args.batch, seed=0, device=dev))

    # data generation time (not part of the step)
    next(batches)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        next(batches)
    torch.cuda.synchronize()
    data_ms = (time.perf_counter() - t0) / 20 * 1e3

    result: dict = {
        "model": args.model, "preset": args.preset, "batch": args.batch, "steps": args.steps,
        "num_sparse": args.num_sparse, "cardinality": args.cardinality,
        "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
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
    plain = timed_loop(step, batches, args.steps)
    result["plain"] = summarize(plain, args.warmup)
    result["phases_ms"] = phase_times(step, batches, max(args.profile_steps, 10))
    breakdown = profile_breakdown(step, batches, args.profile_steps)
    total = sum(breakdown.values())
    result["breakdown_ms_per_step"] = breakdown
    result["gpu_kernel_ms_per_step"] = total
    result["share_outside_linear_gemms"] = 1 - breakdown.get("linear GEMMs", 0.0) / total if total else None

    if args.probe_every:
        from loka_tune.probe import Probe

        every = args.probe_every
        # step_on="manual": no hook at all on the steps that do not collect (the hooks exist for
        # the collection's forward only); --probe-forward-hooks: the forward-counting probe
        mode = "forward" if args.probe_forward_hooks else "manual"
        with Probe(model, every=every, step_on=mode) as probe:
            probed = timed_loop(step, batches, max(args.probe_steps, 2 * every),
                                after=probe.step if mode == "manual" else None)
        result["probe_step_on"] = mode
        plain2 = timed_loop(step, batches, args.steps)
        result["probe"] = summarize(probed, args.warmup)
        result["plain_after"] = summarize(plain2, args.warmup)
        result["probe_collections"] = probe.collections
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
        result["probe_noncollection_median_ms"] = med * 1e3
        result["probe_overhead_steady"] = statistics.fmean(steady) / (every * med)
        result["probe_overhead_first"] = extra[0] / (every * med)
        result["probe_hook_cost_noncollection"] = med * 1e3 / result["plain"]["median_ms"] - 1

    def dump() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    dump()
    print(f"\n{args.model}/{args.preset} batch {args.batch} on {result['device']} (torch {torch.__version__})")
    print(f"step time: median {result['plain']['median_ms']:.2f} ms, mean {result['plain']['mean_ms']:.2f} ms"
          f" over {result['plain']['steps']} steps; data generation {data_ms:.2f} ms/batch (not in the step)")
    print(f"{'category':48s} {'ms/step':>8s} {'share':>6s}")
    for cat, ms in sorted(breakdown.items(), key=lambda kv: -kv[1]):
        print(f"{cat:48s} {ms:8.2f} {ms / total:6.1%}")
    print(f"share of GPU kernel time outside the linear GEMMs: {result['share_outside_linear_gemms']:.1%}")
    print("phases (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in result["phases_ms"].items()))
    if args.probe_every:
        print(f"probe every {args.probe_every}: mean {result['probe']['mean_ms']:.2f} ms vs"
              f" {result['plain']['mean_ms']:.2f} / {result['plain_after']['mean_ms']:.2f} ms plain"
              f" -> overhead {result['probe_overhead_mean']:+.2%} (plain-vs-plain noise"
              f" {result['plain_noise_mean']:.2%}; {result['probe_collections']} collections)")
        print("probe, direct: collection steps cost "
              + ", ".join(f"{e:+.1f}" for e in result["probe_collection_extra_ms"])
              + f" ms over the median other step ({result['probe_noncollection_median_ms']:.2f} ms);"
              f" overhead at every={args.probe_every}: steady {result['probe_overhead_steady']:+.3%},"
              f" first collection {result['probe_overhead_first']:+.3%}", flush=True)
    if args.variant:
        del model, optimizers, step
        torch.cuda.empty_cache()
        result["variants"] = run_variants(args, source, dev)
        dump()
        print_variants(result["variants"], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
