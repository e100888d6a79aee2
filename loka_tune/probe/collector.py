"""The online half of the probe: hooks that collect statistics during real training.

>>> with Probe(model, every=100) as p:          # doctest: +SKIP
...     for batch in batches: train_step(model, batch)
>>> p.stats.save("probe_stats.npz")             # doctest: +SKIP

Step counting: with ``step_on="forward"`` (default) every forward call of ``model`` in
training mode counts as one step; with ``step_on="manual"`` the training loop calls
``p.step()`` after each optimizer step; with ``step_on="batch"`` it calls
``p.step(*inputs, target=labels)`` with the step's batch (below). Steps ``every``,
``2 every``, ... (counted from 1) are *collections*: in the training forward of such a step
(``"forward"``, ``"manual"``) the probe

- installs a forward hook on every site for that one forward (removed by a hook on the
  model's forward when it returns), which merges the site's input ``X`` rows into its
  :class:`~loka_tune.probe.moments.RunningMoments` and registers a tensor hook on the
  site's output, which merges the output gradient ``dY`` during the backward pass;
- folds every site's current weight into its matrix-normal model.

Between collections no per-site hook exists. With ``step_on="manual"`` no hook exists at all:
:meth:`Probe.step` counts, and installs the root hooks only for the collection's forward
(they remove themselves when it returns), so a step that does not collect runs the model
untouched (a hook-free module keeps its fast call path); the collection's own training
forward, though, would re-guard a compiled model.
With ``step_on="forward"`` one forward pre-hook and one forward hook on the root module count
the steps.

A compiled (or CUDA-graph) training step: ``step_on="batch"``. The training step is never
hooked; on a collection step, :meth:`Probe.step` runs the probe's *own* forward and backward
of a random sub-batch of the step's batch (``sub_batch`` examples, default ``max_rows``: 2,048
on a GPU, 65,536 on the CPU) on the uncompiled module (``Probe(torch.compile(m))`` is
unwrapped to ``m``: the same parameters), with the site hooks installed for that forward
only, and takes ``dY`` by ``torch.autograd.grad`` w.r.t. the sites' outputs of the loss
scaled by ``rows / batch`` (each row's gradient as in the full batch's mean loss; no
parameter gradient is formed). The compiled graph never sees a hook, and training is
untouched (global RNG and BatchNorm statistics restored). Its cost is that forward and a
backward without weight gradients on ``sub_batch`` rows, eager, plus the statistics; these
are of a simple random sample of the batch's rows (error bound in
:meth:`Probe._collect_side`), and the amax is the sub-batch's, not the whole batch's.

The accumulators are allocated on the first step (a warm-up step of any timed loop), so the
first collection costs what the others do. A collection itself is kept cheap: float64 moments of the rows (a ``(d, d)`` GEMM per
tensor up to 2048 features, a streaming Nystrom sketch (two GEMMs) above), the weight
model by two float32 GEMMs (moment estimators), quantiles and kurtosis on subsamples, at
most ``max_rows`` rows per tensor (a random subset above). On a GPU the defaults are cheaper
still (issue 13): 2,048 random rows per tensor and the moment GEMMs in float32 on centred
rows, merged in float64 (``max_rows`` / ``precision``); the CPU keeps 65,536 rows and
float64. On a GPU the collection
never reads a value back to the host (finite checks, counters, amax and quantiles stay
device tensors until :attr:`Probe.stats`; the weight model's finite and moved flags are device
masks), so it does not stall the training loop (``weight_flip_flop >= 1`` reads its flags:
it inverts factors anyway). ``Probe(profile=True)`` times each site's
collection (``benchmarks/probe_collect_cost.py``) and a side collection's forward and backward
(``"side.forward_backward"``). Inputs with leading dims (3-D
activations) are flattened into rows: each row is one independent draw of the feature vector.

Non-finite batches: a collected ``X`` or ``dY`` holding NaN/inf is *not merged* (it would
poison the running moments) and is counted per site (``TensorStats.nonfinite``); training
goes on. :meth:`ProbeStats.check` (run by :func:`loka_tune.probe.measure`) then raises a
:class:`ProbeError` naming those layers, unless the caller asks to skip them.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.errors import ProbeError
from loka_tune.probe.graphs import Pinned, SideGraph, capture, graphs_supported
from loka_tune.probe.moments import (
    DEFAULT_SKETCH_RANK,
    MAX_FULL_DIM,
    PRECISIONS,
    RunningMoments,
    StatisticError,
    on_device,
    pick,
    random_rows,
    stacked,
    update_concat,
)
from loka_tune.probe.stats import QUANTILES, ProbeStats, SiteStats, TensorStats, WeightStats, find_sites
from loka_tune.probe.weights import MatrixNormalEMA
from loka_tune.probe.weights import update_many as update_weights

__all__ = ["Probe"]

QUANTILE_SAMPLE = 1 << 16  # elements of |x| subsampled per collection for the quantiles
REAL_ROWS = 256  # rows of the last batch kept per site for "real" replay (float32)
MAX_ROWS = 1 << 16  # rows of X / dY merged per collection and site on the CPU (a random subset above)
CUDA_MAX_ROWS = 2048  # the same on a GPU (issue 13: a collection's cost is its products; see Probe)
SIDE_WEIGHT_EVERY = 8  # a side collection on a GPU folds the weights in at every 8th collection (issue 22)
STEP_ON = ("forward", "manual", "batch")  # how the probe counts steps (see Probe)


def _resolve(device: torch.device, max_rows: int | None, precision: str, side: bool = False) -> tuple[int, str]:
    """The ``(max_rows, precision)`` a stream on ``device`` uses: ``None`` / ``"auto"`` mean the
    CPU defaults (65,536 rows, float64: what the probe always did there) on the CPU and the
    cheap ones (2,048 random rows, float32 products; TF32 products for a side collection,
    ``side``: the compiled production step's budget, issue 22) on any accelerator."""
    cpu = device.type == "cpu"
    rows = max_rows if max_rows is not None else (MAX_ROWS if cpu else CUDA_MAX_ROWS)
    prec = precision if precision != "auto" else ("float64" if cpu else "tf32" if side else "float32")
    return rows, prec


class _StreamAcc:
    """Accumulators of one operand stream (x or dy) of one site.

    On a GPU nothing here reads a value back to the host while training runs: the finite
    check, the counters, amax and the quantile sums stay device tensors, read at
    :meth:`snapshot`.
    """

    def __init__(self, dim: int, max_full_dim: int, sketch_rank: int, max_rows: int | None,
                 precision: str = "auto", side: bool = False) -> None:
        self.dim, self.max_full_dim, self.sketch_rank = dim, max_full_dim, sketch_rank
        self.max_rows_arg, self.precision_arg, self.side = max_rows, precision, side
        self.max_rows, self.precision = _resolve(torch.device("cpu"), max_rows, precision)  # set on allocate
        self.moments: RunningMoments | None = None  # created on first data (on its device)
        self.batches: torch.Tensor | int = 0  # merged batches (device counter once data came)
        self.nonfinite: torch.Tensor | int = 0  # rejected batches
        self.rows = 0
        self.amax: torch.Tensor | float = 0.0
        self.absq_sum: torch.Tensor | np.ndarray = np.zeros(len(QUANTILES))
        self.real: torch.Tensor | None = None

    def allocate(self, device: torch.device, gen: torch.Generator) -> None:
        """Create the accumulators on ``device`` (once; the probe does it on its first step, so
        that the first collection costs what the others do)."""
        if self.moments is not None:
            return
        self.max_rows, self.precision = _resolve(torch.device(device), self.max_rows_arg, self.precision_arg, self.side)
        self.moments = RunningMoments(
            self.dim, max_full_dim=self.max_full_dim, sketch_rank=self.sketch_rank, device=device, generator=gen,
            precision=self.precision,
        )
        self.batches = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.amax = torch.zeros((), dtype=torch.float64, device=device)
        self.absq_sum = torch.zeros(len(QUANTILES), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, gen: torch.Generator, real_idx: torch.Tensor | None,
            rows: int | None = None) -> None:
        """Merge rows ``x (rows, dim)``; a batch holding NaN/inf is not merged (and counted).
        ``rows``: the rows of the real call these stand for (a side collection's sub-batch
        stands for the whole batch: the site's M); default ``x``'s own."""
        x, ok = self.prepare(x, gen, real_idx, rows)
        assert self.moments is not None
        self.moments.update(x, ok)
        self.batches += ok.long()
        self.nonfinite += (~ok).long()
        flat = x.reshape(-1)
        if flat.numel() == 0:
            return
        if flat.numel() > QUANTILE_SAMPLE:
            flat = flat[random_rows(flat.numel(), QUANTILE_SAMPLE, gen, flat.device)]
        ax = flat.abs().to(torch.float64 if flat.dtype == torch.float64 else torch.float32)  # no overflow
        zero = torch.zeros((), dtype=ax.dtype, device=ax.device)
        q = torch.quantile(torch.where(ok, ax, zero), on_device(QUANTILES, ax))
        self.absq_sum += q.double()

    def prepare(self, x: torch.Tensor, gen: torch.Generator, real_idx: torch.Tensor | None,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a merge of ``x`` needs per stream: the finite flag and the whole call's amax
        (one pass), the real rows, the site's M, and at most ``max_rows`` rows drawn at random;
        returns ``(rows to merge, ok)``. :meth:`add` merges them; a side collection merges the
        streams together (:meth:`Probe._merge_side`)."""
        x = x.detach()
        # one memory-bound pass gives the finite check and the whole batch's amax (what a
        # tensor-wise FP8 scale sees): the inf-norm is NaN/inf iff some element is
        amax = torch.linalg.vector_norm(x, float("inf")).double() if x.numel() else None
        ok = torch.isfinite(x).all() if amax is None else amax < math.inf  # NaN and inf fail: one kernel
        self.allocate(x.device, gen)
        self.rows = x.shape[0] if rows is None else int(rows)
        if real_idx is not None:  # the same rows of X and dY: taken before any subsampling
            self.real = torch.where(ok, x[real_idx.to(x.device, non_blocking=True)].float(), torch.nan)
        if amax is not None:
            assert isinstance(self.amax, torch.Tensor)  # a device scalar since the first data
            self.amax = torch.maximum(self.amax, torch.where(ok, amax, torch.zeros_like(amax)))
        if x.shape[0] > self.max_rows:  # a random subset of the rows (i.i.d. draws of the feature vector)
            x = x[random_rows(x.shape[0], self.max_rows, gen, x.device)]
        return x, ok

    def snapshot(self) -> TensorStats:
        """The stream's :class:`TensorStats`. Never raises on the data: a covariance or sketch
        that cannot be formed falls back to the exact diagonal, a non-finite kurtosis to 0,
        each recorded in ``TensorStats.fallbacks``; non-finite means or variances (float64
        overflow, ``|x| > ~1e154``) stay in the stats, whose :meth:`~TensorStats.problem` then
        names them (the site is left unprobed)."""
        batches, nonfinite = int(self.batches), int(self.nonfinite)
        t = TensorStats(dim=self.dim, batches=batches, nonfinite=nonfinite, rows=self.rows, amax=float(self.amax))
        m = self.moments
        if m is None or m.n == 0:
            return t
        t.count = m.n
        t.mean = m.mean.cpu().numpy()
        t.var = m.variance().cpu().numpy()
        if not (np.all(np.isfinite(t.mean)) and np.all(np.isfinite(t.var))):
            t.fallbacks["var"] = ("non-finite mean or variance (float64 overflow: |x| above ~1e154);"
                                  " no statistic of this stream is usable")
        elif m.full:
            c = m.covariance()
            cov = (0.5 * (c + c.T)).cpu().numpy()  # exactly symmetric (files keep one triangle)
            if np.all(np.isfinite(cov)):
                t.cov = cov
            else:
                t.fallbacks["cov"] = "non-finite covariance; the exact diagonal stands in"
                t.lr_vals, t.lr_vecs = np.zeros(0), np.zeros((0, self.dim))
        else:
            try:
                vals, vecs = m.low_rank()
                t.lr_vals, t.lr_vecs = vals.cpu().numpy(), vecs.cpu().numpy()
                assert m.sketch is not None
                if m.sketch.note:
                    t.fallbacks["lowrank"] = m.sketch.note
            except StatisticError as e:
                t.fallbacks["lowrank"] = f"{e}; the exact diagonal stands in"
                t.lr_vals, t.lr_vecs = np.zeros(0), np.zeros((0, self.dim))
        kurt = m.excess_kurtosis().cpu().numpy()
        if not np.all(np.isfinite(kurt)):
            bad = int(np.sum(~np.isfinite(kurt)))
            t.fallbacks["kurtosis"] = (f"{bad} feature(s) with a non-finite kurtosis (float64 overflow of"
                                       " the 4th moment: |x| above ~1e77), set to 0")
            kurt = np.where(np.isfinite(kurt), kurt, 0.0)
        t.kurtosis = kurt
        assert isinstance(self.absq_sum, torch.Tensor)  # a device tensor since the first data
        t.absq = (self.absq_sum / max(batches, 1)).cpu().numpy()
        real = None if self.real is None else self.real.cpu()
        t.real = None if real is None or not bool(torch.isfinite(real).all()) else real.numpy()
        return t


class _Site:
    def __init__(self, name: str, mod: nn.Linear, probe: "Probe") -> None:
        self.name, self.mod = name, mod
        k, n = mod.in_features, mod.out_features
        side = probe.step_on == "batch"
        self.x = _StreamAcc(k, probe.max_full_dim, probe.sketch_rank, probe.max_rows, probe.precision, side)
        self.dy = _StreamAcc(n, probe.max_full_dim, probe.sketch_rank, probe.max_rows, probe.precision, side)
        self.w: MatrixNormalEMA | None = None
        self.w_amax: torch.Tensor | float = 0.0  # device tensors once allocated (read at snapshot)
        self.w_absq: torch.Tensor | np.ndarray = np.zeros(len(QUANTILES))
        self.w_kurt: torch.Tensor | float = 0.0
        self.w_nonfinite: torch.Tensor | int = 0
        self.real_at = -1  # the collection whose batch ``x.real`` / ``dy.real`` hold
        self.w_lazy = False  # weight amax / quantiles / kurtosis from ``w.last`` when read (side collections)


class Probe:
    """Collect per-site statistics of ``model`` during training (see the module docstring).

    Args:
        model: the model; its eligible linears (:func:`find_sites`) are the sites.
        every: collect once every ``every`` steps (default 100).
        step_on: ``"forward"`` (each training-mode forward of ``model`` is a step),
            ``"manual"`` (call :meth:`step` after each training step: no hook at all on the
            steps that do not collect) or ``"batch"`` (call ``step(*inputs, target=labels)``
            after each training step with its batch: a collection is the probe's own forward
            and backward of a sub-batch on the uncompiled module; for ``torch.compile`` and
            CUDA-graph steps, whose graphs then never see a hook).
        sites: optional names or ``re:<regex>`` patterns restricting the sites.
        keep_real: keep the last collected batch of each site (``real_rows`` random rows of X
            and the same rows of dY) for "real" replay.
        max_rows: rows of X and dY merged per collection and site; a batch with more rows (a
            3-D input flattens to batch x tokens rows) merges ``max_rows`` of them drawn at
            random with replacement: the moments estimate the same distribution at a bounded
            cost (and are exact, for any batch split, below the cap). ``None`` (default):
            65,536 on the CPU, 2,048 on a GPU (:data:`CUDA_MAX_ROWS`): the moments accumulate
            over collections, so 2,048 rows x 10 collections already pin a covariance to a
            few percent (``tests/test_probe_cheap.py``), and a collection of large Wukong
            (B = 8192) merges a quarter of each batch. The amax is the whole batch's.
        precision: dtype of a collection's batch pass and products (the ``(d, d)`` scatter GEMM
            and the sketch's GEMMs): ``"float64"``, ``"float32"`` (rows scaled and shifted in
            float32, the shift's rounding corrected and the results merged in float64:
            :func:`~loka_tune.probe.moments.lowp_batch`; TF32 if the caller enabled it),
            ``"tf32"`` (the same on TF32 tensor cores, the weight model's GEMMs too; the CPU
            emulates it) or ``"auto"`` (default): float64 on the CPU, float32 on a GPU, where
            float64 GEMMs run 15-30x slower, tf32 for ``step_on="batch"`` on a GPU (a
            relative error ~1e-3 against a sampling error of ~3% at 2,048 rows:
            ``tests/test_probe_compiled.py``). See :mod:`loka_tune.probe.moments`.
        max_full_dim: feature dims above it keep diagonal + low-rank statistics.
        sketch_rank: rank of that low-rank sketch.
        weight_ema: EMA factor of the weight model.
        weight_flip_flop: 0 (default) fits the weight model's factors by their moment
            estimators (two GEMMs per collection); k >= 1 runs k flip-flop MLE steps per
            collection instead (inverts both factors: costly on wide layers). See
            :mod:`loka_tune.probe.weights`.
        weight_every: fold the weights into the weight model at every ``weight_every``-th
            collection (the first always): weights move slowly between collections ``every``
            steps apart, while folding in large Wukong's weights costs ~35-50 ms on an H200 (a
            compiled step is 37 ms). ``None`` (default): 8 for ``step_on="batch"`` on an
            accelerator (:data:`SIDE_WEIGHT_EVERY`), else 1 (every collection).
        seed: seeds the subsampling (quantiles, real rows).
        profile: record the seconds each site's collection takes (device-synchronised) in
            :attr:`timings` (``"<site>.x"``, ``"<site>.dy"``, ``"<site>.w"``, and
            ``"side.forward_backward"`` with ``step_on="batch"``, summed over collections):
            what ``benchmarks/probe_collect_cost.py`` reports.
        sub_batch: ``step_on="batch"``: examples of the step's batch a collection runs on, drawn
            at random without replacement (the whole batch when it is not larger); ``None``
            (default): ``max_rows`` (2,048 on a GPU: the rows the in-step collection merges
            there anyway; 65,536 on the CPU). Fewer rows cost less but move the verdicts: at
            1,024 of 8,192 rows a tensorwise wgrad MERE on replay moved by 5.3% on average over
            three probe seeds (the bar is 5%; ``tests/test_probe_cheap.py`` at 2,048: within).
        warm_up: ``step_on="batch"`` on an accelerator: the first :meth:`step` runs one side
            collection and discards it (kernels load, buffers are allocated: a one-off ~0.2 s on
            an H200), so that no real collection pays for it. No effect on the CPU.
        loss_fn: ``step_on="batch"``: ``loss_fn(output, target)``, the training loss as a mean
            over the batch's rows (default: binary cross-entropy on logits, the trainer's).
        graphs: ``step_on="batch"`` on a CUDA GPU: run a side collection's statistics as one
            CUDA graph, captured at the warm-up (without one: at the second collection of the
            same shapes) and replayed by every collection (~2,000 launches, ~30 ms of host time
            on large Wukong, become one; :mod:`loka_tune.probe.graphs`). ``None``
            (default) or ``True``: where supported (a capture that fails warns once and stays
            eager: :attr:`graph_note`); ``False``: always eager.
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 100,
        *,
        step_on: str = "forward",
        sites: Iterable[str] | None = None,
        keep_real: bool = True,
        real_rows: int = REAL_ROWS,
        max_rows: int | None = None,
        precision: str = "auto",
        max_full_dim: int = MAX_FULL_DIM,
        sketch_rank: int = DEFAULT_SKETCH_RANK,
        weight_ema: float = 0.5,
        weight_flip_flop: int = 0,
        weight_every: int | None = None,
        seed: int = 0,
        profile: bool = False,
        sub_batch: int | None = None,
        warm_up: bool = True,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        graphs: bool | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"Probe needs an nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ProbeError(f"every must be a positive integer (collect every N steps), got {every=!r}")
        if step_on not in STEP_ON:
            raise ProbeError(f"step_on must be one of {STEP_ON}, got {step_on=!r}")
        compiled = _orig_module(model)
        if compiled is not None:
            if step_on != "batch":
                raise ProbeError(
                    f"{type(compiled).__name__} is torch.compile'd: the hooks of step_on={step_on!r} would"
                    " re-guard (recompile) it on every collection; use step_on='batch' and call"
                    " probe.step(*inputs, target=labels) after each step (collections then run on the"
                    " uncompiled module: the compiled graph never sees a hook)")
            model = compiled  # the module the user compiled: the same parameters, no dynamo frame
        if sub_batch is not None and (isinstance(sub_batch, bool) or not isinstance(sub_batch, int) or sub_batch < 1):
            raise ProbeError(f"sub_batch must be a positive integer (examples per side collection) or None"
                             f" for the device's default, got {sub_batch=!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ProbeError(f"loss_fn must be callable as loss_fn(output, target) -> mean loss, got {loss_fn!r}")
        if not 0.0 < weight_ema <= 1.0:
            raise ProbeError(f"weight_ema must be in (0, 1], got {weight_ema=!r}")
        if isinstance(weight_flip_flop, bool) or not isinstance(weight_flip_flop, int) or weight_flip_flop < 0:
            raise ProbeError(f"weight_flip_flop must be an integer >= 0, got {weight_flip_flop=!r}")
        if weight_every is not None and (isinstance(weight_every, bool) or not isinstance(weight_every, int)
                                         or weight_every < 1):
            raise ProbeError(f"weight_every must be a positive integer (weights at every k-th collection),"
                             f" got {weight_every=!r}")
        if max_full_dim < 1 or sketch_rank < 1 or real_rows < 1 or (max_rows is not None and max_rows < 1):
            raise ProbeError(f"max_full_dim, sketch_rank, real_rows and max_rows must be >= 1 (max_rows: or None"
                             f" for the device's default), got {max_full_dim=}, {sketch_rank=}, {real_rows=}, {max_rows=}")
        if graphs is not None and not isinstance(graphs, bool):
            raise ProbeError(f"graphs must be True, False or None (where supported), got {graphs=!r}")
        if precision not in ("auto", *PRECISIONS):
            raise ProbeError(f"precision must be 'auto', 'float64', 'float32' or 'tf32' (the dtype of a"
                             f" collection's products), got {precision=!r}")
        self.model, self.every, self.step_on = model, every, step_on
        self.keep_real, self.real_rows = keep_real, int(real_rows)
        self.max_rows, self.precision = (None if max_rows is None else int(max_rows)), precision
        self.max_full_dim, self.sketch_rank, self.weight_ema = int(max_full_dim), int(sketch_rank), weight_ema
        self.weight_flip_flop = weight_flip_flop
        self.weight_every = None if weight_every is None else int(weight_every)
        found = find_sites(model)
        if sites is not None:
            found = _select(found, list(sites))
        if not found:
            raise ProbeError(
                f"{type(model).__name__} has no eligible nn.Linear layer"
                + ("" if sites is None else f" matching {list(sites)!r}")
                + ": the probe watches linear layers (nn.Linear and subclasses)"
            )
        self._sites = {name: _Site(name, mod, self) for name, mod in found.items()}
        self._gen = torch.Generator().manual_seed(seed)
        self._seed = int(seed)
        self.steps = 0  # training steps counted
        self.collections = 0
        self._due = False
        self._attached = False
        self._root_handles: list[Any] = []
        self._site_handles: list[Any] = []
        self.profile = bool(profile)
        self.timings: dict[str, float] = {}
        self.sub_batch, self.loss_fn, self.warm_up = sub_batch, loss_fn, bool(warm_up)
        self._segs: dict[tuple[Any, ...], torch.Tensor] = {}  # side collections' column layouts
        self.graphs = graphs
        self._graph: SideGraph | None = None  # the side statistics' CUDA graph (loka_tune.probe.graphs)
        self._graph_error: str | None = None
        self._seen_layout: Any = None  # the last eager side collection's layout (captured on its next sight)
        self._stash: tuple[Any, ...] | None = None  # the warm-up's statistics inputs, for its capture
        self._norms = [m for m in model.modules()
                       if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Probe":
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def attach(self) -> "Probe":
        """Install the root hooks (idempotent; ``step_on="manual"``: only when a collection is due;
        ``step_on="batch"``: none, ever)."""
        self._attached = True
        if self.step_on == "batch":
            return self  # no hook on the model, ever: collections run in step() on the step's batch
        if self.step_on == "manual" and (self.steps + 1) % self.every == 0:
            self._due = True  # every=1: the first step collects
        if self.step_on == "forward" or self._due:
            self._arm()
        return self

    def _arm(self) -> None:
        if not self._root_handles:
            self._root_handles = [
                self.model.register_forward_pre_hook(self._pre),
                self.model.register_forward_hook(self._post),
            ]

    def detach(self) -> None:
        """Remove every hook the probe installed; the collected statistics stay."""
        self._attached = False
        self._disarm()

    def _disarm(self) -> None:
        self._remove_site_hooks()
        for h in self._root_handles:
            h.remove()
        self._root_handles = []

    @property
    def site_names(self) -> list[str]:
        return list(self._sites)

    def step(self, *inputs: Any, target: Any = None) -> None:
        """Count one training step, after it ran (``step_on="manual"`` or ``"batch"``).

        ``step_on="batch"``: pass the step's model inputs (``model(*inputs)``) and ``target``
        (its labels); on a collection step (``every``, ``2 every``, ...) the probe runs its own
        forward and backward of a random sub-batch of them on the uncompiled module (see
        :meth:`_collect_side`). ``step_on="manual"`` takes no arguments: the next training
        forward collects.
        """
        if self.step_on == "forward":
            raise ProbeError("Probe.step() is for step_on='manual' or 'batch'; this probe counts forward calls")
        if self.step_on == "manual" and (inputs or target is not None):
            raise ProbeError("Probe.step() of step_on='manual' takes no inputs (the next training forward"
                             " collects); to collect from the step's batch use step_on='batch'")
        if self.step_on == "batch" and not inputs:
            raise ProbeError("Probe.step() of step_on='batch' needs the step's inputs:"
                             " probe.step(*inputs, target=labels), as the model is called, model(*inputs)")
        self.steps += 1
        if self.steps == 1:
            self._allocate()
            if self._wants_warm_up():
                self._warm_up_side(inputs, target)
        if self.step_on == "batch":
            if self._due or self.steps % self.every == 0:
                self._due = False
                self._collect_side(inputs, target)
            return
        if (self.steps + 1) % self.every == 0:  # the next step is step k * every: it collects
            self.collect_next()

    def collect_next(self) -> None:
        """Make the next training-mode forward (``step_on="batch"``: the next :meth:`step`) a
        collection, whatever the step count."""
        self._due = True
        if self._attached and self.step_on != "batch":
            self._arm()

    def _on_device_rng(self) -> None:
        """Draw the collections' random rows and elements on the sites' accelerator: a CUDA
        generator seeded with ``seed`` replaces the CPU one before anything is allocated. On a
        GPU, drawing ~10^7 indices a collection on the host and copying them over cost ~70 ms
        of host time, twice the H200's compiled large-Wukong step (issue 22); on the device they
        are a few kernels. A CPU probe keeps its CPU generator (and its draws)."""
        dev = self._device()
        if dev.type != "cpu" and self._gen.device != dev:
            self._gen = torch.Generator(device=dev).manual_seed(self._seed)

    def _weights_due(self) -> bool:
        """Whether this collection (already counted) folds in the weights (``weight_every``)."""
        k = self.weight_every
        if k is None:
            k = SIDE_WEIGHT_EVERY if self.step_on == "batch" and self._device().type != "cpu" else 1
        return (self.collections - 1) % k == 0

    def _wants_warm_up(self) -> bool:
        """Whether the first step runs :meth:`_warm_up_side`: side collections on an accelerator."""
        return self.step_on == "batch" and bool(self.warm_up) and self._device().type != "cpu"

    def _warm_up_side(self, inputs: tuple[Any, ...], target: Any) -> None:
        """``step_on="batch"`` on an accelerator, at the first step: one side collection whose
        statistics are then discarded (every site's accumulators made anew, the generator
        re-seeded). The first forward and backward of the uncompiled module loads its CUDA
        kernels and the collection's buffers come from the driver (~0.2 s once on an H200, six
        times a steady collection): paid here, the first real collection costs what the others
        do."""
        self._stash = ()
        self._collect_side(inputs, target)
        stash, self._stash = self._stash, None
        layout, self._seen_layout = self._seen_layout, None
        self.collections = 0
        self._sites = {name: _Site(name, site.mod, self) for name, site in self._sites.items()}
        self._gen.manual_seed(self._seed)
        self._allocate()
        self._seen_layout = key = self._relayout(layout)
        if key is not None and stash and self._graph is None and self._graph_wanted():
            # captured on the warm-up's rows and the fresh state: nothing runs until the first real
            # collection replays it (so that one costs what the others do)
            tensors, want, rows, full = stash
            self._capture_side([self._sites[n] for n in key[0]], list(tensors), list(want), rows, full, key)

    def _relayout(self, key: Any) -> Any:
        """A layout key of :meth:`_side_stats` for the current sites (the same names, their new
        accumulators): what the warm-up's layout is once its statistics are discarded."""
        if key is None:
            return None
        names = key[0]
        return (names, tuple(id(self._sites[n].x) for n in names), *key[2:])

    def _allocate(self) -> None:
        """Every site's accumulators, on its weight's device (see the module docstring)."""
        self._on_device_rng()
        for site in self._sites.values():
            dev = site.mod.weight.device
            site.x.allocate(dev, self._gen)
            site.dy.allocate(dev, self._gen)
            self._allocate_weight(site)
            if not torch.is_tensor(site.w_nonfinite):
                self._allocate_weight_acc(site, dev)

    def _allocate_weight(self, site: _Site) -> None:
        if site.w is None:
            w = site.mod.weight
            prec = _resolve(w.device, self.max_rows, self.precision, self.step_on == "batch")[1]
            site.w = MatrixNormalEMA(
                w.shape[0], w.shape[1], ema=self.weight_ema, flip_flop=self.weight_flip_flop,
                max_full_dim=self.max_full_dim, device=w.device, generator=self._gen, tf32=prec == "tf32",
            )

    # ------------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args: Any) -> None:
        self._remove_site_hooks()  # a forward that raised may have left some
        if not module.training:
            return
        if self.step_on == "forward":
            self.steps += 1
            if self.steps == 1:
                self._allocate()
            if self.steps % self.every == 0:
                self._due = True
        if not self._due:
            return
        self._due = False
        self.collections += 1
        self._on_device_rng()
        if self._weights_due():
            self._collect_weights()
        for site in self._sites.values():
            self._site_handles.append(site.mod.register_forward_hook(self._make_hook(site)))

    def _collect_weights(self) -> None:
        with torch.no_grad(), _exact(self._device()):
            for site in self._sites.values():
                with self._timed(f"{site.name}.w", site.mod.weight):
                    self._collect_weight(site)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._remove_site_hooks()
        if self.step_on == "manual" and module.training and not self._due:
            self._disarm()  # the collection's forward is done: hook-free until the next one

    def _remove_site_hooks(self) -> None:
        for h in self._site_handles:
            h.remove()
        self._site_handles = []

    def _make_hook(self, site: _Site) -> Callable[..., None]:
        def hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not inputs or not torch.is_tensor(inputs[0]) or not torch.is_tensor(output):
                return
            with torch.no_grad(), _exact(inputs[0].device), self._timed(f"{site.name}.x", inputs[0]):
                x = inputs[0].detach().reshape(-1, site.x.dim)  # (M, K)
                idx = None
                if self.keep_real and site.real_at != self.collections:
                    # the first call of this collection only, so that X and dY rows pair up
                    # (a module called twice per forward sees its backward in reverse order)
                    site.real_at = self.collections
                    idx = _row_subset(x.shape[0], self.real_rows, self._gen)
                site.x.add(x, self._gen, idx)
            if output.requires_grad:
                output.register_hook(self._make_grad_hook(site, idx))

        return hook

    def _make_grad_hook(self, site: _Site, idx: torch.Tensor | None) -> Callable[[torch.Tensor], None]:
        def grad_hook(g: torch.Tensor) -> None:
            with torch.no_grad(), _exact(g.device), self._timed(f"{site.name}.dy", g):
                site.dy.add(g.detach().reshape(-1, site.dy.dim), self._gen, idx)  # (M, N)

        return grad_hook

    # ------------------------------------------------------------------ side collection
    def _collect_side(self, inputs: tuple[Any, ...], target: Any) -> None:
        """One collection of ``step_on="batch"``: the probe's own forward and backward of a
        random sub-batch of the step's ``inputs`` on ``self.model``, the uncompiled module.

        - Rows: ``sub_batch`` examples drawn without replacement (all of them when the batch
          is not larger), by the probe's own generator. Every tensor input (and ``target``)
          whose first dim is the batch's is indexed with the same rows.
        - ``dY``: the loss ``loss_fn(output, target)`` (a mean over the rows; default the
          trainer's binary cross-entropy on logits) is scaled by ``rows / batch``, so each
          row's output gradient is the one it has in the full batch's mean loss (the model
          treats rows independently: the reference models do; a BatchNorm would not). It is
          taken by ``torch.autograd.grad`` w.r.t. the sites' outputs only: no parameter's
          ``.grad`` is written, no weight gradient or embedding backward is computed, no
          DDP hook fires.
        - Sampling error: the sub-batch is a simple random sample of the batch's rows, so a
          feature's mean from ``r`` of ``B`` rows is off the batch's by ``sigma sqrt(1/r - 1/B)``
          (one standard deviation) and a Gaussian covariance by a relative Frobenius error of
          ``sqrt((tr(C)^2 + ||C||_F^2)(1/r - 1/B)) / ||C||_F``; over ``c`` collections ``r`` and
          ``B`` become ``c r`` and ``c B`` (``tests/test_probe_compiled.py`` checks both). At the
          GPU default (2,048 of 8,192 rows) that is what the in-step collection's 2,048 random
          rows per batch give: a mean off by ``0.019 sigma`` after one collection, ``0.006
          sigma`` after ten.
        - Training is untouched: the global RNG (CPU, and the batch's CUDA device) is
          restored afterwards (a dropout draws the same masks next step as without the probe),
          BatchNorm running statistics are restored, no optimizer sees anything. Nothing reads
          a value back to the host (as in the in-step collection).
        - The site hooks exist only inside this forward and live on ``self.model``'s
          submodules: a compiled wrapper (``torch.compile(model)``) is not called, and its
          guards do not change once they are removed (``tests/test_probe_compiled.py``).
        """
        self.collections += 1
        self._on_device_rng()
        if self._weights_due():
            self._collect_weights_grouped()
        full = _batch_size(inputs)
        if full is None:
            raise ProbeError(f"Probe.step(*inputs) of step_on='batch' needs at least one tensor input with a"
                             f" batch dim, got {[type(a).__name__ for a in inputs]!r}")
        dev = self._device()
        r = self.sub_batch if self.sub_batch is not None else _resolve(dev, self.max_rows, self.precision)[0]
        idx = None
        if r < full:
            first = _first_tensor(inputs)
            assert first is not None
            idx = _row_subset(full, r, self._gen).to(first.device, non_blocking=True)  # (r,) sorted, distinct
        rows = full if idx is None else idx.numel()
        sub = tuple(_take(a, idx, full) for a in inputs)
        tgt = _take(target, idx, full)
        calls: list[tuple[_Site, torch.Tensor, torch.Tensor]] = []  # (site, X, Y) per call, in forward order

        def make_hook(site: _Site) -> Callable[..., None]:
            def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                if args and torch.is_tensor(args[0]) and torch.is_tensor(output):
                    calls.append((site, args[0].detach(), output))

            return hook

        handles = [site.mod.register_forward_hook(make_hook(site)) for site in self._sites.values()]
        with self._timed("side.forward_backward", _first_tensor(inputs)), self._restored_state(dev):
            try:
                with torch.enable_grad():
                    out = self.model(*sub)
                    loss_fn = self.loss_fn or _bce_with_logits
                    loss = loss_fn(out, tgt) * (rows / full)  # each row's dY as in the full batch's mean loss
            finally:
                for h in handles:
                    h.remove()
            need = [i for i, c in enumerate(calls) if c[2].requires_grad]
            grads = torch.autograd.grad(loss, [calls[i][2] for i in need], allow_unused=True) if need else ()
        dys: dict[int, torch.Tensor | None] = dict(zip(need, grads))
        with torch.no_grad(), _exact(dev), self._timed("side.stats", _first_tensor(inputs)):
            sites = [site for site, _, _ in calls]
            want = []  # the calls whose rows are kept for real replay: a site's first call pairs X and dY
            for i, site in enumerate(sites):
                if self.keep_real and site.real_at != self.collections:
                    site.real_at = self.collections
                    want.append(i)
            tensors: list[torch.Tensor | None] = [x for _, x, _ in calls]
            self._side_stats(sites, tensors + [dys.get(i) for i in range(len(calls))], want, rows, full)

    def _side_stats(self, sites: list[_Site], tensors: list[torch.Tensor | None], want: list[int], rows: int,
                    full: int) -> None:
        """A side collection's statistics from ``tensors`` (each call's X, then each call's dY or
        ``None``): replayed as the CUDA graph of their layout where there is one
        (:mod:`loka_tune.probe.graphs`), captured on a layout's second sight (the warm-up's
        capture is the first real collection's), else eager."""
        key = (tuple(s.name for s in sites), tuple(id(s.x) for s in sites),
               tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors), tuple(want), rows, full)
        g = self._graph
        if g is not None and g.key == key:
            g.run(tensors)
            return
        if g is None and self._graph_wanted() and self._seen_layout == key:
            if self._capture_side(sites, tensors, want, rows, full, key):
                assert self._graph is not None
                self._graph.run(tensors)
                return
        self._seen_layout = key
        if self._stash is not None:  # the warm-up: its inputs are captured once its statistics are discarded
            self._stash = (tensors, want, rows, full)
        if g is not None:  # another layout (a smaller last batch): eager, on the graph's state in place
            with Pinned(self._graph_refs(sites)):
                self._side_stats_eager(sites, tensors, want, rows, full)
            return
        self._side_stats_eager(sites, tensors, want, rows, full)

    def _graph_wanted(self) -> bool:
        if self._graph_error is not None or self.graphs is False:
            return False
        return graphs_supported(self._device())

    def _graph_refs(self, sites: list[_Site]) -> list[tuple[Any, str]]:
        """Every state attribute a side collection of ``sites`` replaces (see :class:`Pinned`)."""
        refs: list[tuple[Any, str]] = []
        for site in {id(s): s for s in sites}.values():
            for acc in (site.x, site.dy):
                refs += [(acc, a) for a in ("amax", "batches", "nonfinite", "absq_sum", "real")]
                m = acc.moments
                if m is not None:
                    refs += [(m, a) for a in ("_n", "mean", "m2d", "m3", "m4", "m2")]
                    if m.sketch is not None:
                        refs.append((m.sketch, "y"))
        return refs

    def _capture_side(self, sites: list[_Site], tensors: list[torch.Tensor | None], want: list[int], rows: int,
                      full: int, key: Any) -> bool:
        """Capture the statistics of this layout (:func:`loka_tune.probe.graphs.capture`); on failure
        the probe says why once (:attr:`graph_note`) and stays eager."""
        def region(static: list[torch.Tensor | None]) -> None:
            # the capture bakes in the autocast state it runs under: the statistics' own precision,
            # whoever captures (the warm-up's capture runs outside the collection's _exact)
            dev = next((t.device for t in static if t is not None), self._device())
            with torch.no_grad(), _exact(dev):
                self._side_stats_eager(sites, static, want, rows, full)

        try:
            self._graph = capture(region, key, tensors, self._graph_refs(sites), self._gen)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager collections, said once
            self._graph_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            warnings.warn(f"Probe: the side collection's statistics could not be captured as a CUDA graph"
                          f" ({self._graph_error}); collections stay eager (the same statistics, more host"
                          " time). Probe(graphs=False) silences this.", RuntimeWarning, stacklevel=3)
            return False
        return True

    @property
    def graph_note(self) -> str:
        """How the side collections' statistics run: ``"graph (n replays)"``, ``"eager"`` or
        ``"eager: <why the capture failed>"``."""
        if self._graph is not None:
            return f"graph ({self._graph.replays} replays)"
        return "eager" if self._graph_error is None else f"eager: {self._graph_error}"

    def _side_stats_eager(self, sites: list[_Site], tensors: list[torch.Tensor | None], want: list[int], rows: int,
                          full: int) -> None:
        n = len(sites)
        items: list[tuple[_StreamAcc, torch.Tensor, torch.Tensor | None, int]] = []
        reals: list[torch.Tensor | None] = []
        xs = []  # (M, K) per call
        for site, t in zip(sites, tensors[:n]):
            assert t is not None  # every call has its X
            xs.append(t.reshape(-1, site.x.dim))
        drawn = dict(zip(want, _row_subsets([xs[i].shape[0] for i in want], self.real_rows, self._gen)))
        for i, site in enumerate(sites):  # X in forward order, as the in-step hooks merge it
            x2 = xs[i]
            real = drawn.get(i)
            if real is not None:
                real = real.to(x2.device, non_blocking=True)
            items.append((site.x, x2, real, _full_rows(x2.shape[0], rows, full)))
            reals.append(real)
        for i in reversed(range(n)):  # dY in backward order
            g = tensors[n + i]
            if g is not None:
                site = sites[i]
                g2 = g.reshape(-1, site.dy.dim)  # (M, N)
                items.append((site.dy, g2, reals[i], _full_rows(g2.shape[0], rows, full)))
        self._merge_side(items)

    def _merge_side(self, items: list[tuple[_StreamAcc, torch.Tensor, torch.Tensor | None, int]]) -> None:
        """Merge a side collection's streams ``(acc, rows (M, dim), real row indices, the site's
        M)``: what :meth:`_StreamAcc.add` does for each, with one kernel per operation for many
        streams at once wherever the work allows (a collection's host cost is its launches).
        Per stream: the inf-norm (finite flag and amax) and, above ``max_rows``, the row
        subset (and its real rows, taken before it). Then the streams of one row count side by
        side, ``(M, D)``: their real rows by one gather, their quantiles by one gather and one
        quantile call, their moments by one merge
        (:func:`~loka_tune.probe.moments.update_concat`); the running amax and counters of all
        streams at once. A stream seen twice (a module called twice per forward) merges its
        second batch in a second round."""
        gen = self._gen
        live = [(a, t, r, n) for a, t, r, n in items if t.numel()]
        if not live:
            return
        for a, t, _, n in live:
            a.allocate(t.device, gen)
            a.rows = n
        dev = live[0][1].device
        amax = torch.stack([torch.linalg.vector_norm(t, float("inf")) for _, t, _, _ in live]).double()  # (S,)
        ok = amax < math.inf  # the inf-norm is NaN/inf iff some element is (NaN < inf is False)
        olds = stacked([a.amax for a, _, _, _ in live])  # type: ignore[misc]
        new_amax = torch.maximum(olds, torch.where(ok, amax, 0.0))
        okl = ok.long()
        batches = stacked([a.batches for a, _, _, _ in live]) + okl  # type: ignore[misc]
        nonfinite = stacked([a.nonfinite for a, _, _, _ in live]) + (1 - okl)  # type: ignore[misc]
        absq = stacked([a.absq_sum for a, _, _, _ in live])  # type: ignore[misc]  # (S, nq)
        merged, own_real = [], {}
        for k, (a, t, r, _) in enumerate(live):  # at most max_rows rows merged: a random subset above
            if t.shape[0] > a.max_rows:
                if r is not None:
                    own_real[k] = t[r]  # the real rows come before any subset
                t = t[random_rows(t.shape[0], a.max_rows, gen, t.device)]
            merged.append(t)
        rounds: list[dict[int, list[int]]] = []  # round -> row count -> streams
        seen: dict[int, int] = {}
        for k, (a, _, _, _) in enumerate(live):
            rnd = seen.get(id(a), 0)
            seen[id(a)] = rnd + 1
            while len(rounds) <= rnd:
                rounds.append({})
            rounds[rnd].setdefault(merged[k].shape[0], []).append(k)
        q_rows: dict[int, torch.Tensor] = {}
        for groups in rounds:
            for ks in groups.values():
                sizes = [live[k][0].dim for k in ks]
                seg = self._seg(sizes, dev)
                x = torch.cat([merged[k] for k in ks], 1) if len(ks) > 1 else merged[ks[0]]  # (M, D)
                okg = pick(ok, ks)
                self._real_side(live, ks, x, okg, seg, own_real)
                q_rows.update(zip(ks, self._quantiles_side(x, sizes, okg).unbind(0)))
                update_concat([live[k][0].moments for k in ks], x, okg, seg, gen)  # type: ignore[misc]
        absq = absq + torch.stack([q_rows[k] for k in range(len(live))])
        for k, (a, _, _, _) in enumerate(live):
            a.amax, a.batches, a.nonfinite, a.absq_sum = new_amax[k], batches[k], nonfinite[k], absq[k]

    def _real_side(self, live: list[tuple[_StreamAcc, torch.Tensor, torch.Tensor | None, int]], ks: list[int],
                   x: torch.Tensor, okg: torch.Tensor, seg: torch.Tensor, own: dict[int, torch.Tensor]) -> None:
        """The real rows of streams ``ks`` (their rows side by side in ``x (M, D)``): each stream's
        row indices gathered column by column in one go (``own``: rows taken before a subset)."""
        with_real = [j for j, k in enumerate(ks) if live[k][2] is not None and k not in own]
        sizes = [live[k][0].dim for k in ks]
        if with_real:
            counts = {int(live[ks[j]][2].numel()) for j in with_real}  # type: ignore[union-attr]
            if len(counts) == 1 and len(with_real) > 1:
                idx = torch.zeros(counts.pop(), len(ks), dtype=torch.long, device=x.device)  # (rows, S_g)
                idx.index_copy_(1, on_device(with_real, idx), torch.stack([live[ks[j]][2] for j in with_real], 1))  # type: ignore[misc]
                real = torch.where(okg[seg], x.gather(0, idx[:, seg]).float(), torch.nan)  # (rows, D)
                offs = [0]
                for d in sizes:
                    offs.append(offs[-1] + d)
                for j in with_real:
                    live[ks[j]][0].real = real[:, offs[j]:offs[j + 1]]
            else:
                for j in with_real:
                    a, t, r, _ = live[ks[j]]
                    a.real = torch.where(okg[j], t[r].float(), torch.nan)
        for j, k in enumerate(ks):
            if k in own:
                live[k][0].real = torch.where(okg[j], own[k].float(), torch.nan)

    def _quantiles_side(self, x: torch.Tensor, sizes: list[int], okg: torch.Tensor) -> torch.Tensor:
        """``(S_g, len(QUANTILES))``: each stream's quantiles of ``|x|`` over its columns of ``x
        (M, D)``, as :meth:`_StreamAcc.add` takes them (every element up to QUANTILE_SAMPLE,
        that many drawn at random with replacement above), a non-finite stream's zero; the
        sampled streams in one gather and one quantile call, the others one call per size."""
        gen, dev, m = self._gen, x.device, x.shape[0]
        out: list[torch.Tensor | None] = [None] * len(sizes)
        offs = [0]
        for d in sizes:
            offs.append(offs[-1] + d)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        qs = on_device(QUANTILES, x, dtype)
        big = [j for j, d in enumerate(sizes) if m * d > QUANTILE_SAMPLE]
        if big:  # element (row, column) pairs drawn per stream, gathered from x in one go
            g = gen.device  # the draws on the generator's device (the accelerator's on a GPU)
            rows = torch.randint(m, (len(big), QUANTILE_SAMPLE), generator=gen, device=g)
            cols = (torch.rand(len(big), QUANTILE_SAMPLE, generator=gen, dtype=torch.float64, device=g)
                    * on_device([float(sizes[j]) for j in big], rows, torch.float64)[:, None]).long()
            cols = cols + on_device([offs[j] for j in big], rows)[:, None]
            flat = x.reshape(-1)[(rows * x.shape[1] + cols).to(dev, non_blocking=True)]  # (S_b, Q)
            ax = torch.where(pick(okg, big)[:, None], flat.abs().to(dtype), 0.0)
            for j, q in zip(big, torch.quantile(ax, qs, dim=1).T.double().unbind(0)):
                out[j] = q
        small: dict[int, list[int]] = {}
        for j, d in enumerate(sizes):
            if m * d <= QUANTILE_SAMPLE:
                small.setdefault(d, []).append(j)
        for d, js in small.items():  # every element: one quantile call for the streams of one size
            ax = torch.stack([x[:, offs[j]:offs[j] + d].reshape(-1) for j in js]).abs().to(dtype)
            ax = torch.where(pick(okg, js)[:, None], ax, 0.0)
            for j, q in zip(js, torch.quantile(ax, qs, dim=1).T.double().unbind(0)):
                out[j] = q
        return torch.stack(out)  # type: ignore[arg-type]

    def _seg(self, sizes: list[int], dev: torch.device) -> torch.Tensor:
        """``(sum(sizes),)``: the position of each column's stream, for streams of ``sizes``
        side by side (cached on ``dev`` per layout)."""
        key = (tuple(sizes), str(dev))
        seg = self._segs.get(key)
        if seg is None:
            seg = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(dev, non_blocking=True)
            self._segs[key] = seg
        return seg

    def _collect_weights_grouped(self) -> None:
        """:meth:`_collect_weight` for every site, the sites of one weight shape (and weight
        model) together: one kernel per operation for each group (a side collection's host
        cost is its launches). Flip-flop models update one by one (they sync anyway)."""
        groups: dict[tuple[Any, ...], list[_Site]] = {}
        with torch.no_grad(), _exact(self._device()), self._timed("side.weights", self._device_tensor()):
            for site in self._sites.values():
                w = site.mod.weight
                self._allocate_weight(site)
                if not torch.is_tensor(site.w_nonfinite):
                    self._allocate_weight_acc(site, w.device)
                if self.weight_flip_flop:
                    self._collect_weight(site)
                    continue
                assert site.w is not None
                groups.setdefault((tuple(w.shape), w.dtype, w.device, site.w._calls), []).append(site)
            for sites in groups.values():
                self._collect_weight_group(sites)

    def _collect_weight_group(self, sites: list[_Site]) -> None:
        """The weight models of ``sites`` (one shape) updated together; their amax, quantiles
        and kurtosis are those of the last finite weight, which the model keeps
        (``MatrixNormalEMA.last``): computed from it when read (:attr:`stats`), not here, and
        the non-finite count is the updates less the weights folded in."""
        w = torch.stack([s.mod.weight.detach() for s in sites])  # (S, N, K)
        ok = torch.linalg.vector_norm(w.flatten(1), float("inf"), dim=1) < math.inf  # (S,) finite weights
        update_weights([s.w for s in sites], w, ok)  # type: ignore[misc]
        for s in sites:
            s.w_lazy = True

    def _device_tensor(self) -> torch.Tensor:
        return next(iter(self._sites.values())).mod.weight

    def _device(self) -> torch.device:
        return next(iter(self._sites.values())).mod.weight.device

    @contextlib.contextmanager
    def _restored_state(self, dev: torch.device) -> Iterator[None]:
        """The global RNG streams and BatchNorm running statistics as they were before."""
        saved = [(m, {k: getattr(m, k).clone() for k in ("running_mean", "running_var", "num_batches_tracked")
                      if torch.is_tensor(getattr(m, k, None))}) for m in self._norms]
        devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # CPU always, the CUDA device when there is one
            try:
                yield
            finally:
                with torch.no_grad():
                    for m, bufs in saved:
                        for k, v in bufs.items():
                            getattr(m, k).copy_(v)

    @contextlib.contextmanager
    def _timed(self, key: str, like: torch.Tensor | None) -> Iterator[None]:
        if not self.profile:
            yield
            return
        cuda = like is not None and like.is_cuda
        if cuda:
            assert like is not None
            torch.cuda.synchronize(like.device)
        t0 = time.perf_counter()
        yield
        if cuda:
            assert like is not None
            torch.cuda.synchronize(like.device)
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def _collect_weight(self, site: _Site) -> None:
        """Fold the site's weight into its model; a non-finite weight is counted and skipped,
        decided on the device (no host sync: ``torch.where`` keeps the previous values)."""
        w = site.mod.weight.detach()  # (N, K)
        self._allocate_weight(site)
        assert site.w is not None
        if not torch.is_tensor(site.w_nonfinite):
            self._allocate_weight_acc(site, w.device)
        assert torch.is_tensor(site.w_nonfinite) and torch.is_tensor(site.w_amax)
        assert torch.is_tensor(site.w_absq) and torch.is_tensor(site.w_kurt)
        amax = torch.linalg.vector_norm(w.float(), float("inf"))  # the model keeps it in float32: beyond is inf
        ok = amax < math.inf  # NaN/inf anywhere makes the inf-norm NaN/inf (and NaN < inf is False)
        site.w_nonfinite = site.w_nonfinite + (~ok).long()  # reported by WeightStats.problem()
        site.w.update(w, ok)
        site.w_amax = torch.where(ok, amax, site.w_amax)
        n = w.numel()
        if n > QUANTILE_SAMPLE:  # quantiles and kurtosis from a subsample
            sub = w.flatten()[random_rows(n, QUANTILE_SAMPLE, self._gen, w.device)].double()
        else:
            sub = w.flatten().double()
        absq = torch.quantile(sub.abs(), on_device(QUANTILES, sub))
        site.w_absq = torch.where(ok, absq, site.w_absq)
        wc = sub - sub.mean()
        var = (wc * wc).mean()
        kurt = torch.where(var > 0, (wc**4).mean() / var.clamp_min(1e-300) ** 2 - 3.0, torch.zeros_like(var))
        site.w_kurt = torch.where(ok, kurt, site.w_kurt)

    @staticmethod
    def _allocate_weight_acc(site: _Site, device: torch.device) -> None:
        site.w_nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        site.w_amax = torch.zeros((), dtype=torch.float32, device=device)
        site.w_absq = torch.zeros(len(QUANTILES), dtype=torch.float64, device=device)
        site.w_kurt = torch.zeros((), dtype=torch.float64, device=device)

    # ------------------------------------------------------------------ read-out
    @property
    def stats(self) -> ProbeStats:
        """A snapshot of everything collected so far (plain numpy; safe to keep and save)."""
        sites = {}
        for name, s in self._sites.items():
            m = s.mod
            nonfinite = s.w._calls - s.w.count if s.w_lazy and s.w is not None else int(s.w_nonfinite)
            ws = WeightStats(rows=m.out_features, cols=m.in_features, ema=self.weight_ema, nonfinite=nonfinite)
            if s.w is not None:
                ws.count, ws.residuals = s.w.count, s.w.residuals
                ws.mean = s.w.mean.float().cpu().numpy()
                ws.last = s.w.last.float().cpu().numpy()
                ws.u, ws.v, ws.fallbacks = _weight_factors(s.w)
                if s.w_lazy and ws.count:
                    read_gen = torch.Generator().manual_seed(self._seed + 7919 * (1 + self.collections))
                    amax, absq, kurt = _weight_summary(s.w.last, read_gen)  # the same numbers at every read
                    ws.amax, ws.kurtosis, ws.absq = float(amax), float(kurt), absq.cpu().numpy()
                else:
                    ws.amax, ws.kurtosis = float(s.w_amax), float(s.w_kurt)
                    ws.absq = s.w_absq.cpu().numpy() if torch.is_tensor(s.w_absq) else s.w_absq
            sites[name] = SiteStats(
                name, m.in_features, m.out_features, s.x.snapshot(), s.dy.snapshot(), ws,
                bias=getattr(m, "bias", None) is not None,
            )
        return ProbeStats(sites, self.every, self.steps, self.collections, type(self.model).__name__)


def _weight_factors(w: MatrixNormalEMA) -> tuple[np.ndarray | None, np.ndarray | None, dict[str, str]]:
    """The weight model's ``(u, v, fallbacks)`` as float32 numpy (float64 where float32 would
    overflow: weight steps above ~1e19). Never raises on the data: a factor that is not finite
    falls back to its diagonal (clipped at 0), and when that is not finite either (or the
    scale cannot be fixed) the model is dropped (``u = v = None``: draws take the mean
    weight); each is recorded in ``fallbacks`` with the fit's own notes."""
    notes = dict(w.notes)
    try:
        pair = [w.u, w.v]
    except StatisticError as e:
        notes["model"] = f"{e}; draws take the mean weight"
        return None, None, notes
    out: list[np.ndarray] = []
    for name, f in zip(("u", "v"), pair):
        a = f.float().cpu().numpy()
        if not np.all(np.isfinite(a)):
            a = f.double().cpu().numpy()  # beyond float32, or not finite at all
        if not np.all(np.isfinite(a)):
            d = np.diagonal(a) if a.ndim == 2 else a
            if not np.all(np.isfinite(d)):
                notes["model"] = f"non-finite {name} factor (its diagonal too); draws take the mean weight"
                return None, None, notes
            notes[name] = f"non-finite {name} factor; its diagonal stands in"
            a = np.clip(d, 0.0, None)
        out.append(a)
    return out[0], out[1], notes


def _row_subset(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``k`` distinct random row indices of ``m``, sorted, on ``gen``'s device (on the CPU no
    O(m) permutation when m >> k; on an accelerator one permutation, which needs no host sync
    where ``unique`` would)."""
    if gen.device.type != "cpu":
        return torch.randperm(m, generator=gen, device=gen.device)[:k].sort().values
    if m <= 8 * k:
        return torch.randperm(m, generator=gen)[:k].sort().values
    u = torch.randint(m, (k + k // 8,), generator=gen).unique()  # collisions are rare when m >> k
    return u[torch.randperm(u.numel(), generator=gen)[:k]].sort().values


def _row_subsets(ms: list[int], k: int, gen: torch.Generator, *, batched: bool | None = None) -> list[torch.Tensor]:
    """:func:`_row_subset` of each of ``ms`` rows (``k`` each, or all when fewer), in that order.
    On an accelerator (``batched``, default: ``gen`` is not on the CPU) the subsets of one row
    count are drawn together, ``k`` distinct rows of each as the top ``k`` of uniform keys (one
    ``rand``, one ``topk``, one ``sort`` for all of them, not a permutation per site: a side
    collection's host cost is its launches); on the CPU one :func:`_row_subset` each, as ever."""
    if not (gen.device.type != "cpu" if batched is None else batched):
        return [_row_subset(m, k, gen) for m in ms]
    out: list[torch.Tensor | None] = [None] * len(ms)
    by_m: dict[int, list[int]] = {}
    for j, m in enumerate(ms):
        by_m.setdefault(m, []).append(j)
    for m, js in by_m.items():
        if m <= k:
            rows = torch.arange(m, device=gen.device).expand(len(js), m)
        else:
            keys = torch.rand(len(js), m, generator=gen, device=gen.device)
            rows = keys.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        for j, r in zip(js, rows.unbind(0)):
            out[j] = r
    return out  # type: ignore[return-value]


def _select(found: dict[str, nn.Linear], patterns: list[str]) -> dict[str, nn.Linear]:
    bad = [p for p in patterns if not p.startswith("re:") and p not in found]
    if bad:
        raise ProbeError(f"unknown site(s) {bad!r}: the model's linear layers are {list(found)[:10]!r}"
                         + (" ..." if len(found) > 10 else ""))
    out = {}
    for name, mod in found.items():
        for p in patterns:
            if (p.startswith("re:") and re.fullmatch(p[3:], name)) or p == name:
                out[name] = mod
                break
    return out


def _weight_summary(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(amax, quantiles of |w|, excess kurtosis)`` of a weight, as :meth:`Probe._collect_weight`
    takes them (quantiles and kurtosis from QUANTILE_SAMPLE random elements above that many)."""
    amax = w.abs().max()
    n = w.numel()
    sub = (w.flatten()[random_rows(n, QUANTILE_SAMPLE, gen, w.device)] if n > QUANTILE_SAMPLE else w.flatten()).double()
    absq = torch.quantile(sub.abs(), on_device(QUANTILES, sub))
    wc = sub - sub.mean()
    var = (wc * wc).mean()
    kurt = torch.where(var > 0, (wc**4).mean() / var.clamp_min(1e-300) ** 2 - 3.0, torch.zeros_like(var))
    return amax, absq, kurt


def _exact(device: torch.device) -> Any:
    """The statistics in their own precision whatever the caller's autocast: a collection runs
    inside the training step's (the side forward must, to see the training's activations), and
    autocast would turn the statistics' float32 / TF32 / float64 products into bf16 ones."""
    return torch.autocast(device.type, enabled=False)


def _orig_module(model: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (dynamo's ``OptimizedModule``) runs, or None."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(orig, nn.Module) and type(model).__name__ == "OptimizedModule" else None


def _first_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    return next((a for a in args if torch.is_tensor(a) and a.dim() >= 1), None)


def _batch_size(inputs: tuple[Any, ...]) -> int | None:
    """The batch size of a step's inputs: the first dim of the first tensor input with one."""
    t = _first_tensor(inputs)
    return None if t is None else int(t.shape[0])


def _take(a: Any, idx: torch.Tensor | None, full: int) -> Any:
    """Rows ``idx`` of a tensor whose first dim is the batch's; anything else as it is."""
    if idx is None or not torch.is_tensor(a) or a.dim() == 0 or a.shape[0] != full:
        return a
    return a.index_select(0, idx.to(a.device, non_blocking=True))


def _full_rows(rows: int, sub: int, full: int) -> int:
    """The rows of a site's real call (the whole batch's) that ``rows`` rows of a ``sub``-example
    sub-batch stand for (tokens per example times the batch size)."""
    if sub == full:
        return rows
    return rows // sub * full if rows % sub == 0 else round(rows * full / sub)


def _bce_with_logits(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The trainer's loss (:class:`~loka_tune.objectives.step.TrainStep`): mean binary
    cross-entropy of logits ``(B,)`` against labels ``(B,)``, in float32."""
    if not torch.is_tensor(target):
        raise ProbeError("Probe.step(*inputs, target=labels): the default loss (binary cross-entropy on"
                         f" logits) needs the labels as a tensor, got target={type(target).__name__}; pass"
                         " them, or give the Probe a loss_fn(output, target)")
    return F.binary_cross_entropy_with_logits(output.float().reshape(-1), target.float().reshape(-1))
