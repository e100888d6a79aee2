"""loka_tune.kernels.dualcast: one cast writing both FP8 layouts of a tensorwise operand
(``torch.ops.loka.cast_dual``), and LokaLinear's shared tensorwise path through it.

CPU: the op's reference against ``cast_to_fp8`` (bit for bit, on adversarial data and strided
views), against float64 (SQNR floors), its errors, and LokaLinear with the mode on against off
(bit for bit, eager and compiled). GPU (marked): the Triton kernel against the reference bit for
bit, and a compiled LokaLinear on CUDA taking the kernel by default.
"""

from __future__ import annotations

import pytest
import torch
from _bench import linear_grads64
from torch import nn

from loka_tune.config import Format, Granularity, ScaleRounding
from loka_tune.kernels import dualcast
from loka_tune.kernels import linear as lin_mod
from loka_tune.kernels.dualcast import cast_dual_reference, cast_to_fp8_dual, dual_cast_mode, set_dual_cast
from loka_tune.kernels.linear import LokaLinear
from loka_tune.kernels.quant import sqnr_db
from loka_tune.kernels.scaled import cast_to_fp8, transposed

FORMATS = [Format.E4M3, Format.E5M2]
ROUNDINGS = list(ScaleRounding)


def _adversarial(kind: str, r: int, c: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(r * 7 + c)
    if kind == "gauss":
        return torch.randn(r, c, generator=g).to(device)
    if kind == "range":  # columns spanning 10 decades
        return (torch.randn(r, c, generator=g) * torch.logspace(-5, 5, c)).to(device)
    if kind == "const":
        return torch.full((r, c), -3.25, device=device)
    if kind == "zeros":
        return torch.zeros(r, c, device=device)
    if kind == "illcond":  # rank one plus a tiny tail: one huge direction
        u, v = torch.randn(r, 1, generator=g), torch.randn(1, c, generator=g)
        return (1e4 * u @ v + 1e-3 * torch.randn(r, c, generator=g)).to(device)
    raise ValueError(kind)


KINDS = ["gauss", "range", "const", "zeros", "illcond"]


# --------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_both_layouts_are_cast_to_fp8_and_its_transpose_bit_for_bit(fmt: Format, rounding: ScaleRounding,
                                                                    kind: str) -> None:
    x = _adversarial(kind, 48, 80).to(torch.bfloat16)
    for view in (x, x.t().contiguous().t()):  # row-major, and a column-major view of the same values
        (d, s), (dt, st) = cast_to_fp8_dual(view, fmt, rounding)
        rd, rs = cast_to_fp8(view, fmt, Granularity.TENSOR, rounding)
        td, ts = transposed((rd, rs))
        assert d.shape == (48, 80) and dt.shape == (80, 48) and d.is_contiguous() and dt.is_contiguous()
        assert d.dtype == dt.dtype == rd.dtype
        assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8))
        assert torch.equal(dt.view(torch.uint8), td.view(torch.uint8))
        assert torch.equal(s, rs) and torch.equal(st, ts)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp32_master_weight_is_rounded_through_the_compute_dtype_first(fmt: Format) -> None:
    w = _adversarial("range", 64, 32)  # float32
    (d, s), (dt, _) = cast_to_fp8_dual(w, fmt, ScaleRounding.POW2, via=torch.bfloat16)
    rd, rs = cast_to_fp8(w.to(torch.bfloat16), fmt, Granularity.TENSOR, ScaleRounding.POW2)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(dt.view(torch.uint8), rd.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt, floor", [(Format.E4M3, 25.0), (Format.E5M2, 18.0)])
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (129, 7), (256, 384)])
def test_the_dequantized_copies_against_float64(fmt: Format, floor: float, shape: tuple[int, int]) -> None:
    x = _adversarial("gauss", *shape)
    (d, s), (dt, st) = cast_to_fp8_dual(x, fmt, ScaleRounding.POW2)
    x64 = x.double()
    assert sqnr_db(x64, d.double() * s.double()) > floor
    assert sqnr_db(x64.t(), dt.double() * st.double()) > floor


def test_the_reference_saturates_and_the_fake_gives_the_shapes() -> None:
    x = torch.tensor([[1.0, -2.0, 1000.0], [0.0, 3.5, -1e6]])
    y, yt = torch.ops.loka.cast_dual(x, torch.tensor(2.0), "e4m3")
    assert y.float().tolist() == [[2.0, -4.0, 448.0], [0.0, 7.0, -448.0]]
    assert torch.equal(yt.float(), y.float().t())
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fy, fyt = torch.ops.loka.cast_dual(torch.empty(5, 7), torch.empty(()), "e5m2", "bfloat16")
        assert fy.shape == (5, 7) and fyt.shape == (7, 5) and fy.dtype == torch.float8_e5m2


@pytest.mark.parametrize("args, match", [
    ((torch.ones(4), torch.tensor(1.0), "e4m3", ""), r"2-D operand \(rows, cols\), got shape \(4,\); flatten"),
    ((torch.ones(2, 2), torch.ones(2), "e4m3", ""), r"one tensorwise scale, got 2 elements"),
    ((torch.ones(2, 2), torch.tensor(1.0), "mxfp8", ""), r"writes e4m3 or e5m2, got fmt='mxfp8'"),
    ((torch.ones(2, 2), torch.tensor(1.0), "e4m3", "int8"), r"rounds through one of .*got via='int8'"),
])
def test_bad_operands_are_named_with_the_fix(args: tuple, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        torch.ops.loka.cast_dual(*args)


def test_the_default_is_off_and_the_environment_sets_it() -> None:
    """Off unless asked for (the op's host cost slowed host-bound steps: dualcast's docstring)."""
    import os
    import subprocess
    import sys

    code = "from loka_tune.kernels import dualcast; print(dualcast.get_dual_cast())"
    env = {k: v for k, v in os.environ.items() if k != "LOKA_DUAL_CAST"}
    for value, want in ((None, "off"), ("", "off"), ("auto", "auto"), ("On", "on")):
        e = env if value is None else {**env, "LOKA_DUAL_CAST": value}
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "LOKA_DUAL_CAST": "yes"}, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "LOKA_DUAL_CAST= 'yes' is not a dual-cast mode; use one of auto, on, off" in bad.stderr


def test_the_mode_is_checked_and_restored() -> None:
    assert dualcast.get_dual_cast() in dualcast.DUAL_CAST_MODES
    with pytest.raises(ValueError, match=r"set_dual_cast: 'sometimes' is not a dual-cast mode; use one of auto, on, off"):
        set_dual_cast("sometimes")
    before = dualcast.get_dual_cast()
    with dual_cast_mode("OFF"):
        assert dualcast.get_dual_cast() == "off"
    assert dualcast.get_dual_cast() == before
    with pytest.raises(ValueError, match=r"LOKA_DUAL_CAST= 'x' is not a dual-cast mode"):
        dualcast._check_mode("x", "LOKA_DUAL_CAST=")
    with pytest.raises(ValueError, match=r"rounds through bfloat16 or float16, got via=torch.int8"):
        cast_to_fp8_dual(torch.ones(2, 2), Format.E4M3, ScaleRounding.POW2, via=torch.int8)


def test_the_form_is_checked_and_the_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys

    code = "from loka_tune.kernels import dualcast; print(dualcast.get_dual_cast_op())"
    env = {k: v for k, v in os.environ.items() if k != "LOKA_DUAL_CAST_OP"}
    for value, want in ((None, "inline"), ("Opaque", "opaque")):
        e = env if value is None else {**env, "LOKA_DUAL_CAST_OP": value}
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
    with pytest.raises(ValueError, match=r"set_dual_cast_op: 'fast' is not a form of the dual cast; use one of inline, opaque"):
        dualcast.set_dual_cast_op("fast")
    # without triton there is no inline form, and setting a mode does not fail for it
    monkeypatch.setattr(dualcast, "_INLINE", {})
    monkeypatch.setattr(dualcast, "triton_available", lambda: False)
    with dual_cast_mode("auto"):
        assert dualcast.inline_op() is None


def test_a_triton_that_cannot_be_imported_leaves_the_opaque_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dualcast, "_INLINE", {})
    monkeypatch.setattr(dualcast, "triton_available", lambda: True)

    def broken() -> None:
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(dualcast, "_register_inline", broken)
    with dual_cast_mode("on"):  # registers (and fails) here, outside any trace
        assert dualcast._INLINE == {"op": None}
        x = torch.randn(6, 5)
        (d, inv), (dt, _) = cast_to_fp8_dual(x, Format.E4M3, ScaleRounding.EXACT)  # the opaque op: the reference
        assert torch.equal(dt.view(torch.uint8), d.t().contiguous().view(torch.uint8))


def test_the_inline_form_under_the_triton_interpreter() -> None:
    """Where triton is installed (not in CI), the triton_op runs eagerly under TRITON_INTERPRET=1
    on the CPU and writes what the opaque form writes (the interpreter's own FP8 rounding on both)."""
    import os
    import subprocess
    import sys

    if not dualcast.triton_available():
        pytest.skip("needs triton (the interpreter runs on the CPU)")
    code = (
        "import torch\n"
        "from loka_tune.config import Format\n"
        "from loka_tune.kernels import dualcast\n"
        "from loka_tune.kernels.triton_quant import dual_cast\n"
        "op = dualcast.inline_op()\n"
        "x = (torch.randn(300, 130) * torch.logspace(-5, 5, 130)).to(torch.bfloat16)\n"
        "s = torch.tensor(0.37)\n"
        "for fmt, f in (('e4m3', Format.E4M3), ('e5m2', Format.E5M2)):\n"
        "    for xx in (x, x.t().contiguous().t()):\n"
        "        y, yt = op(xx, s, fmt, '')\n"
        "        ry, ryt = dual_cast(xx, s, f)\n"
        "        assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8))\n"
        "        assert torch.equal(yt.view(torch.uint8), y.t().contiguous().view(torch.uint8))\n"
        "print('ok', op)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok loka.cast_dual_inline" in out.stdout, out.stderr[-2000:]


# ------------------------------------------------------------------------ LokaLinear through it
_PRECISIONS = [
    "e4m3.tensor.torch_scaled_mm",  # X, W and dY shared
    "e4m3.tensor.fa.torch_scaled_mm",
    "e4m3.tensor.torch_scaled_mm|e5m2+e4m3.tensor.torch_scaled_mm|e5m2+e4m3.tensor.torch_scaled_mm",  # dY in e5m2
    "e4m3.tensor.torch_scaled_mm|e4m3.row.torch_scaled_mm|e4m3.tensor.torch_scaled_mm",  # only X shared
]


class _Count:
    """Counts the op's calls on the CPU (its reference runs once per call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        ref = dualcast.cast_dual_reference

        def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.n += 1
            return ref(*a, **k)

        monkeypatch.setattr(dualcast, "cast_dual_reference", counted)


def _train(precision: str, mode: str, *, compiled: bool, autocast: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    m = LokaLinear.from_linear(nn.Linear(64, 48), precision)
    x = (torch.randn(4, 8, 64) * 2.0).requires_grad_(True)
    dy = torch.randn(4, 8, 48)
    torch._dynamo.reset()
    with dual_cast_mode(mode), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        f = torch.compile(m, fullgraph=True) if compiled else m
        y = f(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, m.weight.grad, m.bias.grad


@pytest.mark.parametrize("precision", _PRECISIONS)
@pytest.mark.parametrize("autocast", [False, True])
def test_eager_shared_path_is_bit_for_bit_with_the_mode_on(precision: str, autocast: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lin_mod, "SHARE_IN_EAGER", True)
    count = _Count(monkeypatch)
    off = _train(precision, "off", compiled=False, autocast=autocast)
    assert count.n == 0
    on = _train(precision, "on", compiled=False, autocast=autocast)
    share = LokaLinear(64, 48, precision=precision)._share
    assert count.n == share.x + share.w + share.dy > 0  # one dual cast per shared operand
    for a, b in zip(off, on):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", _PRECISIONS[:3])
def test_compiled_whole_with_the_op_and_bit_for_bit_with_inductors_casts(precision: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    count = _Count(monkeypatch)
    on = _train(precision, "on", compiled=True, autocast=False)
    assert count.n == 3  # X and W in forward, dY in backward: fullgraph, so in the one graph
    off = _train(precision, "off", compiled=True, autocast=False)
    assert count.n == 3
    for a, b in zip(off, on):
        assert torch.equal(a, b)
    # and within FP8's error of float64
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    x = torch.randn(4, 8, 64) * 2.0
    dy = torch.randn(4, 8, 48)
    y64, dx64, dw64 = linear_grads64(ref.weight, ref.bias, x.reshape(-1, 64), dy.reshape(-1, 48))
    assert sqnr_db(y64, on[0].reshape(-1, 48)) > 20.0
    assert sqnr_db(dx64, on[1].reshape(-1, 64)) > 14.0  # dY may be e5m2 (2 mantissa bits)
    assert sqnr_db(dw64, on[2]) > 14.0


def test_auto_keeps_inductors_casts_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    count = _Count(monkeypatch)
    _train(_PRECISIONS[0], "auto", compiled=True, autocast=False)
    assert count.n == 0


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 129), (300, 130), (1024, 4096), (4100, 64), (3000, 32), (32, 64)])
def test_the_triton_kernel_is_the_reference_bit_for_bit(fmt: Format, kind: str, shape: tuple[int, int]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from loka_tune.kernels.triton_quant import dual_cast

    x32 = _adversarial(kind, *shape, device="cuda")
    scale = torch.tensor(_scale_for(x32, fmt), device="cuda")
    for x, via in ((x32.to(torch.bfloat16), torch.float32), (x32.to(torch.bfloat16).t().contiguous().t(), torch.float32),
                   (x32, torch.bfloat16)):
        y, yt = dual_cast(x, scale, fmt, via)
        ry, ryt = cast_dual_reference(x, scale, fmt, None if via == torch.float32 else via)
        assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8))
        assert torch.equal(yt.view(torch.uint8), ryt.view(torch.uint8))


def _scale_for(x: torch.Tensor, fmt: Format) -> float:
    amax = float(x.abs().amax())
    return 1.0 if amax == 0 else min(dualcast.FMAX[fmt] / amax, 3e38)


@pytest.mark.gpu
def test_a_compiled_linear_on_cuda_takes_the_kernel_and_matches_inductors_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from loka_tune.kernels import triton_quant

    calls = []
    kernel = triton_quant.dual_cast

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(tuple(a[0].shape))
        return kernel(*a, **k)

    monkeypatch.setattr(triton_quant, "dual_cast", counted)
    monkeypatch.setattr(dualcast, "_MODE", {**dualcast._MODE, "op": "opaque"})  # runtime calls: the opaque form
    outs = {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)
        m = LokaLinear.from_linear(nn.Linear(512, 768), "e4m3.tensor.torch_scaled_mm").cuda()
        x = (torch.randn(2048, 512, device="cuda") * 3.0).requires_grad_(True)
        dy = torch.randn(2048, 768, device="cuda")
        torch._dynamo.reset()
        with dual_cast_mode(mode), torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.compile(m, fullgraph=True)(x)
        y.float().backward(dy)
        outs[mode] = (y.float(), x.grad, m.weight.grad)
        if mode == "auto":
            assert sorted(calls) == [(768, 512), (2048, 512), (2048, 768)]  # W, X, dY: once each
    assert len(calls) == 3  # "off": inductor's casts
    y64, dx64, dw64 = linear_grads64(m.weight, m.bias, x.detach(), dy)
    for got, ref in zip(outs["auto"], (y64, dx64, dw64)):
        assert sqnr_db(ref, got) > 20.0
    for a, b in zip(outs["auto"], outs["off"]):  # the same casts (inductor may skip the weight's bf16 rounding)
        assert sqnr_db(b, a) > 35.0


@pytest.mark.gpu
def test_the_inline_form_is_launched_by_inductor_and_equals_the_opaque_one() -> None:
    """LOKA_DUAL_CAST_OP=inline (the default): inductor's generated code launches the Triton
    kernel itself, three times a step (X, W forward; dY backward), calls no ``loka::cast_dual``
    and clones no operand; the results equal the opaque form's bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._inductor.utils import run_and_get_code

    def step(form: str) -> tuple[tuple[torch.Tensor, ...], list[str]]:
        prev = dualcast.set_dual_cast_op(form)
        try:
            torch.manual_seed(0)
            m = LokaLinear.from_linear(nn.Linear(512, 768), "e4m3.tensor.torch_scaled_mm").cuda()
            x = (torch.randn(2048, 512, device="cuda") * 3.0).requires_grad_(True)
            dy = torch.randn(2048, 768, device="cuda")
            torch._dynamo.reset()

            def run() -> torch.Tensor:
                with dual_cast_mode("auto"), torch.autocast("cuda", dtype=torch.bfloat16):
                    y = torch.compile(m, fullgraph=True)(x)
                y.float().backward(dy)
                return y

            y, code = run_and_get_code(run)
            return (y.float(), x.grad, m.weight.grad), code
        finally:
            dualcast.set_dual_cast_op(prev)

    assert dualcast.inline_op() is not None  # triton is installed on a GPU machine
    inline, code = step("inline")
    src = "\n".join(code)
    assert "torch.ops.loka.cast_dual" not in src  # no custom op call left in the graph
    launches = [ln for ln in src.splitlines() if "_dual_cast_kernel" in ln and ".run(" in ln]
    assert len(launches) == 3, [ln.strip() for ln in src.splitlines() if "dual" in ln][:20]
    opaque, code_o = step("opaque")
    src_o = "\n".join(code_o)
    assert "loka.cast_dual" in src_o
    assert src.count("clone") <= src_o.count("clone")  # the kernel's inputs are read only: nothing copied
    for a, b in zip(inline, opaque):
        assert torch.equal(a, b)
