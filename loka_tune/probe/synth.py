"""Synthetic replay: draw GEMM operands (X, dY, W) from what the probe learned.

Distributions (``dist``):

- ``"learned"``: ``X ~ N(mean_x, cov_x)`` and ``dY ~ N(mean_dy, cov_dy)`` row by row (rows iid,
  X and dY drawn independently), ``W`` from the matrix-normal model (``weights="model"``,
  :mod:`loka_tune.probe.weights`) or the weight at the last collection (``weights="current"``).
  Full covariances are factored by Cholesky with jitter escalation (``jitter * mean(diag)``
  added, jitter from 0 then 1e-12 up by 10x to 1e-2), on the correlation matrix (jitter per
  feature) where that jitter would swamp a small feature, eigenvalue clipping if even that
  fails (:func:`psd_factor`): features of any scale draw right, and nothing raises.
  A feature dim above ``max_full_dim`` (default 2048) was stored as exact diagonal + low-rank
  sketch and is drawn as ``mean + V^T (sqrt(vals) z_r) + sqrt(resid_diag) z_d``
  (diagonal + top-r eigenvectors).
- ``"normal"``: every operand standard normal, same shapes (the usual random-input test).
- ``"real"``: the last captured batch of the site (``keep_real=True``), the same rows of X and
  dY, and the current weight; one draw only.

Rows: draws have ``rows = min(site M, max_rows)`` rows (default :data:`MAX_ROWS` = 4096 on the
CPU, where float64 references of bigger GEMMs are slow); the speed side of the probe uses the
real M. wgrad reduces over these rows, so its error is that of a ``max_rows`` reduction.

Where the draws are made (``SiteSampler(..., device=...)``): by default on the CPU with numpy
(bit-for-bit what earlier versions drew); given a device (``measure`` passes its CUDA device),
the factors are formed and the draws made there in float64 torch (:func:`psd_factor_torch`:
the same Cholesky ladder through ``cholesky_ex``, which reports a failure instead of raising,
and an ``eigh`` fallback that goes to the CPU's LAPACK if the device's fails). On a wide site
that is what the replay costs: a weight draw ``A Z B^T`` of a 2048 x 2048 layer is 17 GFLOP of
float64, seconds of a CPU and milliseconds of an H200. The device draws follow a torch
generator, so they are other numbers than the CPU's from the same seed (the same distribution).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loka_tune.errors import ProbeError
from loka_tune.probe.stats import SiteStats, TensorStats, WeightStats

__all__ = ["MAX_ROWS", "DISTS", "psd_factor", "psd_factor_ex", "psd_factor_torch", "SiteSampler"]

MAX_ROWS = 4096  # cap on the rows M of a sampled GEMM (float64 reference cost on the CPU)
DISTS = ("learned", "normal", "real")
_JITTERS = (0.0, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


def psd_factor(cov: np.ndarray) -> tuple[np.ndarray, float]:
    """``L`` with ``L L^T ~= cov`` (Cholesky, jitter escalation) and the relative jitter used.

    First the plain Cholesky of ``cov + j mean(diag(cov)) I`` for ``j`` in 0, 1e-12, 1e-11,
    ..., 1e-2, the first that succeeds, kept when ``j mean(diag)`` is at most 1e-2 of every
    positive variance. Otherwise (features of very different scales, 1e-30 next to 1e30, where
    that jitter would swamp the small ones) the Cholesky runs on the correlation matrix ``R =
    D^-1 cov D^-1`` (``D = sqrt(diag cov)``, zero-variance features left out: their rows of
    ``L`` are 0) and ``L = D chol(R)``, which does not depend on the features' scales, with
    jitter ``j`` added to ``R``'s unit diagonal (``j`` times each feature's own variance) for
    ``j`` in 0, 1e-12, ..., 1e-2 until the Cholesky succeeds; if none does (an indefinite matrix),
    negative eigenvalues of ``R`` are clipped to 0 and its symmetric square root is used, with
    jitter ``nan``, as it is when ``cov`` has negative diagonal entries (clipped to 0). Never
    raises on finite input: if even ``eigh`` fails, the diagonal ``D`` is returned (jitter
    ``nan``; :func:`psd_factor_ex` says which way the factor was formed).
    """
    return psd_factor_ex(cov)[:2]


def psd_factor_ex(cov: np.ndarray) -> tuple[np.ndarray, float, str | None]:
    """:func:`psd_factor` plus the fallback taken: ``None`` (a Cholesky, with jitter or not),
    else why the factor is an eigenvalue-clipped or diagonal one."""
    cov = np.asarray(cov, dtype=np.float64)
    cov = 0.5 * (cov + cov.T)
    d = cov.shape[0]
    diag = np.diag(cov).copy() if cov.size else np.zeros(0)
    neg = bool(np.any(diag < 0))
    sd = np.sqrt(np.clip(diag, 0.0, None))
    pos = sd > 0
    out = np.zeros_like(cov)
    if not pos.any():
        return out, (float("nan") if neg else 0.0), ("negative variances clipped to 0" if neg else None)
    # the plain Cholesky first (jitter j mean(diag)): kept when its jitter is at most 1e-2 (the
    # ladder's top) of every positive variance: the factor normal data always had (the
    # quickstart's near-dead units, variance 1e-9 of the mean, take 1e-3 of theirs)
    scale, small = float(np.mean(diag)), float(np.min(diag[pos]))
    eye_d = np.eye(d)
    for j in _JITTERS if not neg and scale > 0 else ():
        try:
            lf = np.linalg.cholesky(cov + (j * scale) * eye_d)
        except np.linalg.LinAlgError:
            continue
        if j * scale <= 1e-2 * small:
            return lf, j, None
        break  # that jitter would swamp the small features: per feature, below
    idx = np.flatnonzero(pos)
    s = sd[idx]
    r = cov[np.ix_(idx, idx)] / np.outer(s, s)  # the correlation matrix of the varying features
    np.fill_diagonal(r, 1.0)
    eye = np.eye(idx.size)
    for j in _JITTERS:
        try:
            lr = np.linalg.cholesky(r + j * eye)
        except np.linalg.LinAlgError:
            continue
        out[np.ix_(idx, idx)] = s[:, None] * lr
        if neg:
            return out, float("nan"), "negative variances clipped to 0"
        return out, j, None
    try:
        vals, vecs = np.linalg.eigh(r)
        out[np.ix_(idx, idx)] = s[:, None] * (vecs * np.sqrt(np.clip(vals, 0.0, None)))
        why = f"not positive definite even with jitter {_JITTERS[-1]:g}: eigenvalues clipped to 0"
    except np.linalg.LinAlgError as e:  # not seen on finite input; the diagonal is always a factor
        out[idx, idx] = s
        why = f"no factorization ({e}); the diagonal stands in"
    assert out.shape == (d, d)
    return out, float("nan"), why


def _chol(a: torch.Tensor) -> torch.Tensor | None:
    """The Cholesky factor of ``a``, or None where it is not positive definite (no raise)."""
    lf, info = torch.linalg.cholesky_ex(a)
    return lf if int(info) == 0 and bool(torch.isfinite(lf).all()) else None


def psd_factor_torch(cov: torch.Tensor) -> tuple[torch.Tensor, float, str | None]:
    """:func:`psd_factor_ex` of a float64 torch matrix, on its device (same ladder, same
    result up to rounding). The eigenvalue-clipping step runs ``eigh`` on the device and, if
    that fails, on the CPU (LAPACK); if both fail, the diagonal stands in. Never raises on
    finite input."""
    cov = cov.to(torch.float64)
    cov = 0.5 * (cov + cov.T)
    d = cov.shape[0]
    diag = torch.diagonal(cov).clone()
    neg = bool((diag < 0).any()) if d else False
    sd = diag.clamp_min(0.0).sqrt()
    pos = sd > 0
    out = torch.zeros_like(cov)
    if not bool(pos.any()):
        return out, (float("nan") if neg else 0.0), ("negative variances clipped to 0" if neg else None)
    scale, small = float(diag.mean()), float(diag[pos].min())
    eye_d = torch.eye(d, dtype=cov.dtype, device=cov.device)
    for j in _JITTERS if not neg and scale > 0 else ():
        lf = _chol(cov + (j * scale) * eye_d)
        if lf is None:
            continue
        if j * scale <= 1e-2 * small:
            return lf, j, None
        break  # that jitter would swamp the small features: per feature, below
    idx = torch.nonzero(pos).flatten()
    s = sd[idx]
    r = cov[idx][:, idx] / torch.outer(s, s)  # the correlation matrix of the varying features
    r.fill_diagonal_(1.0)
    eye = torch.eye(idx.numel(), dtype=cov.dtype, device=cov.device)
    block: torch.Tensor | None = None
    for j in _JITTERS:
        lr = _chol(r + j * eye)
        if lr is not None:
            block = s[:, None] * lr
            break
    if block is not None:
        out[idx[:, None], idx[None, :]] = block
        if neg:
            return out, float("nan"), "negative variances clipped to 0"
        return out, j, None
    why = f"not positive definite even with jitter {_JITTERS[-1]:g}: eigenvalues clipped to 0"
    try:
        try:
            vals, vecs = torch.linalg.eigh(r)
        except RuntimeError:  # the device's solver: the CPU's LAPACK instead
            vals, vecs = (t.to(cov.device) for t in torch.linalg.eigh(r.cpu()))
        out[idx[:, None], idx[None, :]] = s[:, None] * (vecs * vals.clamp_min(0.0).sqrt())
    except RuntimeError as e:  # not seen on finite input; the diagonal is always a factor
        out[idx, idx] = s
        why = f"no factorization ({e}); the diagonal stands in"
    return out, float("nan"), why


class _GaussianRows:
    """Sampler of rows ``N(mean, cov)`` from one :class:`TensorStats` (numpy on the CPU, or
    float64 torch on ``device``)."""

    factor: Any  # (d, d) with factor @ factor.T = cov (full stats), else None
    lr: Any  # (d, r) low-rank factor (sketched stats), else None

    def __init__(self, t: TensorStats, device: torch.device | None = None) -> None:
        self.device = device
        self.mean: Any = np.asarray(t.mean, dtype=np.float64)
        self.resid_sd: Any = None
        self.jitter = 0.0
        self.fallback: str | None = None  # how the factor was formed, when not by a Cholesky
        if device is not None:
            f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
            self.mean = torch.as_tensor(self.mean, **f64)
            if t.cov is not None:  # a full covariance (None: sketched, or fell back to the diagonal)
                self.factor, self.jitter, self.fallback = psd_factor_torch(torch.as_tensor(t.cov, **f64))
                self.lr = None
            else:
                tvals = torch.as_tensor(np.asarray(t.lr_vals, dtype=np.float64), **f64).clamp_min(0.0)
                tvecs = torch.as_tensor(np.asarray(t.lr_vecs, dtype=np.float64), **f64).reshape(-1, self.mean.shape[0])
                self.lr = tvecs.T * tvals.sqrt()  # (d, r)
                tdiag = (self.lr * self.lr).sum(1)
                self.resid_sd = (torch.as_tensor(np.asarray(t.var, dtype=np.float64), **f64) - tdiag).clamp_min(0.0).sqrt()
                self.factor = None
            return
        if t.cov is not None:
            self.factor, self.jitter, self.fallback = psd_factor_ex(t.cov)  # (d, d)
            self.lr = None
        else:
            vals = np.clip(np.asarray(t.lr_vals, dtype=np.float64), 0.0, None)
            vecs = np.asarray(t.lr_vecs, dtype=np.float64)  # (r, d)
            self.lr = vecs.T * np.sqrt(vals)  # (d, r)
            low_diag = (self.lr * self.lr).sum(1)
            self.resid_sd = np.sqrt(np.clip(np.asarray(t.var, dtype=np.float64) - low_diag, 0.0, None))
            self.factor = None

    def draw(self, rows: int, rng: Any) -> Any:
        """``(rows, d)`` float64 rows: numpy from a numpy ``Generator``, or torch on the
        device from a ``torch.Generator``."""
        d = self.mean.shape[0]
        if self.device is not None:
            f64: dict[str, Any] = dict(dtype=torch.float64, device=self.device, generator=rng)
            if self.factor is not None:
                return self.mean + torch.randn(rows, d, **f64) @ self.factor.T
            return (self.mean + torch.randn(rows, self.lr.shape[1], **f64) @ self.lr.T
                    + torch.randn(rows, d, **f64) * self.resid_sd)
        if self.factor is not None:
            z = rng.standard_normal((rows, d))
            return self.mean + z @ self.factor.T  # (rows, d)
        assert self.lr is not None
        z_r = rng.standard_normal((rows, self.lr.shape[1]))
        z_d = rng.standard_normal((rows, d))
        return self.mean + z_r @ self.lr.T + z_d * self.resid_sd


class _MatrixNormal:
    """Sampler of ``W = M + A Z B^T`` from a :class:`WeightStats` (numpy, or torch on ``device``)."""

    def __init__(self, w: WeightStats, device: torch.device | None = None) -> None:
        self.device = device
        self.mean: Any = np.asarray(w.mean, dtype=np.float64)
        u = np.asarray(w.u, dtype=np.float64)
        v = np.asarray(w.v, dtype=np.float64)
        self.fallbacks: dict[str, str] = {}
        if device is not None:
            self.mean = torch.as_tensor(self.mean, dtype=torch.float64, device=device)
        self.a = self._factor("u", u)
        self.b = self._factor("v", v)

    def _factor(self, name: str, f: np.ndarray) -> Any:
        if self.device is not None:
            ft = torch.as_tensor(f, dtype=torch.float64, device=self.device)
            if ft.ndim != 2:
                return ft.clamp_min(0.0).sqrt()
            lt, _, why = psd_factor_torch(ft)
            if why is not None:
                self.fallbacks[name] = why
            return lt
        if f.ndim != 2:
            return np.sqrt(np.clip(f, 0.0, None))
        lf, _, why = psd_factor_ex(f)
        if why is not None:
            self.fallbacks[name] = why
        return lf

    def draw(self, rng: Any) -> Any:
        if self.device is not None:
            z = torch.randn(*self.mean.shape, dtype=torch.float64, device=self.device, generator=rng)
        else:
            z = rng.standard_normal(self.mean.shape)  # (N, K)
        az = self.a @ z if self.a.ndim == 2 else self.a[:, None] * z
        return self.mean + (az @ self.b.T if self.b.ndim == 2 else az * self.b[None, :])


class SiteSampler:
    """Draws ``(X (rows, K), dY (rows, N), W (N, K))`` float64 operands of one site.

    ``device`` None: numpy draws on the CPU (:meth:`draw`); a device: factors and draws in
    float64 torch there (:meth:`draw_tensors`; :meth:`draw` then copies them to numpy).
    """

    def __init__(
        self,
        site: SiteStats,
        dist: str = "learned",
        *,
        max_rows: int = MAX_ROWS,
        weights: str = "model",
        seed: int = 0,
        device: str | torch.device | None = None,
    ) -> None:
        if dist not in DISTS:
            raise ProbeError(f"unknown distribution {dist!r}: choose one of {', '.join(DISTS)}")
        if weights not in ("model", "current"):
            raise ProbeError(f"weights must be 'model' or 'current', got {weights!r}")
        if max_rows < 1:
            raise ProbeError(f"max_rows must be >= 1, got {max_rows!r}")
        self.site, self.dist, self.weights = site, dist, weights
        self.device = None if device is None else torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.gen: torch.Generator | None = None
        if self.device is not None:
            self.gen = torch.Generator(device=self.device)
            self.gen.manual_seed(int(seed))
        self.rows = max(1, min(site.rows or 1, max_rows))
        if dist == "real":
            if site.x.real is None or site.dy.real is None:
                raise ProbeError(
                    f"site {site.name!r} has no captured batch: collect with Probe(..., keep_real=True)"
                    " to replay real batches"
                )
            n = min(site.x.real.shape[0], site.dy.real.shape[0])
            self.rows = n
        elif dist == "learned":
            self._x = _GaussianRows(site.x, self.device)
            self._dy = _GaussianRows(site.dy, self.device)
            self._w = _MatrixNormal(site.w, self.device) if weights == "model" and site.w.has_model else None

    @property
    def jitter(self) -> dict[str, float]:
        """The relative Cholesky jitter used for X and dY (``learned`` only)."""
        if self.dist != "learned":
            return {}
        return {"x": self._x.jitter, "dy": self._dy.jitter}

    @property
    def fallbacks(self) -> dict[str, str]:
        """``{"x.factor": why, "w.u": why, ...}``: the factors of the draws that were not a
        Cholesky (``learned`` only; see :func:`psd_factor`)."""
        if self.dist != "learned":
            return {}
        out = {f"{p}.factor": g.fallback for p, g in (("x", self._x), ("dy", self._dy)) if g.fallback}
        if self._w is not None:
            out.update({f"w.{k}.factor": why for k, why in self._w.fallbacks.items()})
        return out

    def draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One ``(X, dY, W)`` draw, float64 numpy (a device sampler's draw copied to the CPU)."""
        if self.device is not None:
            x, dy, w = self.draw_tensors()
            return x.cpu().numpy(), dy.cpu().numpy(), w.cpu().numpy()
        return self._draw_numpy()

    def draw_tensors(self, device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``(X, dY, W)`` draw as float64 tensors on ``device`` (default: the sampler's
        device, else the CPU); a device sampler draws there, a CPU one copies its numpy draw."""
        if self.device is None:
            return draws_as_tensors(*self._draw_numpy(), device=device or "cpu")
        target = self.device if device is None else torch.device(device)
        s, rows, gen = self.site, self.rows, self.gen
        k, n = s.in_features, s.out_features
        f64: dict[str, Any] = dict(dtype=torch.float64, device=self.device)
        if self.dist == "normal":
            out = tuple(torch.randn(*shape, generator=gen, **f64) for shape in ((rows, k), (rows, n), (n, k)))
        elif self.dist == "real":
            x_real, dy_real = s.x.real, s.dy.real
            assert x_real is not None and dy_real is not None  # checked in __init__
            out = tuple(torch.as_tensor(np.asarray(a, dtype=np.float64), **f64)
                        for a in (x_real[:rows], dy_real[:rows], s.w.last))
        else:
            x = self._x.draw(rows, gen)
            dy = self._dy.draw(rows, gen)
            if self._w is not None:
                w = self._w.draw(gen)
            else:
                w = torch.as_tensor(np.asarray(s.w.last if self.weights == "current" else s.w.mean,
                                               dtype=np.float64), **f64)
            out = (x, dy, w)
        return tuple(t.to(target) for t in out)  # type: ignore[return-value]

    def _draw_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, rows = self.site, self.rows
        k, n = s.in_features, s.out_features
        if self.dist == "normal":
            r = self.rng
            return r.standard_normal((rows, k)), r.standard_normal((rows, n)), r.standard_normal((n, k))
        if self.dist == "real":
            x_real, dy_real = s.x.real, s.dy.real
            assert x_real is not None and dy_real is not None  # checked in __init__
            w = np.asarray(s.w.last, dtype=np.float64)
            return (np.asarray(x_real[:rows], dtype=np.float64),
                    np.asarray(dy_real[:rows], dtype=np.float64), w)
        x = self._x.draw(rows, self.rng)
        dy = self._dy.draw(rows, self.rng)
        if self._w is not None:
            w = self._w.draw(self.rng)
        else:
            w = np.asarray(s.w.last if self.weights == "current" else s.w.mean, dtype=np.float64)
        return x, dy, w


def draws_as_tensors(
    x: np.ndarray, dy: np.ndarray, w: np.ndarray, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 torch copies of one draw on ``device``."""
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (x, dy, w))  # type: ignore[return-value]
