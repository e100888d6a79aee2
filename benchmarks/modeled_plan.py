"""A Dispatch plan built on the CPU from the cost model alone ("modeled"), for a GPU run.

For every linear of a reference model at a training batch size, and each of its three GEMMs,
it picks the fastest e4m3 candidate of the real GPU backends whose *modeled* speed-up over
bf16 exceeds ``--min-speedup``, else bf16 (the Dispatch rule; errors are not consulted here:
every e4m3 candidate measured MERE 0.13-0.14 on the H200 suite, under the 0.25 threshold, see
BENCHMARKS.md). The plan is a PrecisionConfig that the H200 run times against bf16 and
uniform policies (``benchmarks/train_step.py --variant``).

    python benchmarks/modeled_plan.py --model wukong --preset large --batch 8192 \
        --num-sparse 40 --mods nobias,bn256,hswish --out benchmarks/results/wukong_large_modeled_plan.json
    python benchmarks/modeled_plan.py --model interformer --preset large --batch 4096 --seq-len 64 \
        --num-sparse 40 --mods nobias,bn256,hswish --out benchmarks/results/interformer_large_modeled_plan.json

``--seq-len L`` gives a sequence model (``takes_sequence``) a full behaviour sequence of L
events, so its 3-D sites are priced at B x (summary tokens + L) rows: the rows its GEMMs run
over whatever the mask (padded positions are computed too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loka_tune.config import ROLES, GemmChoice, PrecisionConfig, SitePrecision  # noqa: E402
from loka_tune.kernels import costmodel  # noqa: E402
from loka_tune.models import build_model  # noqa: E402
from loka_tune.space.sites import discover_sites  # noqa: E402

BACKENDS = ("torch_scaled_mm", "fbgemm", "triton")
GRANULARITIES = ("tensor", "row", "block")


def candidates(granularities: tuple[str, ...] = GRANULARITIES) -> list[GemmChoice]:
    out = []
    for backend in BACKENDS:
        for gran in granularities:
            for fa in (True, False):
                try:
                    out.append(GemmChoice.fp8(gran, fast_accum=fa, backend=backend))
                except Exception:  # noqa: BLE001 - an impossible combination
                    pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="large")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--num-sparse", type=int, default=40)
    ap.add_argument("--num-dense", type=int, default=13)
    ap.add_argument("--seq-len", type=int, default=0, help="behaviour-sequence length (sequence models)")
    ap.add_argument("--device", default="h200")
    ap.add_argument("--min-speedup", type=float, default=1.05)
    ap.add_argument("--mods", default="none", help="mods recorded in the plan (see train_step.py)")
    ap.add_argument("--granularities", default=",".join(GRANULARITIES), help="scalings the plan may use")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from train_step import parse_mods

    mods = parse_mods(args.mods)
    torch.manual_seed(0)
    model = build_model(args.model, args.preset, num_dense=args.num_dense, cardinalities=[10] * args.num_sparse)
    if mods.any:
        from loka_tune.mods import apply_mods

        apply_mods(model, mods)
    b0 = 4
    dense = torch.randn(b0, args.num_dense)
    sparse = torch.zeros(b0, args.num_sparse, dtype=torch.long)
    inputs: tuple[torch.Tensor, ...] = (dense, sparse)
    if args.seq_len > 0 and getattr(model, "takes_sequence", False):
        inputs += (torch.zeros(b0, args.seq_len, dtype=torch.long), torch.ones(b0, args.seq_len, dtype=torch.bool))
    sites = discover_sites(model, *inputs)
    cands = candidates(tuple(g for g in args.granularities.split(",") if g))
    plan: dict[str, SitePrecision] = {}
    total_bf16 = total_plan = 0.0
    print(f"{'site':40s} {'M':>7s} {'K':>6s} {'N':>6s}  fwd / dgrad / wgrad (modeled speed-up)")
    for site in sites:
        chosen = []
        for role in ROLES:
            m, k, n = site.shape(role, args.batch)
            best, t = costmodel.best_modeled_choice(cands, m, k, n, role, args.device, min_speedup=args.min_speedup)
            t_bf16 = costmodel.estimate_gemm_seconds(GemmChoice.bf16(), m, k, n, role, args.device)
            total_bf16 += t_bf16
            total_plan += t
            chosen.append((best, t_bf16 / t))
        prec = SitePrecision(*(c for c, _ in chosen))
        if not prec.is_bf16:
            plan[site.name] = prec
        print(f"{site.name:40s} {site.rows(args.batch):7d} {site.in_features:6d} {site.out_features:6d}  "
              + " / ".join(f"{c.short_str()} {s:.2f}x" for c, s in chosen))
    cfg = PrecisionConfig.from_sites(plan, mods=mods, provenance={
        "source": "benchmarks/modeled_plan.py", "speed": "modeled", "cost_device": args.device,
        "model": args.model, "preset": args.preset, "batch_size": args.batch, "granularities": args.granularities,
        "seq_len": args.seq_len,
        "modeled_gemm_speedup": total_bf16 / total_plan})
    cfg.save(args.out)
    print(f"\n{len(plan)} of {len(sites)} sites get FP8 GEMMs; modeled GEMM-time speed-up"
          f" {total_bf16 / total_plan:.3f}x on {args.device} at batch {args.batch}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
