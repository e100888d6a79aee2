"""Probe errors on learned distributions vs standard-normal operands (and vs real batches).

Trains a reference model briefly on synthetic data with the probe attached, then measures
every candidate at every site and GEMM role under three operand distributions:

- ``learned``: synthetic draws from the probe's statistics (the probe's answer);
- ``normal``: standard-normal X, dY, W of the same shapes (the usual random-input test);
- ``real``: the last captured batch of each site with its current weight (ground truth).

and twice more with ``weights="current"`` (the weight itself instead of matrix-normal draws;
two seeds: the second gives the sampling-noise floor) to check that the weight model
predicts the errors of the real weight.

Prints a markdown summary (geomean MERE per candidate and distribution, learned/normal ratio,
per-role ratios, verdicts that flip between distributions, how close learned is to real) and
writes ``summary.json``, ``probe_report.json``, ``probe_heatmap.png`` and the stats to --out.

    python benchmarks/probe_learned_vs_normal.py --model wukong --preset paper \\
        --steps 120 --every 20 --batch-size 256 --samples 16 --max-rows 1024 --out /tmp/lvn
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from statistics import median

import torch

from loka_tune.data import parse_data_spec
from loka_tune.models import build_model
from loka_tune.objectives.trainer import TrainConfig, train
from loka_tune.probe import DEFAULT_CANDIDATES, Probe, ProbeReport, ProbeStats, measure


def _geo(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def summarize(rep: ProbeReport, cur: ProbeReport | None, cur2: ProbeReport | None = None) -> dict:
    by = {(r.site, r.role, r.choice, r.dist): r for r in rep.results}
    cands = rep.candidates
    out: dict = {"candidates": {}, "roles": {}, "flips": {}, "learned_vs_real": {}}
    for c in cands:
        row = {}
        for d in rep.dists:
            row[d] = _geo([r.mere for r in rep.results if r.choice == c and r.dist == d])
        row["learned/normal"] = row["learned"] / row["normal"]
        pairs = [(by[k], by[(k[0], k[1], k[2], "normal")]) for k in by if k[2] == c and k[3] == "learned"]
        row["cells"] = len(pairs)
        row["cells_learned_higher"] = sum(a.mere > b.mere for a, b in pairs)
        row["max_cell_ratio"] = max((a.mere / b.mere for a, b in pairs), default=math.nan)
        if "real" in rep.dists:
            row["learned/real"] = row["learned"] / row["real"]
        out["candidates"][c] = row
    for role in ("fwd", "dgrad", "wgrad"):
        out["roles"][role] = {
            c: _geo([by[k].mere for k in by if k[1] == role and k[2] == c and k[3] == "learned"])
            / _geo([by[k].mere for k in by if k[1] == role and k[2] == c and k[3] == "normal"])
            for c in cands if not (role == "fwd" and c.startswith("e5m2"))
        }
    for d in rep.dists:
        if d == "learned":
            continue
        flips = [k for k in by if k[3] == "learned" and (k[0], k[1], k[2], d) in by
                 and by[k].safe != by[(k[0], k[1], k[2], d)].safe]
        out["flips"][f"learned_vs_{d}"] = {
            "cells": len([k for k in by if k[3] == "learned"]),
            "safe_verdict_differs": len(flips),
            "unsafe_only_under_learned": sum(not by[k].safe for k in flips),
            "examples": [f"{k[0]}.{k[1]} {k[2]}: learned {by[k].mere:.3f} vs {d} {by[(k[0], k[1], k[2], d)].mere:.3f}"
                         for k in flips[:6]],
        }
    if "real" in rep.dists:
        logs = [abs(math.log(by[k].mere / by[(k[0], k[1], k[2], "real")].mere))
                for k in by if k[3] == "learned" and (k[0], k[1], k[2], "real") in by
                and not k[2].startswith("bf16") and by[(k[0], k[1], k[2], "real")].mere > 0]
        logs_n = [abs(math.log(by[(k[0], k[1], k[2], "normal")].mere / by[(k[0], k[1], k[2], "real")].mere))
                  for k in by if k[3] == "learned" and (k[0], k[1], k[2], "real") in by
                  and not k[2].startswith("bf16") and by[(k[0], k[1], k[2], "real")].mere > 0]
        out["learned_vs_real"] = {
            "median_abs_log_ratio_learned": median(logs) if logs else math.nan,
            "median_abs_log_ratio_normal": median(logs_n) if logs_n else math.nan,
        }
    if cur is not None:
        cb = {(r.site, r.role, r.choice): r.mere for r in cur.results}
        rel = [abs(by[k].mere / cb[k[:3]] - 1) for k in by if k[3] == "learned" and k[:3] in cb]
        out["weights_model_vs_current"] = {
            "cells": len(rel),
            "median_rel_diff": median(rel) if rel else math.nan,
            "p90_rel_diff": sorted(rel)[int(0.9 * (len(rel) - 1))] if rel else math.nan,
            "geomean_mere_model": {c: out["candidates"][c]["learned"] for c in cands},
            "geomean_mere_current": {c: _geo([r.mere for r in cur.results if r.choice == c]) for c in cands},
        }
        if cur2 is not None:  # the noise floor: the same weight, other draws of X and dY
            c2 = {(r.site, r.role, r.choice): r.mere for r in cur2.results}
            noise = sorted(abs(c2[k] / cb[k] - 1) for k in cb if k in c2)
            out["weights_model_vs_current"]["noise_median_rel_diff"] = median(noise)
            out["weights_model_vs_current"]["noise_p90_rel_diff"] = noise[int(0.9 * (len(noise) - 1))]
    return out


def markdown(s: dict, dists: list[str]) -> str:
    lines = ["| candidate | " + " | ".join(f"geomean MERE {d}" for d in dists)
             + " | learned/normal | cells learned > normal | max cell ratio |",
             "|---|" + "---:|" * (len(dists) + 3)]
    for c, row in s["candidates"].items():
        lines.append(f"| {c} | " + " | ".join(f"{row[d]:.4f}" for d in dists)
                     + f" | {row['learned/normal']:.3f} | {row['cells_learned_higher']}/{row['cells']}"
                     + f" | {row['max_cell_ratio']:.2f} |")
    lines += ["", "learned/normal geomean MERE ratio per role:", "",
              "| role | " + " | ".join(s["candidates"]) + " |", "|---|" + "---:|" * len(s["candidates"])]
    for role, per in s["roles"].items():
        lines.append(f"| {role} | " + " | ".join(f"{per[c]:.3f}" if c in per else "-" for c in s["candidates"]) + " |")
    lines.append("")
    for k, v in s["flips"].items():
        lines.append(f"- {k}: safe/unsafe verdict differs in {v['safe_verdict_differs']}/{v['cells']} cells"
                     f" ({v['unsafe_only_under_learned']} unsafe only under learned)")
        lines += [f"  - {e}" for e in v["examples"]]
    if s.get("learned_vs_real"):
        lr = s["learned_vs_real"]
        lines.append(f"- distance to real batches (median |log MERE ratio|, FP8 cells): learned"
                     f" {lr['median_abs_log_ratio_learned']:.3f}, normal {lr['median_abs_log_ratio_normal']:.3f}")
    if s.get("weights_model_vs_current"):
        w = s["weights_model_vs_current"]
        lines.append(f"- matrix-normal weight draws vs the current weight: median relative MERE difference"
                     f" {w['median_rel_diff']:.3f}, p90 {w['p90_rel_diff']:.3f} over {w['cells']} cells")
        if "noise_median_rel_diff" in w:
            lines.append(f"  (noise floor, the current weight with other draws of X and dY: median"
                         f" {w['noise_median_rel_diff']:.3f}, p90 {w['noise_p90_rel_diff']:.3f})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--data", default="synthetic:num_sparse=26,cardinality=10000,eval_examples=2048")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-rows", type=int, default=1024)
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe_learned_vs_normal"))
    ap.add_argument("--stats", type=Path, default=None, help="re-analyse saved stats instead of training")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    source = parse_data_spec(args.data)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.preset, num_dense=source.num_dense, cardinalities=list(source.cardinalities))
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, device="cpu",
                      window=min(20, args.steps), eval_batches=4)
    if args.stats is not None:
        stats = ProbeStats.load(args.stats, model=model)
        eval_ll = float(stats.meta.get("eval_logloss", math.nan))
    else:
        with Probe(model, every=args.every, seed=args.seed) as probe:
            res = train(model, source, cfg, progress=False)
        stats = probe.stats
        eval_ll = res.eval_logloss
        stats.meta.update(model=args.model, preset=args.preset, data=args.data, steps=args.steps,
                          eval_logloss=eval_ll)
        stats.save(args.out / "probe_stats.npz")
    t_train = time.perf_counter() - t0
    print(f"trained {args.model}/{args.preset} {args.steps} steps (eval logloss {eval_ll:.4f},"
          f" {t_train:.0f} s), {stats.collections} collections", file=sys.stderr)

    cands = args.candidates.split(",")
    t1 = time.perf_counter()
    rep = measure(stats, cands, samples=args.samples, dists=("learned", "normal", "real"),
                  max_rows=args.max_rows, seed=args.seed, num_threads=args.threads)
    cur = measure(stats, cands, samples=args.samples, dists=("learned",), weights="current",
                  max_rows=args.max_rows, seed=args.seed, num_threads=args.threads)
    cur2 = measure(stats, cands, samples=args.samples, dists=("learned",), weights="current",
                   max_rows=args.max_rows, seed=args.seed + 1, num_threads=args.threads)
    t_measure = time.perf_counter() - t1
    rep.save(args.out / "probe_report.json")
    rep.heatmap(args.out / "probe_heatmap.png")
    (args.out / "probe_table.txt").write_text(rep.table() + "\n")
    s = summarize(rep, cur, cur2)
    s["setup"] = {
        "command": " ".join(sys.argv), "model": args.model, "preset": args.preset, "data": args.data,
        "steps": args.steps, "every": args.every, "batch_size": args.batch_size, "samples": args.samples,
        "max_rows": args.max_rows, "eval_logloss": eval_ll, "train_s": round(t_train, 1),
        "measure_s": round(t_measure, 1), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "guard_frac": rep.meta["guard_frac"], "operand_dtype": rep.meta["operand_dtype"],
    }
    (args.out / "summary.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
    print(markdown(s, rep.dists))
    return 0


if __name__ == "__main__":
    sys.exit(main())
