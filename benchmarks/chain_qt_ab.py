"""The FP8 chain's norm kernels on a GPU, each form of their transposed copy (fp8_chain's ``QT``):
does the transposed FP8 copy equal the row-major copy transposed, and does the row-major copy
equal the float64-free torch reference? (On an H100 on 2026-12-07 form 0's transposed copy of the
forward kernel disagreed in one call of two; written to pick the form by measurement.)

Every output is filled with a sentinel byte (0x7F, NaN in e4m3fn) before each launch, so a byte
the kernel never wrote is told apart from a byte written wrong. Writes one JSON object per
(kernel, form, shape, repeat) to ``--out`` and prints the forms that were right every time.

    python3 benchmarks/chain_qt_ab.py --out $OUT/chain_qt_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_chain as ch  # noqa: E402
from delayed_scales import E4M3  # noqa: E402

SHAPES = [(1, 256), (70, 512), (8192, 2048), (8192, 256), (4096, 1024)]
#: (transposed-copy form, tile rows, warps), in the order of preference
CONFIGS = [(f, br, w) for br, w in ((32, 4), (64, 4), (16, 4), (32, 8)) for f in (0, 1, 2, 4, 5)]


def _launch(kind: str, qt_form: int, y: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor,
            br: int, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    triton, kf, kb = ch._kernels()
    m, n = y.shape
    nb = n // ch.BLOCK
    q = torch.full((m, n), 0x7F, device=y.device, dtype=torch.uint8).view(E4M3)
    qt = torch.full((n, m), 0x7F, device=y.device, dtype=torch.uint8).view(E4M3)
    amax = torch.zeros(1, device=y.device)
    grid = (triton.cdiv(m, br), nb)
    if kind == "fwd":
        r = torch.empty((m, nb), device=y.device)
        x = torch.empty(1, device=y.device, dtype=y.dtype)
        kf[grid](y, scale, q, qt, r, amax, x, m, n, nb, EPS=1e-6, ACT=True, OUT=False, BR=br, BLK=ch.BLOCK,
                 QT=qt_form, num_warps=warps)
    else:
        kb[grid](g, y, rstd, scale, q, qt, amax, m, n, nb, ACT=True, BR=br, BLK=ch.BLOCK, QT=qt_form, num_warps=warps)
    if y.is_cuda:
        torch.cuda.synchronize()
    return q, qt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (a check of this script)")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes")
    args = ap.parse_args()
    dev = args.device
    rows = []
    for m, n in SHAPES[:args.shapes]:
        torch.manual_seed(4)
        y = (torch.randn(m, n, device=dev) * torch.logspace(-3, 3, n, device=dev)).to(torch.bfloat16)
        y[0, :256] = 0.0
        g = (torch.randn(m, n, device=dev) * 1e-4).to(torch.bfloat16)
        s = torch.tensor([30.0], device=dev)
        rq, _, rr, ra = ch.norm_fwd_cast_reference(y, s, 1e-6)
        sb = (torch.tensor(400.0, device=dev) / ra.reshape(())).reshape(1)
        rd, _, _ = ch.norm_bwd_cast_reference(g, y, rr, sb)
        for kind, ref, scale in (("fwd", rq, s), ("bwd", rd, sb)):
            for form, br, warps in CONFIGS:
                for rep in range(args.repeats):
                    q, qt = _launch(kind, form, y, g, rr, scale, br, warps)
                    qb, qtb = q.view(torch.uint8), qt.view(torch.uint8)
                    bad_t = qtb != qb.t()
                    rec = {"kernel": kind, "qt_form": form, "br": br, "warps": warps, "shape": [m, n], "repeat": rep,
                           "q_unwritten": int((qb == 0x7F).sum()), "qt_unwritten": int((qtb == 0x7F).sum()),
                           "q_vs_reference_mismatch": float((qb != ref.view(torch.uint8)).float().mean()),
                           "qt_vs_q_t_mismatch": int(bad_t.sum())}
                    if rec["qt_vs_q_t_mismatch"]:
                        idx = bad_t.nonzero()[:8].tolist()
                        rec["first_bad_qt_index"] = idx
                        rec["first_bad_qt_bytes"] = [int(qtb[i, j]) for i, j in idx]
                        rec["bad_feature_mod4"] = torch.bincount(bad_t.nonzero()[:, 0] % 4, minlength=4).tolist()
                    rows.append(rec)
                    if rec["qt_vs_q_t_mismatch"] or rec["q_vs_reference_mismatch"] >= 1e-3:
                        print(json.dumps(rec), flush=True)
    ok = {}
    for form, br, warps in CONFIGS:
        rs = [r for r in rows if (r["qt_form"], r["br"], r["warps"]) == (form, br, warps)]
        ok[f"qt{form}_br{br}_w{warps}"] = all(
            r["qt_vs_q_t_mismatch"] == 0 and r["q_unwritten"] == 0 and r["qt_unwritten"] == 0
            and r["q_vs_reference_mismatch"] < 1e-3 for r in rs)
    good = [c for c in CONFIGS if ok[f"qt{c[0]}_br{c[1]}_w{c[2]}"]]
    # the first that was right every time, in CONFIGS' order (in-kernel transposes first); else the
    # row-major kernel with the copy transposed after it (form 3), if its row-major copy was right
    q_ok = all(r["q_unwritten"] == 0 and r["q_vs_reference_mismatch"] < 1e-3 for r in rows if r["br"] == 32 and r["warps"] == 4)
    choice = list(good[0]) if good else ([3, 32, 4] if q_ok else None)
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "ok": ok, "good": good, "choice": choice, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1))
    print("ok:", ok, "good:", good, "choice:", choice)


if __name__ == "__main__":
    main()
