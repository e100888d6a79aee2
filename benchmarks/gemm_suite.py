"""GEMM suite: bf16 vs every FP8 backend vs LoKA Dispatch on recommendation-model shapes.

On the GPU (device tool):
    python benchmarks/gemm_suite.py run --out DIR [--quick]
On any machine, from a results file (re-analysis, e.g. after refitting the cost model):
    python benchmarks/gemm_suite.py analyze DIR/gemm_suite.json [--calibration FILE] [--md OUT.md]

Shapes (``SHAPES``) are linear layers of our DLRM / DCNv2 / Wukong ``paper`` and ``large``
presets (site shapes ``M x K -> N``, M = batch x rows per sample), each run as its three
GEMMs (fwd, dgrad, wgrad: canonical ``(m, k, n)`` from :meth:`GemmRole.shape`).

Phase A times bf16 and every candidate (quantization included, CUDA-graph replay, rotating
fresh inputs, see :mod:`loka_tune.kernels.timing`) and measures its error against a float64
GEMM on the same inputs (MERE with the probe's guard, and relative Frobenius error).
Dispatch picks, per GEMM, the fastest candidate with MERE <= ``MAX_ERROR`` and speed-up
> 1.05 (phase A), else bf16. Uniform policies apply one choice to every GEMM (bf16 where the
backend cannot run it). Phase B re-times, on new inputs (seed 1), bf16, the dispatch choice
and every backend's best uniform choice, so that the reported speed-ups do not inherit the
selection bias of picking minima out of phase A. The cost model's predictions are compared
with phase A (median absolute percentage error) and its CPU plan with the measured plan.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MAX_ERROR = 0.25  # the probe's default MERE threshold (loka_tune.probe.measure.DEFAULT_MAX_ERROR)
MIN_SPEEDUP = 1.05

# (label, M, K, N): model.preset.site @ batch
SHAPES: list[tuple[str, int, int, int]] = [
    ("dlrm.paper.top_mlp.0@8192", 8192, 367, 512),
    ("dlrm.paper.bottom_mlp.1@65536", 65536, 512, 256),
    ("dlrm.paper.bottom_mlp.2@65536", 65536, 256, 64),
    ("dlrm.large.bottom_mlp.1@16384", 16384, 2048, 1024),
    ("dlrm.large.top_mlp.0@16384", 16384, 1076, 4096),
    ("dlrm.large.top_mlp.1@16384", 16384, 4096, 4096),
    ("dlrm.large.top_mlp.2@16384", 16384, 4096, 2048),
    ("dcnv2.paper.cross.down@8192", 8192, 3456, 512),
    ("dcnv2.paper.cross.up@8192", 8192, 512, 3456),
    ("dcnv2.paper.deep_mlp.0@8192", 8192, 3456, 1024),
    ("dcnv2.paper.deep_mlp.1@8192", 8192, 1024, 1024),
    ("dcnv2.paper.dense_mlp.1@8192", 8192, 512, 256),
    ("dcnv2.large.dense_mlp.1@8192", 8192, 2048, 1024),
    ("dcnv2.large.deep_mlp.2@8192", 8192, 4096, 2048),
    ("wukong.paper.fmb.mlp.0@8192", 8192, 648, 512),
    ("wukong.paper.fmb.mlp.1@8192", 8192, 512, 512),
    ("wukong.paper.fmb.out@8192", 8192, 512, 2048),
    ("wukong.paper.layers.1.fmb.mlp.0@8192", 8192, 768, 512),
    ("wukong.paper.head_mlp.0@8192", 8192, 4096, 512),
    ("wukong.paper.fmb.out@1024", 1024, 512, 2048),
    ("wukong.paper.fmb.mlp.1@1024", 1024, 512, 512),
    ("wukong.paper.dense_proj@1024", 1024, 512, 128),
    ("wukong.large.fmb.mlp.0@16384", 16384, 1408, 2048),
    ("wukong.large.fmb.mlp.1@16384", 16384, 2048, 2048),
    ("wukong.large.fmb.out@16384", 16384, 2048, 8192),
    ("wukong.large.head_mlp.1@16384", 16384, 4096, 2048),
    ("wukong.large.fmb.mlp.1@65536", 65536, 2048, 2048),
    ("wukong.large.fmb.out@4096", 4096, 2048, 8192),
]
QUICK = [SHAPES[i] for i in (0, 5, 15, 26)]

ROLES = ("fwd", "dgrad", "wgrad")
BACKENDS = ("torch_scaled_mm", "fbgemm", "triton", "torchao")


def candidates(role: str) -> list[str]:
    """FP8 candidates timed for ``role`` (e5m2 gradients only where they are the A operand)."""
    c = ["e4m3.tensor.torch_scaled_mm", "e4m3.row.torch_scaled_mm", "e4m3.row.fa.torch_scaled_mm",
         "e4m3.tensor.fa.torch_scaled_mm",
         "e4m3.row.fbgemm", "e4m3.row.fa.fbgemm", "e4m3.tensor.fbgemm", "e4m3.block.fbgemm",
         "e4m3.tensor.triton", "e4m3.row.triton", "e4m3.row.fa.triton", "e4m3.block.triton",
         "e4m3.tensor.torchao", "e4m3.row.pow2.torchao"]
    if role != "fwd":
        c += ["e5m2+e4m3.tensor.torch_scaled_mm", "e5m2+e4m3.row.triton"]
    return c


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ------------------------------------------------------------------------------ GPU run
def run(out_dir: Path, quick: bool, log, cache_path: Path | None = None) -> dict[str, Any]:
    import torch

    from loka_tune.config import GemmChoice, GemmRole
    from loka_tune.kernels.quant import mere
    from loka_tune.kernels.registry import get_backend
    from loka_tune.kernels.timing import TimingCache, environment, make_operands, time_gemm_result

    env = environment()
    cache = TimingCache(cache_path or (out_dir / "timing_cache.json"))
    shapes = QUICK if quick else SHAPES
    records: list[dict[str, Any]] = []
    backends = {}
    for name in ("bf16",) + BACKENDS:
        try:
            backends[name] = get_backend(name)
        except Exception as e:  # noqa: BLE001
            log(f"backend {name} unavailable: {e}")
    t0 = time.time()
    for si, (label, M, K, N) in enumerate(shapes):
        for role in ROLES:
            m, k, n = GemmRole(role).shape(M, K, N)
            g = torch.Generator(device="cuda")
            g.manual_seed(123)
            a, b = make_operands(m, k, n, role, generator=g)
            exact = a.double() @ b.double().t()
            for cid in ["bf16"] + candidates(role):
                c = GemmChoice.parse(cid)
                rec: dict[str, Any] = dict(shape=label, M=M, K=K, N=N, role=role, m=m, k=k, n=n, choice=cid,
                                           backend=c.backend)
                be = backends.get(c.backend)
                reason = "backend unavailable" if be is None else be.supports(c, role, device="cuda", shape=(m, k, n))
                if reason is not None:
                    rec["unsupported"] = reason
                    records.append(rec)
                    continue
                try:
                    out = be.gemm(a, b, c, GemmRole(role))
                    rec["mere"] = mere(exact, out)
                    rec["rel_err"] = float((out.double() - exact).norm() / exact.norm())
                    del out
                    res = time_gemm_result(c, m, k, n, role, cache=cache, seed=0)
                    rec.update(seconds=res.seconds, spread=res.spread, method=res.method)
                except Exception as e:  # noqa: BLE001 - record and go on: one broken kernel must not stop the suite
                    rec["failed"] = f"{type(e).__name__}: {e}"[:300]
                records.append(rec)
            del a, b, exact
            torch.cuda.empty_cache()
        log(f"[{si + 1}/{len(shapes)}] {label} done at {time.time() - t0:.0f}s")
        partial = {"env": env, "date": time.strftime("%Y-%m-%d %H:%M"), "max_error": MAX_ERROR,
                   "min_speedup": MIN_SPEEDUP, "phase_a": records, "partial": True}
        (out_dir / "gemm_suite.json").write_text(json.dumps(partial, indent=0, default=str))
    result: dict[str, Any] = {"env": env, "date": time.strftime("%Y-%m-%d %H:%M"), "max_error": MAX_ERROR,
                              "min_speedup": MIN_SPEEDUP, "phase_a": records}
    # phase B: fresh inputs for bf16, dispatch and the best uniform choices
    ana = analyze_phase_a(records)
    retime: dict[tuple[str, str], set[str]] = {}
    for key, d in ana["dispatch"].items():
        retime.setdefault(key, set()).update({"bf16", d})
    for be, pol in ana["best_uniform"].items():
        for key, cid in pol["per_gemm"].items():
            retime.setdefault(key, set()).add(cid)
    phase_b = []
    by_key = {(r["shape"], r["role"]): r for r in records}
    for (label, role), cids in retime.items():
        r0 = by_key[(label, role)]
        for cid in sorted(cids):
            try:
                res = time_gemm_result(cid, r0["m"], r0["k"], r0["n"], role, seed=1)
                phase_b.append(dict(shape=label, role=role, choice=cid, seconds=res.seconds, spread=res.spread))
            except Exception as e:  # noqa: BLE001
                phase_b.append(dict(shape=label, role=role, choice=cid, failed=str(e)[:300]))
    log(f"phase B done at {time.time() - t0:.0f}s")
    result["phase_b"] = phase_b
    return result


# ------------------------------------------------------------------------------ analysis (CPU)
def _ok(r: dict[str, Any]) -> bool:
    return "seconds" in r


def analyze_phase_a(records: list[dict[str, Any]], max_error: float = MAX_ERROR,
                    min_speedup: float = MIN_SPEEDUP) -> dict[str, Any]:
    """Dispatch choices and uniform policies from phase-A records."""
    gemms: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in records:
        gemms.setdefault((r["shape"], r["role"]), {})[r["choice"]] = r
    dispatch: dict[tuple[str, str], str] = {}
    for key, by in gemms.items():
        t0 = by["bf16"]["seconds"]
        best, best_t = "bf16", t0
        for cid, r in by.items():
            if cid == "bf16" or not _ok(r) or r.get("mere", math.inf) > max_error:
                continue
            if t0 / r["seconds"] > min_speedup and r["seconds"] < best_t:
                best, best_t = cid, r["seconds"]
        dispatch[key] = best
    # uniform policies: one choice everywhere (bf16 where unsupported / failed / too inaccurate)
    # e4m3 choices only: they exist for all three roles (e5m2 gradients are per-role options)
    all_choices = sorted({r["choice"] for r in records if r["choice"] != "bf16" and r["choice"].startswith("e4m3.")})
    policies = {}
    for cid in all_choices:
        per_gemm, ratios = {}, []
        for key, by in gemms.items():
            r = by.get(cid)
            use = cid if (r is not None and _ok(r) and r.get("mere", math.inf) <= max_error) else "bf16"
            per_gemm[key] = use
            ratios.append(by["bf16"]["seconds"] / by[use]["seconds"])
        policies[cid] = {"per_gemm": per_gemm, "geomean_speedup_a": _geomean(ratios)}
    best_uniform = {}
    for be in BACKENDS:
        own = {c: p for c, p in policies.items() if c.endswith("." + be)}
        if own:
            cid = max(own, key=lambda c: own[c]["geomean_speedup_a"])
            best_uniform[be] = {"choice": cid, **own[cid]}
    return {"gemms": gemms, "dispatch": dispatch, "policies": policies, "best_uniform": best_uniform}


def cost_model_eval(records: list[dict[str, Any]], shapes_subset: set[str] | None = None) -> dict[str, Any]:
    """Modeled vs measured seconds (phase A): MdAPE overall and per backend."""
    from loka_tune.errors import UnsupportedChoiceError
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    errs, by_be = [], {}
    for r in records:
        if not _ok(r) or (shapes_subset is not None and r["shape"] not in shapes_subset):
            continue
        try:
            p = estimate_gemm_seconds(r["choice"], r["m"], r["k"], r["n"], r["role"], "h200")
        except UnsupportedChoiceError:
            continue
        e = abs(p - r["seconds"]) / r["seconds"]
        errs.append(e)
        by_be.setdefault(r["backend"], []).append(e)
    return {"mdape": statistics.median(errs) if errs else float("nan"), "n": len(errs),
            "by_backend": {b: statistics.median(v) for b, v in sorted(by_be.items())}}


def modeled_plan(records: list[dict[str, Any]], max_error: float = MAX_ERROR,
                 min_speedup: float = MIN_SPEEDUP) -> dict[tuple[str, str], str]:
    """The plan the cost model builds on CPU: same candidates (those that ran), same error
    filter (errors are inputs to Dispatch, from the probe), modeled times."""
    from loka_tune.errors import UnsupportedChoiceError
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    plan = {}
    gemms: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        gemms.setdefault((r["shape"], r["role"]), []).append(r)
    for key, rs in gemms.items():
        r0 = rs[0]
        t0 = estimate_gemm_seconds("bf16", r0["m"], r0["k"], r0["n"], r0["role"], "h200")
        best, best_t = "bf16", t0
        for r in rs:
            if r["choice"] == "bf16" or not _ok(r) or r.get("mere", math.inf) > max_error:
                continue
            try:
                t = estimate_gemm_seconds(r["choice"], r["m"], r["k"], r["n"], r["role"], "h200")
            except UnsupportedChoiceError:
                continue
            if t0 / t > min_speedup and t < best_t:
                best, best_t = r["choice"], t
        plan[key] = best
    return plan


def analyze(result: dict[str, Any], *, test_shapes: set[str] | None = None) -> tuple[dict[str, Any], str]:
    """All suite metrics and the markdown tables."""
    recs = result["phase_a"]
    ana = analyze_phase_a(recs, result.get("max_error", MAX_ERROR), result.get("min_speedup", MIN_SPEEDUP))
    gemms, dispatch = ana["gemms"], ana["dispatch"]
    tb = {(r["shape"], r["role"], r["choice"]): r["seconds"] for r in result.get("phase_b", []) if "seconds" in r}
    have_b = bool(tb)

    def t(key: tuple[str, str], cid: str) -> float:
        if have_b and (key[0], key[1], cid) in tb:
            return tb[(key[0], key[1], cid)]
        return gemms[key][cid]["seconds"]

    keys = list(gemms)
    disp_vs_bf16 = [t(k, "bf16") / t(k, dispatch[k]) for k in keys]
    fp8_keys = [k for k in keys if dispatch[k] != "bf16"]
    uni = {}
    for be, pol in ana["best_uniform"].items():
        uni[be] = {"choice": pol["choice"],
                   "geomean_vs_bf16": _geomean([t(k, "bf16") / t(k, pol["per_gemm"][k]) for k in keys]),
                   "dispatch_vs_this": _geomean([t(k, pol["per_gemm"][k]) / t(k, dispatch[k]) for k in keys])}
    best_be = max(uni, key=lambda b: uni[b]["geomean_vs_bf16"]) if uni else None
    worst_vs_bf16 = max(t(k, dispatch[k]) / t(k, "bf16") for k in keys)
    spreads = [r.get("spread") or 0 for r in recs if _ok(r)]
    cm_all = cost_model_eval(recs)
    cm_test = cost_model_eval(recs, test_shapes) if test_shapes else None
    mplan = modeled_plan(recs)
    agree = [mplan[k] == dispatch[k] for k in keys]
    # "as good as": the modeled plan's choice measures within 5% of the measured plan's choice
    near = [gemms[k][mplan[k]]["seconds"] <= 1.05 * gemms[k][dispatch[k]]["seconds"] for k in keys]
    same_kind = [(mplan[k] == "bf16") == (dispatch[k] == "bf16") for k in keys]
    metrics = {
        "gemms": len(keys), "shapes": len({k[0] for k in keys}), "fp8_gemms_in_dispatch": len(fp8_keys),
        "timed_from": "phase B (fresh inputs)" if have_b else "phase A",
        "dispatch_geomean_vs_bf16_all": _geomean(disp_vs_bf16),
        "dispatch_geomean_vs_bf16_fp8_gemms": _geomean([t(k, "bf16") / t(k, dispatch[k]) for k in fp8_keys]),
        "best_uniform_backend": best_be,
        "dispatch_geomean_vs_best_uniform": uni[best_be]["dispatch_vs_this"] if best_be else float("nan"),
        "uniform": uni,
        "dispatch_worst_time_over_bf16": worst_vs_bf16,
        "median_timing_spread": statistics.median(spreads) if spreads else float("nan"),
        "costmodel_mdape_all": cm_all["mdape"], "costmodel_by_backend": cm_all["by_backend"],
        "costmodel_mdape_heldout": cm_test["mdape"] if cm_test else None,
        "plan_agreement_exact": sum(agree) / len(agree),
        "plan_agreement_within_5pct": sum(near) / len(near),
        "plan_agreement_fp8_vs_bf16": sum(same_kind) / len(same_kind),
    }
    # ---- markdown
    L = []
    L.append(f"Device: {result['env'].get('device')}; torch {result['env'].get('torch')}, triton "
             f"{result['env'].get('triton')}, fbgemm-gpu-genai {result['env'].get('fbgemm')}, torchao "
             f"{result['env'].get('torchao')}, CUDA {result['env'].get('cuda')}; {result.get('date')}.")
    L.append("")
    L.append(f"Per GEMM (times in us, quantization included; bf16 and dispatch columns: {metrics['timed_from']};"
             f" 'best <backend>' columns: phase A, the fastest FP8 candidate of that backend with MERE <= {MAX_ERROR};"
             " '-': the backend cannot run this shape):")
    L.append("")
    L.append("| shape (M x K -> N) | GEMM | bf16 | " + " | ".join(f"best {b}" for b in BACKENDS)
             + " | dispatch choice | dispatch speed-up |")
    L.append("|---|---|---|" + "---|" * len(BACKENDS) + "---|---|")
    for k in keys:
        by = gemms[k]
        cells = []
        for be in BACKENDS:
            own = [(r["seconds"], c) for c, r in by.items() if r["backend"] == be and _ok(r)
                   and r.get("mere", math.inf) <= MAX_ERROR]
            cells.append(f"{min(own)[0] * 1e6:.1f}" if own else "-")
        r0 = next(iter(by.values()))
        L.append(f"| {k[0]} ({r0['M']}x{r0['K']}->{r0['N']}) | {k[1]} | {t(k, 'bf16') * 1e6:.1f} | "
                 + " | ".join(cells) + f" | {dispatch[k]} | {t(k, 'bf16') / t(k, dispatch[k]):.2f}x |")
    L.append("")
    L.append("Uniform policies (one choice for every GEMM; bf16 where it cannot run), geometric-mean speed-up"
             " over bf16, and Dispatch's geometric-mean speed-up over each:")
    L.append("")
    L.append("| backend | best uniform choice | uniform vs bf16 | dispatch vs this policy |")
    L.append("|---|---|---|---|")
    for be, u in uni.items():
        L.append(f"| {be} | {u['choice']} | {u['geomean_vs_bf16']:.3f}x | {u['dispatch_vs_this']:.3f}x |")
    L.append("")
    L.append("| metric | value |")
    L.append("|---|---|")
    for name in ("gemms", "shapes", "fp8_gemms_in_dispatch", "dispatch_geomean_vs_bf16_all",
                 "dispatch_geomean_vs_bf16_fp8_gemms", "best_uniform_backend", "dispatch_geomean_vs_best_uniform",
                 "dispatch_worst_time_over_bf16", "median_timing_spread", "costmodel_mdape_all",
                 "costmodel_mdape_heldout", "plan_agreement_exact", "plan_agreement_within_5pct",
                 "plan_agreement_fp8_vs_bf16"):
        v = metrics[name]
        L.append(f"| {name} | {v:.3f} |" if isinstance(v, float) else f"| {name} | {v} |")
    L.append("")
    L.append("Cost model MdAPE by backend: " + ", ".join(f"{b} {v:.1%}" for b, v in cm_all["by_backend"].items()))
    return metrics, "\n".join(L)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="benchmarks/results")
    r.add_argument("--quick", action="store_true")
    r.add_argument("--cache", default=None, help="timing cache file (default OUT/timing_cache.json)")
    a = sub.add_parser("analyze")
    a.add_argument("results")
    a.add_argument("--calibration", default=None)
    a.add_argument("--heldout", default=None, help="JSON list of shape labels held out of the fit")
    a.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        def log(msg: str) -> None:
            print(msg, flush=True)

        result = run(out, args.quick, log, Path(args.cache) if args.cache else None)
        (out / "gemm_suite.json").write_text(json.dumps(result, indent=0, default=str))
        metrics, md = analyze(result)
        (out / "gemm_suite.md").write_text(md + "\n")
        print(md)
        return
    from loka_tune.kernels import costmodel

    if args.calibration:
        costmodel.set_calibration(args.calibration)
    result = json.loads(Path(args.results).read_text())
    held = set(json.loads(Path(args.heldout).read_text())) if args.heldout else None
    metrics, md = analyze(result, test_shapes=held)
    if args.md:
        Path(args.md).write_text(md + "\n")
    print(md)
    json.dump(metrics, sys.stdout, indent=1, default=str)


if __name__ == "__main__":
    main()
