"""Streaming moments of activations and gradients, merged batch by batch in float64.

:class:`RunningMoments` keeps, for a stream of row batches ``x (rows, d)`` (rows are treated
as independent draws: recommendation models have no cross-batch operation):

- ``n``, the feature mean ``(d,)`` and the scatter matrix ``M2 = sum (x - mean)(x - mean)^T``,
  merged with the batched Welford/Chan update (Chan, Golub & LeVeque 1979):
  ``M2 = M2_a + M2_b + delta delta^T n_a n_b / n`` with ``delta = mean_b - mean_a``;
- per-feature third and fourth central moments (Pebay 2008 pairwise formulas), which give
  the excess kurtosis of each feature;

everything in float64 on the device of the data, the row count included: an update never
reads a value back to the host (no GPU sync). With ``precision="float32"`` the batch's pass is
float32 (:func:`lowp_batch`): each feature scaled by a power of two, shifted by its float32
mean, the moments' sums and the costly products (the batch's scatter and the sketch's two
GEMMs, TF32 when the caller enabled it) on those rows, and what the shift's rounding left
corrected in float64, so float32 rounding does not cancel against a large offset; everything is
merged into the float64 state (mean, scatter, diagonal, third and fourth moments). The cost:
a relative error ~1e-6 per batch scatter (float32; ~1e-3 with TF32), far below the sampling
error of any row count the probe merges; the gain: float64 GEMMs run 15-30x slower than
float32 on a data-centre GPU. The float32 operands are scaled per feature to [-1, 1] first and
the products rescaled in float64, so no feature scale over- or underflows them (1e-30 next to
1e30, or gradients of 1e-20). ``precision="tf32"``: the same float32 products on TF32 tensor
cores (a 10-bit mantissa: a relative error up to 2^-10 per operand, ~1e-3 on a covariance entry,
against a sampling error of ~3% at 2,048 rows), 8x faster again; the CPU emulates it by
truncating the operands (:func:`tf32_truncate`), so CPU tests see its error.

Feature dims above ``max_full_dim`` (default :data:`MAX_FULL_DIM` = 2048: a 2048^2 float64
matrix is 32 MiB, the largest we keep per tensor) do not keep the full ``M2``: they keep the
exact diagonal and a streaming randomized Nystrom sketch of ``M2`` (Tropp, Yurtsever, Udell &
Cevher, "Fixed-rank approximation of a positive-semidefinite matrix from streaming data",
NeurIPS 2017): ``Y = M2 Omega`` for a fixed Gaussian test matrix ``Omega (d, 2 r)``. ``M2`` is a
sum of outer products of rows (``A^T A`` for ``A`` = the within-batch centred rows of every
batch stacked with one row ``sqrt(n_a n_b / n) delta`` per Chan merge), so ``Y`` is updated
by two GEMMs per batch, exactly, with no decomposition and no host sync while training runs;
the rank-``r`` approximation ``M2 ~= V^T diag(values) V`` is computed once, when read, on
the CPU in float64 (``eigh`` of the small core, QR + SVD of a ``(dim, 2 r)`` matrix: stable on
rank-deficient, constant and ill-conditioned input, see :class:`NystromSketch`; what still
cannot be factorised raises :class:`StatisticError`, and the probe falls back to the exact
diagonal and reports it). It is exact when ``rank(M2) <= 2 r`` and never
overestimates (``M2 - approx`` is PSD up to the stabilising shift); its expected error is
within ``1 + r / (r - 1)`` of the best rank-``r`` approximation's in the nuclear norm (their
Theorem 4.1 with ``k = 2 r``). A batch of more than ``sketch_rows`` (4096) rows feeds the
sketch that many rows drawn at random (with replacement), scaled by ``sqrt(rows / kept)``
(an unbiased estimate of the batch's scatter); the diagonal stays exact.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

__all__ = ["MAX_FULL_DIM", "PRECISIONS", "TF32_RTOL", "matmul", "tf32_products", "tf32_truncate", "on_device", "pick", "stacked",
           "concatenated", "RunningMoments", "NystromSketch", "StatisticError", "pow2_scale", "random_rows",
           "update_concat", "lowp_batch", "lowp_scatter", "lowp_sketch_product", "sketch_increment"]

PRECISIONS = ("float64", "float32", "tf32")  # the GEMMs of an update (the state is always float64)
TF32_RTOL = 8.0 * 2.0**-10  # the sketch core's eigenvalue floor under TF32 products (a 10-bit mantissa)

MAX_FULL_DIM = 2048  # largest feature dim with a full covariance (32 MiB float64 per tensor)
DEFAULT_SKETCH_RANK = 64  # rank of the Nystrom sketch above MAX_FULL_DIM (sketch width 2 x 64)
DEFAULT_SKETCH_ROWS = 4096  # rows per call fed to the sketch (a random subset, reweighted, above)


def random_rows(m: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` row indices drawn uniformly from ``range(m)`` with replacement (so a scatter summed
    over them and scaled by ``m / k`` is unbiased), on ``device`` without a host sync: drawn
    with ``gen`` on its own device and copied asynchronously when the devices differ."""
    idx = torch.randint(m, (k,), generator=gen, device=gen.device)
    return idx if idx.device == torch.device(device) else idx.to(device, non_blocking=True)


_CONSTANTS: dict[tuple[Any, ...], torch.Tensor] = {}  # on_device's cache (accelerators only)
_MAX_CONSTANTS = 4096


def on_device(values: list[int] | list[float] | tuple[float, ...], like: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``like``'s device, copied without blocking: ``torch.tensor(...,
    device=cuda)`` and indexing a CUDA tensor with a Python list copy with ``non_blocking=False``,
    a stream synchronisation each (what a collection must never do). On an accelerator the
    tensor is cached per values, dtype and device (callers never write to it): a collection's
    layout asks for the same few each time, and a CUDA-graph capture of it
    (:mod:`loka_tune.probe.graphs`) may copy nothing from the host."""
    dt = dtype if dtype is not None else (torch.long if isinstance(values[0], int) else like.dtype)
    if like.device.type == "cpu":
        return torch.tensor(values, dtype=dt)
    key = (tuple(values), dt, like.device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.tensor(values, dtype=dt).to(like.device, non_blocking=True)
    return t


def pick(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """``t[idx]`` along dim 0 for a host list ``idx`` without a blocking copy (all of ``t``:
    ``t`` itself; a contiguous run: a view)."""
    if idx == list(range(t.shape[0])):
        return t
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return t[idx[0]:idx[0] + len(idx)]
    return t.index_select(0, on_device(idx, t))


def stacked(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(ts)``, or the tensor ``ts`` are the rows of when they are exactly that (the
    views a batched update wrote back last time): no copy, no kernel."""
    base = ts[0]._base
    if (base is not None and base.is_contiguous() and base.dim() == ts[0].dim() + 1 and base.shape[0] == len(ts)
            and all(t._base is base and t.shape == base.shape[1:] and t.storage_offset() == base.storage_offset() + i * t.numel()
                    for i, t in enumerate(ts))):
        return base
    return torch.stack(ts)


def concatenated(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(ts)`` of 1-d tensors, or the tensor they are consecutive slices of, in order,
    when they cover it exactly (what :func:`update_concat` wrote back): no copy, no kernel."""
    base = ts[0]._base
    if base is not None and base.dim() == 1 and base.is_contiguous() and all(t.dim() == 1 and t._base is base for t in ts):
        off = base.storage_offset()
        for t in ts:
            if t.storage_offset() != off:
                return torch.cat(ts)
            off += t.numel()
        if off == base.storage_offset() + base.numel():
            return base
    return torch.cat(ts)


def tf32_truncate(t: torch.Tensor) -> torch.Tensor:
    """Float32 ``t`` with its mantissa cut to TF32's 10 explicit bits, toward zero: how the CPU
    stands in for a TF32 tensor-core GEMM (the worst case of its input conversion: a relative
    error up to 2^-10 per operand, biased; round-to-nearest halves it)."""
    i = t.contiguous().view(torch.int32)
    return (i & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def tf32_products() -> Iterator[bool]:
    """CUDA float32 matmuls on TF32 tensor cores inside the block, and the setting exactly as it
    was after it; yields whether TF32 is on (False: this torch refuses the change, float32).

    Through ``torch.backends.cuda.matmul.fp32_precision``, saved and restored as read: the
    legacy ``set_float32_matmul_precision("highest")`` restores the untouched default
    (``"none"``) as ``"ieee"``, the same arithmetic but another value, and inductor's FX graph
    cache keys on it: every compile after a probe collection then misses the cache of one before
    it (the likely reason an H200 study's noise twin recompiled its baseline's graphs, 9.6 s,
    2026-12-02), and a dynamo guard on the flag could recompile a step. A torch without the
    newer attribute uses the legacy setting, restored to what it read."""
    m = torch.backends.cuda.matmul
    newer = hasattr(m, "fp32_precision")
    prev, on = (m.fp32_precision, "tf32") if newer else (torch.get_float32_matmul_precision(), "high")

    def put(value: str) -> None:
        if newer:
            m.fp32_precision = value
        else:
            torch.set_float32_matmul_precision(value)

    try:
        put(on)
    except RuntimeError:  # this torch refuses the change: float32 products
        yield False
        return
    try:
        yield True
    finally:
        put(prev)


def caller_tf32() -> bool:
    """Whether CUDA float32 matmuls run on TF32 now (the caller's setting), read through the newer
    API where this torch has it: reading the legacy ``allow_tf32`` raises once the newer one was
    set (a user's ``fp32_precision = "tf32"``)."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):  # "none": the backends-wide setting's
        own = m.fp32_precision
        return own == "tf32" or (own == "none" and getattr(torch.backends, "fp32_precision", "none") == "tf32")
    return bool(m.allow_tf32)


def matmul(a: torch.Tensor, b: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """``a @ b``; ``tf32``: float32 operands multiplied on TF32 tensor cores (CUDA: TF32 for this
    product only, :func:`tf32_products`; the CPU truncates the operands, see
    :func:`tf32_truncate`), 8x faster than float32 on a data-centre GPU."""
    if not tf32:
        return a @ b
    if a.is_cuda:
        with tf32_products():  # restored at once: dynamo guards the flag and inductor's cache keys on it
            return a @ b
    return tf32_truncate(a) @ tf32_truncate(b)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two at or just above each ``amax`` (1 where it is 0 or not finite), a
    device tensor: dividing by it maps the values into [-1, 1] exactly (no rounding), so a
    float32 product of scaled operands rescaled in float64 equals the unscaled one bit for
    bit wherever that one neither over- nor underflowed."""
    ok = (amax > 0) & (amax < math.inf)  # NaN fails both (one kernel each, where isfinite takes four)
    one = torch.ones_like(amax)
    _, e = torch.frexp(torch.where(ok, amax, one))  # amax = m 2^e, m in [0.5, 1)
    return torch.where(ok, torch.ldexp(one, e), one)


def lowp_batch(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The batch pass of a ``float32`` / ``tf32`` update: every pass over the rows ``x (rows, D)``
    (any float dtype; bf16 activations are read as they are) is float32, none float64
    (issue 22: at large Wukong's 2,048 x 112k a float64 pass moves 1.8 GB; the side
    collection's GPU time was its float64 passes). Returns ``(mean, m2d, m3, m4, g, s, d)``:

    - ``s (D,)``: per column half the power of two above its largest ``|value|`` (1 for a zero
      or non-finite column), so ``x / s`` is exact and in (-2, 2) (``s`` <= 2^127: float32);
    - ``g = x / s - a`` float32, shifted by ``a``, the float32 rounding of the column's mean
      of ``x / s`` (taken with a float64 accumulator); ``d = mean(x / s) - a`` (float64) is
      what that rounding left, so ``g`` centred exactly is ``g - d``;
    - the batch's mean and central moments (float64, in ``x``'s units) from the float32 sums
      ``S_k = sum g^k`` about the shift, corrected by the binomial identities
      ``M2 = S2 - n d^2``, ``M3 = S3 - 3 d S2 + 2 n d^3``, ``M4 = S4 - 4 d S3 + 6 d^2 S2 - 3 n d^4``.

    ``d`` is at most half a float32 ulp of the mean, so the corrections never cancel (a
    feature of mean 1e4 and spread 1e-2 keeps a relative error ~1e-7: centring on a float32
    mean instead would lose ~1e-3); no float32 over- or underflow whatever the scale (1e-30
    next to 1e30), as with the float64 pass. A non-finite column gives non-finite
    statistics: the caller masks them (its stream is not merged)."""
    nb = x.shape[0]
    wide = x.dtype == torch.float64  # a float64 input (the CPU's tests) keeps its own precision until g
    amax = torch.linalg.vector_norm(x, float("inf"), dim=0).double()  # (D,) one pass, x's dtype (max is exact)
    s64 = pow2_scale(amax) * 0.5
    s = s64 if wide else s64.float()
    ms = x.sum(0, dtype=torch.float64) / s64 / nb  # (D,) the mean of x / s, float64-accumulated
    a = ms.to(s.dtype)
    d = ms - a.double()
    g = torch.addcdiv(-a, x, s)  # (rows, D) x / s - a: one kernel, one rounding
    s2 = torch.linalg.vector_norm(g, 2, dim=0).double() ** 2
    s3 = g.pow(3).sum(0).double()
    s4 = torch.linalg.vector_norm(g, 4, dim=0).double() ** 4
    m2 = (s2 - nb * d * d).clamp_min(0.0)
    m3 = s3 - 3.0 * d * s2 + 2.0 * nb * d * d * d
    m4 = (s4 - 4.0 * d * s3 + 6.0 * d * d * s2 - 3.0 * nb * d * d * d * d).clamp_min(0.0)
    s_2 = s64 * s64
    g32 = g if g.dtype == torch.float32 else g.float()
    return ms * s64, m2 * s_2, m3 * s_2 * s64, m4 * s_2 * s_2, g32, s64, d


def lowp_scatter(g: torch.Tensor, s: torch.Tensor, d: torch.Tensor, nb: int, tf32: bool) -> torch.Tensor:
    """The batch scatter ``(S, d, d)`` float64 of streams ``g (S, rows, d)`` from
    :func:`lowp_batch` (``s``, ``d``: ``(S, d)``): ``diag(s) (g^T g - n d d^T) diag(s)``, the
    product in float32 (TF32 with ``tf32``) on operands in (-4, 4)."""
    gg = matmul(g.transpose(1, 2), g, tf32).to(torch.float64)
    return (gg - nb * d[:, :, None] * d[:, None, :]) * (s[:, :, None] * s[:, None, :])


def lowp_sketch_product(g: torch.Tensor, s: torch.Tensor, omega: torch.Tensor, tf32: bool) -> torch.Tensor:
    """``diag(s) g^T g diag(s) Omega`` ``(S, dim, k)`` float64 for rows ``g (S, r, dim)`` in
    (-4, 4) scaled by ``s (S, dim)`` (powers of two) and test matrices ``omega (S, dim, k)``:
    two float32 GEMMs on ``g`` and ``diag(s / max s) Omega``, rescaled in float64."""
    smax = s.amax(1)  # (S,)
    om = ((s / smax[:, None])[:, :, None] * omega).to(torch.float32)
    prod = matmul(g.transpose(1, 2), matmul(g, om, tf32), tf32)
    return prod.to(torch.float64) * (s[:, :, None] * smax[:, None, None])


def sketch_increment(g: torch.Tensor, s: torch.Tensor, d: torch.Tensor, n: torch.Tensor | float,
                     cross: torch.Tensor, omega: torch.Tensor, tf32: bool) -> torch.Tensor:
    """``(S, dim, k)``: what a batch adds to ``S`` sketches' ``Y`` (see
    :meth:`NystromSketch.append_lowp`): ``g (S, r, dim)``, ``s, d, cross (S, dim)``, ``n`` the
    batch's rows (a scalar or ``(S,)``), ``omega (S, dim, k)``."""
    n_t = torch.as_tensor(n, dtype=torch.float64, device=g.device)
    n_t = n_t.reshape(-1, 1, 1) if n_t.dim() else n_t
    ds = d * s  # (S, dim) the shift in x's units
    rank1 = cross[:, :, None] * (cross[:, None, :] @ omega) - n_t * ds[:, :, None] * (ds[:, None, :] @ omega)
    return lowp_sketch_product(g, s, omega, tf32) + rank1


class StatisticError(ArithmeticError):
    """A statistic could not be formed from what was collected (a sketch holding non-finite
    values, a factorization that failed every fallback). Internal: the probe's read-out
    catches it, falls back to a simpler statistic (e.g. the diagonal) and reports why."""


def _eigh(a: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of a small symmetric float64 CPU matrix (LAPACK syevd: no convergence
    failure on finite input in practice); anything that still fails is a StatisticError."""
    try:
        return torch.linalg.eigh(a)
    except RuntimeError as e:  # torch.linalg.LinAlgError is a RuntimeError
        raise StatisticError(f"eigh of {what} failed ({_short(e)})") from None


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__


class NystromSketch:
    """A streaming Nystrom sketch ``Y = A Omega`` of a PSD matrix ``A = sum_i a_i a_i^T`` (rows appended).

    ``Omega`` is ``(dim, k)`` standard normal, ``k = oversample * rank``; :meth:`append` adds
    ``rows^T (rows Omega)`` to ``Y`` (two GEMMs, on the rows' device, no host sync);
    :meth:`eig` returns the top-``rank`` eigenpairs of the Nystrom approximation
    ``Y (Omega^T Y)^+ Y^T`` with the stabilising shift of Tropp et al. 2017 (Algorithm 3).

    Float32 GEMMs (``precision="float32"``): each appended block is scaled per feature by its
    largest ``|value|`` before the cast (``rows = G D``, ``G`` in [-1, 1]) and the products
    are rescaled in float64, ``Y += D G^T (G (D Omega / s)) s`` with ``s = max D``; ``D`` holds
    powers of two (:func:`pow2_scale`), so where the unscaled product was in range this is it
    bit for bit. No float32 overflow or underflow whatever the features' scales (1e-30 next to
    1e30, or all 1e-20), only float32 rounding relative to each feature's own scale.

    :meth:`eig` is stable on rank-deficient, constant, duplicated and ill-conditioned input:
    it runs on the CPU in float64 (LAPACK; cuSOLVER's SVD fails to converge on the repeated
    singular values a rank-deficient sketch has, issue 20) on ``Y`` scaled to ``max |Y| = 1``,
    takes the pseudo-inverse of the small core ``C = Omega^T Y_nu`` through its ``eigh``
    (eigenvalues below ``core_rtol`` x the largest are rounding, mostly of float32 GEMMs:
    ``k eps`` in float64, 8 float32 eps, 8 TF32 eps when TF32 was on; they are dropped, so the
    approximation stays below ``A``), and the eigenpairs of
    ``B B^T`` (``B = Y_nu C^{-1/2}``) from a QR of ``B`` and the SVD of its small ``R``
    (``eigh`` of ``R R^T`` if that SVD fails: :attr:`note` says so). What cannot be
    factorised raises :class:`StatisticError`.
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
        self.tf32 = precision == "tf32"
        self.gemm_dtype = torch.float32 if self.tf32 else getattr(torch, precision)
        self._omega_g = self.omega.to(self.gemm_dtype)  # Omega in the GEMMs' dtype
        # relative floor of the core's eigenvalues: float64 rounding (k eps), or 8 eps of the
        # float32 GEMMs (their rounding makes C indefinite at ~3e-8 relative on rank-deficient
        # input; measured on features spanning 1e-30..1e30: core error 3e-3 with no floor,
        # 5e-8 at 1e-9, 6e-7 at 1e-6 = 8 eps, growing as the floor above: it drops what it cuts)
        self.core_rtol = (self.k * torch.finfo(torch.float64).eps if self.gemm_dtype == torch.float64
                          else TF32_RTOL if self.tf32 else 8.0 * torch.finfo(torch.float32).eps)
        self.note: str | None = None  # set by eig(): a fallback inside the factorization, if any

    def append(self, rows: torch.Tensor) -> None:
        """Add rows ``(r, dim)``: ``Y += rows^T (rows Omega)`` (GEMMs in ``precision``, Y float64)."""
        rows = rows.reshape(-1, self.dim)
        if self.gemm_dtype == torch.float64:
            rows = rows.to(torch.float64)
            self.y += rows.T @ (rows @ self._omega_g)
            return
        if rows.is_cuda and caller_tf32():  # the caller's TF32: a 10-bit mantissa
            self.core_rtol = max(self.core_rtol, TF32_RTOL)
        r64 = rows.to(torch.float64)
        col = pow2_scale(r64.abs().amax(0))  # (dim,) per-feature scale (a device tensor: no host sync)
        s = col.max()
        g = (r64 / col).to(self.gemm_dtype)  # (r, dim) in [-1, 1]
        om = ((col / s)[:, None] * self.omega).to(self.gemm_dtype)  # D Omega / s: (dim, k)
        self.y += matmul(g.T, matmul(g, om, self.tf32), self.tf32).to(torch.float64) * (col[:, None] * s)

    def append_lowp(self, g: torch.Tensor, s: torch.Tensor, d: torch.Tensor, n: torch.Tensor | float,
                    cross: torch.Tensor) -> None:
        """Add a batch from :func:`lowp_batch`: rows ``g (r, dim)`` (float32, in (-4, 4), shifted
        by ``d`` off their mean), column scales ``s (dim,)``, the batch's row count ``n`` and the
        Chan cross row ``cross (dim,)``: ``Y += diag(s) (g^T g - n d d^T) diag(s) Omega + cross
        cross^T Omega``, the product in float32 (:func:`lowp_sketch_product`), the rank-1 terms in
        float64."""
        if g.is_cuda and caller_tf32():
            self.core_rtol = max(self.core_rtol, TF32_RTOL)
        self.y = self.y + sketch_increment(g[None], s[None], d[None], n, cross[None], self.omega[None], self.tf32)[0]

    def eig(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (r,), vectors (r, dim))`` with ``A ~= V^T diag(values) V``, values descending,
        r <= rank, on the sketch's device. Raises :class:`StatisticError` when ``Y`` holds
        non-finite values or cannot be factorised (see the class docstring)."""
        self.note = None
        dev = self.y.device
        y = self.y.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(y).all()):
            raise StatisticError("the sketch holds non-finite values")
        scale = float(y.abs().max())
        if scale == 0.0:
            return y.new_zeros(0).to(dev), y.new_zeros(0, self.dim).to(dev)
        y = y / scale  # A / scale: no under- or overflow below; eigenvalues scale back at the end
        om = self.omega.to("cpu", torch.float64)
        nu = math.sqrt(self.dim) * torch.finfo(torch.float64).eps * float(torch.linalg.matrix_norm(y))
        y_nu = y + nu * om
        c = om.T @ y_nu  # (k, k)
        w, v = _eigh(0.5 * (c + c.T), "the sketch's core Omega^T Y")
        top = float(w[-1])
        if not top > 0.0:
            raise StatisticError(f"the sketch's core has no positive eigenvalue (largest {top:.3g}): not PSD")
        keep = w > top * self.core_rtol
        b = (y_nu @ v[:, keep]) / torch.sqrt(w[keep])  # Y_nu C^+1/2: (dim, k')
        try:
            q, r = torch.linalg.qr(b)  # (dim, k'), (k', k')
        except RuntimeError as e:
            raise StatisticError(f"QR of the sketch failed ({_short(e)})") from None
        try:
            ur, sv, _ = torch.linalg.svd(r)
        except RuntimeError as e:  # the SVD of a small float64 matrix on the CPU: rare, but not never
            self.note = f"SVD of the sketch's R failed ({_short(e)}); eigh of R R^T used"
            ev, ur = _eigh(r @ r.T, "R R^T")
            ev, ur = ev.flip(0), ur.flip(1)
            sv = ev.clamp_min(0.0).sqrt()
        u = q @ ur  # (dim, k')
        lam = (sv * sv - nu).clamp_min(0.0) * scale
        if not bool(torch.isfinite(lam).all() and torch.isfinite(u).all()):
            raise StatisticError("the sketch's eigenpairs are not finite")
        n_pos = int((lam > lam[0] * 1e-14).sum()) if float(lam[0]) > 0 else 0
        r_ = min(self.rank, n_pos)
        return lam[:r_].to(dev), u[:, :r_].T.contiguous().to(dev)


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
        self._tf32 = precision == "tf32"
        self._gemm_dtype = torch.float32 if self._tf32 else getattr(torch, precision)
        self.sketch_rows = int(sketch_rows)
        self._gen = generator if generator is not None else torch.Generator().manual_seed(0)
        self.full = self.dim <= max_full_dim
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        self._n = torch.zeros((), **f64)  # rows merged, on the device (exact in float64 up to 2^53)
        self.mean = torch.zeros(self.dim, **f64)
        self.m2: torch.Tensor | None = torch.zeros(self.dim, self.dim, **f64) if self.full else None  # scatter
        self.m2d = torch.zeros(self.dim, **f64)  # its diagonal (never approximated: float64 sums, float32 for float32/tf32)
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
        xr = x.detach().reshape(-1, self.dim)
        nb = xr.shape[0]
        if nb == 0:
            return
        if xr.device != self.mean.device:
            xr = xr.to(self.mean.device)
        lowp = self._gemm_dtype != torch.float64
        if lowp:  # every pass over the rows in float32 (lowp_batch): the products on g, in (-4, 4)
            mb, m2d_b, m3_b, m4_b, g, sc, dg = lowp_batch(xr)
            xc = g
            m2_b = lowp_scatter(g[None], sc[None], dg[None], nb, self._tf32)[0] if self.full else None
        else:
            xb = xr.to(torch.float64)  # (rows, d)
            mb = xb.mean(0)  # (d,)
            xc = xb - mb  # (rows, d) centred within the batch
            xc2 = xc * xc
            m2d_b = xc2.sum(0)
            m3_b = (xc2 * xc).sum(0)
            m4_b = (xc2 * xc2).sum(0)
            m2_b = self._scatter(xc) if self.full else None  # (d, d)
        if ok is not None:  # a rejected batch: zero statistics and count (where, not *: NaN * 0 = NaN)
            ok = ok.to(self.mean.device)
            zero = torch.zeros((), dtype=torch.float64, device=self.mean.device)
            mb, m2d_b, m3_b, m4_b = (torch.where(ok, t, zero) for t in (mb, m2d_b, m3_b, m4_b))
            m2_b = None if m2_b is None else torch.where(ok, m2_b, zero)
            if not self.full:
                xc = torch.where(ok, xc, torch.zeros((), dtype=xc.dtype, device=xc.device))
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
            if lowp:  # the rows' product on g (float32), the shift's and the merge's rank-1 terms in float64
                if ok is not None:
                    sc, dg = torch.where(ok, sc, 1.0), torch.where(ok, dg, 0.0)
                self.sketch.append_lowp(self._sketch_rows(xc), sc, dg, nb_t, cross[0])
            else:
                self.sketch.append(torch.cat([self._sketch_rows(xc), cross]))  # float64: the sketch casts
        self.mean = self.mean + delta * (nb_t / n1)
        self._n = n

    def _scatter(self, xc: torch.Tensor) -> torch.Tensor:
        """The batch's scatter ``xc^T xc`` ``(d, d)`` float64, of rows centred on the batch mean
        (float32 products then do not cancel an offset). In float32 the rows are first scaled
        per feature by their largest ``|value|`` (``xc = G D``, ``G`` in [-1, 1]) and the product
        rescaled in float64, ``D (G^T G) D``: no float32 overflow (|x| > ~1e19) or underflow
        (|x| < ~1e-19) whatever the features' scales, each entry's rounding relative to
        ``sqrt(M2_ii M2_jj)``; ``D`` holds powers of two (:func:`pow2_scale`), so in range the
        result is the unscaled product's bit for bit."""
        if self._gemm_dtype == torch.float64:
            return xc.T @ xc
        col = pow2_scale(xc.abs().amax(0))  # (d,) a device tensor: no host sync
        g = (xc / col).to(self._gemm_dtype)
        return matmul(g.T, g, self._tf32).to(torch.float64) * torch.outer(col, col)

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
        m2c = m2.clamp_min(1e-300)
        k = self.n * (self.m4 / m2c) / m2c - 3.0  # divided twice: m2^2 overflows for |x| > ~1e77
        return torch.where(m2 > 0, k, torch.zeros_like(k))


def update_concat(moments: list[RunningMoments], x: torch.Tensor, ok: torch.Tensor, seg: torch.Tensor,
                  gen: torch.Generator) -> None:
    """Merge one batch into each of ``S`` streams at once, their rows side by side: ``x (rows,
    D)`` holds stream ``i``'s features at columns ``off_i .. off_i + dim_i`` (in ``moments``
    order, any dims, any mix of full and sketch streams), ``ok (S,)`` each stream's finite flag
    (False: not merged, as in :meth:`RunningMoments.update`), ``seg (D,)`` the stream of each
    column (a device tensor). The same Chan/Pebay merge as ``update``, feature by feature over
    all ``D`` columns in one kernel per operation (a collection's host cost is its kernel
    launches: one merge for every stream instead of one per stream); the scatter matrices
    and sketches by one batched GEMM per dim. Each stream ends where its own ``update`` would,
    up to float rounding; the new state is written back as views. No host sync. The streams
    must share ``precision`` and device; ``gen`` draws the sketches' row subsets."""
    m0 = moments[0]
    nb, d_all = x.shape
    sizes = [m.dim for m in moments]
    assert sum(sizes) == d_all and ok.shape == (len(moments),) and seg.shape == (d_all,)
    assert all(m.precision == m0.precision for m in moments)
    if nb == 0:
        return
    dev = m0.mean.device
    ok = ok.to(dev, non_blocking=True)
    okf = ok[seg]  # (D,) each column's stream's flag
    # a rejected stream's rows become zeros: its batch moments are exact zeros and its count 0,
    # so the merge below leaves its state exactly unchanged (where, not *: NaN * 0 = NaN). Each
    # pass over (rows, D) float64 is a GPU cost here (1.8 GB at large Wukong's 2,048 x 112k):
    # the masks go on the input's own dtype, and the sums of squares and fourth powers are norms
    # (no product materialised)
    lowp = m0._gemm_dtype != torch.float64
    if lowp:  # float32 passes only (lowp_batch); a rejected stream's statistics are masked below
        mb, m2d_b, m3_b, m4_b, g_all, sc_all, dg_all = lowp_batch(x.detach().to(dev))
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        mb, m2d_b, m3_b, m4_b, dg_all = (torch.where(okf, t, zero) for t in (mb, m2d_b, m3_b, m4_b, dg_all))
        sc_all = torch.where(okf, sc_all, 1.0)
        xc = g_all
    else:
        xb = torch.where(okf, x.detach().to(dev), 0.0).to(torch.float64)  # (rows, D)
        mb = xb.mean(0)  # (D,)
        xc = xb - mb  # (rows, D) centred within the batch
        m2d_b = torch.linalg.vector_norm(xc, 2, dim=0) ** 2
        m3_b = xc.pow(3).sum(0)
        m4_b = torch.linalg.vector_norm(xc, 4, dim=0) ** 4
    nbs = ok.to(torch.float64) * float(nb)  # (S,) rows merged per stream
    nas = stacked([m._n for m in moments])  # (S,)
    ns = nas + nbs
    n1s = ns.clamp_min(1.0)
    cs = nas * nbs / n1s  # (S,) the Chan cross weight
    na, nbf, n1 = nas[seg], nbs[seg], n1s[seg]  # (D,) per column
    mean, m2a, m3a, m4a = (concatenated(list(t)) for t in zip(*[(m.mean, m.m2d, m.m3, m.m4) for m in moments]))
    delta = mb - mean  # (D,)
    d2 = delta * delta
    c = cs[seg]
    m4 = (m4a + m4_b + d2 * d2 * (c * (na * na - na * nbf + nbf * nbf) / (n1 * n1))
          + 6.0 * d2 * (na * na * m2d_b + nbf * nbf * m2a) / (n1 * n1)
          + 4.0 * delta * (na * m3_b - nbf * m3a) / n1)
    m3 = m3a + m3_b + d2 * delta * (c * (na - nbf) / n1) + 3.0 * delta * (na * m2d_b - nbf * m2a) / n1
    m2d = m2a + m2d_b + d2 * c
    mean = mean + delta * (nbf / n1)
    offs = [0]
    for d in sizes:
        offs.append(offs[-1] + d)
    groups: dict[tuple[bool, int], list[int]] = {}  # the streams of one mode and dim: one batched GEMM
    for i, m in enumerate(moments):
        groups.setdefault((m.full, m.dim), []).append(i)

    def side(t: torch.Tensor, idx: list[int], d: int) -> torch.Tensor:  # (S_g, d) of a (D,) vector
        return torch.stack([t[offs[i]:offs[i] + d] for i in idx])

    for (full, d), idx in groups.items():
        delta_g = side(delta, idx, d)  # (S_g, d)
        c_g = pick(cs, idx)  # (S_g,)
        if full:
            if lowp:  # the float32 operands g of every full stream (in (-4, 4)), merged in place in float64
                g = torch.stack([g_all[:, offs[i]:offs[i] + d] for i in idx])  # (S_g, rows, d)
                g = torch.where(pick(ok, idx)[:, None, None], g, 0.0)  # a rejected stream adds nothing
                m2 = stacked([moments[i].m2 for i in idx])  # type: ignore[misc]
                _merge_scatter_lowp(m2, g, side(sc_all, idx, d), side(dg_all, idx, d), nb, delta_g, c_g, m0._tf32)
                for i, t in zip(idx, m2.unbind(0)):
                    moments[i].m2 = t
                continue
            else:
                xc_g = torch.stack([xc[:, offs[i]:offs[i] + d] for i in idx])  # (S_g, rows, d)
                m2_b = xc_g.transpose(1, 2) @ xc_g
            m2 = stacked([moments[i].m2 for i in idx]) + m2_b + delta_g[:, :, None] * delta_g[:, None, :] * c_g[:, None, None]  # type: ignore[misc]
            for i, t in zip(idx, m2.unbind(0)):
                moments[i].m2 = t
            continue
        rows = torch.stack([xc[:, offs[i]:offs[i] + d] for i in idx])  # (S_g, rows, d)
        sk_rows = moments[idx[0]].sketch_rows
        if nb > sk_rows:  # each stream its own random rows, reweighted (as RunningMoments._sketch_rows)
            sel = torch.randint(nb, (len(idx), sk_rows), generator=gen, device=gen.device).to(dev, non_blocking=True)
            rows = rows.gather(1, sel[:, :, None].expand(-1, -1, d)) * math.sqrt(nb / sk_rows)
        cross = (delta_g * torch.sqrt(c_g)[:, None])[:, None, :]  # (S_g, 1, d) the Chan cross term
        sketches: list[NystromSketch] = [moments[i].sketch for i in idx]  # type: ignore[misc]
        if lowp:  # a rejected stream's (NaN) increment is masked, not its rows: (S, d, k) is small
            _append_many_lowp(sketches, rows, side(sc_all, idx, d), side(dg_all, idx, d), pick(nbs, idx), cross[:, 0],
                              pick(ok, idx))
        else:
            _append_many(sketches, torch.cat([rows, cross], 1))
    for i, m in enumerate(moments):
        a, b = offs[i], offs[i + 1]
        m.mean, m.m2d, m.m3, m.m4, m._n = mean[a:b], m2d[a:b], m3[a:b], m4[a:b], ns[i]


def _merge_scatter_lowp(m2: torch.Tensor, g: torch.Tensor, s: torch.Tensor, d: torch.Tensor, nb: int,
                        delta: torch.Tensor, c: torch.Tensor, tf32: bool) -> None:
    """``m2 (S, d, d)`` float64 += the batch's scatter of ``g (S, rows, d)`` (:func:`lowp_scatter`)
    and the Chan cross term ``c delta delta^T``, in place: ``diag(s) g^T g diag(s)`` then both
    rank-1 terms by one rank-2 ``baddbmm`` (``c delta delta^T - n (d s)(d s)^T``). Five passes
    over ``(S, d, d)`` where building each term apart took a dozen (issue 22: large Wukong has 25
    full 2,048-dim streams, 840 MB of float64 a pass)."""
    t = matmul(g.transpose(1, 2), g, tf32).to(torch.float64)
    t.mul_(s[:, :, None])
    t.mul_(s[:, None, :])
    a = delta * torch.sqrt(c)[:, None]  # (S, d)
    b = d * s * math.sqrt(nb)
    t.baddbmm_(torch.stack([a, b], 2), torch.stack([a, -b], 1))
    m2.add_(t)


def _append_many_lowp(sketches: list[NystromSketch], g: torch.Tensor, s: torch.Tensor, d: torch.Tensor,
                      n: torch.Tensor, cross: torch.Tensor, ok: torch.Tensor) -> None:
    """:meth:`NystromSketch.append_lowp` of ``S`` sketches of one dim at once (``g (S, r, dim)``,
    ``s, d, cross (S, dim)``, ``n (S,)``); a stream whose ``ok (S,)`` is False keeps its ``Y``."""
    sk = sketches[0]
    if g.is_cuda and caller_tf32():
        for s_ in sketches:
            s_.core_rtol = max(s_.core_rtol, TF32_RTOL)
    omega = stacked([s_.omega for s_ in sketches])  # (S, dim, k)
    inc = sketch_increment(g, s, d, n, cross, omega, sk.tf32)
    y = stacked([s_.y for s_ in sketches]) + torch.where(ok[:, None, None], inc, 0.0)
    for s_, t in zip(sketches, y.unbind(0)):
        s_.y = t


def _append_many(sketches: list[NystromSketch], rows: torch.Tensor) -> None:
    """:meth:`NystromSketch.append` of ``rows (S, r, dim)`` to ``S`` sketches of one dim at once."""
    sk = sketches[0]
    omega = torch.stack([s.omega for s in sketches])  # (S, dim, k)
    y = stacked([s.y for s in sketches])
    if sk.gemm_dtype == torch.float64:
        r64 = rows.to(torch.float64)
        y = y + r64.transpose(1, 2) @ (r64 @ omega)
    else:
        if rows.is_cuda and caller_tf32():
            for s in sketches:
                s.core_rtol = max(s.core_rtol, TF32_RTOL)
        r64 = rows.to(torch.float64)
        col = pow2_scale(r64.abs().amax(1))  # (S, dim)
        smax = col.amax(1)  # (S,)
        g = (r64 / col[:, None, :]).to(sk.gemm_dtype)
        om = ((col / smax[:, None])[:, :, None] * omega).to(sk.gemm_dtype)  # (S, dim, k)
        prod = matmul(g.transpose(1, 2), matmul(g, om, sk.tf32), sk.tf32)
        y = y + prod.to(torch.float64) * (col[:, :, None] * smax[:, None, None])
    for s, t in zip(sketches, y.unbind(0)):
        s.y = t
