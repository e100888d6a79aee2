"""What one probe collection costs, site by site, against a plain training step.

Builds a reference model, times plain training steps (forward + backward + Adam), then steps
where the probe collects (``collect_next()`` before each), with ``Probe(profile=True)`` so
that every site's X, dY and weight collection is timed (device-synchronised). Prints the
median plain step, the median collection step, their difference (the cost of one
collection), the overhead at ``--every`` (cost / (every x plain step)) and the most expensive
sites. Runs on the CPU or a GPU (``--device cuda``).

    python benchmarks/probe_collect_cost.py --model wukong --preset large --batch 1024 \\
        --num-sparse 40 --cardinality 1000 --device cpu --steps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loka_tune.data.base import model_inputs
from loka_tune.data.synthetic import synthetic_for
from loka_tune.models import build_model
from loka_tune.probe import Probe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="large")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--num-sparse", type=int, default=40)
    ap.add_argument("--cardinality", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each kind")
    ap.add_argument("--every", type=int, default=100, help="collection period for the overhead figure")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    src = synthetic_for(args.num_sparse, args.cardinality, eval_examples=256)
    torch.manual_seed(0)
    model = build_model(args.model, args.preset, num_dense=src.num_dense,
                        cardinalities=list(src.cardinalities)).to(dev)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "embeddings" not in n], lr=1e-4)
    batch = next(iter(src.batches("train", args.batch, seed=0, device=dev)))
    ac = torch.autocast("cuda", torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step() -> float:
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with ac:
            logits = model(*model_inputs(model, batch))
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    step()  # warm-up
    plain = [step() for _ in range(args.steps)]
    with Probe(model, every=10**9, profile=True) as p:
        p.collect_next()
        step()  # first collection allocates the accumulators
        p.timings.clear()
        coll = []
        for _ in range(args.steps):
            p.collect_next()
            coll.append(step())
    t_plain, t_coll = statistics.median(plain), statistics.median(coll)
    cost = t_coll - t_plain
    per_site = {k: v / args.steps for k, v in p.timings.items()}
    top = sorted(per_site.items(), key=lambda kv: -kv[1])[: args.top]
    out = {
        "setup": {"command": " ".join(sys.argv), "model": args.model, "preset": args.preset, "batch": args.batch,
                  "device": str(dev) if not cuda else torch.cuda.get_device_name(dev),
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                  "sites": len(p.site_names)},
        "plain_step_s": t_plain, "collection_step_s": t_coll, "collection_cost_s": cost,
        "hooks_total_s": sum(per_site.values()),
        "overhead_at_every": cost / (args.every * t_plain),
        "top_sites_s": dict(top),
    }
    print(f"{args.model}/{args.preset} batch {args.batch} on {out['setup']['device']}: plain step"
          f" {1e3 * t_plain:.1f} ms, collection step {1e3 * t_coll:.1f} ms -> one collection costs"
          f" {1e3 * cost:.1f} ms (hooks {1e3 * out['hooks_total_s']:.1f} ms);"
          f" overhead at every={args.every}: {100 * out['overhead_at_every']:.2f}%")
    for k, v in top:
        print(f"  {k:40s} {1e3 * v:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
