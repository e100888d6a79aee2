"""The contract every GEMM backend keeps, as a test class a backend's tests inherit.

A backend gets the whole suite by inheriting one class and naming what to check (anchor:
optuna's ``optuna/testing/pytest_samplers.py``)::

    class TestEmulatedConformance(BackendConformance):
        backend = "emulated"
        choices = ("e4m3.row.emulated", "e5m2+e4m3.block.emulated", ...)

GPU backends inherit :class:`GPUBackendConformance` instead: marked ``gpu`` (they skip on a
CPU-only machine, tests/conftest.py), on ``cuda``, plus the CUDA-graph check. The classes
live in tests/test_backend_conformance.py (``bf16``, ``emulated``) and
tests/test_gpu_backends.py (``torch_scaled_mm``, ``fbgemm``, ``triton``, ``torchao``). A
backend whose optional dependency is missing skips with the install hint.

The contract, for every choice x role x shape of the class (canonical ``(m, k, n)``, operands
laid out as the role delivers them: :func:`loka_tune.kernels.timing.make_operands`):

1. **Matches the emulated oracle** on the same inputs within the SQNR floor of the role
   (:func:`oracle_floor_db`), while the FP8 error itself (emulated vs float64) is real and
   above its own floor (:func:`fp8_floor_db`), so the comparison means something.
2. **Returns** ``(m, n)`` **in** ``a.dtype``, finite.
3. **Honours** :meth:`~loka_tune.kernels.registry.Backend.supports`: through the public
   paths (:func:`~loka_tune.kernels.registry.check_supported`, :func:`loka_tune.apply`) a
   choice it declares unsupported raises :class:`UnsupportedChoiceError` quoting the reason,
   and one it supports does not; ``must_refuse`` lists cases it has to refuse.
4. **Works under** ``torch.compile(fullgraph=True)`` (inductor) with eager's numbers, and,
   for GPU backends, under CUDA-graph capture and replay (bit-identical to eager).
"""

from __future__ import annotations

import itertools
import math
import zlib
from typing import Any, ClassVar, Sequence

import pytest
import torch
from torch import nn

from loka_tune.applier import apply
from loka_tune.config import ROLES, Format, GemmChoice, GemmRole, Granularity, PrecisionConfig, ScaleRounding
from loka_tune.errors import BackendError, ConfigError, UnsupportedChoiceError
from loka_tune.kernels.emulated import emulated_gemm
from loka_tune.kernels.quant import sqnr_db
from loka_tune.kernels.registry import Backend, check_supported, get_backend
from loka_tune.kernels.timing import make_operands

__all__ = ["BackendConformance", "GPUBackendConformance", "fp8_floor_db", "oracle_floor_db"]

# ---------------------------------------------------------------------------------- floors
# Against the emulated oracle on the same inputs (tests/test_gpu_backends.py's bounds, as
# SQNR: a relative Frobenius error r is -20 log10(r) dB): r < 1e-2 (40 dB) for backends that
# quantize with our reference / Triton quantizers (bit-identical FP8 data and scales: what is
# left is the output rounding and the accumulation order); r < 2e-2 (34 dB) for library
# quantizers (FBGEMM, torchao: scales as amax / fmax or with an eps floor) and for an e5m2
# operand (2-bit mantissa: the output-rounding share is larger; seen 1.01e-2 on the H200).
OWN_QUANT_FLOOR_DB = -20.0 * math.log10(1e-2)  # 40 dB
LIB_QUANT_FLOOR_DB = -20.0 * math.log10(2e-2)  # 34 dB
# The FP8 error itself, emulated vs float64 (tests/test_linear.py's floors): >= 24 dB for
# e4m3 / mxfp8 (3 mantissa bits), >= 20 dB with an e5m2 gradient operand (dgrad / wgrad);
# bf16 choices: >= 40 dB. And FP8 must err by more than 5e-3 (<= 46 dB, the choice really
# quantizes) and at least twice as much as the backend differs from the oracle (6.02 dB).
FP8_MAX_DB = -20.0 * math.log10(5e-3)  # 46 dB
MARGIN_DB = 20.0 * math.log10(2.0)  # 6.02 dB

#: (m, k, n): aligned, K not a multiple of 128, odd M, tiny (tests/test_gpu_backends.py)
GPU_SHAPES = ((1024, 512, 256), (2048, 1040, 528), (777, 256, 384), (256, 128, 64))
#: small CPU shapes with ragged tiles: K, N not multiples of 16 / 32 / 128
CPU_SHAPES = ((64, 48, 32), (33, 70, 45), (130, 136, 16))


def oracle_floor_db(choice: GemmChoice, *, lib_quant: bool = False) -> float:
    """SQNR floor (dB) of a backend's output against the emulated oracle, for the choice a role
    runs: 34 dB with a library quantizer or an e5m2 operand (the gradient operand of dgrad /
    wgrad), else 40 dB."""
    e5m2 = Format.E5M2 in (choice.a_format, choice.b_format)
    return LIB_QUANT_FLOOR_DB if lib_quant or e5m2 else OWN_QUANT_FLOOR_DB


def fp8_floor_db(choice: GemmChoice) -> float:
    """SQNR floor (dB) of the emulated output against float64, for the choice a role runs:
    20 dB with an e5m2 operand (dgrad / wgrad), 24 dB for e4m3 / mxfp8, 40 dB for bf16."""
    if choice.is_bf16:
        return 40.0
    return 20.0 if Format.E5M2 in (choice.a_format, choice.b_format) else 24.0


def _all_choices(backend: str) -> list[GemmChoice]:
    """Every valid GemmChoice naming ``backend`` (bf16 included): the grid supports() is checked on."""
    out = [GemmChoice(backend=backend)]
    fmts = (Format.E4M3, Format.E5M2, Format.MXFP8)
    for a, b, g, r, fa in itertools.product(fmts, fmts, list(Granularity), list(ScaleRounding), (False, True)):
        try:
            c = GemmChoice(a, b, g, r, fa, backend)
        except ConfigError:  # an invalid combination: not a choice at all
            continue
        if c not in out:
            out.append(c)
    return out


def _case_id(choice: str, role: str, shape: Sequence[int]) -> str:
    return f"{choice}-{role}-{'x'.join(map(str, shape))}"


class BackendConformance:
    """The suite; subclass it and set the class attributes below (see the module docstring)."""

    backend: ClassVar[str] = ""
    #: choice ids checked against the oracle, every role and shape
    choices: ClassVar[tuple[str, ...]] = ()
    #: choice ids quantized by a library (looser oracle floor, :func:`oracle_floor_db`)
    lib_quant: ClassVar[frozenset[str]] = frozenset()
    device: ClassVar[str] = "cpu"
    shapes: ClassVar[tuple[tuple[int, int, int], ...]] = CPU_SHAPES
    #: operand dtypes the backend must return unchanged
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float32)
    #: (choice, role, device or None for ``device``) that supports() must refuse
    must_refuse: ClassVar[tuple[tuple[str, str, str | None], ...]] = ()
    #: (choice, role, shape) run under torch.compile; a pytest.param may carry an xfail mark
    compile_cases: ClassVar[tuple[Any, ...]] = ()

    # ------------------------------------------------------------------ parametrization
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Per subclass: ``case`` over choices x roles x shapes, ``refusal`` over
        ``must_refuse``, ``compile_case`` over ``compile_cases``."""
        if "case" in metafunc.fixturenames:
            cases = [(c, r.value, s) for c, r, s in itertools.product(self.choices, ROLES, self.shapes)]
            metafunc.parametrize("case", cases, ids=[_case_id(*x) for x in cases])
        if "refusal" in metafunc.fixturenames:
            metafunc.parametrize("refusal", self.must_refuse or [None],
                                 ids=[f"{c}-{r}-{d or self.device}" for c, r, d in self.must_refuse] or ["none"])
        if "compile_case" in metafunc.fixturenames:
            cases = list(self.compile_cases) or [None]
            ids = [_case_id(*(x.values[0] if hasattr(x, "values") else x)) for x in self.compile_cases] or ["none"]
            metafunc.parametrize("compile_case", cases, ids=ids)

    @pytest.fixture
    def be(self) -> Backend:
        try:
            return get_backend(self.backend)
        except BackendError as e:
            pytest.skip(f"{self.backend}: {e}")

    def _operands(self, m: int, k: int, n: int, role: str, *, seed: int,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return make_operands(m, k, n, role, dtype=dtype, device=self.device, generator=g)

    # ------------------------------------------------------------------ 1 + 2: numerics
    def test_matches_emulated(self, be: Backend, case: tuple[str, str, tuple[int, int, int]]) -> None:
        choice, role, shape = case
        c, (m, k, n) = GemmChoice.parse(choice), shape
        reason = be.supports(c, role, device=self.device, shape=shape)
        if reason is not None:
            with pytest.raises(UnsupportedChoiceError):
                check_supported(c, role, self.device, shape)
            pytest.skip(f"declared unsupported: {reason}")
        a, b = self._operands(m, k, n, role, seed=zlib.crc32(f"{choice}{role}{shape}".encode()) % 10_000)
        out = be.gemm(a, b, c, GemmRole(role))
        assert out.shape == (m, n) and out.dtype == a.dtype, (tuple(out.shape), out.dtype)
        assert torch.isfinite(out).all()
        emu = emulated_gemm(a, b, c, role)
        exact = a.double() @ b.double().t()
        got, floor = sqnr_db(emu, out), oracle_floor_db(c, lib_quant=choice in self.lib_quant)
        assert got >= floor, f"{choice} {role} {shape}: SQNR vs emulated {got:.1f} dB < {floor:.1f} dB"
        fp8, fp8_floor = sqnr_db(exact, emu), fp8_floor_db(c)
        assert fp8 >= fp8_floor, f"{choice} {role} {shape}: emulated vs float64 {fp8:.1f} dB < {fp8_floor:.0f} dB"
        if not c.is_bf16:  # the comparison is meaningful: FP8's own error is much larger
            assert fp8 <= FP8_MAX_DB, f"{choice} {role}: FP8 error {fp8:.1f} dB: is this choice quantizing?"
            assert got >= fp8 + MARGIN_DB, f"{choice} {role} {shape}: {got:.1f} dB vs emulated, FP8 {fp8:.1f} dB"

    def test_returns_a_dtype(self, be: Backend) -> None:
        m, k, n = self.shapes[0]
        for choice, role, dtype in itertools.product(self.choices, ROLES, self.dtypes):
            c = GemmChoice.parse(choice)
            if be.supports(c, role, device=self.device, shape=(m, k, n)) is not None:
                continue
            a, b = self._operands(m, k, n, role.value, seed=7, dtype=dtype)
            out = be.gemm(a, b, c, role)
            assert out.dtype == dtype and out.shape == (m, n), (choice, role.value, dtype, out.dtype)

    # ------------------------------------------------------------------ 3: supports()
    def test_check_supported_agrees_with_supports(self, be: Backend) -> None:
        """Over every choice naming this backend, every role and shape (misaligned ones too):
        check_supported raises UnsupportedChoiceError quoting the reason iff supports() gives one."""
        wrong = []
        for c, role, shape in itertools.product(_all_choices(self.backend), ROLES, (*self.shapes, (40, 70, 45))):
            reason = be.supports(c, role, device=self.device, shape=shape)
            try:
                check_supported(c, role, self.device, shape)
            except UnsupportedChoiceError as e:
                if reason is None or reason not in str(e):
                    wrong.append((c.short_str(), role.value, shape, reason, str(e)[:120]))
            else:
                if reason is not None:
                    wrong.append((c.short_str(), role.value, shape, reason, "no error"))
        assert not wrong, wrong[:5]

    def test_refuses_through_the_public_paths(self, be: Backend, refusal: tuple[str, str, str | None] | None) -> None:
        if refusal is None:
            pytest.skip(f"{self.backend} runs every choice on its devices: nothing it must refuse")
        choice, role, device = refusal
        dev = device or self.device
        c = GemmChoice.parse(choice)
        reason = be.supports(c, role, device=dev, shape=None)
        assert reason is not None, f"{self.backend} claims to run {choice} {role} on {dev}"
        with pytest.raises(UnsupportedChoiceError, match="cannot run"):
            check_supported(c, role, dev)
        model = nn.Sequential(nn.Linear(64, 32)).to(dev)
        site = {"fwd": "bf16", "dgrad": "bf16", "wgrad": "bf16", role: choice}
        with pytest.raises(UnsupportedChoiceError, match="site '0'"):
            apply(model, PrecisionConfig.from_sites({"0": site}))
        summary = apply(model, PrecisionConfig.from_sites({"0": site}), strict=False)
        assert role in summary.fallbacks["0"]  # strict=False: that GEMM runs in bf16

    # ------------------------------------------------------------------ 4: compile, graphs
    def test_torch_compile(self, be: Backend, compile_case: tuple[str, str, tuple[int, int, int]] | None) -> None:
        if compile_case is None:
            pytest.skip("no compile_cases declared")
        choice, role, (m, k, n) = compile_case
        c, r = GemmChoice.parse(choice), GemmRole(role)
        a, b = self._operands(m, k, n, role, seed=1)
        eager = be.gemm(a, b, c, r)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, y: be.gemm(x, y, c, r) * 2.0, fullgraph=True)  # fails on a graph break
        torch.testing.assert_close(fn(a, b), eager * 2.0, rtol=1e-2, atol=1e-2)


class GPUBackendConformance(BackendConformance):
    """:class:`BackendConformance` on CUDA, plus capture and replay in a CUDA graph."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.gpu]
    device: ClassVar[str] = "cuda"
    shapes: ClassVar[tuple[tuple[int, int, int], ...]] = GPU_SHAPES
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)
    #: (choice, role, shape) captured in a CUDA graph
    graph_case: ClassVar[tuple[str, str, tuple[int, int, int]] | None] = None

    def test_cuda_graph(self, be: Backend) -> None:
        if self.graph_case is None:
            pytest.skip("no graph_case declared")
        choice, role, (m, k, n) = self.graph_case
        c, r = GemmChoice.parse(choice), GemmRole(role)
        a, b = self._operands(m, k, n, role, seed=1)
        sa, sb = a.clone(), b.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up outside the capture (lazy init, autotuning)
            be.gemm(sa, sb, c, r)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = be.gemm(sa, sb, c, r)
        a2, b2 = self._operands(m, k, n, role, seed=2)  # replay on new data copied into the inputs
        sa.copy_(a2)
        sb.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(g_out, be.gemm(a2, b2, c, r), rtol=0, atol=0)
