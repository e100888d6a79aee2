"""Serving (issue 23): static FP8 weights (``apply(..., serving=True)``), the serving plan per batch
bucket, padded buckets, the serving copy of a trained model, and their errors. CPU: the emulated
backend, and ``torch._scaled_mm`` (which runs on the CPU) through a CPU twin of ``torch_scaled_mm``.
The GPU backends get the same checks on the device (``test_gpu_serving_*``, marked ``gpu``)."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from loka_tune import apply
from loka_tune.config import (
    GemmChoice,
    GemmRole,
    Granularity,
    ModsConfig,
    PrecisionConfig,
    ServingPlan,
    SitePrecision,
)
from loka_tune.errors import ConfigError, ServingError, UnsupportedChoiceError
from loka_tune.kernels import costmodel
from loka_tune.kernels.emulated import EmulatedBackend, emulated_gemm
from loka_tune.kernels.linear import LokaLinear
from loka_tune.kernels.quant import quantize, sqnr_db
from loka_tune.kernels.registry import Backend, get_backend, register_backend, unregister_backend
from loka_tune.kernels.scaled import cast_to_fp8, scaled_mm_gemm, scaled_mm_static
from loka_tune.kernels.serving import ServingFusedBlock, ServingLinear
from loka_tune.models import build_model
from loka_tune.serving import CapturedBuckets, ServingBuckets, plan_serving, serve_buckets, serving_form, site_rows

GPU = pytest.mark.gpu
ROWS = "e4m3.row.emulated|e5m2+e4m3.row.emulated|e4m3.row.emulated"
MODS = ModsConfig(no_bias=True, blocknorm=8, hardswish=True, fuse_epilogue=True)
CARDS = [50] * 8


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _wukong(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # silu: the hardswish Mod turns it into nn.Hardswish, so chains fuse
    return build_model("wukong", "tiny", num_dense=13, cardinalities=CARDS, activation="silu").eval()


def _batch(b: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 13, generator=g), torch.randint(0, 50, (b, 8), generator=g)


def _cfg(**sites: str) -> PrecisionConfig:
    return PrecisionConfig.from_sites({"head": "bf16", **sites}, default=ROWS, mods=MODS)


def _weights(kind: str, n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 1000 + k)
    if kind == "normal":
        return torch.randn(n, k, generator=g) / k**0.5
    if kind == "constant":
        return torch.full((n, k), -0.3125)
    if kind == "huge_range":  # rows from 1e-30 to 1e30, and one outlier per row
        w = torch.randn(n, k, generator=g) * 10.0 ** torch.linspace(-30, 30, n).unsqueeze(1)
        w[:, 0] *= 1e4
        return w.clamp(-3e38, 3e38)
    if kind == "zeros_and_tiny":
        w = torch.zeros(n, k)
        w[::2] = 1e-40  # subnormal float32 values
        return w
    raise AssertionError(kind)


# ------------------------------------------------------------------ static = per call, bit for bit
@pytest.mark.parametrize("gran", ["tensor", "row", "block", "mx"])
@pytest.mark.parametrize("rounding", ["exact", "pow2"])
@pytest.mark.parametrize("shape", [(32, 64), (130, 300), (1, 7), (256, 128)])
@pytest.mark.parametrize("kind", ["normal", "constant", "huge_range", "zeros_and_tiny"])
def test_static_weight_equals_per_call_quantization_bit_for_bit(gran: str, rounding: str, shape: tuple[int, int],
                                                                kind: str) -> None:
    n, k = shape
    fmt = "mxfp8" if gran == "mx" else "e4m3"
    choice = GemmChoice.parse(f"{fmt}.{gran}{'.pow2' if rounding == 'pow2' and gran != 'mx' else ''}.emulated")
    w = _weights(kind, n, k)
    be = EmulatedBackend()
    data, scale = be.quantize_weight(w, choice)
    ref = quantize(w, choice.b_format, choice.granularity, choice.rounding, is_weight=True)  # what a call does
    assert torch.equal(_u8(data), _u8(ref.data)) and torch.equal(scale, ref.scale)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7)) * 3
    got = be.static_gemm(choice)(x, data, scale)
    want = emulated_gemm(x, w, choice, GemmRole.FWD)  # the per-call GEMM quantizes w again
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", ["e4m3.row.emulated", "e4m3.tensor.pow2.emulated", "e4m3.block.emulated"])
def test_serving_linear_equals_the_training_forward(dtype: torch.dtype, choice: str) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(200, 72).to(dtype)
    served = ServingLinear.from_linear(lin, choice, name="site")
    trained = LokaLinear.from_linear(lin, f"{choice}|bf16|bf16")
    x = torch.randn(3, 5, 200, dtype=dtype)  # a 3-D input: rows = 15
    with torch.no_grad():
        assert torch.equal(served(x), trained(x))
    assert served.bias is not None and served.bias.data_ptr() == lin.bias.data_ptr()  # shared, not copied
    assert set(served.state_dict()) == {"weight_fp8", "weight_scale", "bias"}
    assert served.weight_fp8.dtype == torch.float8_e4m3fn and served.weight_fp8.shape == (72, 200)


# ------------------------------------------------------------------ torch._scaled_mm's static path (CPU)
@pytest.fixture
def cpu_scaled_mm() -> Iterator[str]:
    """``torch_scaled_mm`` with the CPU allowed (``torch._scaled_mm`` runs on the CPU)."""
    from loka_tune.kernels.backends.scaled_mm import ScaledMMBackend

    @register_backend("cpu_scaled_mm")
    class CPUScaledMM(ScaledMMBackend):
        devices = frozenset({"cpu"})

    yield "cpu_scaled_mm"
    unregister_backend("cpu_scaled_mm")


@pytest.mark.parametrize("choice", ["e4m3.row", "e4m3.tensor", "e4m3.row.pow2.fa", "e5m2.tensor"])
@pytest.mark.parametrize("kind", ["normal", "huge_range"])
def test_scaled_mm_static_weight_equals_per_call(choice: str, kind: str) -> None:
    c = GemmChoice.parse(f"{choice}.torch_scaled_mm")
    w = _weights(kind, 48, 96).to(torch.bfloat16)
    be = get_backend("torch_scaled_mm")
    data, inv = be.quantize_weight(w, c)
    ref = quantize(w, c.b_format, c.granularity, c.rounding, is_weight=True)
    assert torch.equal(_u8(data), _u8(ref.data)) and torch.equal(inv.reshape(-1), ref.inv_scale().reshape(-1))
    x = torch.randn(70, 96, dtype=torch.bfloat16)
    assert torch.equal(scaled_mm_static(x, *cast_to_fp8(w, c.b_format, c.granularity, c.rounding), c),
                       scaled_mm_gemm(x, w, c))
    assert torch.equal(be.static_gemm_impl(x, data, inv, c), scaled_mm_gemm(x, w, c))


def test_scaled_mm_serving_model_equals_its_training_form_and_compiles(cpu_scaled_mm: str) -> None:
    m = _wukong()
    cfg = PrecisionConfig.from_sites({"head": "bf16"}, default=f"e4m3.row.{cpu_scaled_mm}|bf16|bf16",
                                     mods=ModsConfig(blocknorm=8, hardswish=True))
    trained, served = copy.deepcopy(m), copy.deepcopy(m)
    t = apply(trained, cfg, strict=False)  # dims not multiples of 16 stay bf16 there, as in serving below
    s = apply(served, cfg, serving=True, strict=False)
    assert s.replaced and set(s.fallbacks) == {site for site, fb in t.fallbacks.items() if "fwd" in fb}
    assert set(s.replaced) == {n for n, mod in trained.named_modules()
                               if isinstance(mod, LokaLinear) and not mod.precision.fwd.is_bf16}
    x = _batch()
    with torch.no_grad():
        want = trained(*x)
        got = served(*x)
        compiled = torch.compile(served, fullgraph=True, dynamic=False)(*x)
    assert torch.equal(got, want)
    assert sqnr_db(got, compiled) >= 60.0  # inductor's fusions reorder float ops, nothing else


# ------------------------------------------------------------------ apply(serving=True) on a model
def test_serving_config_round_trips_through_export_and_apply(tmp_path: Path) -> None:
    m = _wukong()
    cfg = _cfg(**{"layers.0.fmb.out": "e4m3.block.emulated|bf16|bf16", "dense_proj": "bf16|e4m3.row.emulated|bf16"})
    path = tmp_path / "best.json"
    loka_cfg = PrecisionConfig.load(cfg.save(path))  # the export a study writes, read back
    trained, served = copy.deepcopy(m), copy.deepcopy(m)
    apply(trained, loka_cfg)
    summary = apply(served, path, serving=True)
    assert summary.serving and summary.bucket is None
    assert summary.fused == ["dense_mlp.0", "layers.0.fmb.mlp.0", "layers.1.fmb.mlp.0", "head_mlp.0"]
    assert "dense_proj" in summary.unchanged and "head" in summary.unchanged  # bf16 fwd: plain nn.Linear
    assert summary.replaced["layers.0.fmb.out"] == "e4m3.block.emulated"
    assert isinstance(served.dense_mlp[0], ServingFusedBlock) and type(served.dense_proj) is nn.Linear
    assert "inference only" in str(summary) and "static FP8 weight" in str(summary)
    x = _batch()
    with torch.no_grad():
        assert torch.equal(served(*x), trained(*x))  # the emulated math is the same, so bit for bit
        compiled = torch.compile(served, fullgraph=True, dynamic=False)(*x)
    assert sqnr_db(trained(*x).detach(), compiled) >= 60.0


def test_a_config_without_fp8_forwards_serves_bf16_and_says_so() -> None:
    m = _wukong()
    s = apply(m, PrecisionConfig(default=SitePrecision.parse("bf16|e4m3.row.emulated|e4m3.row.emulated")), serving=True)
    assert not s.replaced and len(s.unchanged) == s.n_sites
    assert "serves in bf16" in str(s) and "dgrad / wgrad" in str(s)
    assert all(type(mod) is nn.Linear for n, mod in m.named_modules() if n in s.unchanged)


def test_state_dict_round_trips_and_a_bf16_checkpoint_requantizes() -> None:
    m1, m2 = _wukong(0), _wukong(1)  # two different checkpoints of one architecture
    cfg = _cfg()
    a = copy.deepcopy(m1)
    apply(a, cfg, serving=True)
    sd = a.state_dict()
    assert "layers.0.fmb.out.weight_fp8" in sd and "layers.0.fmb.out.weight_scale" in sd
    assert "layers.0.fmb.out.weight" not in sd and "head.weight" in sd  # the bf16 head keeps nn.Linear's key
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = copy.deepcopy(m2)
    apply(b, cfg, serving=True)
    b.load_state_dict(torch.load(buf))  # the served tensors, as they are
    x = _batch()
    with torch.no_grad():
        assert torch.equal(b(*x), a(*x))
    # the training checkpoint of m2 (nn.Linear's 'weight' keys) re-quantizes into a's layers
    apply(m2, PrecisionConfig(mods=cfg.mods))
    a.load_state_dict(m2.state_dict())
    ref = copy.deepcopy(_wukong(1))
    apply(ref, cfg, serving=True)
    with torch.no_grad():
        assert torch.equal(a(*x), ref(*x))


def test_state_dict_errors_name_the_fix() -> None:
    a = _wukong()
    apply(a, _cfg(), serving=True)
    sd = a.state_dict()
    sd["layers.0.fmb.out.weight"] = torch.randn(32, 32)  # both keys for one site
    with pytest.raises(RuntimeError, match="both 'weight' and 'weight_fp8'; keep one"):
        a.load_state_dict(sd)
    sd = {k: v for k, v in a.state_dict().items() if not k.startswith("layers.0.fmb.out.weight_")}
    sd["layers.0.fmb.out.weight"] = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match=r"shape \(16, 32\); this layer serves \(32, 32\): a state dict of another"):
        a.load_state_dict(sd)
    sd["layers.0.fmb.out.weight"] = torch.full((32, 32), float("nan"))
    with pytest.raises(RuntimeError, match="non-finite values"):
        a.load_state_dict(sd)


# ------------------------------------------------------------------ serving plans and buckets
class _Wide(nn.Module):
    """Two wide linears (FP8 pays on an H200 at large batches, not at small ones) and a narrow one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(1024, 4096, bias=False)
        self.act = nn.Hardswish()
        self.down = nn.Linear(4096, 1024, bias=False)
        self.head = nn.Linear(1024, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.act(self.up(x))))


def test_plan_serving_prices_each_bucket_from_the_cost_model_with_static_weights() -> None:
    model = _Wide()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    planned = plan_serving(model, cfg, (torch.randn(4, 1024),), buckets=(16, 8192))
    plan = planned.serving
    assert plan is not None and plan.sizes == (16, 8192) and plan.time_source == "modeled" and plan.device == "h200"
    for rows in plan.sizes:
        for site, (k, n) in {"up": (1024, 4096), "down": (4096, 1024), "head": (1024, 16)}.items():
            fp8 = costmodel.estimate_gemm_seconds("e4m3.row.emulated", rows, k, n, "fwd", static_b=True)
            bf16 = costmodel.estimate_gemm_seconds("bf16", rows, k, n, "fwd")
            want = "e4m3.row.emulated" if bf16 / fp8 > 1.0 else "bf16"
            assert plan.choices(rows)[site].short_str() == want, (rows, site)
            cell = plan.prices["cells"][str(rows)][site]
            assert cell["m"] == rows and math.isclose(cell["bf16_us"], bf16 * 1e6)
    assert plan.choices(16)["up"].is_bf16 and not plan.choices(8192)["up"].is_bf16  # the decision the buckets exist for
    assert planned.key() == cfg.key()  # the plan does not change training


def test_a_planned_config_serves_each_bucket_with_its_choices(tmp_path: Path) -> None:
    model = _Wide()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    planned = plan_serving(model, cfg, (torch.randn(4, 1024),), buckets=(16, 8192))
    back = PrecisionConfig.load(planned.save(tmp_path / "served.json"))
    assert back == planned and back.serving == planned.serving
    for batch, bucket in ((3, 16), (16, 16), (17, 8192), (8192, 8192)):
        served = copy.deepcopy(model)
        s = apply(served, back, serving=True, batch=batch)
        assert s.bucket == bucket
        want = {site: c.short_str() for site, c in back.serving.choices(bucket).items() if not c.is_bf16}
        assert s.replaced == want
        trained = copy.deepcopy(model)
        apply(trained, PrecisionConfig.from_sites({site: f"{c}|bf16|bf16" for site, c in want.items()}))
        x = torch.randn(5, 1024)
        with torch.no_grad():
            assert torch.equal(served(x), trained(x))


def test_serve_buckets_pad_to_the_bucket_and_share_every_other_tensor() -> None:
    m = _wukong()
    plan = ServingPlan(buckets=((16, {"head_mlp.0.linear": "bf16"}), (64, {})))
    cfg = _cfg().with_serving(plan)
    server = serve_buckets(m, cfg)
    assert isinstance(server, ServingBuckets) and server.sizes == (16, 64)
    small, big = server.models["16"], server.models["64"]
    assert type(small.head_mlp[0].linear) is nn.Linear and isinstance(big.head_mlp[0], ServingFusedBlock)
    emb = m.embeddings.table.weight
    assert small.embeddings.table.weight is emb and big.embeddings.table.weight is emb  # shared, not copied
    assert isinstance(m.dense_mlp[0].linear, nn.Linear) and type(m.dense_mlp[0].linear) is nn.Linear  # m stays bf16
    dense, sparse = _batch(40)
    with torch.no_grad():
        out = server(dense, sparse)
        pad = torch.cat([dense, dense.new_zeros(24, 13)]), torch.cat([sparse, sparse.new_zeros(24, 8)])
        assert out.shape == (40,) and torch.equal(out, big(*pad)[:40])  # padded to 64, cut back to 40
        assert torch.allclose(out, big(dense, sparse), rtol=0, atol=1e-5)  # rowwise: pad rows change nothing
        assert server(*_batch(10)).shape == (10,)
    with pytest.raises(ServingError, match=r"batch 65 is above every bucket of the serving plan \(16, 64\)"):
        server(*_batch(65))


def test_captured_buckets_serve_what_the_buckets_do_padding_included() -> None:
    """ServingBuckets.captured: the request copied into each bucket's static inputs (zero pad rows,
    the previous call's rows past a smaller batch cleared), the same logits as the buckets'
    forward; on the CPU no graph is captured, the static buffers are the GPU path's."""
    m = _wukong()
    plan = ServingPlan(buckets=((16, {"head_mlp.0.linear": "bf16"}), (64, {})))
    # tensorwise: a site's activation scale is the whole padded batch's amax, so a stale pad row
    # (one the previous call's longer batch left) would change the real rows' rounding
    cfg = PrecisionConfig.from_sites({"head": "bf16"}, default="e4m3.tensor.emulated|bf16|bf16", mods=MODS)
    server = serve_buckets(m, cfg.with_serving(plan))
    cap = server.captured(*_batch(40), compile=False)
    assert isinstance(cap, CapturedBuckets) and cap.sizes == (16, 64)
    with torch.no_grad():
        for n, seed in ((40, 1), (64, 2), (3, 3), (16, 4), (17, 5), (5, 6), (64, 7)):
            x = _batch(n, seed=seed)
            got, want = cap(*x), server(*x)
            assert got.shape == (n,) and torch.equal(got, want), n
    with pytest.raises(ServingError, match=r"batch 65 is above every bucket"):
        cap(*_batch(65))
    dense, sparse = _batch(8)
    with pytest.raises(ServingError, match=r"input 1: got \(8, 9\); the capture's batch input 1 is \(rows, 8\)"):
        cap(dense, torch.zeros(8, 9, dtype=torch.long))
    with pytest.raises(ServingError, match="got 1 input"):
        cap(dense)
    with pytest.raises(ServingError, match="warmup=0"):
        server.captured(*_batch(4), warmup=0)


def test_captured_buckets_autotune_compiles_with_coordinate_descent_tuning(monkeypatch: Any) -> None:
    """autotune=True: each bucket compiled with inductor's coordinate-descent tuning (options, as
    torch.compile takes them instead of a mode); the default compiles in mode "default"."""
    seen: list[dict[str, Any]] = []

    def fake_compile(model: nn.Module, **kw: Any) -> nn.Module:
        seen.append(kw)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    m = _wukong()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"), mods=MODS)
    server = serve_buckets(m, cfg.with_serving(ServingPlan(buckets=((16, {}), (32, {})))))
    server.captured(*_batch(8), autotune=True)
    server.captured(*_batch(8))
    tuned = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True}
    assert seen == [{"dynamic": False, "options": tuned}] * 2 + [{"mode": "default", "dynamic": False}] * 2


@pytest.mark.gpu
def test_captured_buckets_on_a_gpu_replay_the_compiled_buckets() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = _wukong().cuda()
    plan = ServingPlan(buckets=((16, {}), (64, {})))
    mods = ModsConfig(no_bias=True, blocknorm=8, hardswish=True)
    cfg = PrecisionConfig.from_sites({"head": "bf16"}, default="e4m3.row.torch_scaled_mm|bf16|bf16", mods=mods)
    server = serve_buckets(m, cfg.with_serving(plan), strict=False)  # sites _scaled_mm cannot take serve bf16
    dense, sparse = (t.cuda() for t in _batch(40))
    cap = server.captured(dense, sparse)
    with torch.no_grad():
        for n in (40, 3, 64, 17):
            x = tuple(t.cuda() for t in _batch(n, seed=n))
            got = cap(*x).clone()
            torch.testing.assert_close(got, server(*x), rtol=1e-2, atol=1e-2)  # compiled vs eager kernels


def test_serving_form_serves_a_trained_model_without_changing_it() -> None:
    m = _wukong()
    apply(m, _cfg(**{"layers.1.fmb.out": "bf16|e4m3.row.emulated|bf16"}))
    served = serving_form(m)
    assert any(isinstance(mod, LokaLinear) for mod in m.modules())  # m itself is unchanged
    assert type(served.layers[1].fmb.out) is nn.Linear  # a bf16 fwd serves as nn.Linear
    assert isinstance(served.layers[0].fmb.out, ServingLinear) and isinstance(served.dense_mlp[0], ServingFusedBlock)
    assert served.head.weight is m.head.weight
    x = _batch()
    with torch.no_grad():
        assert torch.equal(served(*x), m(*x))


def test_the_inference_objective_prices_static_weights() -> None:
    from loka_tune.data.base import Batch
    from loka_tune.objectives.speed import measure_forward_seconds, modeled_gemm_seconds

    m = _Wide()
    apply(m, PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|e4m3.row.emulated|bf16")))
    x = torch.randn(4, 1024)
    rows = site_rows(m, (x,))
    assert rows == {"up": (1.0, 1024, 4096), "down": (1.0, 4096, 1024), "head": (1.0, 1024, 16)}
    batch = Batch(dense=x, sparse=torch.zeros(4, 0, dtype=torch.long), labels=torch.zeros(4))
    kw: dict[str, Any] = dict(batch_size=4, cost_batch_size=8192, device="h200")
    inf = modeled_gemm_seconds(_Model(m), batch, kind="inference", **kw)
    want = sum(costmodel.estimate_gemm_seconds("e4m3.row.emulated", 8192, k, n, "fwd", static_b=True)
               for _, k, n in rows.values())
    assert math.isclose(inf, want, rel_tol=1e-12)
    assert inf < sum(costmodel.estimate_gemm_seconds("e4m3.row.emulated", 8192, k, n, "fwd") for _, k, n in rows.values())
    assert measure_forward_seconds(_Model(m), batch, reps=2, warmup=0) > 0
    assert isinstance(m.up, LokaLinear)  # timed on a serving copy; the trial's model is unchanged


class _Model(nn.Module):
    """``model_inputs``' (dense, sparse) calling convention around a dense-only module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.inner(dense)


def test_a_measured_plan_uses_the_timer_and_its_cache(tmp_path: Path) -> None:
    from loka_tune.kernels.site_timing import SitePriceCache

    calls: list[tuple[int, int, int, str]] = []

    def fake(m: int, k: int, n: int, choice: str, *, device: str) -> dict[str, float]:
        calls.append((m, k, n, choice))  # FP8 pays above 1000 rows, by construction of this fake
        fp8 = choice != "bf16"
        return {"gpu_s": (m * k * n) * (0.5 if fp8 else 1.0) * 1e-15 + (2e-5 if fp8 else 1e-5), "host_s": 0.0}

    model, inputs = _Wide(), (torch.randn(4, 1024),)
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    cache = SitePriceCache(tmp_path / "prices.json", shipped=(), device="fake", versions="v")
    plan = plan_serving(model, cfg, inputs, buckets=(16, 8192), measure=True, timer=fake, cache=cache).serving
    assert plan is not None and plan.time_source == "measured"
    assert plan.choices(16)["up"].is_bf16 and plan.choices(8192)["up"].short_str() == "e4m3.row.emulated"
    n_cells = len(calls)
    assert n_cells == 2 * 3 * 2 and len(cache) == n_cells  # buckets x sites x (bf16, fp8)
    again = plan_serving(model, cfg, inputs, buckets=(16, 8192), measure=True, timer=fake, cache=cache).serving
    assert len(calls) == n_cells and again == plan  # every cell from the cache
    modeled = plan_serving(model, cfg, inputs, buckets=(16,), measure=True, timer=fake, budget_s=0.0).serving
    assert modeled is not None and modeled.time_source == "modeled"  # no time left: the cost model


def test_a_plan_skips_a_shape_the_kernel_cannot_take_and_serves_the_next_option() -> None:
    """``torch._scaled_mm`` needs k and n multiples of 16: large Wukong's 2048 x 44 and 64 x 1
    sites failed inside a compile on the H200, each cell a page of fake-tensor trace. The plan
    now asks the backend first: the cell is never timed, says why, and the site serves the next
    option that runs (here an emulated candidate), or bf16."""
    calls: list[tuple[int, int, int, str]] = []

    def fake(m: int, k: int, n: int, choice: str, *, device: str) -> dict[str, float]:
        calls.append((m, k, n, choice))
        return {"gpu_s": (m * k * n) * (0.5 if choice != "bf16" else 1.0) * 1e-15 + 1e-6, "host_s": 0.0}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096, bias=False), nn.Hardswish(), nn.Linear(4096, 44, bias=False))
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.tensor.fa.torch_scaled_mm|bf16|bf16"))
    inputs = (torch.randn(4, 1024),)
    msgs: list[str] = []
    plan = plan_serving(model, cfg, inputs, buckets=(8192,), measure=True, timer=fake, progress=msgs.append).serving
    assert plan is not None
    assert (8192, 4096, 44, "e4m3.tensor.fa.torch_scaled_mm") not in calls  # never timed
    cell = plan.prices["cells"]["8192"]["2"]
    assert cell["source"]["e4m3.tensor.fa.torch_scaled_mm"] == (
        "unsupported: n=44 of the fwd GEMM (m, k, n)=(8192, 4096, 44) is not a multiple of 16")
    assert plan.choices(8192)["2"].is_bf16 and plan.choices(8192)["0"].short_str() == "e4m3.tensor.fa.torch_scaled_mm"
    assert sum("not priced (n=44" in m for m in msgs) == 1
    with_other = plan_serving(model, cfg, inputs, buckets=(8192,), measure=True, timer=fake,
                              candidates=["e4m3.row.emulated"]).serving
    assert with_other is not None and with_other.choices(8192)["2"].short_str() == "e4m3.row.emulated"


def test_a_plan_prices_the_fast_accumulation_twin_of_each_fp8_option() -> None:
    """Serving runs only the forward GEMM, which torchao's float8 inference runs with fast
    accumulation: a site whose option has none is also priced with it (where its backend has such
    a kernel: not the emulation, whose 'fa' changes nothing), unless fast_accum=False."""
    calls: list[str] = []

    def fake(m: int, k: int, n: int, choice: str, *, device: str) -> dict[str, float]:
        calls.append(choice)
        speed = {"bf16": 1.0, "e4m3.tensor.torch_scaled_mm": 0.7, "e4m3.tensor.fa.torch_scaled_mm": 0.6}
        return {"gpu_s": m * k * n * speed.get(choice, 0.8) * 1e-15, "host_s": 0.0}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096, bias=False))
    inputs = (torch.randn(4, 1024),)
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.tensor.torch_scaled_mm|bf16|bf16"))
    plan = plan_serving(model, cfg, inputs, buckets=(8192,), measure=True, timer=fake).serving
    assert plan is not None and plan.choices(8192)["0"].short_str() == "e4m3.tensor.fa.torch_scaled_mm"
    assert sorted(calls) == ["bf16", "e4m3.tensor.fa.torch_scaled_mm", "e4m3.tensor.torch_scaled_mm"]
    calls.clear()
    plain = plan_serving(model, cfg, inputs, buckets=(8192,), measure=True, timer=fake, fast_accum=False).serving
    assert plain is not None and plain.choices(8192)["0"].short_str() == "e4m3.tensor.torch_scaled_mm"
    assert sorted(calls) == ["bf16", "e4m3.tensor.torch_scaled_mm"]
    calls.clear()
    emulated = PrecisionConfig(default=SitePrecision.parse("e4m3.tensor.emulated|bf16|bf16"))
    plan_serving(model, emulated, inputs, buckets=(8192,), measure=True, timer=fake)
    assert sorted(calls) == ["bf16", "e4m3.tensor.emulated"]  # no twin: the emulation's 'fa' changes nothing


def test_the_serving_timer_runs_and_a_plan_follows_its_prices() -> None:
    """time_serving_site's code on the CPU (wall time, no CUDA graphs): a price is a GPU's, so the
    test checks the plan's decisions against the recorded cells, not against any speed."""
    from loka_tune.kernels.serve_timing import time_serving_site

    cell = time_serving_site(32, 64, 48, "e4m3.row.emulated", device="cpu", iters=2, reps=2, warmup=1)
    assert cell["gpu_s"] > 0 and cell["timing"] == "wall" and cell["iters"] == 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Hardswish(), nn.Linear(48, 16))
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    plan = plan_serving(model, cfg, (torch.randn(4, 64),), buckets=(32,), measure=True, device="cpu").serving
    assert plan is not None and plan.time_source == "measured" and plan.device == "cpu"  # where it was timed
    for site in ("0", "2"):
        c = plan.prices["cells"]["32"][site]
        assert c["source"] == {"bf16": "measured", "e4m3.row.emulated": "measured"}
        fp8_wins = c["bf16_us"] / c["e4m3.row.emulated_us"] > 1.0
        assert plan.choices(32)[site].short_str() == ("e4m3.row.emulated" if fp8_wins else "bf16")


def test_static_b_drops_only_the_weights_quantization() -> None:
    for choice, role in (("e4m3.row.torch_scaled_mm", "fwd"), ("e4m3.tensor.fa.torch_scaled_mm", "fwd"),
                         ("e4m3.row.fbgemm", "dgrad"), ("e4m3.block.fbgemm", "fwd"), ("e4m3.row.fa.triton", "fwd"),
                         ("e4m3.row.torchao", "fwd")):
        full = costmodel.gemm_breakdown(choice, 2048, 2048, 4096, role)
        static = costmodel.gemm_breakdown(choice, 2048, 2048, 4096, role, static_b=True)
        dropped = [s for s in full if s not in static]
        assert dropped and all(s.name.startswith("quant B") or s.name == "transpose B" for s in dropped), choice
        assert [s.name for s in static] == [s.name for s in full if s not in dropped]
        assert math.isclose(costmodel.estimate_gemm_seconds(choice, 2048, 2048, 4096, role, static_b=True),
                            sum(s.seconds for s in static))
    assert costmodel.estimate_gemm_seconds("bf16", 512, 1024, 1024, "fwd", static_b=True) == \
        costmodel.estimate_gemm_seconds("bf16", 512, 1024, 1024, "fwd")
    # emulated: the fastest real backend *with* a static weight
    em = costmodel.estimate_gemm_seconds("e4m3.row.emulated", 512, 2048, 2048, "fwd", static_b=True)
    real = [costmodel.estimate_gemm_seconds(f"e4m3.row.{b}", 512, 2048, 2048, "fwd", static_b=True)
            for b in ("torch_scaled_mm", "fbgemm", "triton", "torchao")]
    assert em == min(real)
    assert costmodel.modeled_speedup("e4m3.row.torch_scaled_mm", 8192, 2048, 2048, "fwd", static_b=True) > \
        costmodel.modeled_speedup("e4m3.row.torch_scaled_mm", 8192, 2048, 2048, "fwd")


# ------------------------------------------------------------------ bad inputs: one clear line each
@pytest.fixture
def no_static() -> Iterator[str]:
    """A backend with a GEMM but no static-weight path, and one that serves rowwise only."""

    @register_backend("cpu_nostatic")
    class NoStatic(Backend):
        def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
            return emulated_gemm(a, b, choice.with_backend("emulated"), role)

    @register_backend("cpu_rowonly")
    class RowOnly(EmulatedBackend):
        static_granularities = frozenset({Granularity.ROW})

    yield "cpu_nostatic"
    unregister_backend("cpu_nostatic")
    unregister_backend("cpu_rowonly")


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_backend_without_a_static_path_is_named(no_static: str) -> None:
    m = _wukong()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = _cfg(**{"layers.0.fmb.out": "e4m3.row.cpu_nostatic"})
    with pytest.raises(UnsupportedChoiceError) as e:
        apply(m, cfg, serving=True)
    msg = _one_line(e)
    assert "'layers.0.fmb.out'" in msg and "'e4m3.row.cpu_nostatic'" in msg
    assert "backend 'cpu_nostatic' has no static-weight (serving) path" in msg and "strict=False" in msg
    assert all(type(mod) is not ServingLinear for mod in m.modules())  # all or nothing: m as it was
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items()) and set(before) == set(m.state_dict())
    s = apply(m, cfg, serving=True, strict=False)
    assert "layers.0.fmb.out" in s.unchanged and "no static-weight" in s.fallbacks["layers.0.fmb.out"]["fwd"]
    with pytest.raises(UnsupportedChoiceError, match=r"serves static weights with granularities \['row'\], not 'tensor'"):
        apply(_wukong(), _cfg(**{"head_mlp.0.linear": "e4m3.tensor.cpu_rowonly"}), serving=True)


def test_a_choice_this_device_cannot_run_is_named() -> None:
    with pytest.raises(UnsupportedChoiceError) as e:
        apply(_wukong(), _cfg(**{"layers.0.fmb.out": "e4m3.row.torch_scaled_mm"}), serving=True)
    msg = _one_line(e)
    assert "device 'cpu' not supported" in msg and "'layers.0.fmb.out'" in msg


@pytest.mark.parametrize("batch", [9000, 0, -3])
def test_a_batch_outside_every_bucket_is_one_line(batch: int) -> None:
    cfg = _cfg().with_serving(ServingPlan(buckets=((512, {}), (2048, {}), (8192, {}))))
    m = _wukong()
    with pytest.raises(ServingError) as e:
        apply(m, cfg, serving=True, batch=batch)
    msg = _one_line(e)
    if batch > 0:
        assert "batch 9000 is above every bucket of the serving plan (512, 2048, 8192)" in msg
        assert "chunks of at most 8192 rows" in msg and "buckets=[..., 9000]" in msg
    else:
        assert f"got batch={batch}; a batch size is a positive integer" in msg
    assert all(type(mod) is not ServingLinear for mod in m.modules())


def test_bad_serving_calls_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="batch=512 without serving=True"):
        apply(_wukong(), _cfg(), batch=512)
    with pytest.raises(ConfigError, match="this config has none: price one with loka_tune.serving.plan_serving"):
        apply(_wukong(), _cfg(), serving=True, batch=512)
    trained = _wukong()
    apply(trained, _cfg())
    with pytest.raises(ServingError, match=r"applied for training \(.*serving_form\(model\)") as e:
        apply(trained, _cfg(), serving=True)
    _one_line(e)
    served = _wukong()
    apply(served, _cfg(), serving=True)
    for serving in (True, False):
        with pytest.raises(ServingError, match="served already .* load its checkpoint"):
            apply(served, _cfg(), serving=serving)
    with pytest.raises(ServingError, match="served already"):
        serving_form(served)
    missing = _cfg().with_serving(ServingPlan(buckets=((64, {"layers.9.out": "bf16"}),)))
    with pytest.raises(ConfigError, match=r"bucket 64 names 'layers.9.out', which is no linear layer") as e:
        apply(_wukong(), missing, serving=True, batch=64)
    _one_line(e)
    assert apply(_wukong(), missing, serving=True, batch=64, strict=False).unmatched == ["layers.9.out"]


def test_training_a_served_model_is_one_line_naming_the_fix() -> None:
    m = _wukong()
    apply(m, _cfg(), serving=True)
    m.train()
    assert not [p for n, p in m.named_parameters() if "fmb.out" in n]  # a served site has no parameters
    y = m(*_batch())  # grad mode on, the embeddings require grad
    with pytest.raises(ServingError) as e:
        y.sum().backward()
    msg = _one_line(e)
    assert "inference only" in msg and "without serving=True" in msg
    with pytest.raises(ServingError, match="non-finite values"):
        ServingLinear(torch.tensor([[1.0, float("inf")]]), None, "e4m3.row.emulated", name="x")
    with pytest.raises(UnsupportedChoiceError, match="a bf16 choice; a bf16 site serves as a plain nn.Linear"):
        ServingLinear(torch.randn(4, 4), None, "bf16")


@pytest.mark.parametrize("section, match", [
    ({"buckets": {"abc": {}}}, "serving.buckets: got bucket 'abc'; a bucket is a positive batch size"),
    ({"buckets": {"0": {}}}, "got bucket 0"),
    ({"buckets": {"512": {"re:.*": "bf16"}}}, "names sites exactly"),
    ({"buckets": {"512": {"a": "e4m3.row"}}}, r"serving.buckets.512.a: got 'e4m3.row'"),
    ({"buckets": {"512": ["a"]}}, "a bucket maps site names to fwd choices"),
    ({"buckets": {}, "when": 1}, r"unknown key\(s\) \['when'\]"),
    ({"buckets": {}, "time_source": "guessed"}, "expected one of modeled, measured, mixed, given"),
    ([1, 2], "the serving section is an object"),
])
def test_a_malformed_serving_section_names_the_key(section: Any, match: str) -> None:
    d = _cfg().to_dict()
    d["serving"] = section
    with pytest.raises(ConfigError, match=match):
        PrecisionConfig.from_dict(d)


def test_configs_without_a_plan_keep_their_json() -> None:
    cfg = _cfg()
    assert "serving" not in cfg.to_dict()
    planned = cfg.with_serving({"buckets": {"512": {"head": "bf16"}}, "time_source": "given"})
    assert PrecisionConfig.from_json(planned.to_json()) == planned
    assert planned.to_dict()["serving"]["buckets"] == {"512": {"head": "bf16"}}
    assert planned.with_serving(None) == cfg


# ------------------------------------------------------------------ GPU: the real backends
def _gpu_choices() -> list[str]:
    return ["e4m3.row.torch_scaled_mm", "e4m3.tensor.fa.torch_scaled_mm", "e4m3.row.fa.fbgemm", "e4m3.tensor.fbgemm",
            "e4m3.block.fbgemm", "e4m3.row.fa.triton", "e4m3.tensor.triton", "e4m3.block.triton", "e4m3.row.torchao",
            "e4m3.tensor.torchao"]


@GPU
@pytest.mark.parametrize("choice", _gpu_choices())
def test_gpu_serving_linear_matches_its_training_forward(choice: str) -> None:
    try:
        get_backend(GemmChoice.parse(choice).backend)
    except Exception as e:  # noqa: BLE001 - a backend not installed on this GPU machine
        pytest.skip(str(e))
    torch.manual_seed(0)
    lin = nn.Linear(1024, 2048, bias=True, device="cuda", dtype=torch.bfloat16)
    served = ServingLinear.from_linear(lin, choice)
    trained = LokaLinear.from_linear(lin, f"{choice}|bf16|bf16")
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        got, want = served(x), trained(x)
        compiled = torch.compile(served, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for _ in range(3):
            out = compiled(x).clone()
    assert sqnr_db(want, got) >= 40.0, f"{sqnr_db(want, got):.1f} dB vs the per-call path"
    assert sqnr_db(ref, got) >= 20.0 and sqnr_db(got, out) >= 40.0  # an FP8 linear's output vs float64


@GPU
def test_gpu_serving_prices_and_the_fused_triton_epilogue() -> None:
    pytest.importorskip("triton")
    from loka_tune.kernels.serve_timing import time_serving_site

    for choice in ("bf16", "e4m3.row.torch_scaled_mm"):
        cell = time_serving_site(2048, 2048, 2048, choice, iters=5, reps=2)
        assert cell["gpu_s"] > 0 and cell["timing"] in ("profiler", "events") and cell["iters"] == 10
    m = build_model("wukong", "tiny", num_dense=13, cardinalities=CARDS, activation="silu",
                    fmb_mlp=(64,), dense_mlp=(64,), head_mlp=(64,)).cuda().to(torch.bfloat16).eval()
    cfg = PrecisionConfig.from_sites({"head": "bf16"}, default="e4m3.row.fa.triton|bf16|bf16",
                                     mods=ModsConfig(blocknorm=32, hardswish=True, fuse_epilogue=True))
    trained, served = copy.deepcopy(m), copy.deepcopy(m)
    apply(trained, cfg, strict=False)
    s = apply(served, cfg, serving=True, strict=False)
    assert s.fused
    x = tuple(t.cuda() for t in _batch(256))
    x = (x[0].to(torch.bfloat16), x[1])
    with torch.no_grad():
        want, got = trained(*x), served(*x)
    assert sqnr_db(want, got) >= 30.0


def _served_counts(model: nn.Module) -> dict[str, int]:
    from loka_tune.kernels.serving import ServingLinear

    out = {"tensor": 0, "row": 0}
    for m in model.modules():
        if isinstance(m, ServingLinear):
            out[m.choice.granularity.value] += 1
    return out


def _three_sites() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Hardswish(), nn.Linear(128, 128, bias=False),
                          nn.Hardswish(), nn.Linear(128, 32, bias=False))
    return model, (torch.randn(4, 64),)


def _per_site(m: int, k: int, n: int, choice: str, *, device: str) -> dict[str, float]:
    """Alone, each site serves rowwise fastest; the last (n = 32) site does not pay at all."""
    speed = {"bf16": 1.0, "e4m3.row.emulated": 0.5, "e4m3.tensor.emulated": 0.6}[choice]
    if n == 32 and choice != "bf16":
        speed = 1.5
    return {"gpu_s": m * k * n * speed * 1e-12, "host_s": 0.0}


def test_the_whole_model_check_keeps_the_fastest_alternative_of_each_bucket() -> None:
    """Sites priced one at a time do not add up to the model (on the H200 the per-site rowwise
    plan served 7.49 ms, every site tensorwise 7.41): verify=True times the per-site plan beside
    whole-model alternatives and keeps the fastest per bucket, recording each one's time."""
    model, inputs = _three_sites()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    seen: list[tuple[int, dict[str, int], int]] = []

    def whole(m: nn.Module, rows: int, inp: tuple[torch.Tensor, ...]) -> float:
        counts = _served_counts(m)
        seen.append((rows, counts, int(inp[0].shape[0])))
        return 1.0 - 0.1 * counts["tensor"] - 0.01 * counts["row"]  # in the model, tensorwise wins

    planned = plan_serving(model, cfg, inputs, buckets=(16, 64), measure=True, timer=_per_site, verify=True,
                           model_timer=whole, candidates=["e4m3.tensor.emulated"])
    plan = planned.serving
    assert plan is not None
    rec = plan.prices["whole_model"]
    for rows in (16, 64):
        alts = rec[str(rows)]["alternatives"]
        assert rec[str(rows)]["chosen"] == "tensor_all"
        assert alts["sites"]["fp8_sites"] == 2 and alts["tensor"]["fp8_sites"] == 2
        assert alts["tensor_all"]["fp8_sites"] == 3 and alts["bf16"]["fp8_sites"] == 0
        assert alts["tensor_all"]["ms"] < alts["tensor"]["ms"] < alts["sites"]["ms"] < alts["bf16"]["ms"]
        assert {c.short_str() for c in plan.choices(rows).values()} == {"e4m3.tensor.emulated"}
    assert [r for r, _, _ in seen] == [64] * 4 + [16] * 4  # the largest bucket first
    assert all(r == n for r, _, n in seen)  # each alternative timed on inputs of its bucket's rows
    assert model[0].__class__ is nn.Linear  # the model itself is not changed


def test_the_whole_model_check_falls_back_to_bf16_and_respects_its_budget() -> None:
    model, inputs = _three_sites()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))

    def fp8_hurts(m: nn.Module, rows: int, inp: tuple[torch.Tensor, ...]) -> float:
        c = _served_counts(m)
        return 1.0 + c["tensor"] + c["row"]

    plan = plan_serving(model, cfg, inputs, buckets=(16,), measure=True, timer=_per_site, verify=True,
                        model_timer=fp8_hurts, alternatives=["bf16", "row"]).serving
    assert plan is not None
    alts = plan.prices["whole_model"]["16"]["alternatives"]
    assert list(alts) == ["sites", "bf16", "row"] and alts["row"] == {"same_as": "sites"}  # timed once
    assert plan.prices["whole_model"]["16"]["chosen"] == "bf16"
    assert all(c.is_bf16 for c in plan.choices(16).values())
    short = plan_serving(model, cfg, inputs, buckets=(16,), measure=True, timer=_per_site, verify=True,
                         model_timer=fp8_hurts, verify_budget_s=0.0).serving
    assert short is not None
    rec = short.prices["whole_model"]["16"]
    assert rec["chosen"] == "sites" and rec["alternatives"]["bf16"] == {"skipped": "over the budget"}
    with pytest.raises(ConfigError, match="alternatives=.*choose from sites, tensor, row"):
        plan_serving(model, cfg, inputs, buckets=(16,), measure=True, timer=_per_site, verify=True,
                     alternatives=["fastest"])


def test_the_whole_model_check_runs_the_real_timer_on_the_cpu() -> None:
    """time_served_model's CPU path (the eager model's wall time; a GPU captures a CUDA graph):
    every alternative timed, one chosen, the verified config applies at each bucket."""
    model, inputs = _three_sites()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    planned = plan_serving(model, cfg, inputs, buckets=(8,), measure=True, timer=_per_site, verify=True)
    rec = planned.serving.prices["whole_model"]["8"]
    assert rec["chosen"] in rec["alternatives"]
    assert all(v.get("ms", 1.0) > 0 for v in rec["alternatives"].values())
    served = copy.deepcopy(model)
    apply(served, planned, serving=True, batch=8)
    with torch.no_grad():
        assert served(inputs[0]).shape == (4, 32)


@GPU
def test_the_whole_model_check_times_captured_graphs_on_a_gpu() -> None:
    """time_served_model's GPU path: each alternative compiled, captured as one CUDA graph and
    timed between events; the verified plan serves through CapturedBuckets."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Hardswish(), nn.Linear(512, 256, bias=False)).cuda()
    model = model.to(torch.bfloat16).eval()
    inputs = (torch.randn(8, 256, device="cuda", dtype=torch.bfloat16),)
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.fa.torch_scaled_mm|bf16|bf16"))
    planned = plan_serving(model, cfg, inputs, buckets=(1024,), measure=True, device="cuda", verify=True,
                           candidates=["e4m3.tensor.fa.torch_scaled_mm"])
    rec = planned.serving.prices["whole_model"]["1024"]
    assert rec["chosen"] in ("sites", "tensor", "tensor_all", "bf16")
    timed = [v for v in rec["alternatives"].values() if "ms" in v]
    assert timed and all(0 < v["ms"] < 1e3 for v in timed), rec
    server = serve_buckets(copy.deepcopy(model), planned).captured(inputs[0].repeat(128, 1))
    with torch.no_grad():
        out = server(inputs[0].repeat(100, 1)).float()
        ref = model(inputs[0].repeat(100, 1)).float()
    assert sqnr_db(ref, out) > 20.0


# ----------------------------------------------------------------------------- calibrated activation scales
@pytest.mark.parametrize("choice", ["e4m3.tensor.emulated", "e5m2+e4m3.tensor.emulated", "e4m3.tensor.pow2.emulated"])
@pytest.mark.parametrize("data", ["normal", "huge_range", "constant"])
def test_a_calibrated_scale_from_the_calls_own_amax_is_the_dynamic_path_bit_for_bit(choice: str, data: str) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    x = torch.randn(32, 64)
    if data == "huge_range":
        x = x * torch.logspace(-6, 6, 64)  # 12 decades across the features
    elif data == "constant":
        x = torch.full((32, 64), -3.25)
    dynamic = ServingLinear.from_linear(lin, choice)
    static = ServingLinear.from_linear(lin, choice).calibrate_(x.abs().amax())
    assert static.calibrated and not dynamic.calibrated and "calibrated" in repr(static)
    with torch.no_grad():
        assert torch.equal(static(x), dynamic(x))
        # another batch, within the calibration's range: the same scale, so still the same FP8 codes
        y = x * 0.5
        half = ServingLinear.from_linear(lin, choice).calibrate_(x.abs().amax())
        ref = emulated_gemm(torch.cat([x, y]), lin.weight.detach(), GemmChoice.parse(choice), GemmRole.FWD)[32:]
        assert sqnr_db(ref, half(y)) > 20.0
    static.clear_calibration_()
    assert not static.calibrated
    with torch.no_grad():
        assert torch.equal(static(x), dynamic(x))


def test_a_calibrated_scale_saturates_what_lies_above_its_amax() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    x[0, 0] = 1e4  # far above the calibration below
    cal = ServingLinear.from_linear(lin, "e4m3.tensor.emulated").calibrate_(2.0)
    clamped = x.clamp(-2.0, 2.0)  # saturation at 448 in FP8 = 2.0 in x's units
    ref = ServingLinear.from_linear(lin, "e4m3.tensor.emulated").calibrate_(2.0)
    with torch.no_grad():
        assert torch.equal(cal(x), ref(clamped))
        assert not torch.equal(cal(x), ServingLinear.from_linear(lin, "e4m3.tensor.emulated")(x))


def _served_mixed() -> tuple[nn.Module, PrecisionConfig]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Hardswish(), nn.Linear(64, 64, bias=False),
                          nn.Hardswish(), nn.Linear(64, 16, bias=False))
    cfg = PrecisionConfig.from_sites({"0": "e4m3.tensor.emulated|bf16|bf16", "2": "e4m3.row.emulated|bf16|bf16",
                                      "4": "e4m3.tensor.emulated|bf16|bf16"}, default="bf16")
    return model, cfg


def test_calibrate_fixes_each_tensorwise_sites_scale_from_real_batches() -> None:
    from loka_tune.serving import calibrate

    model, cfg = _served_mixed()
    plain = copy.deepcopy(model)
    apply(model, cfg, serving=True)
    batches = [(torch.randn(8, 32) * s,) for s in (1.0, 3.0, 0.5)]
    cal = calibrate(model, batches, margin=1.25)
    assert cal.batches == 3 and cal.margin == 1.25
    assert set(cal.amax) == {"0", "4"} and set(cal.skipped) == {"2"} and "row" in cal.skipped["2"]
    assert cal.amax["0"] == max(float(b[0].abs().amax()) for b in batches)  # site 0 sees the inputs themselves
    assert model[0].calibrated and model[4].calibrated and not model[2].calibrated
    expect = 448.0 / (cal.amax["0"] * 1.25)
    assert float(model[0].act_scale) == pytest.approx(expect, rel=1e-6)
    x = batches[1][0]
    with torch.no_grad():
        assert sqnr_db(plain(x), model(x)) > 20.0
    # the state dict carries the scales: a fresh served copy loads them and serves the same logits
    again = copy.deepcopy(plain)
    apply(again, cfg, serving=True)
    missing, unexpected = again.load_state_dict(model.state_dict())
    assert not missing and not unexpected and again[0].calibrated and not again[2].calibrated
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    # a state dict without the key (dynamic, or from an older version) serves per-call scales
    old = {k: v for k, v in model.state_dict().items() if not k.endswith("act_scale")}
    missing, _ = again.load_state_dict(old)
    assert not missing and not again[0].calibrated
    # calibrating again starts from the dynamic path and replaces the scales
    cal2 = calibrate(model, batches[:1])
    assert cal2.amax["0"] == float(batches[0][0].abs().amax()) < cal.amax["0"]


def _graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Every call_function target of an exported graph, its nested (autocast) graphs included."""
    found = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    for child in gm.children():
        if isinstance(child, torch.fx.GraphModule):
            found += _graph_ops(child)
    return found


def test_a_calibrated_site_runs_no_reciprocal_per_call() -> None:
    # the dequantization factor 1 / act_scale is computed once, at calibration: a graph that
    # recomputed it would launch one more kernel per site per call (22 at Wukong's serving step)
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    site = ServingLinear.from_linear(lin, "e4m3.tensor.fa.torch_scaled_mm")
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    dynamic = _graph_ops(torch.export.export(site, (x,)).graph_module)
    assert "aten._scaled_mm.default" in dynamic and "aten.reciprocal.default" in dynamic  # its own amax's scale
    site.calibrate_(float(x.float().abs().amax()))
    assert torch.equal(site.act_inv_scale, site.act_scale.reciprocal())
    ops = _graph_ops(torch.export.export(site, (x,)).graph_module)
    assert "aten._scaled_mm.default" in ops and "aten.reciprocal.default" not in ops and "aten.amax.default" not in ops
    with torch.no_grad():  # the precomputed factor is the one the per-call reciprocal gave
        from loka_tune.kernels.scaled import scaled_mm_calibrated
        ref = scaled_mm_calibrated(x, site.act_scale, site.weight_fp8, site.weight_scale, site.choice)
        assert torch.equal(site(x), ref)
    # loaded from a state dict (where only act_scale is kept) and cleared, the factor follows
    again = ServingLinear.from_linear(lin, "e4m3.tensor.fa.torch_scaled_mm")
    again.load_state_dict(site.state_dict())
    assert "act_inv_scale" not in site.state_dict() and torch.equal(again.act_inv_scale, site.act_inv_scale)
    again.clear_calibration_()
    assert again.act_inv_scale.numel() == 0 and not again.calibrated


def test_calibrate_refuses_what_it_cannot_calibrate_in_one_line() -> None:
    from loka_tune.serving import calibrate

    model, cfg = _served_mixed()
    with pytest.raises(ServingError, match="no served site in this model: apply the config first"):
        calibrate(copy.deepcopy(model), [(torch.randn(2, 32),)])
    apply(model, cfg, serving=True)
    with pytest.raises(ServingError, match="got no batches"):
        calibrate(model, [])
    with pytest.raises(ServingError, match="margin=0.5; a calibration margin is a factor >= 1.0"):
        calibrate(model, [(torch.randn(2, 32),)], margin=0.5)
    with pytest.raises(ServingError, match="calibration amax of 0.0; it must be finite and > 0"):
        calibrate(model, [(torch.zeros(2, 32),)])
    with pytest.raises(UnsupportedChoiceError, match="cannot take a calibrated activation scale.*a row's scale"):
        model[2].calibrate_(1.0)
    rows = copy.deepcopy(_served_mixed()[0])
    apply(rows, PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16")), serving=True)
    with pytest.raises(ServingError, match="no served site can take a calibrated activation scale .*tensorwise"):
        calibrate(rows, [(torch.randn(2, 32),)])


@GPU
def test_a_calibrated_scale_on_the_gpu_equals_the_dynamic_path_eager_and_compiled() -> None:
    """torch_scaled_mm, tensorwise with fast accumulation: calibrated with the call's own amax,
    the FP8 codes and the GEMM are the dynamic path's, bit for bit (eager), and the compiled
    form serves the same logits (inductor fuses the cast into the producer)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Hardswish(), nn.Linear(512, 256, bias=False))
    model = model.cuda().to(torch.bfloat16).eval()
    x = (torch.randn(1024, 256, device="cuda") * torch.logspace(-3, 3, 256, device="cuda")).to(torch.bfloat16)
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.tensor.fa.torch_scaled_mm|bf16|bf16"))
    dyn, cal = copy.deepcopy(model), copy.deepcopy(model)
    apply(dyn, cfg, serving=True)
    apply(cal, cfg, serving=True)
    from loka_tune.serving import calibrate

    calibrate(cal, [(x,)])
    with torch.no_grad():
        assert torch.equal(cal(x), dyn(x))
        fast = torch.compile(cal, dynamic=False)
        assert sqnr_db(dyn(x).float(), fast(x).float()) > 40.0


def test_the_whole_model_check_times_each_alternative_calibrated_when_given_batches() -> None:
    """calibration=batches: each alternative is timed as it will be served, its tensorwise sites
    with calibrated activation scales (the rowwise per-site plan has none to calibrate)."""
    model, inputs = _three_sites()
    cfg = PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated|bf16|bf16"))
    seen: list[int] = []

    def whole(m: nn.Module, rows: int, inp: tuple[torch.Tensor, ...]) -> float:
        cal = sum(isinstance(x, ServingLinear) and x.calibrated for x in m.modules())
        seen.append(cal)
        return 1.0 - 0.2 * cal

    plan = plan_serving(model, cfg, inputs, buckets=(16,), measure=True, timer=_per_site, verify=True,
                        model_timer=whole, candidates=["e4m3.tensor.emulated"],
                        calibration=[(torch.randn(8, 64),)]).serving
    assert plan is not None and plan.prices["calibrated"] is True
    alts = plan.prices["whole_model"]["16"]["alternatives"]
    assert alts["sites"]["calibrated"] == 0 and alts["tensor"]["calibrated"] == 2
    assert alts["tensor_all"]["calibrated"] == 3 and alts["bf16"]["calibrated"] == 0
    assert seen == [0, 2, 3, 0] and plan.prices["whole_model"]["16"]["chosen"] == "tensor_all"
