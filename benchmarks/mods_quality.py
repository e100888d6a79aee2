"""Quality of the LoKA Mods: relative log loss of Wukong with and without each Mod (CPU).

For each dataset (synthetic CTR data and the 2k-row Criteo Kaggle sample) and each seed,
trains the Wukong baseline (SwishLayerNorm activations, LayerNorm, biases: the form the
Mods target) and the same model with each Mod alone and with all of them, then reports the
relative eval log loss ``(LL_mod - LL_base) / LL_base`` in percent, paired by seed: the same
seed gives the same initial weights (the Mods are applied after the seeded build, so the
weights they keep are identical), the same data order and the same eval rows. Table: mean
over seeds, sample standard deviation, and min..max. Positive = the Mod is worse.

Two reference rows calibrate the table: ``pad`` is numerically exact (only the GEMM
summation order differs), so its row checks the pairing and should be ~0; ``reinit`` is the
baseline itself with other initial weights (init seed + 1000, same data order and eval
rows): the size of its row is the run-to-run noise, and a Mod's row means something only
where it clearly exceeds it.

Example (the BENCHMARKS.md entry):
    python benchmarks/mods_quality.py --presets tiny --seeds 3 --out mods_quality.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_tune.config import ModsConfig  # noqa: E402
from loka_tune.data import CriteoSource, SyntheticCTR  # noqa: E402
from loka_tune.models import build_model  # noqa: E402
from loka_tune.mods import apply_mods  # noqa: E402
from loka_tune.objectives.metrics import relative_log_loss  # noqa: E402
from loka_tune.objectives.trainer import TrainConfig, train  # noqa: E402

CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo_kaggle_head2k.tsv"
DEFAULT_BLOCK = {"tiny": 16, "paper": 128, "large": 256}  # BlockNorm block per preset


REINIT = "reinit"  # the baseline with other initial weights: the noise reference
REINIT_OFFSET = 1000


def variants(block: int, pad: int) -> dict[str, ModsConfig]:
    return {
        "baseline": ModsConfig(),
        REINIT: ModsConfig(),
        "no_bias": ModsConfig(no_bias=True),
        f"blocknorm{block}": ModsConfig(blocknorm=block),
        "hardswish": ModsConfig(hardswish=True),
        f"pad{pad}": ModsConfig(pad=pad),
        "all": ModsConfig(no_bias=True, blocknorm=block, hardswish=True, pad=pad),
    }


def make_source(name: str, hash_size: int):
    if name == "synthetic":
        return SyntheticCTR(num_dense=13, cardinalities=[1000] * 8, eval_examples=8192)
    if name == "criteo":
        if not CRITEO.is_file():
            raise SystemExit(f"the Criteo sample is not at {CRITEO}")
        return CriteoSource(CRITEO, hash_size=hash_size)
    raise SystemExit(f"unknown dataset {name!r}: choose synthetic or criteo")


def run_one(preset: str, source, mods: ModsConfig, cfg: TrainConfig, init_seed: int) -> dict:
    torch.manual_seed(init_seed)  # the same initial weights for every variant of a seed
    model = build_model(
        "wukong", preset, num_dense=source.num_dense, cardinalities=source.cardinalities,
        activation="swish_layernorm", norm="layernorm",
    )
    report = apply_mods(model, mods)
    t = time.perf_counter()
    res = train(model, source, cfg, progress=False)
    return {
        "status": res.status,
        "eval_logloss": res.eval_logloss,
        "eval_auc": res.eval_auc,
        "train_logloss": res.train_logloss,
        "step_time_s": res.step_time_s,
        "wall_s": time.perf_counter() - t,
        "changed": report.summary(),
    }


def fmt_pct(xs: list[float]) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "n/a"
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else float("nan")
    return f"{mean:+.3f} ± {sd:.3f} [{min(xs):+.3f}, {max(xs):+.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny", help="comma-separated Wukong presets (tiny, paper)")
    ap.add_argument("--datasets", default="synthetic,criteo")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps-synthetic", type=int, default=1000)
    ap.add_argument("--steps-criteo", type=int, default=100, help="100 x 16 = one epoch of the sample")
    ap.add_argument("--batch-synthetic", type=int, default=256)
    ap.add_argument("--batch-criteo", type=int, default=16)
    ap.add_argument("--hash-size", type=int, default=2000, help="Criteo ids per categorical feature")
    ap.add_argument("--block", type=int, default=None, help="BlockNorm block (default: 16 tiny, 128 paper)")
    ap.add_argument("--pad", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run (baseline and reinit always run)")
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    runs: list[dict] = []
    tables: list[str] = []
    for preset in args.presets.split(","):
        block = args.block or DEFAULT_BLOCK.get(preset, 256)
        vs = variants(block, args.pad)
        if args.only:
            keep = {"baseline", REINIT, *args.only.split(",")}
            vs = {k: v for k, v in vs.items() if k in keep}
        for ds in args.datasets.split(","):
            source = make_source(ds, args.hash_size)
            steps = args.steps_synthetic if ds == "synthetic" else args.steps_criteo
            batch = args.batch_synthetic if ds == "synthetic" else args.batch_criteo
            results: dict[str, list[dict]] = {k: [] for k in vs}
            for seed in range(args.seeds):
                cfg = TrainConfig(steps=steps, batch_size=batch, seed=seed, device="cpu", window=25,
                                  eval_batch_size=2048)
                for name, mods in vs.items():
                    init = seed + REINIT_OFFSET if name == REINIT else seed
                    r = run_one(preset, source, mods, cfg, init)
                    r.update(preset=preset, dataset=ds, seed=seed, variant=name, mods=mods.to_dict(),
                             steps=steps, batch_size=batch)
                    runs.append(r)
                    results[name].append(r)
                    print(f"[{preset}/{ds}/seed {seed}] {name:<12} {r['status']:<9} eval LL "
                          f"{r['eval_logloss']:.5f}  AUC {r['eval_auc']:.4f}  {r['wall_s']:.0f}s",
                          file=sys.stderr, flush=True)
            base = results["baseline"]
            lines = [
                f"Wukong {preset} on {ds} ({steps} steps x batch {batch}, {args.seeds} seeds, paired): "
                f"baseline eval log loss {statistics.fmean(r['eval_logloss'] for r in base):.5f}, "
                f"AUC {statistics.fmean(r['eval_auc'] for r in base):.4f}",
                f"| {'variant':<12} | {'rel. log loss %: mean ± sd [min, max]':<40} | {'Δ AUC (mean)':>12} | ok runs |",
                f"|{'-' * 14}|{'-' * 42}|{'-' * 14}|---------|",
            ]
            for name in vs:
                if name == "baseline":
                    continue
                rel, dauc, ok = [], [], 0
                for b, r in zip(base, results[name]):
                    if r["status"] == "ok" and b["status"] == "ok":
                        ok += 1
                        rel.append(100 * relative_log_loss(r["eval_logloss"], b["eval_logloss"]))
                        dauc.append(r["eval_auc"] - b["eval_auc"])
                d = f"{statistics.fmean(dauc):+.4f}" if dauc else "n/a"
                lines.append(f"| {name:<12} | {fmt_pct(rel):<40} | {d:>12} | {f'{ok}/{len(base)}':<7} |")
            tables.append("\n".join(lines))
            print("\n" + tables[-1] + "\n", file=sys.stderr, flush=True)

    print("\n\n".join(tables))
    if args.out:
        meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "threads": args.threads, "argv": sys.argv[1:]}
        Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
