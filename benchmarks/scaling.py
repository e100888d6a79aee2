"""Scaling of data-parallel training: two ``benchmarks/e2e.py`` results (the same study, variants,
global batch and steps; one at ``--nproc 1``, one at ``--nproc N``) merged into one receipt
with, per variant, the step time at 1 and N GPUs, the scaling efficiency and the FP8 speed-ups
at N GPUs.

At a fixed global batch, N GPUs each do 1/N of the work, so the ideal step time is ``t1 / N``;
the scaling efficiency is ``t1 / (N * tN)`` (1.0 = perfect, communication and fixed per-step
costs lower it).

    python benchmarks/e2e.py --study studies/wukong_h200.toml --compile --variants bf16_mods,config \\
        --config best.json --nproc 1 --out /tmp/e2e_1
    python benchmarks/e2e.py ... --nproc 2 --out /tmp/e2e_2
    python benchmarks/scaling.py /tmp/e2e_1/results.json /tmp/e2e_2/results.json \\
        --out benchmarks/results/e2e_h200x2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_SAME = ("study", "model", "preset", "batch", "steps", "compile", "cuda_graphs", "config")


def merge(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """The scaling receipt of an e2e result at one process (``one``) and at N (``many``)."""
    m1, mn = one["meta"], many["meta"]
    n1, n = int(m1.get("nproc", 1)), int(mn.get("nproc", 1))
    if n1 != 1 or n < 2:
        raise SystemExit(f"expected results at --nproc 1 and at --nproc >= 2; got {n1} and {n}")
    differ = {k: (m1.get(k), mn.get(k)) for k in _SAME if m1.get(k) != mn.get(k)}
    if differ:
        raise SystemExit(f"the two runs differ in {differ}: run both with the same study, batch, steps, config")
    rows1 = {r["variant"]: r for r in one["rows"]}
    rows: list[dict[str, Any]] = []
    for r in many["rows"]:
        v = r["variant"]
        t1 = (rows1.get(v) or {}).get("step_ms")
        tn = r.get("step_ms")
        rows.append({
            "variant": v,
            "step_ms_1gpu": t1,
            f"step_ms_{n}gpu": tn,
            "scaling_efficiency": None if not t1 or not tn else t1 / (n * tn),
            f"speedup_vs_bf16_mods_{n}gpu": r.get("speedup_vs_bf16_mods"),
            "speedup_vs_bf16_mods_1gpu": (rows1.get(v) or {}).get("speedup_vs_bf16_mods"),
            f"rel_ll_pct_vs_bf16_mods_{n}gpu": r.get("rel_ll_pct_vs_bf16_mods"),
        })
    return {"meta": {"one": m1, "many": mn, "nproc": n}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("one", type=Path, help="e2e results.json at --nproc 1")
    ap.add_argument("many", type=Path, help="e2e results.json at --nproc N")
    ap.add_argument("--out", type=Path, required=True, help="the receipt (JSON)")
    args = ap.parse_args(argv)
    out = merge(json.loads(args.one.read_text()), json.loads(args.many.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    n = out["meta"]["nproc"]
    for r in out["rows"]:
        print(f"{r['variant']:>12}: {r['step_ms_1gpu']} ms -> {r[f'step_ms_{n}gpu']} ms on {n} GPUs,"
              f" efficiency {r['scaling_efficiency']}, vs bf16+Mods {r[f'speedup_vs_bf16_mods_{n}gpu']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
