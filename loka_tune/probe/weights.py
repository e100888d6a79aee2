"""A matrix-normal model of a linear layer's weight, fitted online with an EMA.

Model: ``vec(W) ~ N(vec(M), V kron U)`` for ``W (N, K)`` (out x in), i.e. ``W = M + A Z B^T``
with ``Z`` iid standard normal, ``U = A A^T (N, N)`` the row covariance and ``V = B B^T (K, K)``
the column covariance. ``U`` and ``V`` are identified up to ``U c, V / c``: we fix the
scale with ``trace(V) = K`` (so ``U`` carries the magnitude).

Fit, once per probe collection ``t`` (the weight ``W_t`` is read directly, no hook needed):

- mean: ``M_t = (1 - a) M_{t-1} + a W_t`` (EMA, ``a = ema``, default 0.5: collections are
  ~100 steps apart, so the recent weight dominates), ``M_1 = W_1``;
- residual ``R_t = W_t - M_{t-1}`` (how far the weight moved since the last collections);
- ``U`` and ``V``, by one of two estimators (``flip_flop``):

  * ``flip_flop=0`` (default), the moment estimators: EMAs of ``S_U = R R^T`` and
    ``S_V = R^T R``. For ``R ~ MN(0, U, V)``, ``E[R R^T] = tr(V) U`` and
    ``E[R^T R] = tr(U) V``, so ``V = K S_V / tr(S_V)`` and ``U = S_U / K`` are consistent
    estimates under our scale convention. They are also the first flip-flop iteration
    started from identity factors. Cost per collection: two GEMMs (``N^2 K + K^2 N``, run in
    float32; a sum over more than ``max_full_dim`` columns or rows uses that many random ones,
    rescaled: unbiased, and at most ``2 * 2048^3`` flops), no inverse: this is what keeps a
    collection cheap on wide layers. No host sync either: whether the weight is finite, the
    first one or moved at all are device masks (``torch.where``), the counters device tensors.
  * ``flip_flop=k >= 1``: ``k`` alternating MLE (flip-flop) steps per collection, each an EMA
    of the one-sample estimates ``U <- (1 - a) U + a R V^-1 R^T / K``, then
    ``V <- (1 - a) V + a R^T U^-1 R / N``, then the scale fix. Statistically more efficient
    for strongly non-Kronecker-separable noise, but each step inverts both factors
    (``O(N^3 + K^3)`` in float64): on a 2048-wide layer that is seconds on a CPU.

- shrinkage (applied when the factors are read, never fed back into the EMA, where it would
  compound): one residual has rank <= min(N, K), and the EMA keeps only about
  ``n_eff = min(residuals, (2 - a) / a)`` of them, so each full factor is shrunk toward its
  scaled identity, ``U <- (1 - r) U + r mean(diag U) I`` with ``r = N / (N + n_eff K)`` (the
  K columns of each residual are the observations of U; ``r = K / (K + n_eff N)`` for V).
  This keeps the traces (the per-element variance), makes the factors positive definite and,
  in flip-flop mode, keeps the inverses well conditioned: without it a direction that no
  earlier residual spanned has a ~0 eigenvalue whose inverse blows the other factor up.

A factor whose dim exceeds ``max_full_dim`` (2048, as for activations) is kept diagonal
(the same estimators restricted to the diagonal). Synthetic weights drawn from this model are
the running mean plus noise of the size of the recent weight updates: draws stay close to
the weight the layer actually has, which is what the error of its GEMMs depends on (scale
per row / per block, outliers). ``benchmarks/probe_learned_vs_normal.py`` checks that errors
measured on draws of this model agree with errors on the current weight itself
(``weights="current"`` in :func:`loka_tune.probe.measure`) to within the sampling noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loka_tune.probe.moments import MAX_FULL_DIM, StatisticError, matmul, pow2_scale, stacked

__all__ = ["MatrixNormalEMA", "update_many"]

_RIDGE = 1e-6  # relative ridge of the inverses in the flip-flop steps
_TINY = torch.finfo(torch.float64).tiny  # the ridge of an all-zero factor (its inverse is then huge, not inf)


def _ridge_inverse(s: torch.Tensor) -> torch.Tensor:
    """Inverse of a PSD matrix ``(d, d)`` or of a diagonal ``(d,)``, ridge-regularised: ``s +
    lam I`` with ``lam = 1e-6 mean(diag s)`` (the smallest normal float64 if that is 0). Full:
    a Cholesky (``cholesky_ex``, no host sync on failure until the flag is read) with the
    ridge escalated 10x up to 1e-2 relative, else the ``eigh`` pseudo-inverse (eigenvalues
    clipped to the ridge) on the CPU in float64; what still fails (non-finite ``s``) raises
    :class:`~loka_tune.probe.moments.StatisticError` (the flip-flop step is then skipped)."""
    if not bool(torch.isfinite(s).all()):
        raise StatisticError("a factor holds non-finite values")
    if s.dim() == 1:
        lam = max(_RIDGE * float(s.mean()), _TINY)
        return 1.0 / (s.clamp_min(0.0) + lam)
    d = s.shape[0]
    mu = float(torch.diagonal(s).mean())
    eye = torch.eye(d, dtype=s.dtype, device=s.device)
    rel = _RIDGE
    while rel <= 1e-2:
        lam = max(rel * mu, _TINY)
        chol, info = torch.linalg.cholesky_ex(s + lam * eye)
        if int(info) == 0:
            return torch.cholesky_inverse(chol)
        rel *= 10.0
    try:
        w, v = torch.linalg.eigh(0.5 * (s + s.T).to("cpu", torch.float64))
    except RuntimeError as e:
        raise StatisticError(f"eigh of a factor failed ({type(e).__name__})") from None
    lam = max(_RIDGE * float(w.clamp_min(0.0).mean()), _TINY)
    inv = (v / w.clamp_min(lam)) @ v.T
    return inv.to(device=s.device, dtype=s.dtype)


def _shrink(s: torch.Tensor, n_obs: float) -> torch.Tensor:
    """Shrink a full ``(d, d)`` covariance toward ``mean(diag) I`` by ``d / (d + n_obs)``
    (the result exactly symmetric)."""
    if s.dim() == 1:
        return s
    s = 0.5 * (s + s.T)
    d = s.shape[0]
    r = d / (d + n_obs)
    mu = float(torch.diagonal(s).mean())
    return (1.0 - r) * s + (r * mu) * torch.eye(d, dtype=s.dtype, device=s.device)


def _gram(r: torch.Tensor, full: bool, max_cols: int, gen: torch.Generator, tf32: bool = False) -> torch.Tensor:
    """``r r^T`` ``(d, d)`` (float32 GEMM, float64 result) or its diagonal ``(d,)``.

    ``r`` is scaled by the power of two above its largest ``|value|`` before the float32
    product and the result rescaled in float64: no float32 over- or underflow whatever the
    residual's size, and bit for bit the unscaled product where that one was in range. A full
    one over more than ``max_cols`` columns is estimated from ``max_cols`` random columns
    scaled by ``cols / max_cols`` (unbiased): it bounds the GEMM at ``d^2 max_cols``."""
    amax = pow2_scale(r.detach().abs().amax().to(torch.float64))  # a power of two: exact scaling
    r32 = (r / amax).to(torch.float32)
    a2 = amax * amax
    if not full:
        return (r32 * r32).sum(1).to(torch.float64) * a2
    cols = r32.shape[1]
    if cols > max_cols:
        idx = torch.randperm(cols, generator=gen, device=gen.device)[:max_cols].to(r32.device, non_blocking=True)
        sub = r32[:, idx]
        return matmul(sub, sub.T, tf32).to(torch.float64) * (a2 * (cols / max_cols))
    return matmul(r32, r32.T, tf32).to(torch.float64) * a2


class MatrixNormalEMA:
    """Online matrix-normal fit of one weight ``(rows N, cols K)``; see the module docstring."""

    def __init__(
        self,
        rows: int,
        cols: int,
        *,
        ema: float = 0.5,
        flip_flop: int = 0,
        max_full_dim: int = MAX_FULL_DIM,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        tf32: bool = False,
    ) -> None:
        assert 0.0 < ema <= 1.0 and flip_flop >= 0
        self.tf32 = bool(tf32)  # the moment estimators' two GEMMs on TF32 tensor cores (moments.matmul)
        self.max_full_dim = int(max_full_dim)
        self._gen = generator if generator is not None else torch.Generator().manual_seed(0)
        self.rows, self.cols, self.ema, self.flip_flop = int(rows), int(cols), float(ema), int(flip_flop)
        self.u_full = self.rows <= max_full_dim
        self.v_full = self.cols <= max_full_dim
        self.notes: dict[str, str] = {}  # statistic -> a fallback of the fit (reported by the probe)
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        # device counters (read at :attr:`count` / :attr:`residuals`): an update never syncs
        self._count = torch.zeros((), **i64)  # collections folded in (finite weights)
        self._residuals = torch.zeros((), **i64)  # those that moved the weight (fitted U, V)
        self._calls = 0  # update() calls (host): none before means no residual can exist yet
        self.mean = torch.zeros(self.rows, self.cols, **f32)
        self.last = torch.zeros(self.rows, self.cols, **f32)
        # EMA states, before shrinkage: S_U, S_V (moments) or the scale-fixed U, V (flip-flop)
        self._u_raw = torch.zeros(self.rows, self.rows, **f64) if self.u_full else torch.zeros(self.rows, **f64)
        self._v_raw = torch.eye(self.cols, **f64) if self.v_full else torch.ones(self.cols, **f64)

    # ------------------------------------------------------------------ the factors
    @property
    def count(self) -> int:
        """Collections folded in (reads a device counter: a host sync on a GPU)."""
        return int(self._count)

    @property
    def residuals(self) -> int:
        """Collections that moved the weight, i.e. fitted ``U`` and ``V`` (a host sync on a GPU)."""
        return int(self._residuals)

    @property
    def _n_eff(self) -> float:
        return min(float(max(self.residuals, 1)), (2.0 - self.ema) / self.ema)

    def _scaled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unshrunk factors under the ``trace(V) = K`` convention."""
        if self.flip_flop or self.residuals == 0:
            return self._u_raw, self._v_raw
        tr = float(self._v_raw.trace() if self.v_full else self._v_raw.sum())  # = ||R||_F^2 EMA > 0
        if not (tr > 0 and math.isfinite(tr)):  # a residual that moved has a positive norm: only rounding
            raise StatisticError(f"the column factor's trace is {tr!r}, not positive: no scale to fix")
        return self._u_raw / self.cols, self._v_raw * (self.cols / tr)

    @property
    def u(self) -> torch.Tensor:
        """The row covariance ``(N, N)`` (or its diagonal), shrunk."""
        return _shrink(self._scaled()[0], self._n_eff * self.cols)

    @property
    def v(self) -> torch.Tensor:
        """The column covariance ``(K, K)`` (or its diagonal), trace K, shrunk."""
        return _shrink(self._scaled()[1], self._n_eff * self.rows)

    # ------------------------------------------------------------------ the update
    def update(self, w: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Fold in the weight ``w (N, K)`` of one collection. ``ok`` (a 0-d bool device tensor,
        e.g. ``isfinite(w).all()``): when False nothing changes, without reading the flag on the
        host. With the moment estimators (``flip_flop=0``) an update never reads a value back
        (the first-weight and moved-weight decisions are device masks, ``torch.where``: the
        result is the one the branches would give, bit for bit); flip-flop steps read the
        flags and invert factors on the host."""
        w = w.detach().to(device=self.mean.device, dtype=torch.float32)
        assert w.shape == (self.rows, self.cols), (w.shape, self.rows, self.cols)
        calls, self._calls = self._calls, self._calls + 1
        if self.flip_flop:
            self._update_flip_flop(w, ok)
            return
        ok_t = torch.ones((), dtype=torch.bool, device=w.device) if ok is None else ok.to(w.device)
        first = ok_t & (self._count == 0)  # the first finite weight: the mean starts there
        a = self.ema
        r = w - self.mean  # (N, K)
        self.last = torch.where(ok_t, w, self.last)
        self.mean = torch.where(first, w, torch.where(ok_t, (1.0 - a) * self.mean + a * w, self.mean))
        self._count = self._count + ok_t.long()
        if calls == 0:  # no weight was folded in before this one: there is no residual to fit
            return
        moved = ok_t & ~first & torch.any(r != 0)  # a weight that did not move says nothing of U, V
        cap = self.max_full_dim
        su = _gram(r, self.u_full, cap, self._gen, self.tf32)  # R R^T
        sv = _gram(r.T, self.v_full, cap, self._gen, self.tf32)  # R^T R
        first_res = self._residuals == 0
        self._u_raw = torch.where(moved, torch.where(first_res, su, (1.0 - a) * self._u_raw + a * su), self._u_raw)
        self._v_raw = torch.where(moved, torch.where(first_res, sv, (1.0 - a) * self._v_raw + a * sv), self._v_raw)
        self._residuals = self._residuals + moved.long()

    def _update_flip_flop(self, w: torch.Tensor, ok: torch.Tensor | None) -> None:
        """The flip-flop fit's update (host decisions: it inverts factors anyway)."""
        if ok is not None and not bool(ok):
            return
        self.last = w.clone()
        self._count += 1
        if int(self._count) == 1:
            self.mean = w.clone()
            return
        a = self.ema
        r = w - self.mean  # (N, K)
        self.mean = (1.0 - a) * self.mean + a * w
        if not bool(torch.any(r != 0)):
            return  # the weight did not move: nothing to learn about U, V
        first = self.residuals == 0
        self._residuals += 1
        self._flip_flop(r.to(torch.float64), first)

    def _flip_flop(self, r: torch.Tensor, first: bool) -> None:
        """The flip-flop steps of one collection; a step whose inverse cannot be formed, or
        whose factors come out non-finite, is dropped: the factors of the collection before
        are kept and :attr:`notes` says so (``"fit"``)."""
        try:
            u_raw, v_raw = self._flip_flop_steps(r, first)
        except StatisticError as e:
            self.notes["fit"] = f"a flip-flop step failed ({e}); the factors before it were kept"
            return
        if not (bool(torch.isfinite(u_raw).all()) and bool(torch.isfinite(v_raw).all())):
            self.notes["fit"] = "a flip-flop step gave non-finite factors; the factors before it were kept"
            return
        self._u_raw, self._v_raw = u_raw, v_raw

    def _flip_flop_steps(self, r: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a, n_eff = self.ema, self._n_eff
        u_raw, v_raw = self._u_raw, self._v_raw
        u, v = self.u, self.v
        for _ in range(self.flip_flop):
            vi = _ridge_inverse(v)
            su = self._sandwich(r, vi, self.u_full, self.v_full) / self.cols
            u_raw = su if first else (1.0 - a) * self._u_raw + a * su
            u = _shrink(u_raw, n_eff * self.cols)
            ui = _ridge_inverse(u)
            sv = self._sandwich(r.T, ui, self.v_full, self.u_full) / self.rows
            v_raw = sv if first else (1.0 - a) * self._v_raw + a * sv
            c = float(v_raw.trace() if self.v_full else v_raw.sum()) / self.cols
            if c > 0:
                v_raw, u_raw = v_raw / c, u_raw * c  # scale fix: trace(V) = K
            u, v = _shrink(u_raw, n_eff * self.cols), _shrink(v_raw, n_eff * self.rows)
        return u_raw, v_raw

    @staticmethod
    def _sandwich(r: torch.Tensor, inv: torch.Tensor, out_full: bool, inv_full: bool) -> torch.Tensor:
        """``r inv r^T`` (full ``(d, d)``) or its diagonal, for a full or diagonal ``inv``."""
        ri = r @ inv if inv_full else r * inv[None, :]  # (d, e)
        return ri @ r.T if out_full else (ri * r).sum(1)


def update_many(models: list[MatrixNormalEMA], w: torch.Tensor, ok: torch.Tensor) -> None:
    """:meth:`MatrixNormalEMA.update` of ``S`` models of one shape at once (moment estimators):
    ``w (S, N, K)``, ``ok (S,)``. The same masks and EMAs, batched along the first dim (one
    kernel per operation for all S instead of S; R R^T and R^T R share one power-of-two scale
    per residual), written back as views of the stacked state; each model ends where its own
    ``update`` would, up to float rounding. No host sync."""
    m0 = models[0]
    s_, n, k = w.shape
    assert s_ == len(models) and all((m.rows, m.cols, m.flip_flop, m.ema) == (n, k, 0, m0.ema) for m in models)
    assert all(m.max_full_dim == m0.max_full_dim and m.tf32 == m0.tf32 for m in models)
    calls = {m._calls for m in models}
    assert len(calls) == 1, "models of one group are updated together"
    dev = m0.mean.device
    w = w.detach().to(device=dev, dtype=torch.float32)
    ok = ok.to(dev, non_blocking=True)
    okw = ok[:, None, None]
    mean = stacked([m.mean for m in models])  # (S, N, K)
    count = stacked([m._count for m in models])
    first = ok & (count == 0)
    a = m0.ema
    r = w - mean
    last = torch.where(okw, w, stacked([m.last for m in models]))
    mean = torch.where(okw, torch.where(first[:, None, None], w, (1.0 - a) * mean + a * w), mean)
    count = count + ok.long()
    for i, m in enumerate(models):
        m._calls += 1
        m.last, m.mean, m._count = last[i], mean[i], count[i]
    if calls == {0}:  # no weight was folded in before: there is no residual to fit
        return
    moved = ok & ~first & (r != 0).flatten(1).any(1)  # (S,)
    scale = pow2_scale(r.abs().amax((1, 2)).to(torch.float64))  # (S,) a power of two: exact scaling
    r32 = (r / scale[:, None, None].to(r.dtype)).to(torch.float32)
    a2 = scale * scale
    cap, gen = m0.max_full_dim, m0._gen
    su = _gram_many(r32, a2, m0.u_full, cap, gen, m0.tf32)  # R R^T
    sv = _gram_many(r32.transpose(1, 2), a2, m0.v_full, cap, gen, m0.tf32)  # R^T R
    residuals = stacked([m._residuals for m in models])
    first_res = residuals == 0
    out = []
    for new, raw in ((su, stacked([m._u_raw for m in models])), (sv, stacked([m._v_raw for m in models]))):
        shape = (-1,) + (1,) * (new.dim() - 1)
        blend = torch.where(first_res.view(shape), new, (1.0 - a) * raw + a * new)
        out.append(torch.where(moved.view(shape), blend, raw))
    residuals = residuals + moved.long()
    for i, m in enumerate(models):
        m._u_raw, m._v_raw, m._residuals = out[0][i], out[1][i], residuals[i]


def _gram_many(r32: torch.Tensor, a2: torch.Tensor, full: bool, max_cols: int, gen: torch.Generator,
               tf32: bool = False) -> torch.Tensor:
    """:func:`_gram` of ``S`` scaled residuals ``r32 (S, d, cols)`` (``r / sqrt(a2)``) at once
    -> ``(S, d, d)`` or ``(S, d)``; one random column subset shared by the S when a full product
    is over more than ``max_cols`` columns (each estimate stays unbiased)."""
    if not full:
        return (r32 * r32).sum(2).to(torch.float64) * a2[:, None]
    cols = r32.shape[2]
    if cols > max_cols:
        idx = torch.randperm(cols, generator=gen, device=gen.device)[:max_cols].to(r32.device, non_blocking=True)
        sub = r32[:, :, idx]
        return matmul(sub, sub.transpose(1, 2), tf32).to(torch.float64) * (a2 * (cols / max_cols))[:, None, None]
    return matmul(r32, r32.transpose(1, 2), tf32).to(torch.float64) * a2[:, None, None]
