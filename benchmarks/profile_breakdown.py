"""Where a compiled training step's time goes, per variant of ``benchmarks/e2e.py`` receipts: the
GPU time of its matrix products (GEMM kernels, by name) and of everything else, each against a
reference variant (bf16 + the same Mods), read from the ``profile`` the receipts already hold
(``torch.profiler`` over the last timed steps of every run; seeds averaged).

It answers "what is left to gain, and where" before a device call is spent on it (issue 21):

- ``d_gemm_ms``: GEMM time the variant saves (negative) or adds against the reference;
- ``d_other_ms``: what its quantization and layout kernels add around the GEMMs (the casts,
  amax reductions and transposes, wherever inductor fused them);
- ``zero_overhead_step_ms``: the step if ``d_other_ms`` were nothing (a perfect cast: the most a
  cheaper quantization, static scales included, could give), and ``zero_overhead_vs_best`` its
  speed-up over the fastest variant of the receipt;
- ``ceiling``: the reference's step less the largest GEMM saving of any variant, with nothing
  added around it: what these kernels on these sites could give at most.

    python benchmarks/profile_breakdown.py benchmarks/results/study_h200_e2e.json \\
        benchmarks/results/e2e_h200_b32768.json --out benchmarks/results/profile_breakdown_h200.json

CPU only: it reads receipts, it measures nothing. ``--md`` writes the table beside the JSON.

The split is the one the device made (``profile.gemm_ms``). Profiles taken before 2026-12-06
counted inductor's own pointwise and reduction kernels whose names hold ``_scaled_mm`` (inductor
names a fused kernel after the ops it came from: ``triton_poi_fused__scaled_mm__to_copy_clamp_...``
is the cast that feeds an FP8 GEMM) as GEMM time, so in those receipts ``d_other_ms`` leaves out
part of the quantization and ``d_gemm_ms`` holds it: the zero-overhead step and the ceiling read
from them are not bounds. Profiles since then also hold ``kinds`` (GPU ms per kind of kernel:
``gemm_fp8``, ``gemm``, ``embedding``, ``optimizer``, ``reduction``, ``pointwise``, ``copy``,
``other``; :func:`loka_tune.kernels.timing.kernel_kind`), and each row then gets ``kinds`` and
``d_kinds`` (against the reference), with a second table of them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

__all__ = ["breakdown", "table"]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def breakdown(receipt: dict[str, Any], *, ref: str = "bf16_mods", name: str = "") -> dict[str, Any]:
    """The per-variant breakdown of one e2e receipt (``meta``, ``runs`` with ``profile``)."""
    runs = receipt.get("runs")
    if not isinstance(runs, list) or not runs:
        raise SystemExit(f"{name or 'receipt'}: no 'runs' list; pass a benchmarks/e2e.py results.json")
    by: dict[str, list[dict[str, float]]] = {}
    fp8: dict[str, int] = {}
    for r in runs:
        p = r.get("profile") or {}
        if p.get("gpu_ms") is None or p.get("gemm_ms") is None:
            continue  # a run that was not profiled (or failed)
        fp8[r["variant"]] = int(r.get("fp8_sites") or 0)
        x = {"step_ms": float(r["step_time_s"]) * 1e3, "gpu_ms": float(p["gpu_ms"]), "gemm_ms": float(p["gemm_ms"]),
             "kernels": float(p.get("kernels_per_step") or math.nan), "host_ms": float(p.get("host_ms") or math.nan)}
        if isinstance(p.get("kinds"), dict):
            x.update({f"kind:{k}": float(v) for k, v in p["kinds"].items()})
        by.setdefault(r["variant"], []).append(x)
    if not by:
        raise SystemExit(f"{name or 'receipt'}: no run has a profile; run e2e.py with --profile-steps N (N > 0)")
    if ref not in by:
        raise SystemExit(f"{name or 'receipt'}: reference variant {ref!r} has no profiled run; the receipt has"
                         f" {sorted(by)}: pass one of them as --ref")
    rows: list[dict[str, Any]] = []
    for v, xs in by.items():
        row: dict[str, Any] = {"variant": v, "seeds": len(xs), "fp8_sites": fp8[v]}
        for k in ("step_ms", "gpu_ms", "gemm_ms", "kernels", "host_ms"):
            row[k] = _mean([x[k] for x in xs])
        row["other_ms"] = row["gpu_ms"] - row["gemm_ms"]
        kinds = sorted({k for x in xs for k in x if k.startswith("kind:")})
        if kinds and all(k in x for x in xs for k in kinds):  # every seed's profile has them
            row["kinds"] = {k[5:]: _mean([x[k] for x in xs]) for k in kinds}
        rows.append(row)
    base = next(r for r in rows if r["variant"] == ref)
    best = min(r["step_ms"] for r in rows)
    for r in rows:
        r["d_gemm_ms"] = r["gemm_ms"] - base["gemm_ms"]
        r["d_other_ms"] = r["other_ms"] - base["other_ms"]
        if "kinds" in r and "kinds" in base:
            r["d_kinds"] = {k: v - base["kinds"].get(k, 0.0) for k, v in r["kinds"].items()}
        r["speedup_vs_ref"] = base["step_ms"] / r["step_ms"]
        # an FP8 variant's step with no time added around its GEMMs (a saving there is kept)
        zero = r["step_ms"] - max(r["d_other_ms"], 0.0) if r["fp8_sites"] else None
        r["zero_overhead_step_ms"] = zero
        r["zero_overhead_vs_best"] = None if zero is None else best / zero
    fp8_rows = [r for r in rows if r["fp8_sites"]]
    ceiling = None
    if fp8_rows:  # the largest GEMM saving of any variant, with nothing added around it
        top = min(fp8_rows, key=lambda r: r["d_gemm_ms"])
        step = base["step_ms"] + top["d_gemm_ms"]
        ceiling = {"from": top["variant"], "step_ms": step, "vs_best": best / step}
    meta = receipt.get("meta") or {}
    return {"receipt": name, "batch": meta.get("batch"), "seeds": meta.get("seeds"), "device": meta.get("device"),
            "torch": meta.get("torch"), "date": meta.get("date"), "ref": ref, "best_step_ms": best,
            "ceiling": ceiling, "rows": rows}


def table(parts: list[dict[str, Any]]) -> str:
    """The breakdowns as Markdown, one table per receipt."""
    out: list[str] = []
    for b in parts:
        out += [f"**{b['receipt']}** (B = {b['batch']}, seeds {b['seeds']}, {b['device']}, torch {b['torch']},"
                f" {b['date']}; against `{b['ref']}`)", "",
                "| variant | step ms | vs ref | GPU ms | GEMM ms | other ms | d GEMM | d other |"
                " zero-overhead step | vs the fastest |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(b["rows"], key=lambda r: r["step_ms"]):
            zero = "-" if r["zero_overhead_step_ms"] is None else f"{r['zero_overhead_step_ms']:.2f}"
            vs = "-" if r["zero_overhead_vs_best"] is None else f"{r['zero_overhead_vs_best']:.3f}x"
            out.append(f"| `{r['variant']}` | {r['step_ms']:.2f} | {r['speedup_vs_ref']:.3f}x | {r['gpu_ms']:.2f} |"
                       f" {r['gemm_ms']:.2f} | {r['other_ms']:.2f} | {r['d_gemm_ms']:+.2f} | {r['d_other_ms']:+.2f} |"
                       f" {zero} | {vs} |")
        with_kinds = [r for r in b["rows"] if "d_kinds" in r]
        if with_kinds:
            names = list(with_kinds[0]["kinds"])
            out += ["", f"GPU ms per kind of kernel (by name), and against `{b['ref']}`:", "",
                    "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for r in sorted(with_kinds, key=lambda r: r["step_ms"]):
                out.append(f"| `{r['variant']}` | " + " | ".join(
                    f"{r['kinds'][k]:.2f} ({r['d_kinds'][k]:+.2f})" for k in names) + " |")
        c = b["ceiling"]
        if c is not None:
            out += ["", f"Ceiling of these variants: `{b['ref']}` less the largest GEMM saving (`{c['from']}`'s),"
                        f" nothing added around it: {c['step_ms']:.2f} ms, {c['vs_best']:.3f}x the fastest."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("receipts", type=Path, nargs="+", help="benchmarks/e2e.py results.json files")
    ap.add_argument("--ref", default="bf16_mods", help="the variant the deltas are taken against (bf16_mods)")
    ap.add_argument("--out", type=Path, required=True, help="the breakdown (JSON)")
    ap.add_argument("--md", action="store_true", help="also write the tables beside it (.md)")
    args = ap.parse_args(argv)
    parts = []
    for p in args.receipts:
        if not p.is_file():
            raise SystemExit(f"{p}: no such receipt; pass the results.json that benchmarks/e2e.py wrote")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"{p}: not JSON ({e}); pass the results.json that benchmarks/e2e.py wrote") from None
        parts.append(breakdown(d, ref=args.ref, name=p.name))
    if not args.out.parent.is_dir():
        raise SystemExit(f"--out {args.out}: folder {args.out.parent} does not exist (mkdir -p {args.out.parent})")
    args.out.write_text(json.dumps({"receipts": parts}, indent=2) + "\n")
    md = table(parts)
    if args.md:
        args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
