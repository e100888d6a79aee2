"""Probe, online half: streaming moments, the hooks, the weight model, save/load, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from loka_tune.errors import ProbeError
from loka_tune.probe import Probe, ProbeStats, measure
from loka_tune.probe.moments import NystromSketch, RunningMoments
from loka_tune.probe.weights import MatrixNormalEMA


def _data(n: int, d: int, seed: int = 0) -> np.ndarray:
    """Correlated, offset, mixed-scale, partly skewed rows: not an easy case for streaming."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d))
    x = rng.standard_normal((n, d)) @ mix * np.logspace(-2, 2, d) + rng.uniform(-100, 100, d)
    x[:, 0] = rng.exponential(3.0, n) + 50.0  # skewed, heavy-ish tail
    return x


def _merge(parts: list[np.ndarray], **kw) -> RunningMoments:
    rm = RunningMoments(parts[0].shape[-1], **kw)
    for p in parts:
        rm.update(torch.from_numpy(p))
    return rm


def _check_against_numpy(rm: RunningMoments, x: np.ndarray) -> None:
    x2 = x.reshape(-1, x.shape[-1])
    ref_cov = np.cov(x2, rowvar=False)
    assert rm.n == x2.shape[0]
    np.testing.assert_allclose(rm.mean.numpy(), x2.mean(0), rtol=1e-10, atol=1e-10 * np.abs(x2).max())
    np.testing.assert_allclose(rm.covariance().numpy(), ref_cov, rtol=1e-10, atol=1e-10 * np.abs(ref_cov).max())


SPLITS = {
    "one_batch": [],
    "first_row_alone": [1],
    "uneven": [3, 4, 150, 151, 299],
    "many_small": list(range(7, 300, 7)),
    "single_rows_head": [1, 2, 3, 4, 5],
}


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_streaming_mean_cov_equal_numpy_whatever_the_split(split: str) -> None:
    x = _data(300, 7)
    rm = _merge(np.split(x, SPLITS[split]))
    _check_against_numpy(rm, x)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=199), max_size=12), seed=st.integers(0, 10_000))
def test_streaming_moments_any_split_hypothesis(cuts: list[int], seed: int) -> None:
    x = _data(200, 5, seed)
    rm = _merge(np.split(x, sorted(set(cuts))))
    _check_against_numpy(rm, x)


def test_three_d_batches_flatten_into_rows() -> None:
    x = _data(4 * 5 * 6, 4).reshape(4, 5 * 6, 4)  # (B, T, d) batches
    rm = RunningMoments(4)
    for b in range(4):
        rm.update(torch.from_numpy(x[b].reshape(5, 6, 4)))  # 3-D (5, 6, d) per call
    _check_against_numpy(rm, x)


def test_kurtosis_matches_scipy() -> None:
    x = _data(500, 3)
    x[:, 1] = np.random.default_rng(1).standard_t(5, 500)  # heavy tails
    rm = _merge(np.split(x, [17, 200, 333]))
    np.testing.assert_allclose(rm.excess_kurtosis().numpy(), scipy.stats.kurtosis(x, axis=0), rtol=1e-9)


def test_sketch_mode_diag_exact_and_nystrom_approximation() -> None:
    rng = np.random.default_rng(2)
    d, rank = 48, 12
    x = rng.standard_normal((900, 5)) @ rng.standard_normal((5, d)) * 4 + rng.standard_normal((900, d)) * 0.3
    x += rng.uniform(-5, 5, d)
    parts = np.split(x, [100, 101, 500])
    full = _merge(parts)
    sk = _merge(parts, max_full_dim=32, sketch_rank=rank)
    assert not sk.full and full.full
    m2 = full.m2.numpy()
    np.testing.assert_allclose(sk.m2d.numpy(), np.diag(m2), rtol=1e-10)
    np.testing.assert_allclose(sk.mean.numpy(), full.mean.numpy(), rtol=1e-12, atol=1e-12)
    vals, vecs = sk.sketch.eig()
    assert vals.shape == (rank,) and torch.all(vals[:-1] >= vals[1:])
    np.testing.assert_allclose(vecs.numpy() @ vecs.numpy().T, np.eye(rank), atol=1e-9)  # orthonormal
    approx = (vecs.T.numpy() * vals.numpy()) @ vecs.numpy()
    gap = m2 - approx
    eig = np.linalg.eigvalsh(m2)[::-1]
    assert np.linalg.eigvalsh(gap).min() > -1e-8 * eig[0]  # Nystrom never overestimates
    # the nuclear-norm error within the paper's bound 1 + r / (k - r - 1) (k = 2r) of the best rank-r one,
    # with margin for one draw of Omega (the bound is on the expectation)
    best = eig[rank:].sum()
    assert np.linalg.eigvalsh(gap).sum() <= 3.0 * (1 + rank / (rank - 1)) * best
    # 5 strong directions + noise: the sketch captures the top eigenvalues closely
    np.testing.assert_allclose(vals.numpy()[:5], eig[:5], rtol=0.05)


def test_sketch_of_large_batches_uses_a_reweighted_row_subset() -> None:
    rng = np.random.default_rng(4)
    d = 40
    x = rng.standard_normal((6000, 3)) @ (rng.standard_normal((3, d)) * 3) + rng.standard_normal((6000, d)) * 0.2
    parts = np.split(x, [3000])  # two calls of 3000 rows, 256 of each feed the sketch
    full = _merge(parts)
    sk = _merge(parts, max_full_dim=16, sketch_rank=8, sketch_rows=256)
    np.testing.assert_allclose(sk.m2d.numpy(), np.diag(full.m2.numpy()), rtol=1e-10)  # still exact
    top = np.linalg.eigvalsh(full.m2.numpy())[::-1][:3]
    vals, _ = sk.sketch.eig()
    # 3 strong directions seen through 2 x 256 reweighted rows: within ~4 standard errors
    np.testing.assert_allclose(vals.numpy()[:3], top, rtol=0.3)


def test_nystrom_exact_for_low_rank_whatever_the_split() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 4)) @ rng.standard_normal((4, 20))
    ref = a.T @ a
    for cuts in ([], [1, 150, 299]):
        sk = NystromSketch(20, 3)  # sketch width 6 >= rank 4: exact (the top 3 returned, then all 4)
        for part in np.split(a, cuts):
            sk.append(torch.from_numpy(part))
        vals, vecs = sk.eig()
        np.testing.assert_allclose(vals.numpy(), np.linalg.eigvalsh(ref)[::-1][:3], rtol=1e-8)
        sk.rank = 4
        vals, vecs = sk.eig()
        np.testing.assert_allclose((vecs.T * vals) @ vecs, ref, rtol=1e-8, atol=1e-8 * np.abs(ref).max())
    assert NystromSketch(5, 2).eig()[0].numel() == 0  # nothing appended: an empty approximation


# ---------------------------------------------------------------------------- the weight model
@pytest.mark.parametrize("flip_flop", [0, 2], ids=["moments", "flip_flop"])
def test_matrix_normal_recovers_u_and_v(flip_flop: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 6, 4
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    u = a @ a.T / n + 0.2 * torch.eye(n, dtype=torch.float64)
    b = torch.randn(k, k, generator=g, dtype=torch.float64)
    v = b @ b.T / k + 0.2 * torch.eye(k, dtype=torch.float64)
    v = v * k / v.trace()  # the model's scale convention
    lu, lv = torch.linalg.cholesky(u), torch.linalg.cholesky(v)
    m0 = 3 * torch.randn(n, k, generator=g, dtype=torch.float64)
    ema, sd = 0.02, 0.1
    mn = MatrixNormalEMA(n, k, ema=ema, flip_flop=flip_flop)
    for _ in range(3000):
        mn.update(m0 + sd * lu @ torch.randn(n, k, generator=g, dtype=torch.float64) @ lv.T)
    # residual W_t - M_{t-1}: variance inflated by the EMA mean's own variance a / (2 - a)
    infl = sd**2 * (1 + ema / (2 - ema))
    assert float(mn.v.trace()) == pytest.approx(k)
    assert (mn.v - v).abs().max() <= 0.1 * v.abs().max()
    assert (mn.u / infl - u).abs().max() <= 0.2 * u.abs().max()
    assert (mn.mean - m0).abs().max() <= 0.1


@pytest.mark.parametrize("flip_flop", [0, 2], ids=["moments", "flip_flop"])
def test_matrix_normal_diagonal_mode_above_the_cap(flip_flop: int) -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 8, 5
    u = torch.linspace(0.5, 4.0, n, dtype=torch.float64)
    v = torch.linspace(0.2, 2.0, k, dtype=torch.float64)
    v = v * k / v.sum()
    mn = MatrixNormalEMA(n, k, ema=0.02, max_full_dim=3, flip_flop=flip_flop)
    assert not mn.u_full and not mn.v_full
    for _ in range(3000):
        mn.update(u.sqrt()[:, None] * torch.randn(n, k, generator=g, dtype=torch.float64) * v.sqrt()[None, :])
    infl = 1 + 0.02 / 1.98
    np.testing.assert_allclose(mn.v.numpy(), v.numpy(), rtol=0.15)
    np.testing.assert_allclose(mn.u.numpy() / infl, u.numpy(), rtol=0.2)


def test_matrix_normal_moments_from_column_subsets() -> None:
    """K = 40 columns > max_full_dim = 8: V is diagonal and R R^T comes from 8 random columns
    per collection, rescaled; U must still be recovered."""
    g = torch.Generator().manual_seed(2)
    n, k = 6, 40
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    u = a @ a.T / n + 0.2 * torch.eye(n, dtype=torch.float64)
    v = torch.linspace(0.5, 1.5, k, dtype=torch.float64)  # trace k
    lu = torch.linalg.cholesky(u)
    mn = MatrixNormalEMA(n, k, ema=0.02, max_full_dim=8)
    assert mn.u_full and not mn.v_full
    for _ in range(3000):
        mn.update(lu @ torch.randn(n, k, generator=g, dtype=torch.float64) * v.sqrt())
    infl = 1 + 0.02 / 1.98
    assert (mn.u / infl - u).abs().max() <= 0.2 * u.abs().max()
    # each V_jj is seen through N = 6 values per residual, ~100 residuals kept: SE ~6%
    np.testing.assert_allclose(mn.v.numpy(), v.numpy(), rtol=0.25)


@pytest.mark.parametrize("flip_flop", [0, 2], ids=["moments", "flip_flop"])
@pytest.mark.parametrize("n,k", [(32, 32), (8, 64), (64, 8)])
def test_matrix_normal_few_collections_keep_the_step_scale(n: int, k: int, flip_flop: int) -> None:
    """Few residuals of rank <= min(N, K) in new directions each time: the shrinkage must keep
    the per-element variance of the model at the size of the weight's steps (no blow-up)."""
    g = torch.Generator().manual_seed(0)
    mn = MatrixNormalEMA(n, k, flip_flop=flip_flop)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    for _ in range(5):
        mn.update(w)
        w = w + 0.01 * torch.randn(n, k, generator=g, dtype=torch.float64)
    sd = float((mn.u.diagonal().mean() * mn.v.diagonal().mean()).sqrt())
    assert 0.007 < sd < 0.015
    assert float(torch.linalg.eigvalsh(mn.u).min()) > 0 and float(torch.linalg.eigvalsh(mn.v).min()) > 0


def test_static_weight_gives_no_residual_model() -> None:
    mn = MatrixNormalEMA(3, 2)
    w = torch.randn(3, 2)
    for _ in range(4):
        mn.update(w)
    assert mn.count == 4 and mn.residuals == 0
    torch.testing.assert_close(mn.mean, w)


# ---------------------------------------------------------------------------- the hooks
class Toy(nn.Module):
    """Two linears on 3-D inputs (rows = B * T), plus a non-linear in between."""

    def __init__(self, k: int = 6, h: int = 5, n: int = 3) -> None:
        super().__init__()
        self.a = nn.Linear(k, h)
        self.b = nn.Linear(h, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))  # (B, T, n)


def _train_with_reference(model: Toy, probe: Probe | None, steps: int, every: int, seed: int = 0):
    """SGD on a fixed linear loss; returns the reference X / dY rows of collected steps."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    c = torch.randn(3, generator=g)
    ref = {"a.x": [], "a.dy": [], "b.x": [], "b.dy": []}
    for step in range(1, steps + 1):
        x = torch.randn(4, 7, 6, generator=g) * torch.linspace(0.5, 3, 6) + torch.linspace(-2, 2, 6)
        if step % every == 0:  # reference, from the submodules directly (no root hooks fire)
            ya = model.a(x)
            h = torch.tanh(ya)
            yb = model.b(h)
            ga, gb = torch.autograd.grad((yb * c).sum(), [ya, yb])
            ref["a.x"].append(x.reshape(-1, 6))
            ref["a.dy"].append(ga.reshape(-1, 5))
            ref["b.x"].append(h.detach().reshape(-1, 5))
            ref["b.dy"].append(gb.reshape(-1, 3))
            weights = {n: getattr(model, n).weight.detach().clone() for n in ("a", "b")}
        opt.zero_grad()
        (model(x) * c).sum().backward()
        opt.step()
        model.eval()
        model(x)  # an eval forward: not a step, never collected
        model.train()
    out = {k: torch.cat(v).double().numpy() for k, v in ref.items()}
    out.update({f"{n}.w": w.numpy() for n, w in weights.items()})  # at the last collection
    return out


def test_probe_collects_exact_moments_of_collected_steps() -> None:
    torch.manual_seed(0)
    model = Toy()
    with Probe(model, every=3) as p:
        ref = _train_with_reference(model, p, steps=10, every=3)
    st_ = p.stats
    assert p.steps == 10 and st_.collections == 3  # steps 3, 6, 9; eval forwards not counted
    for site in ("a", "b"):
        s = st_.sites[site]
        for part in ("x", "dy"):
            rows = ref[f"{site}.{part}"]
            t = getattr(s, part)
            assert t.count == rows.shape[0] and t.batches == 3 and t.rows == 28
            np.testing.assert_allclose(t.mean, rows.mean(0), rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(t.cov, np.cov(rows, rowvar=False), rtol=1e-9, atol=1e-12)
            assert t.amax == pytest.approx(np.abs(rows).max(), rel=1e-6)
            assert t.real.shape == (28, rows.shape[1])
        assert s.w.count == 3 and s.w.residuals == 2
        np.testing.assert_array_equal(s.w.last, ref[f"{site}.w"])
    assert st_.sites["a"].rows == 28 and st_.sites["a"].shape("wgrad") == (5, 28, 6)


def test_no_site_hooks_between_collections_and_after_exit() -> None:
    model = Toy()
    x = torch.randn(2, 3, 6)
    seen = []
    with Probe(model, every=5) as p:
        for _ in range(7):
            model(x).sum().backward()
            seen.append(len(model.a._forward_hooks) + len(model.b._forward_hooks))
        assert len(model._forward_pre_hooks) == 1
    assert seen == [0] * 7  # site hooks live only inside a collecting forward
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert p.collections == 1


def test_manual_stepping_and_collect_next() -> None:
    model = Toy()
    x = torch.randn(2, 3, 6)
    with Probe(model, every=2, step_on="manual") as p:
        for _ in range(5):
            model(x).sum().backward()
            p.step()
        assert p.collections == 2  # forwards after steps 2 and 4
        p.collect_next()
        model(x).sum().backward()
    assert p.collections == 3 and p.steps == 5
    with pytest.raises(ProbeError, match="manual"):
        Probe(Toy(), every=2).step()


def test_probe_handles_loka_linear_subclass() -> None:
    from loka_tune.kernels.linear import LokaLinear

    model = nn.Sequential(LokaLinear.from_linear(nn.Linear(4, 3), "e4m3.row.emulated"))
    with Probe(model, every=1) as p:
        model(torch.randn(5, 4)).sum().backward()
    s = p.stats.sites["0"]
    assert s.x.count == 5 and s.dy.count == 5


def test_module_called_twice_per_forward() -> None:
    """Both calls are merged; the captured real batch pairs X and dY of the first call."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l(x) + 3 * self.l(2 * x)

    model = Twice()
    x = torch.randn(5, 3)
    with Probe(model, every=1) as p:
        model(x).sum().backward()
    s = p.stats.sites["l"]
    assert s.x.count == 10 and s.x.batches == 2 and s.dy.count == 10
    np.testing.assert_array_equal(np.sort(s.x.real, 0), np.sort(x.numpy(), 0))  # first call: x
    np.testing.assert_allclose(s.dy.real, np.ones((5, 2)))  # d(sum)/dY of the first call is 1


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ProbeError, match="no eligible nn.Linear"):
        Probe(nn.Sequential(nn.ReLU(), nn.LayerNorm(3)))
    with pytest.raises(ProbeError, match="every"):
        Probe(Toy(), every=0)
    with pytest.raises(ProbeError, match="step_on"):
        Probe(Toy(), step_on="epoch")
    with pytest.raises(ProbeError, match="unknown site"):
        Probe(Toy(), sites=["c"])
    p = Probe(Toy(), sites=["re:b"])
    assert p.site_names == ["b"]
    with pytest.raises(ProbeError, match="never collected"):
        Probe(Toy(), every=100).stats.check()


def test_nonfinite_batches_are_skipped_recorded_and_reported() -> None:
    model = Toy()
    x = torch.randn(2, 3, 6)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with Probe(model, every=1) as p:
        model(x).sum().backward()
        model(bad).sum().backward()  # NaN input: X of a (and everything downstream) skipped
        model(x).sum().backward()
    st_ = p.stats
    assert st_.sites["a"].x.nonfinite == 1 and st_.sites["a"].x.batches == 2
    assert np.all(np.isfinite(st_.sites["a"].x.cov))  # not poisoned
    assert set(st_.problems()) == {"a", "b"}
    with pytest.raises(ProbeError, match=r"'?a'?: x: 1 collected batch\(es\) held NaN/inf"):
        st_.check()
    with pytest.raises(ProbeError, match="skip_bad_sites"):
        measure(st_, ["e4m3.row.emulated"], samples=1)
    rep = measure(st_, ["e4m3.row.emulated"], samples=1, skip_bad_sites=True)
    assert not rep.results and {s.site for s in rep.skipped if s.role == "*"} == {"a", "b"}


def test_a_rejected_batch_leaves_every_moment_bit_identical() -> None:
    x = torch.from_numpy(_data(50, 5))
    bad = x.clone()
    bad[3, 2] = float("inf")
    for kw in ({}, {"max_full_dim": 2, "sketch_rank": 2}):  # full covariance and sketch mode
        rm = RunningMoments(5, **kw)
        rm.update(x, torch.isfinite(x).all())
        before = [t.clone() for t in (rm._n, rm.mean, rm.m2d, rm.m3, rm.m4)] + ([rm.m2.clone()] if rm.full else [])
        rm.update(bad, torch.isfinite(bad).all())  # decided on the device: no host read of the flag
        after = [rm._n, rm.mean, rm.m2d, rm.m3, rm.m4] + ([rm.m2] if rm.full else [])
        for b, a in zip(before, after):
            assert torch.equal(a, b)
        assert rm.n == 50


def test_rows_above_max_rows_merge_a_random_subset() -> None:
    model = Toy()
    x = torch.randn(4, 7, 6)  # 28 rows per site and collection
    with Probe(model, every=1, max_rows=10) as p:
        for _ in range(3):
            model(x).sum().backward()
    s = p.stats.sites["a"]
    assert s.x.count == 30 and s.dy.count == 30 and s.x.rows == 28  # 10 of 28 rows, 3 collections
    assert s.x.real.shape == (28, 6)  # the real-replay rows are drawn from the whole batch
    rows = x.reshape(-1, 6).double().numpy()
    assert np.all(np.isfinite(s.x.cov))
    assert np.all((s.x.mean >= rows.min(0)) & (s.x.mean <= rows.max(0)))  # a mean of actual rows
    with pytest.raises(ProbeError, match="max_rows"):
        Probe(model, max_rows=0)


def test_problems_of_unselected_sites_do_not_block_measuring_others() -> None:
    model = Toy()
    with Probe(model, every=1) as p:
        model(torch.randn(2, 3, 6)).sum().backward()
    st_ = p.stats
    st_.sites["b"].x.nonfinite = 1  # as if b had seen a NaN batch
    with pytest.raises(ProbeError, match="'?b'?: x"):
        measure(st_, ["e4m3.row.emulated"], samples=1)
    rep = measure(st_, ["e4m3.row.emulated"], samples=1, sites=["a"])
    assert rep.sites == ["a"]


# ---------------------------------------------------------------------------- files
def _collected(model: nn.Module, steps: int = 4) -> ProbeStats:
    with Probe(model, every=2) as p:
        for i in range(steps):
            model(torch.randn(3, 2, 6) + i).sum().backward()
    return p.stats


def test_save_load_roundtrip(tmp_path) -> None:
    model = Toy()
    st_ = _collected(model)
    st_.meta["note"] = "x"
    path = st_.save(tmp_path / "stats")  # suffix added
    assert path.name == "stats.npz"
    back = ProbeStats.load(path, model=model)
    assert back.fingerprint() == st_.fingerprint() == [["a", 6, 5], ["b", 5, 3]]
    assert (back.every, back.steps, back.collections, back.model, back.meta) == (2, 4, 2, "Toy", {"note": "x"})
    for name, s in st_.sites.items():
        b = back.sites[name]
        for part in ("x", "dy", "w"):
            o, r = getattr(s, part), getattr(b, part)
            for k in o._SCALARS:
                assert getattr(o, k) == getattr(r, k), (name, part, k)
            for k in o._ARRAYS:
                a1, a2 = getattr(o, k), getattr(r, k)
                assert (a1 is None) == (a2 is None)
                if a1 is not None:
                    np.testing.assert_array_equal(a1, a2)
                    assert a1.dtype == a2.dtype
    assert "2 sites" in back.summary()


def test_load_for_another_model_names_the_mismatch(tmp_path) -> None:
    path = _collected(Toy()).save(tmp_path / "s.npz")
    with pytest.raises(ProbeError, match=r"shapes differ.*b: stats 5->3, model 5->4"):
        ProbeStats.load(path, model=Toy(n=4))
    other = nn.Sequential(nn.Linear(6, 5))
    with pytest.raises(ProbeError, match=r"not in the model: 'a', 'b'.*not in the stats: '0'"):
        ProbeStats.load(path, model=other)


def test_load_bad_files(tmp_path) -> None:
    with pytest.raises(ProbeError, match="no probe stats"):
        ProbeStats.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ProbeError, match="without probe metadata"):
        ProbeStats.load(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ProbeError, match="not a probe stats file"):
        ProbeStats.load(tmp_path / "junk.npz")


@pytest.mark.gpu
def test_probe_on_cuda_collects_what_it_collects_on_the_cpu() -> None:
    """The device path (counters, flags, amax and quantiles kept on the GPU, a rejected batch
    masked there) gives the CPU path's statistics, to float64 rounding."""
    x = torch.randn(3, 4, 7, 6, dtype=torch.float64)
    x[1, 0, 0, 0] = float("nan")  # the second collection's X is rejected on both devices
    out = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = Toy().double().to(dev)
        with Probe(model, every=1, max_rows=20, precision="float64") as p:  # 28 > 20 rows: subset path
            for i in range(3):
                model(x[i].to(dev)).sum().backward()
        out[dev] = p.stats
    for site in ("a", "b"):
        for part in ("x", "dy"):
            c, g = getattr(out["cpu"].sites[site], part), getattr(out["cuda"].sites[site], part)
            assert (c.count, c.batches, c.nonfinite) == (g.count, g.batches, g.nonfinite)
            np.testing.assert_allclose(g.mean, c.mean, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(g.cov, c.cov, rtol=1e-9, atol=1e-12)
            assert g.amax == pytest.approx(c.amax, rel=1e-6)
            np.testing.assert_allclose(g.absq, c.absq, rtol=1e-6)
        np.testing.assert_allclose(out["cuda"].sites[site].w.u, out["cpu"].sites[site].w.u, rtol=1e-5, atol=1e-7)
