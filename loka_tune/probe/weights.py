"""A matrix-normal model of a linear layer's weight, fitted online (flip-flop + EMA).

Model: ``vec(W) ~ N(vec(M), V kron U)`` for ``W (N, K)`` (out x in), i.e. ``W = M + A Z B^T``
with ``Z`` iid standard normal, ``U = A A^T (N, N)`` the row covariance and ``V = B B^T (K, K)``
the column covariance. ``U`` and ``V`` are identified up to ``U c, V / c``: we fix the
scale with ``trace(V) = K`` (so ``U`` carries the magnitude).

Fit, once per probe collection ``t`` (the weight ``W_t`` is read directly, no hook needed):

- mean: ``M_t = (1 - a) M_{t-1} + a W_t`` (EMA, ``a = ema``, default 0.5: collections are
  ~100 steps apart, so the recent weight dominates), ``M_1 = W_1``;
- residual ``R_t = W_t - M_{t-1}`` (how far the weight moved since the last collections);
- ``flip_flop`` (default 2) alternating MLE steps, each an EMA of the one-sample flip-flop
  estimates: ``U <- (1 - a) U + a R V^-1 R^T / K``, then ``V <- (1 - a) V + a R^T U^-1 R / N``
  (the first residual initialises them, from ``V = I``), then the scale fix.
- shrinkage: one residual has rank <= min(N, K), and the EMA keeps only about
  ``n_eff = min(residuals, (2 - a) / a)`` of them, so each full factor is shrunk toward its
  scaled identity, ``U <- (1 - r) U + r mean(diag U) I`` with ``r = N / (N + n_eff K)`` (the
  K columns of each residual are the observations of U; ``r = K / (K + n_eff N)`` for V),
  which keeps traces (the per-element variance) and makes the inverses of the next
  flip-flop steps well conditioned: without it a direction that no earlier residual
  spanned gets a ~0 eigenvalue, and its inverse blows the other factor up by orders of
  magnitude. Inverses are also ridge-regularised (``1e-6 * trace / dim``).

A factor whose dim exceeds ``max_full_dim`` (2048, as for activations) is kept diagonal
(the same updates restricted to the diagonal). Synthetic weights drawn from this model are
the running mean plus noise of the size of the recent weight updates: draws stay close to
the weight the layer actually has, which is what the error of its GEMMs depends on (scale
per row / per block, outliers). ``benchmarks/probe_learned_vs_normal.py`` checks that errors
measured on draws of this model agree with errors on the current weight itself
(``weights="current"`` in :func:`loka_tune.probe.measure`).
"""

from __future__ import annotations

import torch

from loka_tune.probe.moments import MAX_FULL_DIM

__all__ = ["MatrixNormalEMA"]

_RIDGE = 1e-6  # relative ridge of the inverses in the flip-flop steps


def _ridge_inverse(s: torch.Tensor) -> torch.Tensor:
    """Inverse of a PSD matrix ``(d, d)`` or of a diagonal ``(d,)``, ridge-regularised."""
    if s.dim() == 1:
        lam = _RIDGE * float(s.mean()) + 1e-300
        return 1.0 / (s + lam)
    d = s.shape[0]
    lam = _RIDGE * float(torch.diagonal(s).mean()) + 1e-300
    eye = torch.eye(d, dtype=s.dtype, device=s.device)
    return torch.linalg.solve(s + lam * eye, eye)


def _shrink(s: torch.Tensor, n_obs: float) -> torch.Tensor:
    """Shrink a full ``(d, d)`` covariance toward ``mean(diag) I`` by ``d / (d + n_obs)``."""
    if s.dim() == 1:
        return s
    d = s.shape[0]
    r = d / (d + n_obs)
    mu = float(torch.diagonal(s).mean())
    return (1.0 - r) * s + (r * mu) * torch.eye(d, dtype=s.dtype, device=s.device)


class MatrixNormalEMA:
    """Online matrix-normal fit of one weight ``(rows N, cols K)``; see the module docstring."""

    def __init__(
        self,
        rows: int,
        cols: int,
        *,
        ema: float = 0.5,
        flip_flop: int = 2,
        max_full_dim: int = MAX_FULL_DIM,
        device: torch.device | str | None = None,
    ) -> None:
        assert 0.0 < ema <= 1.0 and flip_flop >= 1
        self.rows, self.cols, self.ema, self.flip_flop = int(rows), int(cols), float(ema), int(flip_flop)
        self.u_full = self.rows <= max_full_dim
        self.v_full = self.cols <= max_full_dim
        self.count = 0  # collections seen
        self.residuals = 0  # collections that moved the weight (fitted U, V)
        f64 = dict(dtype=torch.float64, device=device)
        self.mean = torch.zeros(self.rows, self.cols, **f64)
        self.last = torch.zeros(self.rows, self.cols, **f64)
        self.u = torch.zeros(self.rows, self.rows, **f64) if self.u_full else torch.zeros(self.rows, **f64)
        self.v = torch.eye(self.cols, **f64) if self.v_full else torch.ones(self.cols, **f64)
        self._u_raw, self._v_raw = self.u, self.v  # EMA states before shrinkage

    def update(self, w: torch.Tensor) -> None:
        """Fold in the weight ``w (N, K)`` of one collection."""
        w = w.detach().to(device=self.mean.device, dtype=torch.float64)
        assert w.shape == (self.rows, self.cols), (w.shape, self.rows, self.cols)
        self.last = w.clone()
        self.count += 1
        if self.count == 1:
            self.mean = w.clone()
            return
        a = self.ema
        r = w - self.mean  # (N, K)
        self.mean = (1.0 - a) * self.mean + a * w
        if not bool(torch.any(r != 0)):
            return  # the weight did not move: nothing to learn about U, V
        first = self.residuals == 0
        self.residuals += 1
        n_eff = min(float(self.residuals), (2.0 - a) / a)  # residuals the EMA effectively keeps
        # the EMA runs on the raw estimates; shrinkage is applied on use (it must not compound)
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
        self._u_raw, self._v_raw = u_raw, v_raw
        self.u, self.v = u, v

    @staticmethod
    def _sandwich(r: torch.Tensor, inv: torch.Tensor, out_full: bool, inv_full: bool) -> torch.Tensor:
        """``r inv r^T`` (full ``(d, d)``) or its diagonal, for a full or diagonal ``inv``."""
        ri = r @ inv if inv_full else r * inv[None, :]  # (d, e)
        return ri @ r.T if out_full else (ri * r).sum(1)
