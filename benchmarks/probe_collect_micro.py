"""What one probe collection of one stream (X or dY of one site) costs, per setting (issue 13).

Times ``_StreamAcc.add`` (the work a collection does per tensor: finite check, amax, row
subset, moments, quantiles) on a random ``(rows, dim)`` batch, for the old CPU/GPU setting
(65,536 rows cap, float64 products), each change alone, and the new GPU default (2,048 rows,
float32 products), plus the weight model's update of a ``(dim, dim)`` weight. Medians of
``--reps`` calls, each after a warm-up call, the settings interleaved; device-synchronised on
a GPU.

    python benchmarks/probe_collect_micro.py --dims 2048 4096 --rows 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from loka_tune.probe.collector import _StreamAcc
from loka_tune.probe.moments import DEFAULT_SKETCH_RANK, MAX_FULL_DIM
from loka_tune.probe.weights import MatrixNormalEMA

SETTINGS = {  # name: (max_rows, precision)
    "before (65536 rows, float64)": (1 << 16, "float64"),
    "rows only (2048 rows, float64)": (2048, "float64"),
    "float32 only (65536 rows, float32)": (1 << 16, "float32"),
    "after: GPU default (2048 rows, float32)": (2048, "float32"),
}


def _time(fn: Callable[[], None], reps: int, dev: torch.device) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    res: dict[str, dict[str, float]] = {}
    for d in args.dims:
        x = torch.randn(args.rows, d, device=dev) * 3.0 + 100.0  # an offset: float32 must not cancel it
        fns: dict[str, Callable[[], None]] = {}
        for name, (max_rows, prec) in SETTINGS.items():
            acc = _StreamAcc(d, MAX_FULL_DIM, DEFAULT_SKETCH_RANK, max_rows, prec)
            acc.allocate(dev, gen)
            fns[name] = (lambda a: lambda: a.add(x, gen, None))(acc)
        w = MatrixNormalEMA(d, d, device=dev, generator=gen)
        w0 = torch.randn(d, d, device=dev)
        w.update(w0)
        fns["weight model update (float32 GEMMs, unchanged)"] = lambda: w.update(w0 + 1e-3 * torch.randn_like(w0))
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.reps):  # settings interleaved: a shared machine's drift hits all alike
            for k, fn in fns.items():
                times[k].append(_time(fn, 1, dev))
        row = {k: statistics.median(v) for k, v in times.items()}
        res[f"{args.rows}x{d}"] = row
        print(f"stream of {args.rows} rows x {d} features ({'full cov' if d <= MAX_FULL_DIM else 'sketch'}):")
        for k, v in row.items():
            print(f"  {k:48s} {1e3 * v:9.1f} ms")
    out = {"setup": {"command": " ".join(sys.argv), "device": str(dev) if dev.type != "cuda"
                     else torch.cuda.get_device_name(dev), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "python": platform.python_version(),
                     "date": time.strftime("%Y-%m-%d"), "reps": args.reps},
           "seconds_per_call": res}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
