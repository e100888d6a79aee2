"""Issue 22's diagnostic: a graphed probe's statistics against an eager one's, after every step.

Three probes on one small model (``tests/test_probe_compiled.py``'s ``Net``) under bf16 autocast
on CUDA: ``graphs=True``, ``graphs=False`` and a second eager one (eager vs eager: should be 0).
Per step, the fields whose relative difference exceeds 1e-6. Variants: every batch of 1,024 rows;
a 512-row batch in between; precision float64 and float32. It made
``benchmarks/results/probe_graph_vs_eager_diag_h200_s7.json`` (the covariance off in the
float32/TF32 paths only: bf16 GEMMs baked into the warm-up's capture, fixed since).

    python3 benchmarks/probe_graph_vs_eager.py   # on a GPU, from the repo root; -> $OUT/diag.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.getcwd())

from loka_tune.probe import Probe  # noqa: E402
from tests.test_probe_compiled import Net, _batches, _step, _tensor_fields  # noqa: E402


def diff(a: Probe, b: Probe) -> dict[str, Any]:
    """Fields of ``a``'s and ``b``'s statistics whose largest relative difference exceeds 1e-6."""
    fa, fb = _tensor_fields(a.stats), _tensor_fields(b.stats)
    out: dict[str, Any] = {}
    for k in fa:
        if fa[k] is None or fb[k] is None:
            continue
        x, y = np.asarray(fa[k], float), np.asarray(fb[k], float)
        if x.shape != y.shape:
            out[k] = "shape"
            continue
        d = float(np.nanmax(np.abs(x - y) / (np.abs(x) + 1e-9))) if x.size else 0.0
        if d > 1e-6:
            out[k] = d
    return out


def run(sizes: list[int], **extra: Any) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Net().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [tuple(t.to(dev) for t in _batches(1, b, seed=i)[0]) for i, b in enumerate(sizes)]
    kw = dict(every=1, step_on="batch", max_rows=1 << 14, real_rows=1 << 14, max_full_dim=8, sketch_rank=2, **extra)
    g, e, e2 = Probe(model, graphs=True, **kw), Probe(model, graphs=False, **kw), Probe(model, graphs=False, **kw)
    steps = []
    for i, (x, seq, y) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _step(model, opt, x, seq, y)
            for p in (g, e, e2):
                p.step(x, seq, target=y)
        torch.cuda.synchronize()
        d = diff(e, g)
        steps.append({"i": i, "rows": sizes[i], "graph_vs_eager": dict(list(d.items())[:12]), "n_diff": len(d),
                      "eager_vs_eager": len(diff(e, e2)), "note": g.graph_note})
    return steps


def main() -> None:
    out: dict[str, Any] = {"prec": torch.get_float32_matmul_precision(),
                           "allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    mixed = [1024] * 4 + [512] + [1024] * 2
    for name, sizes, extra in [("all1024", [1024] * 5, {}), ("test", mixed, {}),
                               ("f64", mixed, {"precision": "float64"}), ("f32", mixed, {"precision": "float32"})]:
        try:
            out[name] = run(sizes, **extra)
        except Exception as ex:  # noqa: BLE001 - a diagnostic: record and go on
            out[name] = repr(ex)[:500]
    with open(os.path.join(os.environ.get("OUT", "."), "diag.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out)[:6000])


if __name__ == "__main__":
    main()
