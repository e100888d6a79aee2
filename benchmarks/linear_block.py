"""Linear -> ReLU -> Linear, forward + backward, compiled: LokaLinear against torchao and bf16.

The unit of every LRM MLP, at the shapes where FP8 should pay. Each cell compiles one
variant at one shape in one mode under :func:`loka_tune.objectives.compiled.strict_compile`
(dynamo reset first; a graph break, an eager run or a recompile-limit hit fails the cell),
then times ``iters`` back-to-back training iterations (bf16 autocast, fp32 master weights,
input and weight gradients: all six GEMMs) between two CUDA events, ``--reps`` times, and
reports the median per iteration, plus the host time to enqueue one iteration (``host_ms``:
above ``ms`` the block is host-bound).

Variants (``--variants``): ``bf16``; ``torchao_tensorwise`` / ``torchao_rowwise``
(``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``); LokaLinear with
``loka_sm_tensor`` (= torchao's tensorwise numerics: e4m3 tensorwise, fast accumulation in the
forward GEMM only), ``loka_sm_row`` (= torchao's rowwise: e4m3 rowwise, power-of-two scales,
fast accumulation in the forward only), ``loka_sm_row_fa`` (rowwise, fast accumulation in all
three), ``loka_triton_row_fa``, ``loka_fbgemm_row_fa``. Modes (``--modes``): ``default`` and
``reduce-overhead`` (CUDA graphs).

    python benchmarks/linear_block.py --out $OUT/linear_block.json --budget 300
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
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_tune.kernels.linear import LokaLinear  # noqa: E402
from loka_tune.kernels.quant import sqnr_db  # noqa: E402
from loka_tune.objectives.compiled import strict_compile  # noqa: E402

SHAPES = ((8192, 1024), (8192, 2048), (32768, 1024), (32768, 2048), (32768, 4096), (16384, 8192))  # (M, K = N)
LOKA = {
    "loka_sm_tensor": "e4m3.tensor.fa.torch_scaled_mm|e4m3.tensor.torch_scaled_mm|e4m3.tensor.torch_scaled_mm",
    "loka_sm_row": "e4m3.row.pow2.fa.torch_scaled_mm|e4m3.row.pow2.torch_scaled_mm|e4m3.row.pow2.torch_scaled_mm",
    "loka_sm_row_fa": "e4m3.row.fa.torch_scaled_mm",
    "loka_triton_row_fa": "e4m3.row.fa.triton",
    "loka_fbgemm_row_fa": "e4m3.row.fa.fbgemm",
}
VARIANTS = ("bf16", "torchao_tensorwise", "torchao_rowwise", *LOKA)
RO_VARIANTS = ("bf16", "torchao_tensorwise", "loka_sm_tensor", "loka_sm_row_fa")


def block(k: int, n: int, variant: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(k, n, bias=False), nn.ReLU(), nn.Linear(n, n, bias=False)).to(device)
    if variant.startswith("torchao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(variant.split("_", 1)[1]))
    elif variant in LOKA:
        for i in (0, 2):
            m[i] = LokaLinear.from_linear(m[i], LOKA[variant], name=f"{i}")
    return m


def time_cell(step: Callable[[], Any], device: torch.device, *, reps: int, target_ms: float) -> dict[str, Any]:
    for _ in range(3):  # compile, autotune, allocator, CUDA graph recording
        step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    est = max(time.perf_counter() - t0, 1e-4) * 1e3
    iters = max(5, min(200, math.ceil(target_ms / est)))
    ms, host = [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        e0.record()
        h0 = time.perf_counter()
        for _ in range(iters):
            step()
        host.append((time.perf_counter() - h0) * 1e3 / iters)
        e1.record()
        torch.cuda.synchronize(device)
        ms.append(e0.elapsed_time(e1) / iters)
    return {"ms": statistics.median(ms), "ms_spread": (max(ms) - min(ms)) / statistics.median(ms),
            "host_ms": statistics.median(host), "iters": iters}


def run_cell(variant: str, mode: str, m_rows: int, k: int, device: torch.device, reps: int,
             ref: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m_rows, k, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(m_rows, k, device=device, generator=g, dtype=torch.bfloat16)
    model = block(k, k, variant, device)
    with strict_compile(max_graphs=2) as dyn:  # the forward graph; backward rides along with it
        compiled = torch.compile(model, mode=None if mode == "default" else mode)

        graphs = mode != "default"

        params = [x, *model.parameters()]  # x too: its gradient is the dgrad output

        def step() -> torch.Tensor:
            for p in params:  # as a training step does (zero_grad): CUDA-graph outputs are not accumulated into
                p.grad = None
            if graphs:  # a new iteration: the CUDA-graph trees may reuse the last one's outputs
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = compiled(x)
            y.backward(dy)
            return y

        y0 = step().detach().float().clone()  # (M, N), for the accuracy check
        rec = time_cell(step, device, reps=reps, target_ms=30.0)
    rec.update(variant=variant, mode=mode, M=m_rows, K=k, N=k, dynamo=dyn)
    if ref is not None:
        rec["sqnr_vs_bf16_db"] = sqnr_db(ref, y0)
    return rec, y0


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in sorted({c["mode"] for c in cells}):
        for (m_rows, k) in sorted({(c["M"], c["K"]) for c in cells if c["mode"] == mode}):
            got = {c["variant"]: c.get("ms") for c in cells if c["mode"] == mode and (c["M"], c["K"]) == (m_rows, k)}
            row: dict[str, Any] = {"mode": mode, "M": m_rows, "K": k, "N": k, "ms": got}
            tao = [v for n, v in got.items() if n.startswith("torchao") and v]
            sm = [v for n, v in got.items() if n.startswith("loka_sm") and v]
            if tao and sm:
                row["best_loka_sm_ms"], row["best_torchao_ms"] = min(sm), min(tao)
                row["loka_le_torchao"] = min(sm) <= min(tao)
            for a, b in (("loka_sm_row", "torchao_rowwise"), ("loka_sm_tensor", "torchao_tensorwise")):
                if got.get(a) and got.get(b):
                    row[f"{a}_over_{b}"] = got[a] / got[b]
            if got.get("bf16"):
                row["speedup_vs_bf16"] = {n: got["bf16"] / v for n, v in got.items() if v}
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], variants: list[str]) -> str:
    out = []
    for mode in sorted({r["mode"] for r in rows}):
        out += [f"mode={mode} (ms per fwd+bwd iteration)", "| M x K=N | " + " | ".join(variants) + " | loka <= torchao |",
                "|---|" + "---|" * (len(variants) + 1)]
        for r in (r for r in rows if r["mode"] == mode):
            cells = [f"{r['ms'][v]:.3f}" if r["ms"].get(v) else "-" for v in variants]
            out.append(f"| {r['M']}x{r['K']} | " + " | ".join(cells) + f" | {r.get('loka_le_torchao', '-')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file (written after every cell)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ro-variants", default=",".join(RO_VARIANTS), help="variants also run in reduce-overhead mode")
    ap.add_argument("--modes", default="default,reduce-overhead")
    ap.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES), help="MxK list (N = K)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds: start no new cell after this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linear_block.py times CUDA kernels: run it on a GPU machine")
    dev = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    ro = [v for v in args.ro_variants.split(",") if v]
    import torchao  # noqa: F401 - fail now, not in the middle

    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "python": platform.python_version(),
            "torchao": getattr(sys.modules.get("torchao"), "__version__", None), "date": time.strftime("%Y-%m-%d"),
            "argv": sys.argv[1:] if argv is None else argv, "autocast": "bf16", "weights": "fp32 master"}
    cells: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    def dump() -> None:
        rows = summarize([c for c in cells if "ms" in c])
        args.out.write_text(json.dumps({"meta": meta, "cells": cells, "rows": rows}, indent=1))

    for mode in args.modes.split(","):
        for m_rows, k in shapes:
            ref = None
            for v in (variants if mode == "default" else [v for v in variants if v in ro]):
                if time.perf_counter() - t_start > args.budget:
                    cells.append({"variant": v, "mode": mode, "M": m_rows, "K": k, "skipped": "over the --budget"})
                    continue
                try:
                    rec, y = run_cell(v, mode, m_rows, k, dev, args.reps, ref)
                    if v == "bf16":
                        ref = y
                except Exception as e:  # one failing cell must not end the table
                    rec = {"variant": v, "mode": mode, "M": m_rows, "K": k, "error": f"{type(e).__name__}: {e}"[:400]}
                cells.append(rec)
                dump()
                shown = {key: rec[key] for key in ("ms", "host_ms", "sqnr_vs_bf16_db", "error") if key in rec}
                print(f"[block {time.perf_counter() - t_start:5.0f}s] {mode} {m_rows}x{k} {v}: {shown}", flush=True)
                torch.cuda.empty_cache()
    dump()
    print(table(summarize([c for c in cells if "ms" in c]), variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
