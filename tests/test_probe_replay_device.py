"""The replay on the measuring device (issue 20: the smoke's probe timed out on the H200).

``measure(..., device="cuda")`` forms the replay's factors and draws with float64 torch on the
GPU instead of numpy on the CPU (:mod:`loka_tune.probe.synth`). These tests hold the device
path to the CPU one: :func:`psd_factor_torch` against :func:`psd_factor_ex` on the adversarial
covariances of ``tests/test_probe_robust.py`` (same route, same jitter, the same factor up to
rounding, never a raise), and a device sampler's draws against the statistics they replay
(mean and covariance within 5 sampling standard deviations), on the CPU's torch here and on
CUDA in the ``gpu`` variants, where the measured errors are also compared with the CPU's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_probe_robust import KINDS, _collect, adversarial_rows

from loka_tune.probe import Probe, measure
from loka_tune.probe.synth import SiteSampler, _GaussianRows, psd_factor_ex, psd_factor_torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _covs() -> dict[str, np.ndarray]:
    covs = {kind: np.cov(adversarial_rows(kind, 400, 24, 0), rowvar=False) for kind in KINDS}
    covs["indefinite"] = np.array([[1.0, 2.0], [2.0, 1.0]])
    covs["negative_variance"] = np.array([[1.0, 0.1, 0.0], [0.1, -0.5, 0.0], [0.0, 0.0, 2.0]])
    covs["zero"] = np.zeros((5, 5))
    one = np.zeros((4, 4))
    one[1, 1] = 2.0
    covs["three_constant"] = one
    return covs


COVS = _covs()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(COVS))
def test_psd_factor_torch_takes_the_numpy_route(name: str, device: str) -> None:
    cov = COVS[name]
    ref, j_ref, why_ref = psd_factor_ex(cov)
    lt, j, why = psd_factor_torch(torch.as_tensor(cov, dtype=torch.float64, device=device))
    assert lt.device.type == device and lt.dtype == torch.float64 and torch.isfinite(lt).all()
    assert (why is None) == (why_ref is None), (why, why_ref)
    assert (math.isnan(j) and math.isnan(j_ref)) or j == j_ref
    lf = lt.cpu().numpy()
    sd = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    # the products at each pair's scale (a Cholesky of an ill-conditioned matrix differs by
    # cond x eps entry by entry; its product does not), plus the jitter both added
    floor = np.outer(sd, sd) + (0.0 if math.isnan(j) else j) * max(float(np.mean(np.diag(cov))), 0.0)
    floor = np.maximum(floor, np.finfo(np.float64).tiny)
    assert np.max(np.abs(lf @ lf.T - ref @ ref.T) / floor) <= 1e-9


def test_psd_factor_torch_falls_back_to_the_cpu_then_the_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # indefinite: every Cholesky fails
    calls: list[str] = []
    real = torch.linalg.eigh

    def eigh_once_fails(a: torch.Tensor):  # noqa: ANN202 - the device's solver fails, the CPU's works
        calls.append(str(a.device))
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (error code: 1)")
        return real(a)

    monkeypatch.setattr(torch.linalg, "eigh", eigh_once_fails)
    lf, j, why = psd_factor_torch(bad)
    assert len(calls) == 2 and math.isnan(j) and "eigenvalues clipped" in why
    np.testing.assert_allclose((lf @ lf.T).numpy(), np.array([[1.5, 1.5], [1.5, 1.5]]), rtol=1e-12)

    def fail(a: torch.Tensor):  # noqa: ANN202
        raise torch.linalg.LinAlgError("failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fail)
    lf, j, why = psd_factor_torch(bad)
    assert math.isnan(j) and "diagonal stands in" in why and torch.allclose(lf, torch.eye(2, dtype=torch.float64))


def _probe_stats(steps: int = 4, **kw):  # noqa: ANN003, ANN202
    g = torch.Generator().manual_seed(0)
    low = torch.randn(3, 16, generator=g) * 2
    scale = torch.logspace(-1, 0.5, 16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12)).double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Probe(model, every=1, **kw) as p:
        for _ in range(steps):
            x = (torch.randn(512, 3, generator=g) @ low + torch.randn(512, 16, generator=g) * scale + 3.0).double()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return p.stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sketch", [False, True], ids=["full_cov", "diag_lowrank"])
def test_device_draws_reproduce_mean_and_covariance(sketch: bool, device: str) -> None:
    stats = _probe_stats(**({"max_full_dim": 8, "sketch_rank": 8} if sketch else {}))
    site = stats.sites["0"]
    t = site.x
    smp = SiteSampler(site, "learned", seed=1, device=device)
    x, dy, w = smp.draw_tensors()
    assert all(a.device.type == device and a.dtype == torch.float64 for a in (x, dy, w))
    assert x.shape == (512, 16) and dy.shape == (512, 12) and w.shape == (12, 16)
    xs = np.concatenate([smp.draw_tensors("cpu")[0].numpy() for _ in range(40)])
    rows = xs.shape[0]
    cov = t.covariance()
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(xs.mean(0) - t.mean) <= 5 * sd / math.sqrt(rows))
    tol = 5 * np.sqrt((np.outer(sd**2, sd**2) + cov**2) / rows)
    assert np.all(np.abs(np.cov(xs, rowvar=False) - cov) <= tol)
    again = SiteSampler(site, "learned", seed=1, device=device).draw_tensors()[0]
    assert torch.equal(again, x)  # seeded: the same draws
    np_draw = SiteSampler(site, "learned", seed=1).draw()  # the CPU's numpy path: unchanged, other numbers
    assert np_draw[0].shape == (512, 16) and not np.array_equal(np_draw[0], x.cpu().numpy())
    for dist in ("normal",):
        a, b, c = SiteSampler(site, dist, seed=2, device=device).draw_tensors()
        assert a.shape == (512, 16) and b.shape == (512, 12) and c.shape == (12, 16) and a.device.type == device


@pytest.mark.gpu
def test_gpu_measure_replays_on_the_gpu_and_agrees_with_the_cpu() -> None:
    """The same statistics measured on the CPU (numpy replay) and on CUDA (torch replay), the
    emulated backend on both: the same safe verdicts, MERE within 4 sampling sigmas (16 draws each)."""
    stats = _probe_stats(steps=6)
    cands = ["e4m3.tensor.emulated", "e4m3.row.emulated", "e5m2+e4m3.tensor.emulated"]
    cpu = measure(stats, cands, samples=16, device="cpu")
    gpu = measure(stats, cands, samples=16, device="cuda")
    assert cpu.meta["replay_device"] == "cpu" and gpu.meta["replay_device"] == "cuda"
    ref = {(r.site, r.role, r.choice): r for r in cpu.results}
    assert len(gpu.results) == len(cpu.results)
    for r in gpu.results:
        c = ref[(r.site, r.role, r.choice)]
        assert r.safe == c.safe
        # other draws of one distribution: the means differ by their sampling noise (4 sigma)
        tol = 4 * math.sqrt((r.mere_std**2 + c.mere_std**2) / 16) + 1e-3
        assert abs(r.mere - c.mere) <= tol, (r.site, r.role, r.choice, r.mere, c.mere, tol)


@pytest.mark.parametrize("device", [None, *DEVICES])
def test_a_full_stream_whose_covariance_fell_back_draws_from_its_diagonal(device: str | None) -> None:
    """A full-covariance stream whose covariance went non-finite keeps only its exact diagonal
    (``t.cov`` None, no sketch): both replays draw independent features of those variances."""
    acc, _, x = _collect("rank1", 16, device="cpu", precision="float32", max_full_dim=64, rank=8,
                         dtype=torch.float32)
    acc.moments.m2[2, 7] = float("nan")  # as a float32 overflow would have left it
    t = acc.snapshot()
    assert t.cov is None and "non-finite covariance" in t.fallbacks["cov"]
    if device is None:
        draws = _GaussianRows(t).draw(4000, np.random.default_rng(0))
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        draws = _GaussianRows(t, torch.device(device)).draw(4000, gen).cpu().numpy()
    np.testing.assert_allclose(draws.var(0), t.var, rtol=0.15)
    np.testing.assert_allclose(np.corrcoef(draws, rowvar=False), np.eye(16), atol=0.1)  # independent features
