"""LokaLinear, the loka::gemm custom op, the emulated backend and the backend registry.

References are float64 and gradients are the analytic formulas (dX = dY W, dW = dY^T X,
db = sum dY), not autograd. SQNR floors (dB) for output, dX and dW, and what was measured
(N(0,1) data, weights N(0, 1/K)):

- brief's acceptance floor for every FP8 choice: 17 dB.
- e4m3 / mxfp8 (3 mantissa bits): tighter floor 24 dB; measured ~31 dB (output), ~28.5 dB
  (gradients: dY is not scaled like W, both operands are rounded).
- e5m2 gradient operand (2 mantissa bits) in dgrad / wgrad: floor 20 dB; measured ~24.5 dB
  (6 dB per mantissa bit less on one operand, ~4 dB on the product).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Callable

import pytest
import torch
from torch import nn

from loka_tune.config import BF16, ROLES, Format, GemmChoice, GemmRole, Granularity, ScaleRounding, SitePrecision
from loka_tune.errors import BackendError, UnsupportedChoiceError
from loka_tune.kernels import ops
from loka_tune.kernels.emulated import emulated_gemm
from loka_tune.kernels.linear import LokaLinear, find_linears
from loka_tune.kernels.quant import fake_quantize, sqnr_db
from loka_tune.kernels.registry import (
    LAZY_BACKENDS,
    Backend,
    candidate_choices,
    check_supported,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)

SHAPES = [(33, 70, 45), (256, 129, 130), (16, 64, 32)]  # (M, K, N): K, N not multiples of 16/128
FP8_CHOICES = [c.short_str() for c in candidate_choices(roles=("wgrad",))]  # incl. e5m2 gradients


def _data(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    return x, w, b, dy


def _layer(k: int, n: int, precision: SitePrecision | str, w: torch.Tensor, b: torch.Tensor | None) -> LokaLinear:
    lin = LokaLinear(k, n, bias=b is not None, precision=precision)
    with torch.no_grad():
        lin.weight.copy_(w.float())
        if b is not None:
            lin.bias.copy_(b.float())
    return lin


def _run(
    lin: LokaLinear, x: torch.Tensor, dy: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    xf = x.float().requires_grad_()
    y = (fn if fn is not None else lin)(xf)
    y.backward(dy.float())
    return y.detach(), xf.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


def _floor(choice: str) -> float:
    c = GemmChoice.parse(choice)
    return 20.0 if Format.E5M2 in (c.a_format, c.b_format) else 24.0


# ------------------------------------------------------------------------ numerics vs fp64
@pytest.mark.parametrize("choice", FP8_CHOICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lokalinear_sqnr_vs_float64(choice: str, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    x, w, b, dy = _data(m, k, n, seed=m + k + n)
    fwd = choice.replace("e5m2+e4m3", "e4m3")  # e5m2 only for the gradient operand
    lin = _layer(k, n, f"{fwd}|{choice}|{choice}", w, b)
    y, dx, dw, db = _run(lin, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = x @ w.T + b, dy @ w, dy.T @ x, dy.sum(0)  # analytic
    for name, got, ref, floor in (
        ("out", y, y_ref, _floor(fwd)),
        ("dX", dx, dx_ref, _floor(choice)),
        ("dW", dw, dw_ref, _floor(choice)),
    ):
        s = sqnr_db(ref, got)
        assert s >= 17.0 and s >= floor, f"{name}: {s:.1f} dB"
    assert sqnr_db(db_ref, db) >= 100.0  # bias grad in high precision (float32 sum)


@pytest.mark.parametrize("bias", [True, False])
def test_3d_input_e4m3_rowwise(bias: bool) -> None:
    x3, w, b, _ = _data(4 * 9, 70, 45, seed=1)
    x = x3.reshape(4, 9, 70)  # (B, n, d)
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(4, 9, 45, generator=g, dtype=torch.float64)
    lin = _layer(70, 45, "e4m3.row.emulated", w, b if bias else None)
    y, dx, dw, db = _run(lin, x, dy)
    assert y.shape == (4, 9, 45) and dx.shape == (4, 9, 70)
    y_ref = torch.einsum("bnk,ok->bno", x, w) + (b if bias else 0)
    dx_ref = torch.einsum("bno,ok->bnk", dy, w)
    dw_ref = torch.einsum("bno,bnk->ok", dy, x)
    assert sqnr_db(y_ref, y) >= 24.0
    assert sqnr_db(dx_ref, dx) >= 24.0
    assert sqnr_db(dw_ref, dw) >= 24.0
    assert (db is None) == (not bias)
    if bias:
        torch.testing.assert_close(db.double(), dy.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_plain_bf16_is_exactly_nn_linear() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(70, 45)
    lin = LokaLinear.from_linear(ref, SitePrecision())
    x = torch.randn(5, 3, 70)
    assert torch.equal(lin(x), ref(x))
    emu = LokaLinear.from_linear(ref, "bf16.emulated")  # through the custom op, float32 GEMM
    torch.testing.assert_close(emu(x), ref(x), rtol=1e-5, atol=1e-5)


def test_mixed_roles_are_independent() -> None:
    """Quantizing only one GEMM leaves the other two exact (fp32 vs fp32 nn.Linear)."""
    x, w, b, dy = _data(32, 64, 48, seed=5)
    ref = _layer(64, 48, "bf16", w, b)
    r = _run(ref, x, dy)
    for role in ROLES:
        p = {rr.value: "bf16" for rr in ROLES}
        p[role.value] = "e4m3.tensor.emulated"
        lin = _layer(64, 48, SitePrecision.from_obj(p), w, b)
        got = _run(lin, x, dy)
        for i, rr in enumerate(ROLES):
            if rr == role:
                assert not torch.equal(got[i], r[i])
                assert sqnr_db(r[i], got[i]) >= 24.0
            else:
                torch.testing.assert_close(got[i], r[i], rtol=1e-5, atol=1e-5)


def test_fast_accum_is_ignored_by_emulation() -> None:
    x, w, _, _ = _data(16, 64, 32, seed=3)
    a = emulated_gemm(x.float(), w.float(), GemmChoice.parse("e4m3.row.emulated"), "fwd")
    f = emulated_gemm(x.float(), w.float(), GemmChoice.parse("e4m3.row.fa.emulated"), "fwd")
    assert torch.equal(a, f)


def test_emulated_weight_operand_uses_128x128_blocks() -> None:
    """Blockwise B is a weight (128x128 tiles) in fwd and dgrad, an activation in wgrad."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 256, generator=g)
    b = torch.randn(200, 256, generator=g)
    b[5] *= 1e6  # a huge row inside the first 128x128 weight tile
    c = GemmChoice.parse("e4m3.block.emulated")
    qa = fake_quantize(a, "e4m3", "block")
    for role, is_weight in ((GemmRole.FWD, True), (GemmRole.DGRAD, True), (GemmRole.WGRAD, False)):
        expected = qa @ fake_quantize(b, "e4m3", "block", is_weight=is_weight).t()
        assert torch.equal(emulated_gemm(a, b, c, role), expected)


def test_dtypes_and_autocast() -> None:
    x, w, b, dy = _data(16, 64, 32, seed=9)
    lin = _layer(64, 32, "e4m3.row.emulated", w, b)
    xb = x.to(torch.bfloat16).requires_grad_()
    y = lin(xb)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    assert xb.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    assert sqnr_db(x @ w.T + b, y) >= 20.0
    lin.weight.grad = None
    xf = x.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = lin(xf)
    assert y2.dtype == torch.bfloat16
    y2.float().backward(dy.float())
    assert xf.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    assert sqnr_db(dy @ w, xf.grad) >= 20.0


# -------------------------------------------------------------------- edge magnitudes
def test_all_zero_input() -> None:
    _, w, b, dy = _data(8, 64, 32, seed=4)
    lin = _layer(64, 32, "e4m3.row.emulated|e5m2+e4m3.block.emulated|mxfp8.mx.emulated", w, b)
    y, dx, dw, _ = _run(lin, torch.zeros(8, 64, dtype=torch.float64), dy)
    assert torch.equal(y, b.float().expand(8, 32))  # exact: zeros times anything, plus bias
    assert torch.equal(dw, torch.zeros(32, 64))
    assert torch.isfinite(dx).all() and sqnr_db(dy @ w, dx) >= 20.0


@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_extreme_input_magnitudes(magnitude: float) -> None:
    x, w, b, dy = _data(16, 64, 32, seed=6)
    x = x * magnitude
    lin = _layer(64, 32, "e4m3.row.emulated", w, None)
    y, dx, dw, _ = _run(lin, x, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dw).all()
    assert sqnr_db(x @ w.T, y) >= 24.0
    assert sqnr_db(dy.T @ x, dw) >= 24.0
    assert sqnr_db(dy @ w, dx) >= 24.0


def test_nonfinite_operand_falls_back_and_is_counted() -> None:
    """Documented choice: a quantized GEMM with a non-finite operand runs unquantized for that
    call (inf/NaN propagate exactly as in the plain GEMM, instead of NaN-ing whole tiles) and
    the layer counts it in ``nonfinite_fallbacks``."""
    x, w, b, dy = _data(6, 64, 32, seed=8)
    x = x.float()
    x[2, 7] = float("inf")
    lin = _layer(64, 32, "e4m3.row.emulated", w, b)
    plain = _layer(64, 32, "bf16", w, b)
    assert lin.nonfinite_fallbacks == 0
    y = lin(x)
    assert lin.nonfinite_fallbacks == 1  # the fwd GEMM only
    y_plain = plain(x)
    assert torch.equal(torch.isfinite(y), torch.isfinite(y_plain))
    assert torch.isfinite(y[[0, 1, 3, 4, 5]]).all()
    torch.testing.assert_close(y[[0, 1, 3]], y_plain[[0, 1, 3]])  # the unquantized GEMM
    # backward: x (an operand of wgrad) is non-finite; dgrad's operands are finite
    xr = x.clone().requires_grad_()
    lin(xr).backward(dy.float())
    assert lin.nonfinite_fallbacks == 3  # + fwd + wgrad
    lin.reset_nonfinite_fallbacks()
    assert lin.nonfinite_fallbacks == 0
    prev = ops.set_nonfinite_check(False)
    try:
        y_nocheck = lin(x)
        assert lin.nonfinite_fallbacks == 0
        assert torch.isnan(y_nocheck[2]).all()  # the documented quantizer behaviour: NaN tile
    finally:
        ops.set_nonfinite_check(prev)


# ------------------------------------------------------- rowwise = along the reduction dim
# For each GEMM, make one row of one canonical operand huge (x 2^20). Scaling along the
# reduction dim (right) gives that row its own scale; scaling across it (wrong axis) puts the
# huge value in every tile, flushing the other rows' values to zero, so the output rows (A) or
# columns (B) computed from the other rows are lost. Their worst SQNR catches it.
HUGE = 2.0**20

CASES = {
    # (role, operand): how the huge canonical row is made from X (M,K), W (N,K), dY (M,N)
    ("fwd", "a"): "x_row",  # A = X: one batch row of X
    ("fwd", "b"): "w_row",  # B = W: one output row of W
    ("dgrad", "a"): "dy_row",  # A = dY: one batch row of dY
    ("dgrad", "b"): "w_col",  # B = W^T: one input column of W
    ("wgrad", "a"): "dy_col",  # A = dY^T: one output column of dY (across the batch)
    ("wgrad", "b"): "x_col",  # B = X^T: one input column of X (across the batch)
}


def _worst_other_sqnr(ref: torch.Tensor, got: torch.Tensor, operand: str, huge: int) -> float:
    """The lowest SQNR over the output rows (operand a) or columns (operand b) other than the
    huge one: a huge row of A makes output row ``huge`` huge, a huge row of B column ``huge``."""
    if operand == "b":
        ref, got = ref.t(), got.t()
    return min(sqnr_db(ref[i], got[i]) for i in range(ref.shape[0]) if i != huge)


def _wrong_axis(a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: str) -> torch.Tensor:
    """The same GEMM with every operand's tiles laid across the reduction dim (the bug)."""
    g, r = choice.granularity, choice.rounding
    b_w = role in ("fwd", "dgrad")
    qa = fake_quantize(a.t().contiguous(), choice.a_format, g, r).t()
    qb = fake_quantize(b.t().contiguous(), choice.b_format, g, r, is_weight=b_w).t()
    return qa.double() @ qb.double().t()


@pytest.mark.parametrize(
    "choice",
    ["e4m3.row.emulated", "e4m3.row.pow2.emulated", "e4m3.block.emulated", "mxfp8.mx.emulated"],
)

@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_scales_run_along_the_reduction_dim(choice: str, case: tuple[str, str]) -> None:
    role, operand = case
    if choice.startswith("e4m3.block") and operand == "b" and role in ("fwd", "dgrad"):
        pytest.skip("128x128 weight tiles share one scale across rows by design")
    m, k, n = 64, 96, 80
    x, w, _, dy = _data(m, k, n, seed=21)
    kind = CASES[case]
    if kind == "x_row":
        x[5] *= HUGE
    elif kind == "w_row":
        w[5] *= HUGE
    elif kind == "dy_row":
        dy[5] *= HUGE
    elif kind == "w_col":
        w[:, 5] *= HUGE
    elif kind == "dy_col":
        dy[:, 5] *= HUGE
    else:
        x[:, 5] *= HUGE
    lin = _layer(k, n, choice, w, None)
    y, dx, dw, _ = _run(lin, x, dy)
    got = {"fwd": y, "dgrad": dx, "wgrad": dw}[role]
    a, b = {"fwd": (x, w), "dgrad": (dy, w.t()), "wgrad": (dy.t(), x.t())}[role]  # canonical operands
    ref = a @ b.t()
    right = _worst_other_sqnr(ref, got, operand, 5)
    wrong = _worst_other_sqnr(ref, _wrong_axis(a.float(), b.float(), GemmChoice.parse(choice), role), operand, 5)
    assert right >= 20.0, f"LokaLinear {role}: worst row/column {right:.1f} dB"
    assert wrong < 6.0, f"wrong-axis scaling unexpectedly fine: {wrong:.1f} dB"


# -------------------------------------------------------------------- module mechanics
def test_from_linear_shares_parameters_and_state_dicts_load_both_ways() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    ref.register_forward_hook(lambda mod, inp, out: None)
    lin = LokaLinear.from_linear(ref, "e4m3.row.emulated", name="top.0")
    assert lin.weight is ref.weight and lin.bias is ref.bias
    assert len(lin._forward_hooks) == 1
    assert set(lin.state_dict()) == {"weight", "bias"}
    other = nn.Linear(16, 8)
    other.load_state_dict(lin.state_dict())
    assert torch.equal(other.weight, ref.weight)
    fresh = LokaLinear(16, 8, precision="e4m3.row.emulated")
    fresh.load_state_dict(nn.Linear(16, 8).state_dict())
    nobias = LokaLinear.from_linear(nn.Linear(16, 8, bias=False), "e4m3.row.emulated")
    assert nobias.bias is None and set(nobias.state_dict()) == {"weight"}
    assert "precision=e4m3.row.emulated" in repr(lin)
    lin.precision = "bf16"
    assert lin.precision == SitePrecision()
    with pytest.raises(Exception, match="top.0"):
        lin.precision = "e4m3.rows.emulated"
    with pytest.raises(TypeError):
        LokaLinear.from_linear(nn.Conv1d(1, 1, 1), "bf16")  # type: ignore[arg-type]


def test_copies_have_their_own_nonfinite_counter() -> None:
    import copy

    lin = LokaLinear(8, 4, precision="e4m3.row.emulated")
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    lin(x)
    twin = copy.deepcopy(lin)
    assert lin.nonfinite_fallbacks == 1 and twin.nonfinite_fallbacks == 0
    twin(x)
    assert lin.nonfinite_fallbacks == 1 and twin.nonfinite_fallbacks == 1
    assert twin.precision == lin.precision and torch.equal(twin.weight, lin.weight)


def test_find_linears() -> None:
    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    shared = nn.Linear(4, 4)
    model = nn.ModuleDict(
        {
            "a": nn.Sequential(nn.Linear(4, 4), nn.ReLU(), shared),
            "b": shared,
            "attn": nn.MultiheadAttention(4, 1),
            "c": Custom(4, 4),
            "d": LokaLinear(4, 4, precision="e4m3.row.emulated"),
        }
    )
    assert list(find_linears(model)) == ["a.0", "a.2", "d"]
    assert find_linears(nn.Linear(3, 3)) == {}


# --------------------------------------------------------------- custom op and compile
def test_custom_op_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 40, generator=g)
    b = torch.randn(24, 40, generator=g)
    for choice, role in (("e4m3.row.emulated", "fwd"), ("e5m2+e4m3.block.emulated", "wgrad"), ("bf16", "dgrad")):
        torch.library.opcheck(torch.ops.loka.gemm.default, (a, b, choice, role, "t"))
    out = torch.ops.loka.gemm(a.t().contiguous().t(), b, "mxfp8.mx.emulated", "fwd")  # strided input
    assert out.shape == (8, 24)


def _compile_check(backend: str) -> None:
    torch._dynamo.reset()
    x, w, b, dy = _data(12, 70, 45, seed=13)
    lin = _layer(70, 45, "e4m3.row.emulated|e5m2+e4m3.block.emulated|mxfp8.mx.emulated", w, b)
    eager = _run(lin, x.reshape(3, 4, 70), dy.reshape(3, 4, 45))
    lin.weight.grad = lin.bias.grad = None
    compiled = torch.compile(lin, fullgraph=True, backend=backend)  # fails on any graph break
    got = _run(lin, x.reshape(3, 4, 70), dy.reshape(3, 4, 45), fn=compiled)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph_aot_eager() -> None:
    _compile_check("aot_eager")
    torch._dynamo.reset()
    explain = torch._dynamo.explain(LokaLinear(16, 8, precision="e4m3.row.emulated"))(torch.randn(4, 16))
    assert explain.graph_break_count == 0 and explain.graph_count == 1


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor() -> None:
    _compile_check("inductor")


# ---------------------------------------------------------------------------- registry
def test_list_backends_lists_lazy_ones_without_importing() -> None:
    names = list_backends()
    assert {"bf16", "emulated", "torch_scaled_mm", "fbgemm", "triton", "torchao"} <= set(names)
    code = (
        "import sys; from loka_tune.kernels.registry import list_backends, LAZY_BACKENDS;"
        "names = list_backends();"
        "assert {'torch_scaled_mm', 'fbgemm', 'triton', 'torchao'} <= set(names), names;"
        "loaded = [m for m, _ in LAZY_BACKENDS.values() if m in sys.modules and 'backends' in m];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_get_backend_errors() -> None:
    with pytest.raises(BackendError) as ei:
        get_backend("nope")
    assert "nope" in str(ei.value) and "emulated" in str(ei.value)
    LAZY_BACKENDS["_missing_dep"] = ("loka_tune.kernels._does_not_exist_", "the moon (`pip install moon`)")
    try:
        with pytest.raises(BackendError, match="_missing_dep"):
            get_backend("_missing_dep")
    finally:
        del LAZY_BACKENDS["_missing_dep"]
    assert get_backend("emulated") is get_backend("emulated")
    assert isinstance(get_backend("bf16"), Backend)


def test_lazy_backend_with_missing_dependency_says_what_to_install(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "lt_fake_backend_mod.py").write_text("import lt_definitely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(LAZY_BACKENDS, "fakegpu", ("lt_fake_backend_mod", "fakegpu-kernels (`pip install fakegpu`)"))
    with pytest.raises(BackendError) as ei:
        get_backend("fakegpu")
    assert "pip install fakegpu" in str(ei.value) and "lt_definitely_not_installed_pkg" in str(ei.value)


@pytest.fixture
def aligned_backend():  # type: ignore[no-untyped-def]
    @register_backend("testaligned")
    class Aligned(Backend):
        formats = frozenset({Format.E4M3})
        granularities = frozenset({Granularity.ROW, Granularity.TENSOR})
        roles = frozenset({GemmRole.FWD, GemmRole.DGRAD})
        roundings = frozenset({ScaleRounding.EXACT})
        fast_accum_modes = (False, True)
        devices = frozenset({"cuda"})
        alignment = 16

        def gemm(self, a, b, choice, role):  # type: ignore[no-untyped-def]
            return a @ b.t()

    yield Aligned
    unregister_backend("testaligned")
    assert "testaligned" not in list_backends()


def test_custom_backend_capabilities_and_check_supported(aligned_backend) -> None:  # type: ignore[no-untyped-def]
    Aligned = aligned_backend
    be = get_backend("testaligned")
    ok = GemmChoice.parse("e4m3.row.testaligned")
    assert be.supports(ok, "fwd", device="cuda:0", shape=(None, 64, 32)) is None
    assert "device 'cpu'" in be.supports(ok, "fwd", device="cpu")
    assert "k=70" in be.supports(ok, "fwd", device="cuda", shape=(8, 70, 32))
    assert "n=33" in be.supports(ok, "dgrad", device="cuda", shape=(8, 64, 33))
    assert "role 'wgrad'" in be.supports(ok, "wgrad", device="cuda")
    assert "block" in be.supports(GemmChoice.parse("e4m3.block.testaligned"), "fwd", device="cuda")
    assert "pow2" in be.supports(GemmChoice.parse("e4m3.row.pow2.testaligned"), "fwd", device="cuda")
    with pytest.raises(UnsupportedChoiceError) as ei:
        check_supported(ok, "fwd", "cpu", site="top.0")
    msg = str(ei.value)
    assert "top.0" in msg and "e4m3.row.testaligned" in msg and "devices ['cuda']" in msg
    assert "k and n multiples of 16" in msg
    got = candidate_choices(["testaligned"], roles=["fwd"], fast_accum=None)
    assert [c.short_str() for c in got] == [
        "e4m3.tensor.testaligned",
        "e4m3.tensor.fa.testaligned",
        "e4m3.row.testaligned",
        "e4m3.row.fa.testaligned",
    ]
    assert candidate_choices(["testaligned"], roles=["fwd"], device="cpu") == []
    assert candidate_choices(["testaligned"], roles=["fwd"], device="cuda", shape=(8, 70, 32)) == []
    with pytest.raises(BackendError, match="already registered"):

        @register_backend("testaligned")
        class Other(Aligned):
            pass

    with pytest.raises(BackendError, match="lower-case"):
        register_backend("Bad-Name")


def test_candidate_choices_emulated() -> None:
    fwd = candidate_choices(roles=["fwd"])
    wgrad = candidate_choices(roles=["wgrad"])
    assert all(c.backend == "emulated" for c in fwd + wgrad)
    assert not any(Format.E5M2 in (c.a_format, c.b_format) for c in fwd)
    e5 = [c for c in wgrad if c.a_format == Format.E5M2]
    assert e5 and all(c.b_format == Format.E4M3 for c in e5)
    assert {c.short_str() for c in fwd} < {c.short_str() for c in wgrad}
    assert candidate_choices(roles=ROLES) == fwd  # valid for all three: no e5m2
    assert len({c.short_str() for c in wgrad}) == len(wgrad)
    assert not any(c.fast_accum for c in wgrad)  # 'fa' is a no-op in the emulation
    only = candidate_choices(granularities=["row"], formats=["e4m3"], roles=["dgrad"])
    assert [c.short_str() for c in only] == ["e4m3.row.emulated", "e4m3.row.pow2.emulated"]
    assert candidate_choices(include_bf16=True)[0] == BF16
    with pytest.raises(BackendError):
        candidate_choices(["nope"])


def test_emulated_supports_everything_on_cpu() -> None:
    be = get_backend("emulated")
    for c in candidate_choices(roles=["wgrad"]) + [GemmChoice.parse("e4m3.row.fa.emulated")]:
        for r in ROLES:
            if Format.E5M2 in (c.a_format,) and r == GemmRole.FWD:
                continue
            assert be.supports(c, r, device="cpu", shape=(3, 5, 7)) is None
    assert "format" in get_backend("bf16").supports(GemmChoice.parse("e4m3.row.bf16"), "fwd", device="cpu")


def test_imports_stay_light() -> None:
    code = (
        "import sys, loka_tune, loka_tune.kernels, loka_tune.kernels.linear, loka_tune.applier;"
        "heavy = [m for m in ('triton', 'fbgemm_gpu', 'torchao', 'mlflow', 'optuna') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
