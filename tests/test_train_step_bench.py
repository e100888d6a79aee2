"""benchmarks/train_step.py's variant loop on the CPU: a failing variant must not end the run."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("train_step_bench", REPO / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_failing_variant_is_recorded_and_the_next_ones_run(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from loka_tune.data.synthetic import SyntheticCTR

    ts = _load()

    def cpu_timed_loop(step, batches, steps):  # noqa: ANN001, ANN202 - CUDA events -> perf_counter
        out = []
        for _ in range(steps):
            b = next(batches)
            t0 = time.perf_counter()
            step(b)
            out.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(ts, "timed_loop", cpu_timed_loop)
    src = SyntheticCTR(num_dense=3, cardinalities=[20, 30], eval_examples=64)
    args = argparse.Namespace(
        model="dlrm", preset="tiny", num_dense=3, batch=16, variant_steps=3, warmup=0, compile=False,
        variant=["bf16|none|bf16", "broken|none|uniform:e4m3.row.no_such_backend", "bf16 again|nobias|bf16"])
    rows = ts.run_variants(args, src, torch.device("cpu"))
    assert [r["variant"] for r in rows] == ["bf16", "broken", "bf16 again"]
    assert "no_such_backend" in rows[1]["error"] and "median_ms" not in rows[1]
    assert rows[0]["median_ms"] > 0 and rows[2]["median_ms"] > 0
    assert rows[0]["speedup_vs_first"] == pytest.approx(1.0) and rows[1]["speedup_vs_first"] is None
    ts.print_variants(rows, args)
    assert "failed: BackendError" in capsys.readouterr().out
