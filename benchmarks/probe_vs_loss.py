"""Does the probe's predicted error rank precision configs like their real loss impact?

For each model: one bf16 baseline run per seed (the first with the probe attached), the probe
measures every candidate on the learned (and standard-normal) distributions, then each
precision config is applied to a fresh model (same init, same data order: a paired run) and
trained the same number of steps. Per config:

- predicted error: the geometric mean over every (site, GEMM role) of the probe's MERE of the
  choice the config makes there (``learned``; ``normal`` for comparison);
- measured: the relative eval log loss vs the paired bf16 baseline, averaged over seeds.

Prints the per-config table and the Spearman rank correlation between the two (per model
and pooled), and writes ``probe_vs_loss.json`` to --out. FP8 is emulated on the CPU (exact
quantize-dequantize, float32 accumulation), so this is about numerics, not speed.

    python benchmarks/probe_vs_loss.py --models wukong,dlrm --steps 400 --seeds 0,1,2 --out /tmp/pvl
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from loka_tune.applier import apply
from loka_tune.config import ROLES, PrecisionConfig, SitePrecision
from loka_tune.data import parse_data_spec
from loka_tune.models import build_model
from loka_tune.objectives.trainer import TrainConfig, train
from loka_tune.probe import Probe, measure

# name -> (fwd, dgrad, wgrad); every site but the prediction head (which stays bf16)
CONFIGS: dict[str, tuple[str, str, str]] = {
    "e4m3 tensor": ("e4m3.tensor.emulated",) * 3,
    "e4m3 row": ("e4m3.row.emulated",) * 3,
    "e4m3 block": ("e4m3.block.emulated",) * 3,
    "mxfp8": ("mxfp8.mx.emulated",) * 3,
    "e5m2 grads (row)": ("e4m3.row.emulated", "e5m2+e4m3.row.emulated", "e5m2+e4m3.row.emulated"),
    "e5m2 grads (tensor)": ("e4m3.tensor.emulated", "e5m2+e4m3.tensor.emulated", "e5m2+e4m3.tensor.emulated"),
    "mixed": ("e4m3.row.emulated", "e4m3.block.emulated", "e5m2+e4m3.tensor.emulated"),
}
# --harsh adds configs that should hurt: e5m2 (2 mantissa bits) for every operand of every GEMM,
# so that the loss effects span more than the paired-run noise
HARSH: dict[str, tuple[str, str, str]] = {
    "e5m2 everywhere (row)": ("e5m2.row.emulated",) * 3,
    "e5m2 everywhere (tensor)": ("e5m2.tensor.emulated",) * 3,
    "e5m2 everywhere (tensor, pow2)": ("e5m2.tensor.pow2.emulated",) * 3,
}


def _geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _config(model: torch.nn.Module, choices: tuple[str, str, str]) -> PrecisionConfig:
    head = getattr(model, "prediction_head", "head")
    return PrecisionConfig.from_sites({head: "bf16"}, default=SitePrecision(*choices))


def run_model(name: str, args: argparse.Namespace, source) -> dict:
    seeds = [int(s) for s in args.seeds.split(",")]

    def cfg(seed: int) -> TrainConfig:
        return TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=seed, device="cpu",
                           window=min(50, args.steps), lr_dense=args.lr)

    def fresh(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(name, args.preset, num_dense=source.num_dense, cardinalities=list(source.cardinalities))

    base: dict[int, float] = {}
    stats = stats_cheap = None
    cheap = _cheap(args.cheap)
    for seed in seeds:
        model = fresh(seed)
        if stats is None:
            if cheap is None:
                with Probe(model, every=args.every, seed=seed) as p:
                    r = train(model, source, cfg(seed), progress=False)
            else:  # the same collections through the cheap statistics too, in the same run
                with Probe(model, every=args.every, seed=seed) as p, \
                        Probe(model, every=args.every, seed=seed, precision=cheap[0], max_rows=cheap[1]) as pc:
                    r = train(model, source, cfg(seed), progress=False)
                stats_cheap = pc.stats
            stats = p.stats
        else:
            r = train(model, source, cfg(seed), progress=False)
        assert r.status == "ok", r.status
        base[seed] = r.eval_logloss
        print(f"{name} bf16 seed {seed}: eval logloss {r.eval_logloss:.5f}", file=sys.stderr)

    cands = sorted({c for chs in CONFIGS.values() for c in chs})
    rep = measure(stats, cands, samples=args.samples, dists=("learned", "normal"), seed=0, e5m2_anywhere=args.harsh)
    mere = {(r.site, r.role, r.choice, r.dist): r.mere for r in rep.results}
    if stats_cheap is not None:
        rep_c = measure(stats_cheap, cands, samples=args.samples, dists=("learned",), seed=0, e5m2_anywhere=args.harsh)
        mere.update({(r.site, r.role, r.choice, "cheap"): r.mere for r in rep_c.results})
    head = getattr(fresh(seeds[0]), "prediction_head", "head")
    sites = [s for s in stats.sites if s != head]

    rows = []
    for cname, choices in CONFIGS.items():
        pred = {}
        for dist in ("learned", "normal") + (("cheap",) if stats_cheap is not None else ()):
            vals = [mere[(s, role.value, ch, dist)] for s in sites for role, ch in zip(ROLES, choices)]
            pred[dist] = _geo(vals)
        rel = []
        for seed in seeds:
            model = fresh(seed)
            apply(model, _config(model, choices))
            r = train(model, source, cfg(seed), progress=False)
            ll = r.eval_logloss if r.status == "ok" else math.inf
            rel.append((ll - base[seed]) / base[seed])
        row = {"config": cname, "choices": list(choices), "pred_learned": pred["learned"],
               "pred_normal": pred["normal"], "rel_logloss": sum(rel) / len(rel), "rel_logloss_seeds": rel}
        if "cheap" in pred:
            row["pred_cheap"] = pred["cheap"]
        rows.append(row)
        print(f"{name} {cname:22s} pred {pred['learned']:.4f} (normal {pred['normal']:.4f})"
              f"  rel logloss {100 * row['rel_logloss']:+.3f}%  seeds {[f'{100 * x:+.3f}' for x in rel]}",
              file=sys.stderr)
    rho_l = spearmanr([r["pred_learned"] for r in rows], [r["rel_logloss"] for r in rows])
    rho_n = spearmanr([r["pred_normal"] for r in rows], [r["rel_logloss"] for r in rows])
    out = {"model": name, "baseline_logloss": base, "rows": rows,
           "spearman_learned": {"rho": rho_l.statistic, "p": rho_l.pvalue},
           "spearman_normal": {"rho": rho_n.statistic, "p": rho_n.pvalue}}
    if stats_cheap is not None:
        rho_c = spearmanr([r["pred_cheap"] for r in rows], [r["rel_logloss"] for r in rows])
        out["spearman_cheap"] = {"rho": rho_c.statistic, "p": rho_c.pvalue, "precision": cheap[0], "max_rows": cheap[1]}
    return out


def _cheap(spec: str | None) -> tuple[str, int | None] | None:
    """``--cheap PRECISION[:ROWS]`` -> (precision, max_rows)."""
    if not spec:
        return None
    prec, _, rows = spec.partition(":")
    if prec not in ("float64", "float32", "tf32"):
        raise SystemExit(f"--cheap {spec!r}: the precision is one of float64, float32, tf32 (e.g. tf32:128)")
    try:
        return prec, int(rows) if rows else None
    except ValueError:
        raise SystemExit(f"--cheap {spec!r}: ROWS is a whole number of rows (e.g. tf32:128)") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="wukong,dlrm")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--data", default="synthetic:num_sparse=8,cardinality=1000,eval_examples=8192")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--harsh", action="store_true", help="also the e5m2-everywhere configs (larger errors)")
    ap.add_argument("--cheap", default=None, metavar="PRECISION[:ROWS]",
                    help="also a second probe on the same collections with the cheap statistics (e.g. tf32:128: TF32"
                         " products, 128 random rows a collection, as a GPU side collection's defaults do): its"
                         " prediction's rank correlation beside the float64 one's (issue 22)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe_vs_loss"))
    args = ap.parse_args()
    if args.harsh:
        CONFIGS.update(HARSH)
    torch.set_num_threads(args.threads)  # tiny models: one thread avoids contention
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = parse_data_spec(args.data)
    results = [run_model(m, args, source) for m in args.models.split(",")]
    pooled_rows = [(m["model"], r) for m in results for r in m["rows"]]
    # pooled: rank within each model would remove the model offset; report the plain pooled rho too
    rho = spearmanr([r["pred_learned"] for _, r in pooled_rows], [r["rel_logloss"] for _, r in pooled_rows])
    out = {
        "setup": {"command": " ".join(sys.argv), "models": args.models, "preset": args.preset, "data": args.data,
                  "steps": args.steps, "batch_size": args.batch_size, "lr_dense": args.lr, "seeds": args.seeds,
                  "samples": args.samples, "torch": torch.__version__, "python": platform.python_version(),
                  "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.perf_counter() - t0)},
        "models": results,
        "pooled_spearman_learned": {"rho": rho.statistic, "p": rho.pvalue},
    }
    if all("pred_cheap" in r for _, r in pooled_rows):
        rc = spearmanr([r["pred_cheap"] for _, r in pooled_rows], [r["rel_logloss"] for _, r in pooled_rows])
        out["pooled_spearman_cheap"] = {"rho": rc.statistic, "p": rc.pvalue, "cheap": args.cheap}
    (args.out / "probe_vs_loss.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    for m in results:
        print(f"\n{m['model']}/{args.preset}: {args.steps} steps, seeds {args.seeds}\n")
        print("| config | predicted MERE (learned) | predicted MERE (normal) | rel. log loss (mean) | std. error | per seed |")
        print("|---|---:|---:|---:|---:|---|")
        for r in m["rows"]:
            xs = r["rel_logloss_seeds"]
            se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
            print(f"| {r['config']} | {r['pred_learned']:.4f} | {r['pred_normal']:.4f} | {100 * r['rel_logloss']:+.3f}% |"
                  f" {100 * se:.3f}% | {', '.join(f'{100 * x:+.3f}%' for x in xs)} |")
        sl, sn = m["spearman_learned"], m["spearman_normal"]
        print(f"\nSpearman(predicted, rel. log loss): learned rho = {sl['rho']:.3f} (p = {sl['p']:.3f}),"
              f" normal rho = {sn['rho']:.3f} (p = {sn['p']:.3f})")
    print(f"\npooled over models (learned): rho = {rho.statistic:.3f} (p = {rho.pvalue:.3f})")
    for m in results:
        if "spearman_cheap" in m:
            sc = m["spearman_cheap"]
            print(f"{m['model']}: the cheap statistics ({args.cheap}): rho = {sc['rho']:.3f} (p = {sc['p']:.3f})")
    if "pooled_spearman_cheap" in out:
        pc = out["pooled_spearman_cheap"]
        print(f"pooled over models (cheap {args.cheap}): rho = {pc['rho']:.3f} (p = {pc['p']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
