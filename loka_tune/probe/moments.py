"""Streaming moments of activations and gradients, merged batch by batch in float64.

:class:`RunningMoments` keeps, for a stream of row batches ``x (rows, d)`` (rows are treated
as independent draws: recommendation models have no cross-batch operation):

- ``n``, the feature mean ``(d,)`` and the scatter matrix ``M2 = sum (x - mean)(x - mean)^T``,
  merged with the batched Welford/Chan update (Chan, Golub & LeVeque 1979):
  ``M2 = M2_a + M2_b + delta delta^T n_a n_b / n`` with ``delta = mean_b - mean_a``;
- per-feature third and fourth central moments (Pebay 2008 pairwise formulas), which give
  the excess kurtosis of each feature;

everything in float64 on the device of the data, the row count included: an update never
reads a value back to the host (no GPU sync), except for the Frequent Directions shrink below.

Feature dims above ``max_full_dim`` (default :data:`MAX_FULL_DIM` = 2048: a 2048^2 float64
matrix is 32 MiB, the largest we keep per tensor) do not keep the full ``M2``: they keep the
exact diagonal and a Frequent Directions sketch (Liberty 2013; Ghashami et al. 2016) of
``M2`` with ``sketch_rank`` rows. The Chan merge is exactly "append rows" in that picture:
``M2`` equals ``A^T A`` for ``A`` = the within-batch centred rows of every batch stacked with
one row ``sqrt(n_a n_b / n) delta`` per merge, so the sketch sees those rows and satisfies the
FD guarantee ``0 <= M2 - B^T B`` and ``||M2 - B^T B||_2 <= ||A - A_k||_F^2 / (l - k)`` for
every ``k < l`` (``l = sketch_rank``). To bound the cost of a collection, a batch of more
than ``sketch_rows`` (512) rows feeds the sketch that many rows drawn at random (with replacement), scaled by
``sqrt(rows / 512)`` (an unbiased estimate of the batch's scatter): the guarantee then holds
for that stream, the diagonal stays exact.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_FULL_DIM", "RunningMoments", "FrequentDirections", "random_rows"]

MAX_FULL_DIM = 2048  # largest feature dim with a full covariance (32 MiB float64 per tensor)
DEFAULT_SKETCH_RANK = 64  # rows of the Frequent Directions sketch above MAX_FULL_DIM
DEFAULT_SKETCH_ROWS = 512  # rows per call fed to the sketch (a random subset, reweighted)


def random_rows(m: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` row indices drawn uniformly from ``range(m)`` with replacement (so a scatter summed
    over them and scaled by ``m / k`` is unbiased), on ``device`` without a host sync: drawn
    with ``gen`` on its own device and copied asynchronously when the devices differ."""
    idx = torch.randint(m, (k,), generator=gen, device=gen.device)
    return idx if idx.device == torch.device(device) else idx.to(device, non_blocking=True)


class FrequentDirections:
    """A Frequent Directions sketch ``B (<= l, d)`` with ``B^T B ~= A^T A`` for appended rows ``A``.

    Each shrink works on the Gram matrix of the buffer (``m x m``, m <= ``l + max_append``):
    ``G = Y Y^T`` on the data's device, its eigendecomposition on the host (float64; a few
    ms for m ~ 600), then ``B = diag(sqrt((lam_i - lam_l) / lam_i)) U^T Y`` for the top ``l``:
    the same result as an SVD of ``Y`` (up to rounding in the discarded directions), without a
    GPU SVD of a wide matrix per chunk, which is what made collections slow.
    """

    def __init__(self, dim: int, rank: int, *, device: torch.device | str | None = None,
                 max_append: int = 1024) -> None:
        assert rank >= 1 and dim >= 1
        self.dim, self.rank, self.max_append = dim, rank, max(int(max_append), rank)
        self._b = torch.zeros(0, dim, dtype=torch.float64, device=device)  # (<= l + max_append, d)

    def append(self, rows: torch.Tensor) -> None:
        """Add rows ``(r, d)`` (float64) to the sketch."""
        rows = rows.reshape(-1, self.dim)
        for i in range(0, rows.shape[0], self.max_append):
            self._b = torch.cat([self._b, rows[i : i + self.max_append]])
            if self._b.shape[0] > 2 * self.rank:
                self._b = self._top(self._b, shrink=True)[2]

    def _top(self, y: torch.Tensor, *, shrink: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values (r,), vectors (r, d), B (r, d))`` of the top ``r <= l`` directions of ``y``
        (values are shrunk by the (l+1)-th one when ``shrink``)."""
        g = (y @ y.T).to("cpu")  # (m, m) Gram matrix, host
        lam, u = torch.linalg.eigh(0.5 * (g + g.T))  # ascending
        lam, u = lam.flip(0).clamp_min(0.0), u.flip(1)
        r = min(self.rank, lam.shape[0])
        delta = lam[r] if shrink and lam.shape[0] > r else lam.new_zeros(())
        keep = lam[:r]
        ok = keep > keep[0] * 1e-14 if r else keep > 0  # directions resolved in float64
        inv = torch.where(ok, keep.clamp_min(1e-300).rsqrt(), torch.zeros_like(keep))
        vecs = (inv[:, None] * u[:, :r].T).to(y.device) @ y  # (r, d) unit rows (v_i = Y^T u_i / s_i)
        vals = torch.where(ok, keep - delta, torch.zeros_like(keep)).clamp_min(0.0)
        b = vals.sqrt().to(y.device)[:, None] * vecs
        keep_rows = vals > 0
        return vals[keep_rows].to(y.device), vecs[keep_rows.to(y.device)], b[keep_rows.to(y.device)]

    def eig(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sketch as ``(values (r,), vectors (r, d))``: ``B^T B = V^T diag(values) V``, r <= l."""
        if self._b.shape[0] == 0:
            return self._b.new_zeros(0), self._b.new_zeros(0, self.dim)
        vals, vecs, _ = self._top(self._b, shrink=False)
        return vals, vecs


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
    ) -> None:
        self.dim = int(dim)
        self.sketch_rows = int(sketch_rows)
        self._gen = generator if generator is not None else torch.Generator().manual_seed(0)
        self.full = self.dim <= max_full_dim
        f64 = dict(dtype=torch.float64, device=device)
        self._n = torch.zeros((), **f64)  # rows merged, on the device (exact in float64 up to 2^53)
        self.mean = torch.zeros(self.dim, **f64)
        self.m2 = torch.zeros(self.dim, self.dim, **f64) if self.full else None  # scatter matrix
        self.m2d = torch.zeros(self.dim, **f64)  # its diagonal (always exact)
        self.m3 = torch.zeros(self.dim, **f64)
        self.m4 = torch.zeros(self.dim, **f64)
        self.sketch = None if self.full else FrequentDirections(
            self.dim, sketch_rank, device=device, max_append=self.sketch_rows + 1
        )

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
        m2_b = xc.T @ xc if self.full else None  # (d, d)
        if ok is not None:  # a rejected batch: zero statistics and count (where, not *: NaN * 0 = NaN)
            ok = ok.to(self.mean.device)
            zero = torch.zeros((), dtype=torch.float64, device=self.mean.device)
            mb, m2d_b, m3_b, m4_b = (torch.where(ok, t, zero) for t in (mb, m2d_b, m3_b, m4_b))
            m2_b = None if m2_b is None else torch.where(ok, m2_b, zero)
            xc = torch.where(ok, xc, zero)
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
            self.m2 = self.m2 + m2_b + torch.outer(delta, delta) * (na * nb_t / n1)
        else:
            cross = (delta * torch.sqrt(na * nb_t / n1))[None]  # the Chan cross term, one row (0 if na = 0)
            self.sketch.append(torch.cat([self._sketch_rows(xc), cross]))
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
        assert self.full, "covariance() needs full mode; use variance() and low_rank()"
        return self.m2 / max(self.n - ddof, 1)

    def variance(self, ddof: int = 1) -> torch.Tensor:
        """The exact per-feature variance ``(d,)``."""
        return self.m2d / max(self.n - ddof, 1)

    def low_rank(self, ddof: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sketch mode: ``(values (r,), vectors (r, d))`` with ``cov ~= V^T diag(values) V``."""
        assert not self.full
        vals, vecs = self.sketch.eig()
        return vals / max(self.n - ddof, 1), vecs

    def excess_kurtosis(self) -> torch.Tensor:
        """Per-feature excess kurtosis ``n M4 / M2^2 - 3`` (0 for a normal; 0 where a feature is constant)."""
        m2 = self.m2d
        k = self.n * self.m4 / (m2 * m2).clamp_min(1e-300) - 3.0
        return torch.where(m2 > 0, k, torch.zeros_like(k))
