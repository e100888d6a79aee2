"""``Backend.error_gemm``: the GEMM the probe measures errors with.

``torch_scaled_mm`` answers it with the compiled step's own path (torch quantization ops and
``torch._scaled_mm``, :func:`~loka_tune.kernels.scaled.scaled_mm_gemm`) instead of its eager
Triton quantizer, which compiles anew at each operand width. Both must give the numerics of
:meth:`gemm`: on the CPU through a backend built exactly like ``torch_scaled_mm``
(``torch._scaled_mm`` runs there, its quantizer the reference's), on the H200 against the
real Triton path, on adversarial operands (constant, zero rows, a huge range, ill-conditioned).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from torch import nn

from loka_tune.config import GemmChoice, GemmRole
from loka_tune.kernels.backends import GPUBackend
from loka_tune.kernels.registry import get_backend, register_backend, unregister_backend
from loka_tune.probe import Probe, measure

CHOICES = ["e4m3.tensor", "e5m2.tensor", "e4m3.row", "e4m3.row.fa", "e4m3.tensor.fa"]


def _operands(kind: str, m: int, k: int, n: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a (m, k), b (n, k))`` bf16 of one adversarial kind."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, generator=g, device=device)
    b = torch.randn(n, k, generator=g, device=device)
    if kind == "constant":
        a = torch.full_like(a, 0.37)
    elif kind == "zero_rows":
        a[::3] = 0.0
        b[1] = 0.0
    elif kind == "huge_range":  # ~2^-20 .. 2^20 across the rows and columns
        a = a * torch.logspace(-6, 6, m, device=device)[:, None]
        b = b * torch.logspace(6, -6, k, device=device)[None, :]
    elif kind == "ill_conditioned":  # rank-2 plus a tiny full-rank part
        u = torch.randn(m, 2, generator=g, device=device)
        a = u @ torch.randn(2, k, generator=g, device=device) * 50 + 1e-4 * a
    return a.to(torch.bfloat16), b.to(torch.bfloat16)


KINDS = ["gaussian", "constant", "zero_rows", "huge_range", "ill_conditioned"]


@pytest.fixture
def cpu_scaled_mm() -> Iterator[GPUBackend]:
    """``torch_scaled_mm``'s class on the CPU (its quantizer there: the reference one)."""
    from loka_tune.kernels.backends.scaled_mm import ScaledMMBackend

    @register_backend("cpu_scaled_mm")
    class CPUScaledMM(ScaledMMBackend):
        devices = frozenset({"cpu"})

    yield get_backend("cpu_scaled_mm")  # type: ignore[misc]
    unregister_backend("cpu_scaled_mm")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("choice", CHOICES)
def test_error_gemm_is_the_backends_gemm_bit_for_bit_on_the_cpu(cpu_scaled_mm: GPUBackend, choice: str,
                                                                 kind: str) -> None:
    c = GemmChoice.parse(f"{choice}.cpu_scaled_mm")
    for m, k, n in [(48, 64, 32), (33, 160, 16)]:
        a, b = _operands(kind, m, k, n, "cpu")
        for role in GemmRole:
            for x, y in [(a, b), (a.t().contiguous().t(), b.t().contiguous().t())]:
                want = cpu_scaled_mm.gemm_impl(x, y, c, role)
                got = cpu_scaled_mm.error_gemm(x, y, c, role)
                assert got.dtype == want.dtype and got.shape == (m, n)
                assert torch.equal(got, want), (choice, kind, role, (m, k, n))


def test_a_backend_without_its_own_error_path_measures_with_gemm() -> None:
    be = get_backend("emulated")
    c = GemmChoice.parse("e4m3.row.emulated")
    a, b = _operands("huge_range", 40, 64, 24, "cpu")
    assert torch.equal(be.error_gemm(a, b, c, GemmRole.WGRAD), be.gemm(a, b, c, GemmRole.WGRAD))


def test_the_probe_measures_through_error_gemm(cpu_scaled_mm: GPUBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's errors come from ``error_gemm`` (counted), and equal those of ``gemm``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Probe(model, every=1) as p:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(128, 64) * 3).square().mean().backward()
            opt.step()
    cands = ["e4m3.tensor.cpu_scaled_mm", "e4m3.row.cpu_scaled_mm"]
    calls: list[str] = []
    cls = type(cpu_scaled_mm)
    own = cls.error_gemm

    def counted(self: GPUBackend, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        calls.append(choice.short_str())
        return own(self, a, b, choice, role)

    monkeypatch.setattr(cls, "error_gemm", counted)
    fast = measure(p.stats, cands, samples=3, seed=1)
    assert len(calls) == 3 * 3 * len(cands)  # draws x roles x candidates
    monkeypatch.setattr(cls, "error_gemm", lambda self, a, b, choice, role: self.gemm_impl(a, b, choice, role))
    slow = measure(p.stats, cands, samples=3, seed=1)
    key = lambda r: (r.site, r.role, r.choice)  # noqa: E731
    got = {key(r): (r.mere, r.sqnr_db) for r in fast.results}
    want = {key(r): (r.mere, r.sqnr_db) for r in slow.results}
    assert got.keys() == want.keys() and len(got) == 3 * (len(cands) + 1)  # bf16 included
    assert all(0.0 < got[k][0] < 0.2 for k in got if "cpu_scaled_mm" in k[2])
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_error_gemm_matches_the_triton_path_on_the_gpu(kind: str) -> None:
    """On CUDA ``gemm`` quantizes with our Triton kernels (bit-exact FP8 data; scales within
    1e-6, tests/test_gpu_backends.py); ``error_gemm`` with torch ops: the outputs agree to the
    bf16 rounding of those scales, far inside FP8's own error."""
    pytest.importorskip("triton")
    be = get_backend("torch_scaled_mm")
    ran = 0
    for choice in CHOICES:
        c = GemmChoice.parse(f"{choice}.torch_scaled_mm")
        if be.supports(c, GemmRole.FWD, device="cuda") is not None:  # e5m2 x e5m2: no cuBLASLt kernel
            continue
        ran += 1
        for m, k, n in [(4096, 2048, 1024), (4096, 64, 32), (2048, 16384, 4096)]:
            a, b = _operands(kind, m, k, n, "cuda")
            for role in GemmRole:
                want = be.gemm(a, b, c, role).double()
                got = be.error_gemm(a, b, c, role).double()
                ref = a.double() @ b.double().t()
                diff = (got - want).norm() / want.norm().clamp_min(1e-30)
                fp8 = (want - ref).norm() / ref.norm().clamp_min(1e-30)
                assert diff <= 1e-2 * max(float(fp8), 1e-3), (choice, kind, role, (m, k, n), float(diff), float(fp8))
    assert ran == len(CHOICES) - 1  # all but e5m2.tensor
