"""Streaming moments of activations and gradients, merged batch by batch in float64.

:class:`RunningMoments` keeps, for a stream of row batches ``x (rows, d)`` (rows are treated
as independent draws: recommendation models have no cross-batch operation):

- ``n``, the feature mean ``(d,)`` and the scatter matrix ``M2 = sum (x - mean)(x - mean)^T``,
  merged with the batched Welford/Chan update (Chan, Golub & LeVeque 1979):
  ``M2 = M2_a + M2_b + delta delta^T n_a n_b / n`` with ``delta = mean_b - mean_a``;
- per-feature third and fourth central moments (Pebay 2008 pairwise formulas), which give
  the excess kurtosis of each feature;

everything in float64 on the device of the data, the row count included: an update never
reads a value back to the host (no GPU sync). With ``precision="float32"`` the one costly
product, the batch's scatter ``xc^T xc`` (and the sketch's two GEMMs), runs in float32 (TF32
when the caller enabled it) on rows already centred on the batch's float64 mean, so float32
rounding does not cancel against a large offset; its result is merged into the float64
state, and the mean, the diagonal and the third and fourth moments stay float64. The cost:
a relative error ~1e-6 per batch scatter (float32; ~1e-3 with TF32), far below the sampling
error of any row count the probe merges; the gain: float64 GEMMs run 15-30x slower than
float32 on a data-centre GPU. Float32 products overflow only for rows with
``|x| > ~1e17``.

Feature dims above ``max_full_dim`` (default :data:`MAX_FULL_DIM` = 2048: a 2048^2 float64
matrix is 32 MiB, the largest we keep per tensor) do not keep the full ``M2``: they keep the
exact diagonal and a streaming randomized Nystrom sketch of ``M2`` (Tropp, Yurtsever, Udell &
Cevher, "Fixed-rank approximation of a positive-semidefinite matrix from streaming data",
NeurIPS 2017): ``Y = M2 Omega`` for a fixed Gaussian test matrix ``Omega (d, 2 r)``. ``M2`` is a
sum of outer products of rows (``A^T A`` for ``A`` = the within-batch centred rows of every
batch stacked with one row ``sqrt(n_a n_b / n) delta`` per Chan merge), so ``Y`` is updated
by two GEMMs per batch, exactly, with no decomposition and no host sync while training runs;
the rank-``r`` approximation ``M2 ~= V^T diag(values) V`` is computed once, when read
(Cholesky + SVD of small matrices). It is exact when ``rank(M2) <= 2 r`` and never
overestimates (``M2 - approx`` is PSD up to the stabilising shift); its expected error is
within ``1 + r / (r - 1)`` of the best rank-``r`` approximation's in the nuclear norm (their
Theorem 4.1 with ``k = 2 r``). A batch of more than ``sketch_rows`` (4096) rows feeds the
sketch that many rows drawn at random (with replacement), scaled by ``sqrt(rows / kept)``
(an unbiased estimate of the batch's scatter); the diagonal stays exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["MAX_FULL_DIM", "PRECISIONS", "RunningMoments", "NystromSketch", "random_rows"]

PRECISIONS = ("float64", "float32")  # dtype of the GEMMs of an update (the state is always float64)

MAX_FULL_DIM = 2048  # largest feature dim with a full covariance (32 MiB float64 per tensor)
DEFAULT_SKETCH_RANK = 64  # rank of the Nystrom sketch above MAX_FULL_DIM (sketch width 2 x 64)
DEFAULT_SKETCH_ROWS = 4096  # rows per call fed to the sketch (a random subset, reweighted, above)


def random_rows(m: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` row indices drawn uniformly from ``range(m)`` with replacement (so a scatter summed
    over them and scaled by ``m / k`` is unbiased), on ``device`` without a host sync: drawn
    with ``gen`` on its own device and copied asynchronously when the devices differ."""
    idx = torch.randint(m, (k,), generator=gen, device=gen.device)
    return idx if idx.device == torch.device(device) else idx.to(device, non_blocking=True)


class NystromSketch:
    """A streaming Nystrom sketch ``Y = A Omega`` of a PSD matrix ``A = sum_i a_i a_i^T`` (rows appended).

    ``Omega`` is ``(dim, k)`` standard normal, ``k = oversample * rank``; :meth:`append` adds
    ``rows^T (rows Omega)`` to ``Y`` (two GEMMs, on the rows' device, no host sync);
    :meth:`eig` returns the top-``rank`` eigenpairs of the Nystrom approximation
    ``Y (Omega^T Y)^+ Y^T`` with the stabilising shift of Tropp et al. 2017 (Algorithm 3).
    """

    def __init__(self, dim: int, rank: int, *, device: torch.device | str | None = None,
                 generator: torch.Generator | None = None, oversample: int = 2,
                 precision: str = "float64") -> None:
        assert rank >= 1 and dim >= 1 and oversample >= 1
        self.dim, self.rank = int(dim), int(rank)
        self.k = min(self.dim, oversample * self.rank)
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        omega = torch.randn(self.dim, self.k, generator=gen, dtype=torch.float64, device=gen.device)
        self.omega = omega.to(device) if device is not None else omega
        self.y = torch.zeros(self.dim, self.k, dtype=torch.float64, device=self.omega.device)
        self.gemm_dtype = getattr(torch, precision)
        self._omega_g = self.omega.to(self.gemm_dtype)  # Omega in the GEMMs' dtype

    def append(self, rows: torch.Tensor) -> None:
        """Add rows ``(r, dim)``: ``Y += rows^T (rows Omega)`` (GEMMs in ``precision``, Y float64)."""
        rows = rows.reshape(-1, self.dim).to(self.gemm_dtype)
        self.y += (rows.T @ (rows @ self._omega_g)).to(torch.float64)

    def eig(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (r,), vectors (r, dim))`` with ``A ~= V^T diag(values) V``, values descending, r <= rank."""
        y, om = self.y, self.omega
        norm = float(torch.linalg.matrix_norm(y))
        if norm == 0.0:
            return y.new_zeros(0), y.new_zeros(0, self.dim)
        nu = math.sqrt(self.dim) * torch.finfo(torch.float64).eps * norm
        y_nu = y + nu * om
        c = om.T @ y_nu
        c = 0.5 * (c + c.T)
        jitter = 0.0
        for _ in range(8):  # C is PSD; rounding can make a tiny eigenvalue negative
            chol, info = torch.linalg.cholesky_ex(c + jitter * torch.eye(self.k, dtype=c.dtype, device=c.device))
            if int(info) == 0:
                break
            jitter = max(jitter * 10.0, nu * 1e-3 + 1e-300)
        b = torch.linalg.solve_triangular(chol, y_nu.T, upper=False).T  # Y_nu C^-1/2: (dim, k)
        u, sv, _ = torch.linalg.svd(b, full_matrices=False)
        lam = (sv * sv - nu).clamp_min(0.0)
        r = min(self.rank, int((lam > lam[0] * 1e-14).sum()) if float(lam[0]) > 0 else 0)
        return lam[:r], u[:, :r].T.contiguous()


class RunningMoments:
    """Streaming count / mean / covariance (+ per-feature kurtosis) of row batches.

    ``update(x)`` takes any float tensor whose last dim is ``dim`` (leading dims are
    flattened into rows). Non-finite batches must be filtered by the caller.
    """

    def __init__(
        self,
        dim: int,
        *,
        max_full_dim: int = MAX_FULL_DIM,
        sketch_rank: int = DEFAULT_SKETCH_RANK,
        sketch_rows: int = DEFAULT_SKETCH_ROWS,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        precision: str = "float64",
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision=!r}")
        self.dim, self.precision = int(dim), precision
        self._gemm_dtype = getattr(torch, precision)
        self.sketch_rows = int(sketch_rows)
        self._gen = generator if generator is not None else torch.Generator().manual_seed(0)
        self.full = self.dim <= max_full_dim
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        self._n = torch.zeros((), **f64)  # rows merged, on the device (exact in float64 up to 2^53)
        self.mean = torch.zeros(self.dim, **f64)
        self.m2: torch.Tensor | None = torch.zeros(self.dim, self.dim, **f64) if self.full else None  # scatter
        self.m2d = torch.zeros(self.dim, **f64)  # its diagonal (always exact)
        self.m3 = torch.zeros(self.dim, **f64)
        self.m4 = torch.zeros(self.dim, **f64)
        self.sketch: NystromSketch | None = None if self.full else NystromSketch(
            self.dim, sketch_rank, device=device, generator=self._gen, precision=precision)

    @property
    def n(self) -> int:
        """Rows merged so far (reads the device counter: a host sync on a GPU)."""
        return int(self._n.item())

    def update(self, x: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Merge the rows of ``x``. ``ok`` (a 0-d bool tensor, e.g. ``isfinite(x).all()``):
        when False the batch is not merged, without reading the flag on the host (no GPU
        sync): the batch's statistics are masked to zero and its count to 0, which leaves
        every running moment exactly unchanged."""
        xb = x.detach().reshape(-1, self.dim).to(torch.float64)  # (rows, d)
        nb = xb.shape[0]
        if nb == 0:
            return
        if xb.device != self.mean.device:
            xb = xb.to(self.mean.device)
        mb = xb.mean(0)  # (d,)
        xc = xb - mb  # (rows, d) centred within the batch
        xc2 = xc * xc
        m2d_b = xc2.sum(0)
        m3_b = (xc2 * xc).sum(0)
        m4_b = (xc2 * xc2).sum(0)
        xg = xc.to(self._gemm_dtype)  # centred first: float32 products do not cancel an offset
        m2_b = (xg.T @ xg).to(torch.float64) if self.full else None  # (d, d)
        if ok is not None:  # a rejected batch: zero statistics and count (where, not *: NaN * 0 = NaN)
            ok = ok.to(self.mean.device)
            zero = torch.zeros((), dtype=torch.float64, device=self.mean.device)
            mb, m2d_b, m3_b, m4_b = (torch.where(ok, t, zero) for t in (mb, m2d_b, m3_b, m4_b))
            m2_b = None if m2_b is None else torch.where(ok, m2_b, zero)
            xg = torch.where(ok, xg, zero.to(xg.dtype))
            nb_t = torch.where(ok, torch.full((), float(nb), dtype=torch.float64, device=self.mean.device), zero)
        else:
            nb_t = torch.full((), float(nb), dtype=torch.float64, device=self.mean.device)
        # The Chan/Pebay merge with the counts as device tensors; with na = 0 it reduces exactly
        # to "take the batch" (mean + delta * nb / n = mb), with nb = 0 to "keep the state".
        na = self._n
        n = na + nb_t
        n1 = n.clamp_min(1.0)  # both counts 0: every numerator below is 0 too
        delta = mb - self.mean  # (d,)
        d2 = delta * delta
        m2a, m3a = self.m2d, self.m3
        # Pebay's pairwise formulas, each using the *old* lower moments
        self.m4 = (
            self.m4 + m4_b
            + d2 * d2 * (na * nb_t * (na * na - na * nb_t + nb_t * nb_t) / n1**3)
            + 6.0 * d2 * (na * na * m2d_b + nb_t * nb_t * m2a) / n1**2
            + 4.0 * delta * (na * m3_b - nb_t * m3a) / n1
        )
        self.m3 = (
            m3a + m3_b + d2 * delta * (na * nb_t * (na - nb_t) / n1**2)
            + 3.0 * delta * (na * m2d_b - nb_t * m2a) / n1
        )
        self.m2d = m2a + m2d_b + d2 * (na * nb_t / n1)
        if self.full:
            assert self.m2 is not None and m2_b is not None
            self.m2 = self.m2 + m2_b + torch.outer(delta, delta) * (na * nb_t / n1)
        else:
            assert self.sketch is not None
            cross = (delta * torch.sqrt(na * nb_t / n1))[None]  # the Chan cross term, one row (0 if na = 0)
            self.sketch.append(torch.cat([self._sketch_rows(xg), cross.to(xg.dtype)]))
        self.mean = self.mean + delta * (nb_t / n1)
        self._n = n

    def _sketch_rows(self, xc: torch.Tensor) -> torch.Tensor:
        """At most ``sketch_rows`` random rows of ``xc``, scaled by ``sqrt(rows / kept)`` so
        that their scatter is an unbiased estimate of the batch's (all rows when fewer)."""
        nb = xc.shape[0]
        if nb <= self.sketch_rows:
            return xc
        idx = random_rows(nb, self.sketch_rows, self._gen, xc.device)
        return xc[idx] * math.sqrt(nb / self.sketch_rows)

    # ------------------------------------------------------------------ read-outs
    def covariance(self, ddof: int = 1) -> torch.Tensor:
        """The ``(d, d)`` covariance (full mode only): ``M2 / (n - ddof)``."""
        assert self.full and self.m2 is not None, "covariance() needs full mode; use variance() and low_rank()"
        return self.m2 / max(self.n - ddof, 1)

    def variance(self, ddof: int = 1) -> torch.Tensor:
        """The exact per-feature variance ``(d,)``."""
        return self.m2d / max(self.n - ddof, 1)

    def low_rank(self, ddof: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sketch mode: ``(values (r,), vectors (r, d))`` with ``cov ~= V^T diag(values) V``."""
        assert not self.full and self.sketch is not None
        vals, vecs = self.sketch.eig()
        return vals / max(self.n - ddof, 1), vecs

    def excess_kurtosis(self) -> torch.Tensor:
        """Per-feature excess kurtosis ``n M4 / M2^2 - 3`` (0 for a normal; 0 where a feature is constant)."""
        m2 = self.m2d
        k = self.n * self.m4 / (m2 * m2).clamp_min(1e-300) - 3.0
        return torch.where(m2 > 0, k, torch.zeros_like(k))
