"""Fit the cost model's calibration constants to a GEMM-suite run (CPU).

    python benchmarks/fit_costmodel.py RESULTS.json [--out loka_tune/kernels/data/costmodel_h200.json]

Fits, by least squares on log(modeled / measured) over phase-A timings of the *even*
shapes of the suite (the odd ones are held out and reported separately): the fixed
per-kernel cost, the memory-bandwidth fraction, the fast-accumulation gain, each GEMM
family's achieved fraction of peak and fixed per-tile cost, and each quantization family's
achieved fraction of bandwidth. Design facts (passes, launches, tiles) are not fitted.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_suite  # noqa: E402

from loka_tune.errors import UnsupportedChoiceError  # noqa: E402
from loka_tune.kernels import costmodel  # noqa: E402


def _params(cal: dict) -> list[tuple[tuple[str, ...], float, float]]:
    """(path in the calibration dict, lower, upper) of every fitted constant."""
    ps = [(("launch_s",), 5e-7, 3e-5), (("mem_frac",), 0.3, 1.0)]
    for fam in cal["gemm"]:
        ps.append((("gemm", fam, "rate_frac"), 0.05, 1.0))
        ps.append((("gemm", fam, "tile_fixed_s"), 0.0, 2e-5))
        ps.append((("gemm", fam, "fa_rate_frac"), 0.05, 1.0))
    for fam in cal["quant"]:
        ps.append((("quant", fam, "bw_frac"), 0.03, 1.0))
    return ps


def _get(d: dict, path: tuple[str, ...]) -> float:
    for p in path[:-1]:
        d = d[p]
    return float(d[path[-1]])


def _set(d: dict, path: tuple[str, ...], v: float) -> None:
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = float(v)


def _used(records: list[dict], cal: dict) -> set[tuple[str, ...]]:
    """Parameters that some record depends on (others stay at their prior)."""
    costmodel.set_calibration(cal)
    used = {("launch_s",), ("mem_frac",)}
    for r in records:
        try:
            steps = costmodel.gemm_breakdown(r["choice"], r["m"], r["k"], r["n"], r["role"], "h200")
        except UnsupportedChoiceError:
            continue
        for s in steps:
            if ".fa." in r["choice"] and s.name.startswith("gemm"):
                used.add(("gemm", s.name.split()[-1], "fa_rate_frac"))
            kind, fam = s.name.split()[0], s.name.split()[-1]
            if kind == "gemm":
                used |= {("gemm", fam, "rate_frac"), ("gemm", fam, "tile_fixed_s")}
            elif kind == "quant":
                used.add(("quant", fam, "bw_frac"))
            elif kind == "transpose":
                used.add(("quant", "transpose_copy", "bw_frac"))
    return used


def fit(records: list[dict], base: dict) -> tuple[dict, dict]:
    recs = [r for r in records if "seconds" in r]
    cal = copy.deepcopy(base)
    params = [p for p in _params(cal) if p[0] in _used(recs, cal)]
    for fam in cal["gemm"]:
        g = cal["gemm"][fam]
        g.setdefault("fa_rate_frac", min(1.0, g["rate_frac"] * float(cal.get("fast_accum_gain", 1.1))))
    x0 = np.array([min(max(_get(cal, p), lo * 1.0001 + 1e-12), hi * 0.9999) for p, lo, hi in params])
    lo = np.array([p[1] for p in params])
    hi = np.array([p[2] for p in params])
    meas = np.array([r["seconds"] for r in recs])

    def residual(x: np.ndarray) -> np.ndarray:
        c = copy.deepcopy(cal)
        for (path, _, _), v in zip(params, x):
            _set(c, path, v)
        costmodel.set_calibration(c)
        pred = []
        for r in recs:
            try:
                pred.append(costmodel.estimate_gemm_seconds(r["choice"], r["m"], r["k"], r["n"], r["role"], "h200"))
            except UnsupportedChoiceError:
                pred.append(r["seconds"])
        return np.log(np.array(pred) / meas)

    sol = least_squares(residual, x0, bounds=(lo, hi), x_scale=np.maximum(np.abs(x0), 1e-7), max_nfev=400,
                        loss="soft_l1", f_scale=0.1)
    for (path, _, _), v in zip(params, sol.x):
        _set(cal, path, v)
    costmodel.set_calibration(None)
    res = np.abs(np.exp(residual(sol.x)) - 1) if False else None  # noqa: F841
    return cal, {"params": len(params), "records": len(recs), "cost": float(sol.cost), "status": int(sol.status)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results")
    ap.add_argument("--out", default="loka_tune/kernels/data/costmodel_h200.json")
    ap.add_argument("--heldout-out", default="benchmarks/results/costmodel_heldout_shapes.json")
    args = ap.parse_args()
    result = json.loads(Path(args.results).read_text())
    order = [s[0] for s in gemm_suite.SHAPES]
    labels = sorted({r["shape"] for r in result["phase_a"]}, key=lambda s: order.index(s) if s in order else 999)
    train = set(labels[0::2])
    held = set(labels[1::2])
    base = costmodel.load_calibration()
    cal, info = fit([r for r in result["phase_a"] if r["shape"] in train], base)
    costmodel.set_calibration(cal)
    tr = gemm_suite.cost_model_eval(result["phase_a"], train)
    te = gemm_suite.cost_model_eval(result["phase_a"], held)
    al = gemm_suite.cost_model_eval(result["phase_a"])
    cal["fitted_on"] = (f"{result['env'].get('device')} ({result['env'].get('torch')}, triton {result['env'].get('triton')}),"
                        f" benchmarks/gemm_suite.py run of {result.get('date')}; fitted on {len(train)} shapes"
                        f" ({info['records']} timings), {len(held)} shapes held out")
    cal["fit"] = {"date": time.strftime("%Y-%m-%d"), **info, "mdape_train": tr["mdape"], "mdape_heldout": te["mdape"],
                  "mdape_all": al["mdape"], "heldout_shapes": sorted(held)}
    Path(args.out).write_text(json.dumps(cal, indent=1) + "\n")
    Path(args.heldout_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.heldout_out).write_text(json.dumps(sorted(held), indent=1) + "\n")
    print(json.dumps(cal["fit"], indent=1))
    print("by backend (all):", {b: round(v, 3) for b, v in al["by_backend"].items()})


if __name__ == "__main__":
    main()
