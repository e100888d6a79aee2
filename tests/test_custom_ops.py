"""Every custom op of the package against its fake (meta) kernel, with ``torch.library.opcheck``.

A fake kernel is what ``torch.compile`` plans with: a shape, dtype or stride that differs from
the real op's output makes inductor's generated code assert (``expected size ..., stride ...``)
or, worse, read the buffer wrongly. ``opcheck`` runs the op for real and under fake tensors,
AOT autograd and dynamic shapes, and compares. The package's custom ops:

- ``loka::gemm`` (:mod:`loka_tune.kernels.ops`): the canonical GEMM of one choice and role;
- ``loka_tune::fp8_gemm`` (:mod:`loka_tune.kernels.backends`): the opaque call of a non-traceable
  GPU backend's kernels. On the CPU it is checked through a CPU backend built exactly like the
  GPU ones (``torch._scaled_mm`` runs on the CPU); on a GPU through every real backend that
  calls it (``fbgemm``, ``triton``, ``torch_scaled_mm`` in eager mode), skipped where missing;
- ``loka_tune::fp8_gemm_static`` (:mod:`loka_tune.kernels.backends`): the serving GEMM of a weight
  quantized once (``fbgemm``, ``triton``); on the CPU through a CPU backend whose static path is
  routed through the op, on a GPU through the real backends;
- ``loka_tune::serve_fused_epilogue`` (:mod:`loka_tune.kernels.serving`): the served fused
  Linear -> BlockNorm -> Hard Swish (Triton, GPU only);
- ``loka::cast_dual`` (:mod:`loka_tune.kernels.dualcast`): a tensorwise operand cast into both
  FP8 layouts (the torch reference on the CPU, the Triton kernel on a GPU).

No other ``torch.library`` op is defined (the test below that lists them fails when one is
added without a check here). The row-wise Adagrad (:mod:`loka_tune.objectives.optim`) and the
training step (:mod:`loka_tune.objectives.step`) are plain torch code, no custom op.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest
import torch

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity
from loka_tune.errors import BackendError
from loka_tune.kernels import ops
from loka_tune.kernels.backends import GPUBackend, _ensure_op
from loka_tune.kernels.registry import get_backend, register_backend, unregister_backend
from loka_tune.kernels.scaled import scaled_mm_gemm

ROOT = Path(__file__).resolve().parents[1] / "loka_tune"
OPS = {"loka::gemm", "loka_tune::fp8_gemm", "loka_tune::fp8_gemm_static",  # every custom op this file checks
       "loka_tune::serve_fused_epilogue", "loka::cast_dual"}


def _operands(m: int, k: int, n: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, generator=g, device=device).to(dtype)  # (m, k)
    b = torch.randn(n, k, generator=g, device=device).to(dtype)  # (n, k)
    return a, b


def _layouts(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Row-major operands, and column-major views of the same values (what a transpose hands the op)."""
    yield "rowmajor", a, b
    yield "transposed", a.t().contiguous().t(), b.t().contiguous().t()


def test_the_package_defines_no_custom_op_this_file_does_not_check() -> None:
    found = set()
    for path in ROOT.rglob("*.py"):
        found |= set(re.findall(r"custom_op\(\s*\"([\w:]+)\"", path.read_text()))
    assert found == OPS, f"custom ops in loka_tune: {sorted(found)}; add an opcheck here for each new one"


# ------------------------------------------------------------------------------- loka::gemm
@pytest.mark.parametrize("choice, role", [
    ("bf16", "fwd"), ("e4m3.tensor.emulated", "fwd"), ("e4m3.row.emulated", "dgrad"),
    ("e5m2+e4m3.block.emulated", "wgrad"), ("mxfp8.mx.emulated", "fwd"),
])
def test_gemm_fake_matches_the_op(choice: str, role: str) -> None:
    a, b = _operands(8, 64, 24)
    for layout, x, y in _layouts(a, b):
        torch.library.opcheck(torch.ops.loka.gemm.default, (x, y, choice, role, f"opcheck-{layout}"))
        fake = ops._gemm_fake(x, y, choice, role)
        real = torch.ops.loka.gemm(x, y, choice, role)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype), layout


def test_gemm_fake_matches_the_nonfinite_fallback() -> None:
    """A non-finite operand runs the plain GEMM instead (CPU check on): the same output layout."""
    a, b = _operands(8, 32, 16, seed=1)
    a[3, 5] = float("inf")
    ops.reset_nonfinite("opcheck-nf")
    torch.library.opcheck(torch.ops.loka.gemm.default, (a, b, "e4m3.row.emulated", "fwd", "opcheck-nf"))
    assert ops.nonfinite_count("opcheck-nf") > 0  # the fallback is what ran
    real = torch.ops.loka.gemm(a, b, "e4m3.row.emulated", "fwd")
    assert real.stride() == ops._gemm_fake(a, b, "e4m3.row.emulated", "fwd").stride()


# ------------------------------------------------------------------------ loka_tune::fp8_gemm
@pytest.fixture
def cpu_opaque() -> Iterator[GPUBackend]:
    """A CPU backend built like the non-traceable GPU ones: its GEMMs go through fp8_gemm."""

    @register_backend("cpu_opaque")
    class CPUOpaque(GPUBackend):
        devices = frozenset({"cpu"})
        formats = frozenset({Format.E4M3, Format.E5M2})
        granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
        fast_accum_modes = (False, True)
        alignment = 16

        def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
            return scaled_mm_gemm(a, b, choice)

    yield get_backend("cpu_opaque")  # type: ignore[misc]
    unregister_backend("cpu_opaque")


@pytest.mark.parametrize("choice", ["e4m3.tensor.cpu_opaque", "e4m3.row.cpu_opaque", "e5m2+e4m3.tensor.cpu_opaque"])
def test_fp8_gemm_fake_matches_the_op_on_the_cpu(cpu_opaque: GPUBackend, choice: str) -> None:
    _ensure_op()
    a, b = _operands(16, 64, 32, dtype=torch.bfloat16)
    for _layout, x, y in _layouts(a, b):
        args = (x, y, "cpu_opaque", choice, "fwd")
        torch.library.opcheck(torch.ops.loka_tune.fp8_gemm.default, args)
        out = cpu_opaque.gemm(x, y, GemmChoice.parse(choice), GemmRole.FWD)  # the public path: through the op
        assert out.shape == (16, 32) and out.dtype == torch.bfloat16 and out.is_contiguous()


GPU_CHOICES = {  # one choice per role kind that each backend's kernels run through fp8_gemm
    "fbgemm": ["e4m3.row.fbgemm", "e4m3.tensor.fbgemm"],
    "triton": ["e4m3.tensor.triton", "e4m3.row.triton", "e4m3.block.triton"],
    "torch_scaled_mm": ["e4m3.tensor.torch_scaled_mm", "e4m3.row.torch_scaled_mm"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", sorted(GPU_CHOICES))
def test_fp8_gemm_fake_matches_every_gpu_backend(backend: str) -> None:
    try:
        be = get_backend(backend)
    except BackendError as e:
        pytest.skip(f"{backend}: {e}")
    _ensure_op()
    a, b = _operands(256, 512, 128, device="cuda", dtype=torch.bfloat16)
    for choice in GPU_CHOICES[backend]:
        c = GemmChoice.parse(choice)
        for role in ("fwd", "dgrad", "wgrad"):
            reason = be.supports(c, role, device="cuda", shape=(256, 512, 128))
            if reason is not None:
                continue
            for _layout, x, y in _layouts(a, b):
                torch.library.opcheck(torch.ops.loka_tune.fp8_gemm.default, (x, y, backend, choice, role))


# ----------------------------------------------------------------- loka_tune::fp8_gemm_static
# opcheck's schema test compares inputs with arithmetic that FP8 tensors do not support: the
# static weight is an FP8 input, so these ops are checked by the other three tests
_FP8_INPUT_TESTS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.fixture
def cpu_opaque_static() -> Iterator[GPUBackend]:
    """``torch_scaled_mm`` on the CPU with its static (serving) path routed through the op."""
    from loka_tune.kernels.backends.scaled_mm import ScaledMMBackend

    @register_backend("cpu_opaque_static")
    class CPUOpaqueStatic(ScaledMMBackend):
        devices = frozenset({"cpu"})
        static_traceable = False

    yield get_backend("cpu_opaque_static")  # type: ignore[misc]
    unregister_backend("cpu_opaque_static")


@pytest.mark.parametrize("choice", ["e4m3.tensor.cpu_opaque_static", "e4m3.row.cpu_opaque_static"])
def test_fp8_gemm_static_fake_matches_the_op_on_the_cpu(cpu_opaque_static: GPUBackend, choice: str) -> None:
    c = GemmChoice.parse(choice)
    a, w = _operands(16, 64, 32, dtype=torch.bfloat16)
    fn = cpu_opaque_static.static_gemm(c)  # the serving call path: the op (static_traceable off)
    data, scale = cpu_opaque_static.quantize_weight(w, c)
    for _layout, x, _ in _layouts(a, w):
        torch.library.opcheck(torch.ops.loka_tune.fp8_gemm_static.default, (x, data, scale, "cpu_opaque_static", choice),
                              test_utils=_FP8_INPUT_TESTS)
        out = fn(x, data, scale)
        assert out.shape == (16, 32) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert torch.equal(out, scaled_mm_gemm(x, w, c))


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["e4m3.row.fbgemm", "e4m3.tensor.fbgemm", "e4m3.block.fbgemm",
                                    "e4m3.row.triton", "e4m3.tensor.triton", "e4m3.block.triton"])
def test_fp8_gemm_static_fake_matches_every_gpu_backend(choice: str) -> None:
    c = GemmChoice.parse(choice)
    try:
        be = get_backend(c.backend)
    except BackendError as e:
        pytest.skip(f"{c.backend}: {e}")
    a, w = _operands(256, 512, 128, device="cuda", dtype=torch.bfloat16)
    data, scale = be.quantize_weight(w, c)
    be.static_gemm(c)  # defines the op
    torch.library.opcheck(torch.ops.loka_tune.fp8_gemm_static.default, (a, data, scale, c.backend, choice),
                          test_utils=_FP8_INPUT_TESTS)


@pytest.mark.gpu
def test_serve_fused_epilogue_fake_matches_the_op() -> None:
    pytest.importorskip("triton")
    from loka_tune.kernels import serving

    be = get_backend("triton")
    c = GemmChoice.parse("e4m3.row.fa.triton")
    a, w = _operands(256, 512, 256, device="cuda", dtype=torch.bfloat16)
    data, scale = be.quantize_weight(w, c)
    serving._ensure_fused_op()
    for bias in (None, torch.randn(256, device="cuda")):
        torch.library.opcheck(torch.ops.loka_tune.serve_fused_epilogue.default,
                              (a, data, scale, bias, 128, 1e-6, c.short_str()), test_utils=_FP8_INPUT_TESTS)


# ------------------------------------------------------------------------------ loka::cast_dual
# FP8 outputs: opcheck's schema test compares them with arithmetic FP8 does not support
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt, via", [("e4m3", ""), ("e5m2", ""), ("e4m3", "bfloat16")])
def test_cast_dual_fake_matches_the_op(device: str, fmt: str, via: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from loka_tune.kernels import dualcast  # noqa: F401  (defines the op)

    a, _ = _operands(96, 160, 8, device=device, dtype=torch.float32 if via else torch.bfloat16)
    for _layout, x, _ in _layouts(a, a):
        torch.library.opcheck(torch.ops.loka.cast_dual.default, (x, torch.tensor(3.0, device=device), fmt, via),
                              test_utils=_FP8_INPUT_TESTS)
