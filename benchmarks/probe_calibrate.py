"""Calibration of the probe's error metric: MERE and SQNR of each candidate on random operands.

Standard-normal X, dY, W at a few (M, K, N) shapes, every GEMM role, bf16 operands into the
candidate (``emulated`` FP8 on the CPU), float64 reference, the probe's guard: what a
well-scaled GEMM of each format measures, which is where ``DEFAULT_MAX_ERROR`` comes from.

    python benchmarks/probe_calibrate.py --draws 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from loka_tune.config import GemmChoice, role_operands
from loka_tune.kernels.quant import mere, sqnr_db
from loka_tune.probe import DEFAULT_MAX_ERROR
from loka_tune.probe.measure import DEFAULT_CANDIDATES, GUARD_FRAC, _backend_gemm

SHAPES = ((256, 16, 8), (1024, 512, 512), (4096, 64, 256))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--guard", type=float, default=GUARD_FRAC)
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"# probe calibration: standard-normal operands, {args.draws} draws, guard {args.guard:g} rms(ref),"
          f" torch {torch.__version__}, python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"# DEFAULT_MAX_ERROR = {DEFAULT_MAX_ERROR}\n")
    print("| (M, K, N) | candidate | fwd MERE | dgrad MERE | wgrad MERE | SQNR dB (mean of roles) |")
    print("|---|---|---:|---:|---:|---:|")
    for m, k, n in SHAPES:
        for c in args.candidates.split(","):
            ch = GemmChoice.parse(c)
            cells, sq = [], []
            for role in ("fwd", "dgrad", "wgrad"):
                if role == "fwd" and ch.a_format.value == "e5m2":
                    cells.append("-")
                    continue
                ms = []
                for _ in range(args.draws):
                    x = torch.randn(m, k, generator=g, dtype=torch.float64)
                    w = torch.randn(n, k, generator=g, dtype=torch.float64)
                    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
                    a, b = role_operands(role, x, dy, w)
                    ref = a @ b.T
                    out = _backend_gemm(ch, a.bfloat16(), b.bfloat16(), role)
                    ms.append(mere(ref, out, args.guard))
                    sq.append(sqnr_db(ref, out))
                cells.append(f"{statistics.mean(ms):.3f} +- {statistics.pstdev(ms):.3f}")
            print(f"| {m}x{k}x{n} | {c} | " + " | ".join(cells) + f" | {statistics.mean(sq):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
