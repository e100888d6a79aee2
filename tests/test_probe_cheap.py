"""Issue 13, a cheap collection: float32 products on centred rows and a small row subset per
collection keep the statistics (against float64 full-rows references) and the errors
measured on their synthetic replay."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from loka_tune.errors import ProbeError
from loka_tune.probe import Probe, ProbeStats, measure
from loka_tune.probe.collector import CUDA_MAX_ROWS, MAX_ROWS, _resolve
from loka_tune.probe.moments import RunningMoments


def _rel_fro(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _offset_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Correlated rows, mixed scales (1e-2..1e1) on a large offset (1e4): float32 cancellation bait."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) @ mix) * torch.logspace(-2, 1, d, dtype=torch.float64) + 1e4


def test_float32_products_on_centred_rows_match_float64() -> None:
    x = _offset_rows(4096, 96, seed=0).float().double()  # float32 inputs (as on a GPU), both sides
    ref, f32 = RunningMoments(96), RunningMoments(96, precision="float32")
    for part in x.split(1000):
        ref.update(part)
        f32.update(part.float())  # what a GPU stream hands over
    np.testing.assert_allclose(f32.mean.numpy(), ref.mean.numpy(), rtol=1e-12)  # the mean stays float64
    cov_ref = ref.covariance().numpy()
    err = _rel_fro(f32.covariance().numpy(), cov_ref)
    assert err < 1e-5, f"float32 scatter of centred rows: relative Frobenius error {err:.2e} >= 1e-5"
    np.testing.assert_allclose(f32.variance().numpy(), ref.variance().numpy(), rtol=1e-5)
    np.testing.assert_allclose(f32.excess_kurtosis().numpy(), ref.excess_kurtosis().numpy(), atol=1e-4)
    # the floor discriminates: the same float32 GEMM on uncentred rows loses the covariance
    x32 = x.float()
    raw = (x32.T @ x32 / x32.shape[0] - torch.outer(x32.mean(0), x32.mean(0))).double().numpy()
    assert _rel_fro(raw, cov_ref) > 1e-2


def test_float32_sketch_matches_float64() -> None:
    x = _offset_rows(3000, 48, seed=1).float().double()
    ref = RunningMoments(48, max_full_dim=16, sketch_rank=8)
    f32 = RunningMoments(48, max_full_dim=16, sketch_rank=8, precision="float32")
    for part in x.split(700):
        ref.update(part)
        f32.update(part.float())
    (v64, u64), (v32, u32) = ref.low_rank(), f32.low_rank()
    np.testing.assert_allclose(v32.numpy(), v64.numpy(), rtol=1e-4)
    a64 = (u64.T * v64) @ u64
    a32 = (u32.T * v32) @ u32
    assert _rel_fro(a32.numpy(), a64.numpy()) < 1e-4


@pytest.fixture(scope="module")
def gauss() -> tuple[np.ndarray, np.ndarray, dict[str, ProbeStats]]:
    """A known Gaussian X (d = 64, eigenvalues 1..1e-2, mean -1..2) through nn.Linear(64, 16),
    16 collections of 8192 rows: stats with the GPU defaults (2,048 random rows, float32)
    and the float64 full-rows ones, from the same batches."""
    d, n, batches = 64, 16, 16
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = torch.logspace(0, -2, d, dtype=torch.float64)
    cov = (q * lam) @ q.T
    mean = torch.linspace(-1, 2, d, dtype=torch.float64)
    xs = [torch.randn(8192, d, generator=g, dtype=torch.float64) @ (q * lam.sqrt()).T + mean for _ in range(batches)]
    c = torch.randn(n, generator=g)
    out = {name: _train(xs, c, "cpu", **kw) for name, kw in {
        "full64": dict(max_rows=MAX_ROWS, precision="float64"),
        "cheap": dict(max_rows=CUDA_MAX_ROWS, precision="float32"),
        # the side collection (issue 22): every row in float64 (the reference's own numbers), and
        # its GPU defaults, 2,048 of the 8,192 rows with TF32 products (emulated here by truncating
        # the operands: the worst case of the tensor cores' conversion), for three probe seeds
        "side_full64": dict(step_on="batch", sub_batch=8192, precision="float64"),
        **{f"side_tf32_{seed}": dict(step_on="batch", sub_batch=CUDA_MAX_ROWS, max_rows=CUDA_MAX_ROWS,
                                     precision="tf32", seed=seed) for seed in (1, 5, 9)},
    }.items()}
    if torch.cuda.is_available():  # the defaults on a GPU: the cheap path (checked by the gpu test)
        out["cuda_default"] = _train(xs, c, "cuda")
    return cov.numpy(), mean.numpy(), out


def _train(xs: list[torch.Tensor], c: torch.Tensor, device: str, **kw) -> ProbeStats:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(xs[0].shape[1], c.numel())).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(y: torch.Tensor, _target: object = None) -> torch.Tensor:
        return (y * c.to(device) + 0.5 * y * y).mean()

    side = kw.get("step_on") == "batch"
    kw.setdefault("seed", 1)
    with Probe(model, every=1, **({"loss_fn": loss_fn} if side else {}), **kw) as p:
        for x in xs:
            opt.zero_grad()
            loss_fn(model(x.float().to(device))).backward()
            if side:  # a sub-batch of the step's batch, at the weights the in-step probes see (it
                p.step(x.float().to(device))  # writes no gradient: it may run before opt.step())
            opt.step()
    return p.stats


def test_cheap_stats_of_a_known_gaussian(gauss) -> None:
    cov, mean, st = gauss
    full, cheap = st["full64"].sites["0"].x, st["cheap"].sites["0"].x
    assert full.count == 16 * 8192 and cheap.count == 16 * CUDA_MAX_ROWS
    # E||S - C||_F^2 = (tr(C)^2 + ||C||_F^2) / n for Gaussian rows: the sampling floor
    floor = math.sqrt((np.trace(cov) ** 2 + np.sum(cov**2)) / cheap.count) / np.linalg.norm(cov)
    assert floor < 0.05
    err_cheap, err_full = _rel_fro(cheap.cov, cov), _rel_fro(full.cov, cov)
    assert err_cheap < 1.5 * floor, f"covariance error {err_cheap:.4f} vs sampling floor {floor:.4f}"
    assert err_full < 1.5 * floor / 2  # 4x the rows: half the error
    assert _rel_fro(cheap.cov, full.cov) < 0.05
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(cheap.mean - mean) <= 5 * sd / math.sqrt(cheap.count))
    assert cheap.amax == full.amax  # amax is the whole batch's, not the subset's
    dy_err = _rel_fro(st["cheap"].sites["0"].dy.cov, st["full64"].sites["0"].dy.cov)
    assert dy_err < 0.05, f"dY covariance: {dy_err:.4f}"


def test_mere_on_replay_of_cheap_stats_matches_float64(gauss) -> None:
    _, _, st = gauss
    kw = dict(samples=8, dists=("learned",), seed=2)
    cands = ["e4m3.tensor.emulated", "e4m3.row.emulated", "e5m2+e4m3.row.emulated"]
    a, b = measure(st["full64"], cands, **kw), measure(st["cheap"], cands, **kw)
    assert len(a.results) == len(b.results) >= 10  # 3 roles x (bf16 + the candidates that apply)
    for ra, rb in zip(a.results, b.results):
        assert (ra.role, ra.choice) == (rb.role, rb.choice)
        assert rb.mere == pytest.approx(ra.mere, rel=0.05), (ra.role, ra.choice, ra.mere, rb.mere)
        assert abs(rb.mere - ra.mere) <= 3 * math.hypot(ra.mere_std, rb.mere_std) + 0.01 * ra.mere


def test_side_stats_of_a_known_gaussian_and_their_mere_on_replay(gauss) -> None:
    """The side collection: with every row in float64 it gives the reference's statistics and
    MERE (the sub-batch mechanics are exact: dY at the batch's scale, the site's M); at its GPU
    defaults (2,048 of 8,192 rows, TF32 products, truncated: the worst case) the covariance
    within the sampling floor of the truth and 5% of the float64 full-row statistics, and the
    MERE on replay within 5% of theirs on average over three probe seeds (each within 10%: at
    2,048 rows one subset moves a wgrad MERE by up to ~5-8% either way; so does the in-step
    cheap path's, by up to ~3.5% over the same seeds)."""
    cov, _, st = gauss
    kw = dict(samples=8, dists=("learned",), seed=2)
    cands = ["e4m3.tensor.emulated", "e4m3.row.emulated", "e5m2+e4m3.row.emulated"]
    ref = measure(st["full64"], cands, **kw)
    exact = measure(st["side_full64"], cands, **kw)
    for ra, rb in zip(ref.results, exact.results):
        assert rb.mere == pytest.approx(ra.mere, rel=1e-6), (ra.role, ra.choice)
    full = st["full64"].sites["0"]
    np.testing.assert_allclose(st["side_full64"].sites["0"].dy.cov, full.dy.cov, rtol=1e-9, atol=1e-15)
    devs: dict[tuple[str, str], list[float]] = {}
    for seed in (1, 5, 9):
        side = st[f"side_tf32_{seed}"].sites["0"]
        assert side.x.count == 16 * CUDA_MAX_ROWS and side.rows == 8192  # priced at the batch's M
        floor = math.sqrt((np.trace(cov) ** 2 + np.sum(cov**2)) / side.x.count) / np.linalg.norm(cov)
        assert _rel_fro(side.x.cov, cov) < 1.5 * floor and _rel_fro(side.x.cov, full.x.cov) < 0.05
        assert _rel_fro(side.dy.cov, full.dy.cov) < 0.05
        rep = measure(st[f"side_tf32_{seed}"], cands, **kw)
        assert len(rep.results) == len(ref.results) >= 10
        for ra, rb in zip(ref.results, rep.results):
            assert (ra.role, ra.choice) == (rb.role, rb.choice)
            devs.setdefault((ra.role, ra.choice), []).append(rb.mere / ra.mere - 1)
    for key, d in devs.items():
        assert abs(float(np.mean(d))) <= 0.05 and max(abs(x) for x in d) <= 0.10, (key, d)


def test_tf32_products_stay_far_below_the_sampling_error() -> None:
    """TF32 (emulated on the CPU by truncating the operands to a 10-bit mantissa): the scatter
    within ~2^-10 of float64 on rows offset by 1e4 (the sampling error of 2,048 rows is ~3%;
    float32 stays at 1e-7), the sketch's approximation within 5% of float64's."""
    x = _offset_rows(4096, 96, seed=0).float().double()
    ref, t32 = RunningMoments(96), RunningMoments(96, precision="tf32")
    for part in x.split(1000):
        ref.update(part)
        t32.update(part.float())
    err = _rel_fro(t32.covariance().numpy(), ref.covariance().numpy())
    assert 1e-5 < err < 2e-3, f"tf32 scatter: relative Frobenius error {err:.2e}"  # > 1e-5: TF32 is in use
    # the sketch: its rank-8 approximation of the covariance about as good as float64's (the
    # products' rounding only moves the core's smallest eigenvalues, below its TF32 floor)
    cov = ref.covariance()[:48, :48].numpy()
    errs = {}
    for prec in ("float64", "tf32"):
        sk = RunningMoments(48, max_full_dim=16, sketch_rank=8, precision=prec)
        for part in x[:, :48].split(700):
            sk.update(part.float() if prec == "tf32" else part)
        vals, vecs = sk.low_rank()
        errs[prec] = _rel_fro(((vecs.T * vals) @ vecs).numpy(), cov)
    assert errs["tf32"] <= 1.05 * errs["float64"], errs


def test_device_defaults_and_bad_precision() -> None:
    assert _resolve(torch.device("cpu"), None, "auto") == (MAX_ROWS, "float64")  # the CPU: as before
    assert _resolve(torch.device("cuda", 0), None, "auto") == (CUDA_MAX_ROWS, "float32")
    assert _resolve(torch.device("cuda", 0), 512, "float64") == (512, "float64")
    assert _resolve(torch.device("cuda", 0), None, "auto", side=True) == (CUDA_MAX_ROWS, "tf32")  # issue 22
    assert _resolve(torch.device("cpu"), None, "auto", side=True) == (MAX_ROWS, "float64")
    with pytest.raises(ProbeError, match="precision='float16'"):
        Probe(nn.Linear(3, 2), precision="float16")
    with pytest.raises(ProbeError, match="max_rows=0"):
        Probe(nn.Linear(3, 2), max_rows=0)


@pytest.mark.gpu
def test_cuda_defaults_take_the_cheap_path(gauss) -> None:
    cov, _, st = gauss
    gpu, full = st["cuda_default"].sites["0"].x, st["full64"].sites["0"].x
    assert gpu.count == 16 * CUDA_MAX_ROWS  # 2,048 of each 8,192-row batch
    floor = math.sqrt((np.trace(cov) ** 2 + np.sum(cov**2)) / gpu.count) / np.linalg.norm(cov)
    assert _rel_fro(gpu.cov, cov) < 1.5 * floor and _rel_fro(gpu.cov, full.cov) < 0.05
    assert gpu.amax == pytest.approx(full.amax, rel=1e-6)


@pytest.mark.parametrize("case", ["offset", "dynamic_range", "bf16", "constant", "huge_mean_shift"])
def test_float32_batch_pass_matches_float64(case: str) -> None:
    """lowp_batch (a float32/tf32 update's one batch pass, issue 22: no float64 pass over the rows)
    against float64 on the same values: the mean float64-exact, the central moments within float32
    sums' rounding of their own scale (M2 relative, M3 relative to sum |xc|^3), whatever the offset
    or the scale; a constant column is exactly zero spread."""
    from loka_tune.probe.moments import lowp_batch

    g = torch.Generator().manual_seed(3)
    rows, d = 2048, 24
    z = torch.randn(rows, d, generator=g, dtype=torch.float64)
    if case == "offset":  # spread 1e-2 on 1e4: centring on a float32 mean would lose ~1e-3 of M2
        x = (1e4 + 1e-2 * z).float()
    elif case == "dynamic_range":
        x = (z * torch.logspace(-30, 30, d, dtype=torch.float64)).float()
    elif case == "bf16":
        x = (3.0 + z * torch.linspace(0.1, 10, d, dtype=torch.float64)).bfloat16()
    elif case == "constant":
        x = torch.full((rows, d), 7.25, dtype=torch.float32)
    else:  # a mean 1e6 standard deviations off zero
        x = (1e6 + z).float()
    ref = x.double()
    mean_ref = ref.mean(0)
    xc = ref - mean_ref
    mean, m2, m3, m4, gg, s, dd = lowp_batch(x)
    assert gg.dtype == torch.float32 and gg.abs().max() < 4 and mean.dtype == torch.float64
    scale = ref.abs().amax(0).clamp_min(1e-300)
    assert torch.all((mean - mean_ref).abs() <= 1e-13 * scale), (mean - mean_ref).abs().max()
    m2_ref, m4_ref = (xc**2).sum(0), (xc**4).sum(0)
    a3 = (xc.abs() ** 3).sum(0)
    if case == "constant":
        assert torch.all(m2 == 0) and torch.all(m3 == 0) and torch.all(m4 == 0)
        return
    assert torch.all((m2 - m2_ref).abs() <= 1e-5 * m2_ref), ((m2 - m2_ref).abs() / m2_ref).max()
    assert torch.all((m3 - (xc**3).sum(0)).abs() <= 2e-5 * a3), ((m3 - (xc**3).sum(0)).abs() / a3).max()
    assert torch.all((m4 - m4_ref).abs() <= 2e-5 * m4_ref), ((m4 - m4_ref).abs() / m4_ref).max()
    # the floor discriminates: centring on the float32 mean and dropping the correction loses the offset's M2
    if case in ("offset", "huge_mean_shift"):
        naive = ((gg.double() * s) ** 2).sum(0)
        assert ((naive - m2_ref).abs() / m2_ref).max() > 1e-5
