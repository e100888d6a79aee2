"""Fused Linear -> BlockNorm -> Hard Swish epilogue vs unfused chains, on the GPU (issue 6).

Variants of ``hardswish(blocknorm(x @ W.T + b))`` (bf16 activations, BlockNorm block 256):

- ``bf16 eager``: ``nn.Linear`` + ``BlockNorm`` + ``nn.Hardswish`` in bf16;
- ``bf16 compile``: the same under ``torch.compile`` (inductor fuses norm + activation);
- ``fp8 unfused``: ``LokaLinear`` (``e4m3.row.fa.triton``, all three GEMMs) + BlockNorm +
  Hardswish in bf16;
- ``fp8 fused``: :class:`~loka_tune.kernels.fused.FusedLinearBlockNormHardswish`
  (``e4m3.row.fa.triton``: one fused forward kernel; backward epilogue kernel + triton FP8
  dgrad / wgrad); ``fp8 fused, bf16 bwd GEMMs``: the same forward, dgrad / wgrad in bf16.

``fwd`` is an inference forward (``torch.no_grad``), ``fwd+bwd`` a training step of the chain
(forward, then backward of a fixed upstream gradient into X, W and b). Times are
``triton.testing.do_bench`` medians (ms), quantization included. Shapes: the ``large`` preset's
widths (K = N = 2048 / 4096) at M = 8192 ... 65536 rows.

    python benchmarks/fused_epilogue.py --out results.json [--budget 70] [--quick]

Prints a markdown table and writes JSON (``--out``). Stops adding work once ``--budget``
seconds have passed (remaining cells are recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_tune.kernels.fused import FusedLinearBlockNormHardswish  # noqa: E402
from loka_tune.kernels.linear import LokaLinear  # noqa: E402
from loka_tune.layers import BlockNorm  # noqa: E402

CHOICE = "e4m3.row.fa.triton"
SHAPES = [(8192, 2048, 2048), (32768, 2048, 2048), (16384, 4096, 4096), (65536, 4096, 4096)]
QUICK_SHAPES = [(8192, 2048, 2048), (32768, 4096, 4096)]
BLOCK = 256


def _variants(lin: nn.Linear) -> dict[str, nn.Module]:
    bf16 = nn.Sequential(lin, BlockNorm(BLOCK), nn.Hardswish())
    return {  # bf16 compile last: its compiles are the slow part, the budget may skip it
        "bf16 eager": bf16,
        "fp8 fused": FusedLinearBlockNormHardswish(lin, BlockNorm(BLOCK), nn.Hardswish(), choice=CHOICE),
        "fp8 fused, bf16 bwd GEMMs": FusedLinearBlockNormHardswish(lin, BlockNorm(BLOCK), nn.Hardswish(), choice=CHOICE,
                                                                   dgrad="bf16", wgrad="bf16"),
        "fp8 unfused": nn.Sequential(LokaLinear.from_linear(lin, CHOICE), BlockNorm(BLOCK), nn.Hardswish()),
        "bf16 compile": torch.compile(nn.Sequential(lin, BlockNorm(BLOCK), nn.Hardswish())),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON results path")
    ap.add_argument("--budget", type=float, default=70.0, help="seconds of wall time before skipping the rest")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--cudagraph", action="store_true",
                    help="also time each variant replayed as a CUDA graph (triton.testing.do_bench_cudagraph):"
                         " GPU time without the Python/launch overhead, as inside a graph-captured train step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    rows = []
    for (m, k, n) in (QUICK_SHAPES if args.quick else SHAPES):
        torch.manual_seed(0)
        lin = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        dh = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        variants = _variants(lin)
        with torch.no_grad():
            ref = variants["bf16 eager"](x).float()
        for name, mod in variants.items():
            row = {"M": m, "K": k, "N": n, "block": BLOCK, "variant": name}
            if time.perf_counter() - t0 > args.budget:
                row["skipped"] = "over the time budget"
                rows.append(row)
                continue
            try:
                with torch.no_grad():
                    out = mod(x)
                    row["rel_err_vs_bf16"] = _rel(out, ref)
                    row["fwd_ms"] = do_bench(lambda: mod(x), warmup=10, rep=40)
                xg = x.detach().requires_grad_()

                def step(dh: torch.Tensor = dh) -> None:  # dh bound now: the loop deletes it after use
                    mod(xg).backward(dh)

                step()
                row["fwd_bwd_ms"] = do_bench(step, warmup=10, rep=40, grad_to_none=[xg, lin.weight, lin.bias])
                if args.cudagraph:
                    params = [p for p in mod.parameters() if p.requires_grad]

                    def fwd_nograd() -> None:
                        with torch.no_grad():
                            mod(x)

                    def grad_step(dh: torch.Tensor = dh) -> None:  # no .grad accumulation inside the graph
                        torch.autograd.grad(mod(xg), [xg, *params], dh)

                    row["fwd_ms_graph"] = do_bench_cudagraph(fwd_nograd, rep=40)
                    row["fwd_bwd_ms_graph"] = do_bench_cudagraph(grad_step, rep=40)
            except Exception as e:  # record and go on: one variant failing must not hide the rest
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del variants, x, dh, lin
        torch.cuda.empty_cache()
    # tile-config sweep of the fused forward kernel alone (quantization excluded), one shape
    sweep = []
    if not args.quick and time.perf_counter() - t0 < args.budget:
        from loka_tune.kernels import triton_epilogue, triton_quant

        m, k, n = (32768, 2048, 2048) if dev.type == "cuda" else (256, 128, 512)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        qx, qw = triton_quant.quantize(x, "e4m3", "row"), triton_quant.quantize(w, "e4m3", "row", is_weight=True)
        default = triton_epilogue.pick_epilogue_config(m, n, BLOCK, torch.cuda.get_device_properties(dev).multi_processor_count)
        for bm, bn, nw, ns in [(128, 256, 8, 3), (64, 256, 8, 3), (64, 256, 4, 3), (128, 256, 8, 4), (128, 256, 8, 2)]:
            if time.perf_counter() - t0 > args.budget:
                break
            cfg = dict(BM=bm, BN=bn, num_warps=nw, num_stages=ns)
            r = {"M": m, "K": k, "N": n, **cfg, "default": cfg == default}
            for save in (False, True):
                try:
                    r["save" if save else "nosave"] = do_bench(lambda: triton_epilogue.fused_forward(
                        qx.data, qx.inv_scale, qw.data, qw.inv_scale, None, BLOCK, 1e-6, save=save, config=cfg),
                        warmup=10, rep=40)
                except Exception as e:
                    r["error"] = f"{type(e).__name__}: {e}"[:200]
            sweep.append(r)
            print(json.dumps(r), flush=True)
        del x, w, qx, qw
    # speedups of the fused kernel
    by = {(r["M"], r["K"], r["N"], r["variant"]): r for r in rows}
    graph = any("fwd_bwd_ms_graph" in r for r in rows)
    gh = " fwd ms (graph) | fwd+bwd ms (graph) | fused speedup fwd+bwd (graph) |" if graph else ""
    lines = ["| M | K=N | variant | fwd ms | fwd+bwd ms | fused speedup fwd | fused speedup fwd+bwd |" + gh
             + " rel err vs bf16 |", "|---|---|---|---|---|---|---|" + "---|" * (3 if graph else 0) + "---|"]
    for r in rows:
        f = by.get((r["M"], r["K"], r["N"], "fp8 fused"), {})

        def cell(key: str) -> str:
            return f"{r[key]:.3f}" if key in r else "-"

        def sp(key: str) -> str:
            if key in r and key in f:
                return f"{r[key] / f[key]:.2f}x"
            return "-"

        note = r.get("error") or r.get("skipped") or ""
        err = f"{r['rel_err_vs_bf16']:.4f}" if "rel_err_vs_bf16" in r else note
        gcells = f" {cell('fwd_ms_graph')} | {cell('fwd_bwd_ms_graph')} | {sp('fwd_bwd_ms_graph')} |" if graph else ""
        lines.append(f"| {r['M']} | {r['K']} | {r['variant']} | {cell('fwd_ms')} | {cell('fwd_bwd_ms')} | "
                     f"{sp('fwd_ms')} | {sp('fwd_bwd_ms')} |{gcells} {err} |")
    if sweep:
        r0 = sweep[0]
        lines += ["", f"Fused forward kernel alone (quantized operands given), M={r0['M']} K={r0['K']} N={r0['N']}, b={BLOCK}:", "",
                  "| BM | BN | warps | stages | default | ms (inference) | ms (saving y, rstd) |", "|---|---|---|---|---|---|---|"]
        for r in sweep:
            lines.append(f"| {r['BM']} | {r['BN']} | {r['num_warps']} | {r['num_stages']} | {r['default']} | "
                         f"{r.get('nosave', float('nan')):.3f} | {r.get('save', float('nan')):.3f} | " + r.get("error", ""))
    table = "\n".join(lines)
    print()
    print(table)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "choice": CHOICE,
        "block": BLOCK,
        "timing": "triton.testing.do_bench median (ms), warmup=10 ms, rep=40 ms"
                  + ("; (graph): triton.testing.do_bench_cudagraph, rep=40 ms" if args.cudagraph else ""),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(f"\nwall {meta['wall_s']} s on {meta['device']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "config_sweep": sweep, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
