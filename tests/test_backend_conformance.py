"""The CPU backends (``bf16``, ``emulated``) against the backend conformance suite
(tests/backend_conformance.py); the GPU backends' classes are in tests/test_gpu_backends.py."""

from __future__ import annotations

import pytest
from backend_conformance import BackendConformance

from loka_tune.kernels.registry import candidate_choices

# torch 2.13's inductor on CPU miscompiles a tile-scale broadcast followed by a slice (the
# ragged last tile of `block` / `mx` scaling along K, kernels/quant.py:_expand): it reads
# outside the scales and returns garbage (inf, 1e30). Eager and aot_eager are right.
_INDUCTOR_RAGGED_TILES = pytest.mark.xfail(
    reason="inductor (CPU, torch 2.13) miscompiles the broadcast + slice of ragged block/mx scales", strict=False
)


class TestBF16Conformance(BackendConformance):
    backend = "bf16"
    choices = ("bf16",)
    must_refuse = (("e4m3.row.bf16", "fwd", None), ("e5m2+e4m3.tensor.bf16", "wgrad", None))
    compile_cases = (("bf16", "wgrad", (130, 136, 16)),)


class TestEmulatedConformance(BackendConformance):
    backend = "emulated"
    choices = ("bf16.emulated", *(c.short_str() for c in candidate_choices(roles=("wgrad",))))  # e5m2 too
    compile_cases = (
        ("e5m2+e4m3.row.pow2.emulated", "wgrad", (130, 136, 16)),
        pytest.param(("e4m3.block.emulated", "fwd", (64, 136, 32)), marks=_INDUCTOR_RAGGED_TILES),
    )
