"""Issue 20: a probe that never raises on real data.

The statistics of the probe (full covariance, the streaming Nystrom sketch above
``max_full_dim``, the matrix-normal weight model, the Cholesky factors of the replay) on
adversarial inputs: rank 1, rank << k, constant (zero variance), duplicated rows and columns,
ill-conditioned, features spanning 1e-30..1e30, all 1e-20, all 1e30, LayerNorm + SiLU
activations. Every case goes through the real collection path (``_StreamAcc.add`` /
``snapshot``: finite check, amax, quantiles, moments) in float64 and with float32 products
(the GPU default), below and above ``max_full_dim``; where the factorization succeeds, its
accuracy is checked against a float64 numpy reference with an explicit floor:

- full covariance: every entry within ``FLOOR x sqrt(C_ii C_jj)``;
- sketch: never above the covariance (``C - A >= -FLOOR ||C||``), and its nuclear-norm error
  within 3x the Tropp et al. 2017 bound ``(1 + r / (k - r - 1))`` of the best rank-r one
  (Theorem 4.1; 3x: one draw of Omega, the bound is on the expectation) plus ``FLOOR ||C||_*``.

Where a factorization cannot succeed (injected: a non-finite sketch, a failing SVD / eigh, a
non-finite covariance or weight factor; natural: float64 overflow), the stats record the
fallback per statistic, the report per site, and a site with no usable statistic is
"unprobed" and keeps every candidate. The ``gpu`` variants run the same checks with
``device="cuda"`` and the probe's defaults there (float32 products, 2,048 rows).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from loka_tune.probe import Probe, ProbeReport, ProbeStats, measure
from loka_tune.probe.collector import _StreamAcc, _weight_factors
from loka_tune.probe.moments import DEFAULT_SKETCH_RANK, MAX_FULL_DIM, NystromSketch, RunningMoments, StatisticError
from loka_tune.probe.synth import _GaussianRows, psd_factor, psd_factor_ex
from loka_tune.probe.weights import MatrixNormalEMA, _ridge_inverse

KINDS = ("rank1", "low_rank", "constant", "duplicated", "ill_conditioned", "dynamic_range", "tiny", "huge",
         "layernorm_silu")
# relative error floors of the statistics: float64 rounding; float32 products (~1e-7 per
# entry, relative to each feature's scale) and the sketch's core floor (8 float32 eps)
FLOOR = {"float64": 1e-10, "float32": 2e-5}
VAR_FLOOR = {"float64": 1e-9, "float32": 2e-5}  # the diagonal: float64 sums, or float32 ones (issue 22)
ROWS = 2048  # rows per batch: the GPU's max_rows, so every row is merged (the reference sees them all)


def adversarial_rows(kind: str, n: int, d: int, seed: int) -> np.ndarray:
    """``(n, d)`` float64 rows of one adversarial kind (each seed its own batch)."""
    g = np.random.default_rng(seed)
    z = g.standard_normal
    mix = np.eye(d) + 0.3 * z((d, d)) / math.sqrt(d)  # correlated, well-conditioned
    if kind == "rank1":
        return np.outer(z(n), z(d)) + g.uniform(-3, 3, d)
    if kind == "low_rank":  # rank 3, far below the sketch width
        return z((n, 3)) @ z((3, d)) * 2 + 1.0
    if kind == "constant":  # every row the same, not exactly representable: zero variance up to rounding
        return np.tile(0.1 + 0.37 * np.arange(d), (n, 1))
    if kind == "duplicated":  # each column twice, each row four times
        h = z((n // 4, d // 2)) @ z((d // 2, d // 2)) / math.sqrt(d)
        return np.repeat(np.concatenate([h, h], 1), 4, 0)
    if kind == "ill_conditioned":  # standard deviations 1 .. 1e-8 along a random rotation
        q, _ = np.linalg.qr(z((d, d)))
        return (z((n, d)) * np.logspace(0, -8, d)) @ q.T
    if kind == "dynamic_range":
        return (z((n, d)) @ mix) * np.logspace(-30, 30, d)
    if kind == "tiny":  # gradients of a bf16 run can be this small
        return (z((n, d)) @ mix) * 1e-20
    if kind == "huge":
        return (z((n, d)) @ mix) * 1e30
    if kind == "layernorm_silu":  # rows of zero mean and unit variance (a null direction), then SiLU
        t = z((n, d)) @ mix + 0.5
        t = (t - t.mean(1, keepdims=True)) / t.std(1, keepdims=True)
        return t / (1 + np.exp(-t))
    raise AssertionError(kind)


def _collect(kind: str, d: int, *, device: str, precision: str, max_full_dim: int, rank: int,
             dtype: torch.dtype, batches: int = 3):
    """The real collection path of one operand stream; returns the accumulator, its stats and
    the rows it was fed (float64, as they arrived)."""
    acc = _StreamAcc(d, max_full_dim, rank, None, precision)
    gen = torch.Generator().manual_seed(0)  # the probe's generator lives on the CPU
    fed = []
    for b in range(batches):
        x = torch.from_numpy(adversarial_rows(kind, ROWS, d, seed=b)).to(device=device, dtype=dtype)
        acc.add(x, gen, None)
        fed.append(x.double().cpu().numpy())
    return acc, acc.snapshot(), np.concatenate(fed)


def _check_stats(t, x: np.ndarray, precision: str, rank: int) -> None:  # noqa: ANN001
    """The stream's statistics against the float64 reference of the rows it merged."""
    floor = FLOOR[precision]
    d = x.shape[1]
    assert t.problem() is None and t.fallbacks == {}, (t.problem(), t.fallbacks)
    c = np.cov(x, rowvar=False)
    col = np.abs(x).max(0)  # (d,) each feature's scale
    # below 1e-6 of its scale, a feature's spread is the rounding of its mean over the rows (a
    # constant feature: torch's and numpy's float64 means differ by ~1e-12 relative)
    noise = 1e-6 * col
    tiny = float(np.max(noise) ** 2)
    assert t.count == x.shape[0] and t.amax == pytest.approx(float(col.max()), rel=1e-7)
    np.testing.assert_allclose(t.mean, x.mean(0), rtol=1e-12, atol=1e-14 * col.max())
    # float64: exact (elementwise); float32 / tf32: the batch's sums are float32 (issue 22), about
    # the float32 mean with the float64 correction of what its rounding left (no cancellation)
    vfloor = VAR_FLOOR[precision]
    assert np.all(np.abs(t.var - np.diag(c)) <= vfloor * np.diag(c) + (1e-4 * noise) ** 2), \
        f"variance: max relative error {np.max(np.abs(t.var - np.diag(c)) / np.diag(c)):.2e} > {vfloor:g}"
    assert np.all(np.isfinite(t.kurtosis)) and np.all(np.isfinite(t.absq))
    sd = np.sqrt(np.clip(np.diag(c), 0.0, None))
    if t.cov is not None:
        err = np.abs(t.cov - c) / (np.outer(sd, sd) + np.outer(noise, noise))
        assert err.max() <= floor, f"covariance: max error {err.max():.2e} of sqrt(C_ii C_jj) > {floor:g}"
        return
    vals, vecs = t.lr_vals, t.lr_vecs
    k = min(d, 2 * rank)
    assert vals.shape[0] <= rank and vecs.shape == (vals.shape[0], d) and np.all(vals >= 0)
    np.testing.assert_allclose(vecs @ vecs.T, np.eye(vals.shape[0]), atol=1e-8)  # orthonormal
    a = (vecs.T * vals) @ vecs
    ev = np.linalg.eigvalsh(c)[::-1]
    gap = np.linalg.eigvalsh(c - a)
    top = max(float(ev[0]), tiny)
    assert gap.min() >= -floor * top - tiny, f"the sketch overestimates by {-gap.min() / top:.2e} of ||C||"
    best = float(np.clip(ev[rank:], 0.0, None).sum())
    total = float(np.clip(ev, 0.0, None).sum()) + d * tiny
    err = float(np.abs(gap).sum())
    bound = 3.0 * (1 + rank / (k - rank - 1)) * best + floor * total
    assert err <= bound, f"nuclear error {err / total:.3e} > bound {bound / total:.3e} (relative to ||C||_*)"


# ---------------------------------------------------------------------------- the moments (CPU)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["full", "sketch"])
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_of_adversarial_rows(kind: str, mode: str, precision: str, device: str) -> None:
    d, max_full_dim, rank = (48, 64, 8) if mode == "full" else (96, 64, 8)
    dtype = torch.float32 if precision == "float32" else torch.float64  # float32: what a GPU stream hands over
    acc, t, x = _collect(kind, d, device=device, precision=precision, max_full_dim=max_full_dim, rank=rank,
                         dtype=dtype)
    assert acc.moments.full == (mode == "full") and acc.moments.mean.device.type == device
    _check_stats(t, x, precision, rank)
    # the replay draws from these statistics without a fallback, rows of the right covariance
    t.real = None
    fac, jitter, why = psd_factor_ex(t.covariance())
    assert why is None and jitter <= 1e-6
    c = t.covariance()
    sd = np.sqrt(np.diag(c))
    noise = 1e-6 * np.abs(x).max(0)
    err = np.abs(fac @ fac.T - c) / (np.outer(sd, sd) + np.outer(noise, noise))
    assert err.max() <= 1e-4  # the jitter (j mean(diag) <= 1e-2 of each variance, here far less) and rounding


def test_float32_products_are_the_unscaled_ones_bit_for_bit_in_range() -> None:
    """The per-feature power-of-two scaling changes nothing where float32 was in range (the
    probe's verdicts on normal data stay), and rescues what was not (1e30 overflowed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 40, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 40, dtype=torch.float64)
    xc = x - x.mean(0)
    rm = RunningMoments(40, precision="float32")
    xg = xc.float()
    assert torch.equal(rm._scatter(xc), (xg.T @ xg).double())
    sk = NystromSketch(40, 4, precision="float32")
    sk.append(xc)
    assert torch.equal(sk.y, (xg.T @ (xg @ sk._omega_g)).double())
    big = xc * 1e30
    assert not torch.isfinite((big.float().T @ big.float())).all()  # what the unscaled GEMM did
    assert torch.isfinite(rm._scatter(big)).all()


def test_a_rejected_batch_leaves_the_float32_state_bit_identical() -> None:
    x = torch.from_numpy(adversarial_rows("dynamic_range", 64, 12, 0))
    bad = x.clone()
    bad[3, 2] = float("nan")
    for kw in ({}, {"max_full_dim": 4, "sketch_rank": 2}):
        rm = RunningMoments(12, precision="float32", **kw)
        rm.update(x, torch.isfinite(x).all())
        state = [rm._n, rm.mean, rm.m2d, rm.m3, rm.m4, rm.m2 if rm.full else rm.sketch.y]
        before = [s.clone() for s in state]
        rm.update(bad, torch.isfinite(bad).all())
        after = [rm._n, rm.mean, rm.m2d, rm.m3, rm.m4, rm.m2 if rm.full else rm.sketch.y]
        for b, a in zip(before, after):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------- fallbacks
def _sketched(kind: str = "low_rank"):
    return _collect(kind, 96, device="cpu", precision="float32", max_full_dim=64, rank=8, dtype=torch.float32)


def test_a_failing_svd_falls_back_to_eigh_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    acc, _, x = _sketched("ill_conditioned")

    def no_svd(*a, **k):  # noqa: ANN002, ANN003, ANN202 - cuSOLVER's failure, as on the H200
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge (error code: 128)")

    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    t = acc.snapshot()
    assert "SVD" in t.fallbacks["lowrank"] and "eigh" in t.fallbacks["lowrank"]
    t.fallbacks = {}
    _check_stats(t, x, "float32", 8)  # the eigh path is as accurate


@pytest.mark.parametrize("how", ["nonfinite_sketch", "no_factorization"])
def test_an_unfactorisable_sketch_falls_back_to_the_exact_diagonal(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    acc, _, x = _sketched()
    if how == "nonfinite_sketch":
        acc.moments.sketch.y[5, 3] = float("inf")
    else:
        def fail(*a, **k):  # noqa: ANN002, ANN003, ANN202
            raise torch.linalg.LinAlgError("failed to converge")

        monkeypatch.setattr(torch.linalg, "eigh", fail)
    with pytest.raises(StatisticError):
        acc.moments.low_rank()
    t = acc.snapshot()  # does not raise
    assert "diagonal stands in" in t.fallbacks["lowrank"]
    assert ("non-finite" if how == "nonfinite_sketch" else "eigh") in t.fallbacks["lowrank"]
    assert t.problem() is None and t.lr_vals.shape == (0,) and t.lr_vecs.shape == (0, 96)
    np.testing.assert_allclose(t.covariance(), np.diag(np.var(x, 0, ddof=1)), rtol=VAR_FLOOR["float32"])
    draws = _GaussianRows(t).draw(4000, np.random.default_rng(0))  # the replay of a diagonal-only stream
    np.testing.assert_allclose(draws.var(0), t.var, rtol=0.15)


def test_a_nonfinite_full_covariance_falls_back_to_the_diagonal() -> None:
    acc, _, x = _collect("rank1", 16, device="cpu", precision="float32", max_full_dim=64, rank=8,
                         dtype=torch.float32)
    acc.moments.m2[2, 7] = float("nan")  # as a float32 overflow would have left it
    t = acc.snapshot()
    assert t.cov is None and "non-finite covariance" in t.fallbacks["cov"] and t.problem() is None
    np.testing.assert_allclose(t.covariance(), np.diag(np.var(x, 0, ddof=1)), rtol=VAR_FLOOR["float32"])


def test_float64_overflow_leaves_the_stream_unusable_and_the_kurtosis_falls_back() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.from_numpy(adversarial_rows("rank1", 256, 8, 0))
    acc = _StreamAcc(8, 64, 4, None, "float64")
    acc.add(x * 1e160, gen, None)  # x^2 overflows float64
    t = acc.snapshot()
    assert "overflow" in t.problem() and "var" in t.fallbacks
    acc = _StreamAcc(8, 64, 4, None, "float64")
    acc.add(x * 1e100, gen, None)  # x^4 overflows, x^2 does not
    t = acc.snapshot()
    assert t.problem() is None and "kurtosis" in t.fallbacks and np.all(np.isfinite(t.kurtosis))
    assert np.all(np.isfinite(t.cov))


# ---------------------------------------------------------------------------- the weight model
def _weight_steps(kind: str, n: int, k: int, steps: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * (1e-19 if kind == "tiny" else 0.1)
    out = [w]
    for i in range(steps):
        if kind == "rank1":  # every step along one direction
            step = 1e-2 * torch.outer(torch.ones(n), torch.linspace(-1, 1, k)) * (i + 1)
        elif kind == "dead_rows":  # half the rows never move: U singular
            step = 1e-2 * torch.randn(n, k, generator=g)
            step[: n // 2] = 0
        elif kind == "tiny":  # a weight of 1e-19 moving by 1e-20 (float32 subnormals start at 1e-38)
            step = 1e-20 * torch.randn(n, k, generator=g)
        elif kind == "huge":
            step = 1e30 * torch.randn(n, k, generator=g)
        elif kind == "dynamic_range":
            step = torch.randn(n, k, generator=g) * torch.logspace(-30, 30, k)
        else:
            raise AssertionError(kind)
        out.append(out[-1] + step)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("full", [True, False], ids=["full", "diag"])
@pytest.mark.parametrize("flip_flop", [0, 2], ids=["moments", "flip_flop"])
@pytest.mark.parametrize("kind", ["rank1", "dead_rows", "tiny", "huge", "dynamic_range"])
def test_weight_model_on_adversarial_steps(kind: str, flip_flop: int, full: bool, device: str) -> None:
    n, k = 12, 10
    mn = MatrixNormalEMA(n, k, flip_flop=flip_flop, max_full_dim=64 if full else 4, device=device)
    ws = _weight_steps(kind, n, k)
    for w in ws:
        mn.update(w.to(device))
    u, v, notes = _weight_factors(mn)
    assert mn.residuals > 0
    assert u is not None and v is not None and not notes, notes
    if kind in ("huge", "dynamic_range"):  # a per-element variance of 1e60: kept in float64, not float32
        assert u.dtype == np.float64
    for f in (u, v):
        assert np.all(np.isfinite(f))
        if f.ndim == 2:
            assert np.linalg.eigvalsh(f.astype(np.float64)).min() >= -1e-6 * np.abs(f).max()
        else:
            assert np.all(f >= 0)
    assert float(np.trace(v) if v.ndim == 2 else v.sum()) == pytest.approx(k, rel=1e-4)
    if flip_flop == 0 and kind in ("rank1", "dead_rows", "tiny"):  # the moment estimators: per element
        r = torch.stack([b - a for a, b in zip(ws[:-1], ws[1:])]).double()  # (about) the residuals' scale
        per_elem = float(np.mean(np.diag(u) if u.ndim == 2 else u) * np.mean(np.diag(v) if v.ndim == 2 else v))
        assert per_elem <= 10 * float((r**2).mean()) and per_elem > 0
    # draws from it: finite, and around the mean
    fl = [psd_factor(f.astype(np.float64))[0] if f.ndim == 2 else np.sqrt(f) for f in (u, v)]
    assert all(np.all(np.isfinite(f)) for f in fl)


def test_ridge_inverse_of_singular_and_broken_factors() -> None:
    rank1 = torch.outer(torch.arange(1.0, 6.0, dtype=torch.float64), torch.arange(1.0, 6.0, dtype=torch.float64))
    for s in (rank1, torch.zeros(5, 5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)):
        inv = _ridge_inverse(s)
        assert torch.isfinite(inv).all()
    inv = _ridge_inverse(rank1)  # the ridge: 1e-6 of mean(diag) = 1.1e-5
    np.testing.assert_allclose((rank1 + 1.1e-5 * torch.eye(5, dtype=torch.float64)) @ inv, np.eye(5), atol=1e-6)
    with pytest.raises(StatisticError, match="non-finite"):
        _ridge_inverse(torch.full((3, 3), float("nan"), dtype=torch.float64))


def test_broken_weight_factors_fall_back_to_the_diagonal_then_to_the_mean() -> None:
    mn = MatrixNormalEMA(6, 5, flip_flop=1)
    for w in _weight_steps("rank1", 6, 5, steps=3):
        mn.update(w)
    mn._u_raw[0, 1] = float("inf")  # an off-diagonal entry: the diagonal stands in
    u, v, notes = _weight_factors(mn)
    assert u.ndim == 1 and np.all(np.isfinite(u)) and v.ndim == 2 and "u" in notes
    mn._u_raw[2, 2] = float("nan")  # the diagonal too: no model
    u, v, notes = _weight_factors(mn)
    assert u is None and v is None and "mean weight" in notes["model"]
    mm = MatrixNormalEMA(3, 2)
    for w in _weight_steps("rank1", 3, 2, steps=2):
        mm.update(w)
    mm._v_raw.zero_()  # no positive trace to fix the scale with
    assert _weight_factors(mm)[0] is None and "trace" in _weight_factors(mm)[2]["model"]


# ---------------------------------------------------------------------------- the replay's factors
def test_psd_factor_is_scale_free_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    x = adversarial_rows("dynamic_range", 400, 24, 0)
    c = np.cov(x, rowvar=False)
    lf, j = psd_factor(c)
    sd = np.sqrt(np.diag(c))
    assert j == 0.0 and np.max(np.abs(lf @ lf.T - c) / np.outer(sd, sd)) < 1e-9  # each feature at its own scale
    sing = np.cov(adversarial_rows("duplicated", 400, 24, 0), rowvar=False)  # singular: jitter, per feature
    lf, j, why = psd_factor_ex(sing)
    sd = np.sqrt(np.diag(sing))
    assert why is None and 0 < j <= 1e-6 and np.max(np.abs(lf @ lf.T - sing) / np.outer(sd, sd)) <= 1e-4
    const = np.zeros((4, 4))
    const[1, 1] = 2.0  # three zero-variance features
    lf, j = psd_factor(const)
    np.testing.assert_allclose(lf @ lf.T, const, atol=1e-12 * 2.0)  # at most the jitter on the constant ones

    def fail(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise np.linalg.LinAlgError("Eigenvalues did not converge")

    bad = np.array([[1.0, 2.0], [2.0, 1.0]])  # indefinite: every Cholesky fails
    monkeypatch.setattr(np.linalg, "eigh", fail)
    lf, j, why = psd_factor_ex(bad)
    assert math.isnan(j) and "diagonal" in why and np.allclose(lf, np.eye(2))


# ---------------------------------------------------------------------------- end to end (CPU)
class Branches(nn.Module):
    """Four linears on separate inputs: ``big`` (|x| ~ 1e160: float64 moments overflow),
    ``const`` (a constant input), ``rank1`` (rank-1 input), ``wide`` (sketched: 24 > max_full_dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.big, self.const, self.rank1, self.wide = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8 + 8 + 8 + 24)
        a, b, c, d = x.split([8, 8, 8, 24], dim=1)
        return self.big(a) * 1e-160 + self.const(b) + self.rank1(c) + self.wide(d)


def _probe_branches(monkeypatch: pytest.MonkeyPatch, steps: int = 6) -> ProbeStats:
    torch.manual_seed(0)
    model = Branches().double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with Probe(model, every=1, max_full_dim=16, sketch_rank=4) as p:
        for _ in range(steps):
            n = 64
            big = torch.randn(n, 8, generator=g, dtype=torch.float64) * 1e160
            const = torch.full((n, 8), 0.3, dtype=torch.float64)
            r1 = torch.outer(torch.randn(n, generator=g, dtype=torch.float64), torch.linspace(-1, 1, 8, dtype=torch.float64))
            wide = torch.randn(n, 24, generator=g, dtype=torch.float64)
            opt.zero_grad()
            model(torch.cat([big, const, r1, wide], 1)).square().mean().backward()
            opt.step()

    def fail(*a, **k):  # noqa: ANN002, ANN003, ANN202 - the sketch's factorization fails (as on the H200)
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge (error code: 128)")

    with monkeypatch.context() as m:
        m.setattr(torch.linalg, "svd", fail)
        m.setattr(torch.linalg, "eigh", fail)
        return p.stats


def test_probe_on_adversarial_activations_reports_fallbacks_and_unprobed_sites(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stats = _probe_branches(monkeypatch)
    assert set(stats.problems()) == {"big"} and "overflow" in stats.problems()["big"]
    assert set(stats.sites["wide"].fallbacks) == {"x.lowrank"}  # 24 > 16: sketched, its eig failed
    assert stats.sites["const"].fallbacks == {} and np.abs(stats.sites["const"].x.cov).max() < 1e-30  # rounding
    stats = ProbeStats.load(stats.save(tmp_path / "st.npz"))  # the fallbacks survive the file
    assert "x.lowrank" in stats.sites["wide"].fallbacks
    rep = measure(stats, ["e4m3.row.emulated"], samples=2, skip_bad_sites=True)
    status = rep.site_status()
    assert status["big"]["status"] == "unprobed" and "overflow" in status["big"]["reason"]
    assert status["wide"]["status"] == "fallback" and "diagonal" in status["wide"]["fallbacks"]["x.lowrank"]
    assert status["const"]["status"] == status["rank1"]["status"] == "probed"
    assert rep.unprobed == ["big"] and {r.site for r in rep.results} == {"const", "rank1", "wide"}
    line = rep.status_line()
    assert "4 sites, 3 probed" in line and "wide: x.lowrank" in line and "1 unprobed" in line and "big:" in line
    table = rep.sites_table()
    assert "unprobed" in table and "fallback" in table and "24x4" in table
    back = ProbeReport.load(rep.save(tmp_path / "probe_report.json"))  # what the study writes and report reads
    assert back.site_status() == status and back.status_line() == line
    assert json.loads((tmp_path / "probe_report.json").read_text())["meta"]["sites"]["big"]["status"] == "unprobed"


def test_unprobed_sites_keep_every_candidate() -> None:
    from loka_tune.space.candidates import SearchSpace, SiteChoices, prune_by_probe
    from loka_tune.space.sites import Site

    choices = {"fwd": ("bf16", "e4m3.row.emulated", "e4m3.tensor.emulated")}
    sites = tuple(SiteChoices(Site(name, 256, 256, 1.0), dict(choices), {}, {}, {}) for name in ("a", "b"))
    space = SearchSpace(sites=sites)
    results = [dict(site="a", role="fwd", choice="e4m3.row.emulated", mere=0.9, speedup=2.0)]
    slow = lambda site, role, cid: 0.5  # noqa: E731 - every FP8 choice priced slower than bf16
    pruned = prune_by_probe(space, results, max_error=0.2, min_speedup=1.0, speedup=slow)
    assert [sc.choices["fwd"] for sc in pruned.sites] == [("bf16",), ("bf16",)]
    kept = prune_by_probe(space, results, max_error=0.2, min_speedup=1.0, speedup=slow, unprobed=["b"])
    assert kept.sites[0].choices["fwd"] == ("bf16",) and kept.sites[1] == space.sites[1]


# ---------------------------------------------------------------------------- the GPU collection path
@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, MAX_FULL_DIM + 256], ids=["full", "sketch"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_statistics_of_adversarial_rows(kind: str, d: int) -> None:
    """The probe's defaults on a GPU (precision 'auto' = float32 products, 2,048 rows, the real
    MAX_FULL_DIM and sketch rank) on the adversarial kinds: no raise, no fallback, the floors."""
    acc, t, x = _collect(kind, d, device="cuda", precision="auto", max_full_dim=MAX_FULL_DIM,
                         rank=DEFAULT_SKETCH_RANK, dtype=torch.float32)
    assert acc.precision == "float32" and acc.max_rows == ROWS and acc.moments.mean.is_cuda
    assert acc.moments.full == (d <= MAX_FULL_DIM)
    _check_stats(t, x, "float32", DEFAULT_SKETCH_RANK)


@pytest.mark.gpu
def test_gpu_bf16_probe_of_layernorm_silu_widths_forms_its_report() -> None:
    """A bf16 model on the GPU whose sites see LayerNorm + SiLU activations above and below
    MAX_FULL_DIM and tiny bf16 gradients: the probe's stats and report form, every site probed."""
    torch.manual_seed(0)
    wide = MAX_FULL_DIM + 256
    model = nn.Sequential(nn.Linear(64, wide), nn.LayerNorm(wide), nn.SiLU(), nn.Linear(wide, 512), nn.LayerNorm(512),
                          nn.SiLU(), nn.Linear(512, 1)).cuda().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Probe(model, every=1) as p:
        for _ in range(4):
            opt.zero_grad()
            x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
            (model(x).float().square().mean() * 1e-6).backward()  # tiny gradients
            opt.step()
    stats = p.stats
    assert stats.problems() == {} and all(not s.fallbacks for s in stats.sites.values())
    assert not stats.sites["3"].x.full and stats.sites["3"].x.lr_vals.shape[0] > 0  # LayerNorm(2304): sketched
    rep = measure(stats, ["e4m3.row.emulated"], samples=2, device="cpu")
    assert {s["status"] for s in rep.site_status().values()} == {"probed"} and rep.results


# ---------------------------------------------------------------------------- a study goes on
def test_a_study_with_an_unprobed_site_goes_on_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny CPU study of ``test_tune`` with one site's statistics unformable (a float64
    overflow of its variance, injected into the probe's stats) and another's covariance
    fallen back to its diagonal: preparation goes on, logs one line naming both, the
    unprobed site keeps every candidate while max_error = 1e-6 prunes every FP8 choice of the
    probed ones, and ``loka-tune report`` lists the probe's sites with their fallbacks."""
    from loka_tune.cli import main
    from loka_tune.space.candidates import SearchSpace
    from loka_tune.tuner import prepare
    from loka_tune.tuner.results import ATTR_SPACE
    from loka_tune.tuner.study import load_study
    from tests.test_tune import write_study

    p = write_study(tmp_path, n_trials=1)
    p.write_text(p.read_text().replace("[probe]\n", "[probe]\nmax_error = 1e-6\n"))
    real = prepare.run_baseline
    picked: dict[str, str] = {}

    def run_baseline(*a, **k):  # noqa: ANN002, ANN003, ANN202
        bl, stats, model = real(*a, **k)
        names = list(stats.sites)
        picked.update(unprobed=names[0], fallback=names[-1])
        x = stats.sites[names[0]].x
        x.var = x.var.copy()
        x.var[0] = math.inf
        x.fallbacks["var"] = "non-finite mean or variance (float64 overflow: |x| above ~1e154)"
        y = stats.sites[names[-1]].x
        y.fallbacks["cov"] = "non-finite covariance; the exact diagonal stands in"
        y.cov, y.lr_vals, y.lr_vecs = None, np.zeros(0), np.zeros((0, y.dim))
        return bl, stats, model

    monkeypatch.setattr(prepare, "run_baseline", run_baseline)
    assert main(["tune", str(p), "--no-tracking"]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "probe sites:" in ln)
    assert "1 unprobed, keeping every candidate" in line and picked["unprobed"] in line
    assert f"{picked['fallback']}: x.cov" in line
    cfg = load_study(p)
    import optuna

    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)
    space = SearchSpace.from_dict(study.user_attrs[ATTR_SPACE])
    un = space.site(picked["unprobed"])
    assert any(c != "bf16" for cs in un.choices.values() for c in cs)  # kept its FP8 candidates
    assert not any(why.startswith(("unsafe", "slow")) for d in un.dropped.values() for why in d.values())
    for sc in space.sites:  # every probed site: all FP8 choices unsafe at max_error 1e-6
        if sc.name != picked["unprobed"]:
            assert all(cs == ("bf16",) for cs in sc.choices.values()), sc.name
    rep = ProbeReport.load(cfg.output_dir / "probe_report.json")
    assert rep.unprobed == [picked["unprobed"]] and rep.site_status()[picked["fallback"]]["status"] == "fallback"
    assert main(["report", str(p), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "probe (" in out and "unprobed" in out and "x.cov: non-finite covariance" in out
    assert all(n in out for n in rep.site_status())


def test_report_finds_the_probe_report_where_tune_wrote_it(tmp_path: Path) -> None:
    """``tune --out-dir X`` writes probe_report.json into X and stores X; ``report`` with the study
    file (whose own output dir is elsewhere) reads it from X, then the study file's dir, then its
    own ``--out-dir``; with none there the line names the stored dir's missing file."""
    from types import SimpleNamespace

    from loka_tune.commands.report import _probe_report_path

    ran, own, extra = tmp_path / "ran", tmp_path / "own", tmp_path / "extra"
    for d in (ran, own, extra):
        d.mkdir()
    cfg = SimpleNamespace(output_dir=own)
    attr = {"study": {"output_dir": str(ran)}}
    assert _probe_report_path(cfg, attr) == ran / "probe_report.json"  # none exists: the stored one's
    (extra / "probe_report.json").write_text("{}")
    assert _probe_report_path(cfg, attr, extra) == extra / "probe_report.json"
    (own / "probe_report.json").write_text("{}")
    assert _probe_report_path(cfg, attr, extra) == own / "probe_report.json"
    (ran / "probe_report.json").write_text("{}")
    assert _probe_report_path(cfg, attr, extra) == ran / "probe_report.json"
    assert _probe_report_path(None, {}) is None
