"""loka_tune.kernels.chain, the product's FP8 chain: what the benchmark tests (tests/test_fp8_chain_bench.py,
through benchmarks/fp8_chain.py's re-export) do not: its import stays light and its ops live in the
``loka`` namespace."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from loka_tune.layers import BlockNorm
from loka_tune.models.base import MLPBlock


def test_importing_the_chain_imports_no_triton() -> None:
    code = ("import sys, loka_tune.kernels.chain as c; assert 'triton' not in sys.modules, 'triton imported'; "
            "assert c.BLOCK == 256 and c.MARGIN >= 1.0; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_chain_registers_its_ops_in_the_loka_namespace_and_runs_on_the_cpu() -> None:
    from loka_tune.kernels import chain as ch

    b = MLPBlock(64, 256, norm="none", activation="relu", bias=False)
    b.norm, b.act = BlockNorm(256), nn.Hardswish()
    m = ch.ChainMLP([b], nn.Linear(256, 64, bias=False))
    for name in ("chain_cast_dual_amax", "chain_norm_fwd_cast", "chain_norm_fwd_out", "chain_norm_bwd_cast"):
        assert hasattr(torch.ops.loka, name), name
    x = torch.randn(32, 64)
    ch.calibrate(nn.Sequential(m), [(x,)], lambda out, i: out.float().square().sum())
    assert m.calibrated
    out = m(x)
    assert out.shape == (32, 64) and torch.isfinite(out).all()
