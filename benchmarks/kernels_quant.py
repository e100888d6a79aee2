"""Quantization kernels: achieved bandwidth against the card's measured copy bandwidth.

Run on the GPU (device tool):  python benchmarks/kernels_quant.py --out DIR
Writes DIR/kernels_quant.json and prints a markdown table last.

Bandwidth is counted on the *minimum* traffic of a quantization (each bf16 input element
read once, each FP8 element and each fp32 scale written once: 3 B/element + scales), over
the median time of back-to-back CUDA-graph replays on two rotating inputs (each larger than
the L2). The copy bandwidth is a device-to-device copy of 2 GiB counting bytes read +
written. Tensorwise scaling needs the global amax before any element can be cast, and
rowwise scaling of a transposed view (wgrad) reduces over the strided dimension: both read
the input twice by design (5 B/element), so their ceiling on this accounting is 60% of copy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from loka_tune.kernels.timing import copy_bandwidth, environment, time_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from loka_tune.kernels import triton_quant as tq

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    copies = {n: copy_bandwidth(n) for n in (256 << 20, 1 << 30, 4 << 30)}  # bytes -> B/s
    copy_bw = max(copies.values())
    shapes = [(8192, 2048), (65536, 1024), (16384, 4096)] if not args.quick else [(8192, 2048)]
    rows = []
    for R, C in shapes:
        for trans in (False, True):
            xs = []
            for s in range(2):
                torch.manual_seed(s)
                base = torch.randn((C, R) if trans else (R, C), device="cuda", dtype=torch.bfloat16)
                xs.append(base.t() if trans else base)
            for gran, is_w in (("row", False), ("block", False), ("block", True), ("tensor", False)):
                fns = [lambda x=x, g=gran, w=is_w: tq.quantize(x, "e4m3", g, is_weight=w) for x in xs]
                res = time_fn(fns, target_s=5e-3)
                n = R * C
                n_scales = {"row": R, "tensor": 1}.get(gran, ((R + 127) // 128 if is_w else R) * ((C + 127) // 128))
                min_bytes = 3 * n + 4 * n_scales
                design_reads = 2 if gran == "tensor" or (gran == "row" and trans) else 1
                rows.append(dict(impl="triton", gran=gran + ("128x128" if is_w else ("1x128" if gran == "block" else "")),
                                 rows=R, red=C, transposed=trans, elems=n, seconds=res.seconds, spread=res.spread,
                                 method=res.method, gbps=min_bytes / res.seconds / 1e9,
                                 frac_copy=min_bytes / res.seconds / copy_bw, design_reads=design_reads,
                                 design_frac_copy=(design_reads * 2 + 1) * n / res.seconds / copy_bw))
        # libraries, for reference (row-major input only)
        x = torch.randn((R, C), device="cuda", dtype=torch.bfloat16)
        refs = {}
        try:
            import fbgemm_gpu.experimental.gen_ai  # noqa: F401

            refs["fbgemm quantize_fp8_per_row"] = ("row", lambda: torch.ops.fbgemm.quantize_fp8_per_row(x))
            refs["fbgemm quantize_fp8_per_tensor"] = ("tensor", lambda: torch.ops.fbgemm.quantize_fp8_per_tensor(x))
        except Exception as e:  # noqa: BLE001
            print("fbgemm unavailable:", e)
        try:
            from loka_tune.config import Format, Granularity
            from loka_tune.kernels.backends.torchao_backend import _cast

            refs["torchao eager cast (row)"] = ("row", lambda: _cast(x, Format.E4M3, Granularity.ROW, True))
            refs["torchao eager cast (tensor)"] = ("tensor", lambda: _cast(x, Format.E4M3, Granularity.TENSOR, False))
        except Exception as e:  # noqa: BLE001
            print("torchao unavailable:", e)
        for name, (gran, fn) in refs.items():
            res = time_fn([fn], target_s=5e-3)
            n = R * C
            min_bytes = 3 * n + 4 * (R if gran == "row" else 1)
            rows.append(dict(impl=name, gran=gran, rows=R, red=C, transposed=False, elems=n, seconds=res.seconds,
                             spread=res.spread, method=res.method, gbps=min_bytes / res.seconds / 1e9,
                             frac_copy=min_bytes / res.seconds / copy_bw))
    result = {"env": environment(), "date": time.strftime("%Y-%m-%d %H:%M"), "copy_gbps": copy_bw / 1e9,
              "copy_gbps_by_size": {str(k): v / 1e9 for k, v in copies.items()}, "rows": rows}
    (out_dir / "kernels_quant.json").write_text(json.dumps(result, indent=1))
    lines = [f"copy bandwidth (torch copy_, best of 256 MiB / 1 GiB / 4 GiB): {copy_bw / 1e9:.0f} GB/s (read + write);"
             " by size: " + ", ".join(f"{k >> 20} MiB {v / 1e9:.0f}" for k, v in copies.items()), "",
             "| impl | granularity | rows x red | transposed view | us | GB/s (3 B/elem) | % of copy |"
             " passes over input (design) | % of copy on design traffic |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['gran']} | {r['rows']}x{r['red']} | {'yes' if r['transposed'] else 'no'} |"
                     f" {r['seconds'] * 1e6:.1f} | {r['gbps']:.0f} | {100 * r['frac_copy']:.0f}% |"
                     + (f" {r['design_reads']} | {100 * r['design_frac_copy']:.0f}% |" if "design_reads" in r else " - | - |"))
    md = "\n".join(lines)
    (out_dir / "kernels_quant.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
