"""The deterministic short-run trainer: the quality-and-speed measurement behind every trial.

``train(model, source, cfg)`` trains a CTR model for ``cfg.steps`` steps on the source's train
split and evaluates it on the eval split. Two runs that differ only in the numerics of some
layers are a *paired* comparison:

- the data order comes only from ``source.batches("train", batch_size, seed=cfg.seed)``, so
  both runs see the same batches in the same order whatever the model does;
- python, numpy and torch RNGs are seeded from ``cfg.seed`` at the start, and on the CPU
  deterministic algorithms are requested (``warn_only``) for the duration of the run: there
  the same model, data, seed, steps and thread count give a bit-identical loss curve (on
  CUDA runs are close but not promised bit-identical: atomics in embedding backward);
- evaluation is one deterministic pass over the eval split (seed ``cfg.eval_seed``).

Optimizers follow LRM practice (:mod:`loka_tune.objectives.optim`): embedding tables get a
sparse-aware optimizer that only touches the rows a batch used (row-wise Adagrad, the
torchrec/FBGEMM default, or ``torch.optim.SparseAdam``); every other parameter gets Adam.
``cfg.lr_warmup_steps`` ramps both learning rates up linearly over the first steps and
``cfg.lr_cooldown_steps`` down over the last ones (both off by default; ``cfg.warmup_steps`` is
only the timing warm-up). Training runs under bf16 autocast on CUDA and in fp32 on the CPU (``cfg.autocast``).

On a GPU the step is built to be GPU-bound (:mod:`loka_tune.objectives.step`): no host sync
inside it (losses are read back every ``log_every`` steps), fused optimizers, the model
compiled with ``cfg.compile`` and the whole step captured in one CUDA graph with
``cfg.cuda_graphs``. ``cfg.profile_steps`` profiles the last steps and reports the GPU's
kernel time per step beside the step time (:mod:`loka_tune.objectives.profiling`).

A non-finite loss never raises: the run stops with ``status="nonfinite"`` and the step it
happened at. ``on_step(step, window_loss) -> bool`` is called at the end of every loss window
and stops the run (``status="pruned"``) when it returns True: the tuner's pruner hook.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

import loka_tune.objectives.distributed as D
from loka_tune.data.base import model_inputs
from loka_tune.errors import ConfigError, DataError
from loka_tune.objectives.distributed import DistEnv
from loka_tune.objectives.metrics import auc, log_loss, normalized_entropy
from loka_tune.objectives.optim import (
    SPARSE_OPTIMIZERS,
    RowwiseAdagrad,
    build_optimizers,
    rowwise_adagrad_update_,
    split_parameters,
)
from loka_tune.objectives.profiling import StepProfiler
from loka_tune.objectives.step import TrainStep, autocast_context, autocast_for

__all__ = [
    "TrainConfig",
    "TrainResult",
    "RowwiseAdagrad",
    "rowwise_adagrad_update_",
    "SPARSE_OPTIMIZERS",
    "split_parameters",
    "build_optimizers",
    "TrainStep",
    "autocast_for",
    "resolve_device",
    "train",
    "evaluate",
    "phases_note",
]

STATUSES = ("ok", "nonfinite", "pruned")
AUTOCAST_MODES = ("auto", "bf16", "off")

OnStep = Callable[[int, float], bool]
ProgressFn = Callable[[int, float], None]


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class TrainConfig:
    """How one short training run goes.

    steps:            optimizer steps (one batch each)
    batch_size:       training batch size
    lr_dense:         Adam learning rate of every non-embedding parameter
    lr_sparse:        learning rate of the embedding tables' sparse optimizer
    seed:             seeds the train data order and the python/numpy/torch RNGs
    eval_seed:        seed passed to the eval split (fixed by default so that runs with
                      different training seeds are still evaluated on the same rows)
    eval_batches:     evaluate on at most this many eval batches (None = the whole eval split)
    eval_batch_size:  eval batch size (None = ``batch_size``)
    window:           the loss curve is the mean training log loss over each ``window`` steps
    warmup_steps:     *timing* warm-up: steps left out of the step-time median (allocation,
                      caches, autotuning, compilation); it changes no number of the training
    lr_warmup_steps:  *learning-rate* warm-up: every optimizer's rate (``lr_dense``, ``lr_sparse``)
                      ramps linearly over the first ``lr_warmup_steps`` steps, step ``i`` (0-based)
                      at ``min(1, (i + 1) / lr_warmup_steps)`` of it (0 = full rates from the first
                      step). Adam's first steps move every weight by about ``lr`` whatever its
                      gradient's size, so a layer of fan-in ``n`` shifts its outputs by up to
                      ``lr * n`` times its inputs' size at once: wide models need it (and a lower
                      ``lr_dense``); see :mod:`loka_tune.objectives.step`
    lr_cooldown_steps: *learning-rate* cool-down: every optimizer's rate falls linearly over the run's
                      last ``lr_cooldown_steps`` steps, step ``i`` (0-based) of ``steps`` at
                      ``(steps - i) / (lr_cooldown_steps + 1)`` of it (0 = none). A short run is
                      judged by its final weights: at a constant rate they carry the last steps'
                      noise, and the paired eval loss of two runs with them (a study's noise
                      floor): cooling the rate lets the run settle first (``lr_warmup_steps`` and
                      it take the smaller factor where they meet)
    device:           "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"
    autocast:         "auto" (bf16 on CUDA, fp32 on CPU), "bf16" (everywhere) or "off" (fp32)
    compile:          wrap the model in ``torch.compile`` (CPU bit-identity not promised then)
    sparse_optimizer: "rowwise_adagrad" (default) or "sparse_adam"
    deterministic:    request ``torch.use_deterministic_algorithms(True, warn_only=True)``
                      during the run (previous setting restored afterwards): True, False or
                      "auto" = on the CPU only (on CUDA it fills every fresh allocation and
                      picks slower kernels, which would bias the step times the tuner ranks)
    log_every:        steps between progress updates (and, on CUDA, host-device syncs)
    cpu_threads:      torch intra-op threads during the run (None = leave torch's setting);
                      1 is fastest for tiny models on a shared or oversubscribed CPU
    cuda_graphs:      capture the whole step (forward, backward, optimizers) in one CUDA graph
                      after 3 eager warm-up steps and replay it: no host work per step (CUDA
                      only; one batch shape; see :mod:`loka_tune.objectives.step`)
    profile_steps:    profile the last N steps with torch.profiler: ``TrainResult.gpu_time_s``
                      (GPU kernel time per step) and ``.profile`` (GEMM share, top kernels);
                      those steps are left out of ``step_time_s`` when others remain
    """

    steps: int = 300
    batch_size: int = 256
    lr_dense: float = 1e-3
    lr_sparse: float = 1e-2
    seed: int = 0
    eval_seed: int = 0
    eval_batches: int | None = None
    eval_batch_size: int | None = None
    window: int = 50
    warmup_steps: int = 5
    lr_warmup_steps: int = 0
    lr_cooldown_steps: int = 0
    device: str = "auto"
    autocast: str = "auto"
    compile: bool = False
    sparse_optimizer: str = "rowwise_adagrad"
    deterministic: bool | str = "auto"
    log_every: int = 10
    cpu_threads: int | None = None
    cuda_graphs: bool = False
    profile_steps: int = 0

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "window", "log_every"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"must be an integer >= 1, got {v!r}", key=key)
        for key in ("seed", "eval_seed", "warmup_steps", "lr_warmup_steps", "lr_cooldown_steps", "profile_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"must be an integer >= 0, got {v!r}", key=key)
        if self.lr_cooldown_steps > self.steps:
            raise ConfigError(f"got {self.lr_cooldown_steps!r} > steps={self.steps}: the cool-down must fit in the"
                              " run; give a few tenths of it (e.g. a quarter), or 0 for none", key="lr_cooldown_steps")
        for key in ("eval_batches", "eval_batch_size", "cpu_threads"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"must be an integer >= 1 or None, got {v!r}", key=key)
        for key in ("lr_dense", "lr_sparse"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"must be a finite number > 0, got {v!r}", key=key)
        if self.autocast not in AUTOCAST_MODES:
            raise ConfigError(
                f"unknown autocast mode {self.autocast!r}: choose one of {', '.join(AUTOCAST_MODES)}",
                key="autocast",
            )
        for key in ("compile", "cuda_graphs"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"must be true or false, got {getattr(self, key)!r}", key=key)
        if self.profile_steps >= self.steps:
            raise ConfigError(
                f"profiles the last steps of the run and must be < steps ({self.steps}), got {self.profile_steps}",
                key="profile_steps",
            )
        if self.deterministic not in (True, False, "auto"):
            raise ConfigError(
                f"must be True, False or 'auto', got {self.deterministic!r}", key="deterministic"
            )
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ConfigError(
                f"unknown sparse optimizer {self.sparse_optimizer!r}: choose one of "
                f"{', '.join(SPARSE_OPTIMIZERS)}",
                key="sparse_optimizer",
            )
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ConfigError(
                f"unknown device {self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'", key="device"
            )
        if self.cuda_graphs and self.device == "cpu":
            raise ConfigError("CUDA graphs need device 'cuda' (or 'auto' on a GPU machine), got 'cpu'",
                              key="cuda_graphs")


# --------------------------------------------------------------------------------------------
# result


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def phases_note(result: "TrainResult") -> str:
    """Where a run's wall time went, for a progress line: ``"first step 8.1s (compiling), 199
    steps 6.0s, eval 3.2s, setup 0.4s"`` (``""`` for a result without :attr:`TrainResult.phases_s`);
    a compiled run's :attr:`TrainResult.compile_s` is said inside the brackets
    (:func:`~loka_tune.objectives.compiled.compile_note`)."""
    ph = result.phases_s
    if not ph:
        return ""
    compiled = ""
    if result.config.compile:
        from loka_tune.objectives.compiled import compile_note

        split = compile_note(getattr(result, "compile_s", None) or {})
        compiled = f" (compiling: {split})" if split else " (compiling)"
    parts = [f"first step {ph.get('first_step', 0.0):.1f}s{compiled}",
             f"{max(result.steps_run - 1, 0)} steps {ph.get('steps', 0.0):.1f}s",
             f"eval {ph.get('eval', 0.0):.1f}s", f"setup {ph.get('setup', 0.0):.1f}s"]
    return ", ".join(parts)


@dataclass(frozen=True)
class TrainResult:
    """What one short run measured.

    status:            "ok", "nonfinite" (a non-finite loss stopped it) or "pruned" (on_step)
    steps_run:         optimizer steps taken (< cfg.steps when stopped early)
    nonfinite_step:    0-based step whose training loss was first non-finite (None if none;
                       ``steps_run`` when training was finite but the eval logits were not)
    step_losses:       training log loss of every step run (float32 values as floats)
    loss_curve:        mean training log loss over each ``cfg.window`` steps; the last entry
                       covers the remaining steps when ``steps_run`` is not a multiple
    curve_steps:       number of steps seen at the end of each loss_curve window
    train_logloss:     mean training log loss of the last ``cfg.window`` steps (of every step
                       when fewer ran; nan if none): a full window even when the last
                       loss_curve entry covers only the few steps left over
    eval_logloss, eval_ne, eval_auc, eval_count, eval_ctr:
                       held-out metrics (nan / 0 when the run did not finish "ok")
    step_time_s:       median seconds per training step after ``cfg.warmup_steps`` (fwd + bwd
                       + optimizer; data loading excluded); CUDA-event timed on GPU
    examples_per_s:    batch_size / step_time_s
    wall_s:            seconds for the whole call, evaluation included
    num_params, num_sparse_params: parameter counts (all; in embedding tables)
    device, precision: where and how it ran ("cpu"/"cuda:0", "fp32"/"bf16")
    config:            the TrainConfig
    gpu_time_s:        GPU kernel time per step over the profiled steps (nan unless
                       ``cfg.profile_steps`` on CUDA); ``step_time_s / gpu_time_s`` near 1
                       means the step is GPU-bound
    profile:           the profiled steps' summary (:class:`~loka_tune.objectives.profiling.
                       StepProfiler`), or None
    phases_s:          where ``wall_s`` went, in wall seconds: ``setup`` (seeding, moving the
                       model, building the optimizers and the step), ``first_step`` (the first
                       training step, the device synchronised after it: a compiled run's
                       tracing and compiling, or loading them from inductor's caches, happen
                       there), ``steps`` (every later step, callbacks and side collections
                       included) and ``eval``; :func:`phases_note` says it in words
    compile_s:         a compiled run's first step, by dynamo's own timers: tracing, the forward
                       and backward compiles, and inside them kernel codegen, the generated
                       module's load and the wait for inductor's compile workers; and the
                       workers' count and state
                       (:func:`~loka_tune.objectives.compiled.compile_split`; ``{}`` eager)
    """

    status: str
    steps_run: int
    nonfinite_step: int | None
    step_losses: tuple[float, ...]
    loss_curve: tuple[float, ...]
    curve_steps: tuple[int, ...]
    train_logloss: float
    eval_logloss: float
    eval_ne: float
    eval_auc: float
    eval_count: int
    eval_ctr: float
    step_time_s: float
    examples_per_s: float
    wall_s: float
    num_params: int
    num_sparse_params: int
    device: str
    precision: str
    config: TrainConfig = field(repr=False)
    gpu_time_s: float = math.nan
    profile: dict[str, Any] | None = field(default=None, repr=False)
    phases_s: dict[str, float] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self, *, step_losses: bool = False) -> dict[str, Any]:
        """A JSON-safe dict (non-finite floats become None); per-step losses only if asked."""
        d: dict[str, Any] = {
            "status": self.status,
            "steps_run": self.steps_run,
            "nonfinite_step": self.nonfinite_step,
            "train_logloss": _json_float(self.train_logloss),
            "eval_logloss": _json_float(self.eval_logloss),
            "eval_ne": _json_float(self.eval_ne),
            "eval_auc": _json_float(self.eval_auc),
            "eval_count": self.eval_count,
            "eval_ctr": _json_float(self.eval_ctr),
            "step_time_s": _json_float(self.step_time_s),
            "examples_per_s": _json_float(self.examples_per_s),
            "wall_s": _json_float(self.wall_s),
            "num_params": self.num_params,
            "num_sparse_params": self.num_sparse_params,
            "device": self.device,
            "precision": self.precision,
            "loss_curve": [_json_float(x) for x in self.loss_curve],
            "curve_steps": list(self.curve_steps),
            "config": asdict(self.config),
            "gpu_time_s": _json_float(self.gpu_time_s),
            "phases_s": {k: _json_float(v) for k, v in self.phases_s.items()},
        }
        if self.compile_s:
            d["compile_s"] = {k: _json_float(v) for k, v in self.compile_s.items()}
        if self.profile is not None:
            d["profile"] = self.profile
        if step_losses:
            d["step_losses"] = [_json_float(x) for x in self.step_losses]
        return d


# --------------------------------------------------------------------------------------------
# helpers


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; a CUDA device without CUDA -> ConfigError."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} asked for but CUDA is not available here: use 'cpu' or 'auto'",
            key="device",
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# kept for callers of the private names; the rule lives in objectives.step
_autocast_dtype = autocast_for
_autocast = autocast_context


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class _RunSettings:
    """Context: deterministic algorithms (warn_only) and the CPU thread count for one run;
    the previous settings are restored afterwards."""

    def __init__(self, deterministic: bool, threads: int | None) -> None:
        self.deterministic, self.threads = deterministic, threads

    def __enter__(self) -> "_RunSettings":
        self.prev = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.get_num_threads(),
        )
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.use_deterministic_algorithms(self.prev[0], warn_only=self.prev[1])
        if self.threads is not None:
            torch.set_num_threads(self.prev[2])


def _make_progress(progress: bool | ProgressFn, total: int, desc: str) -> tuple[Any, ProgressFn | None]:
    """``(tqdm bar or None, callable or None)`` for the ``progress`` argument."""
    if callable(progress):
        return None, progress
    if not progress:
        return None, None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
    return bar, None


def _count(params: list[nn.Parameter]) -> int:
    return int(sum(p.numel() for p in params))


# --------------------------------------------------------------------------------------------
# evaluation


def evaluate(
    model: nn.Module,
    source: Any,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    seed: int = 0,
    max_batches: int | None = None,
    autocast: str = "auto",
    _env: DistEnv | None = None,
) -> dict[str, float]:
    """Held-out metrics of ``model`` on one deterministic pass over ``source``'s eval split.

    Returns ``{"logloss", "ne", "auc", "count", "ctr"}`` computed in float64 from the float32
    logits (``count`` = examples seen, ``ctr`` = their mean label). Runs under ``no_grad``
    with the same autocast rule as training, and restores the model's train/eval mode.
    """
    if autocast not in AUTOCAST_MODES:
        raise ConfigError(
            f"unknown autocast mode {autocast!r}: choose one of {', '.join(AUTOCAST_MODES)}",
            key="autocast",
        )
    dev = resolve_device(device)
    dtype = _autocast_dtype(autocast, dev)
    was_training = model.training
    model.eval()
    logits: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    try:
        with torch.no_grad(), _autocast(dev, dtype):
            batches = source.batches("eval", batch_size, seed=seed, device=dev)
            if max_batches is not None:  # a RankSource yields every world_size-th batch of the split
                batches = itertools.islice(batches, D.rank_share(max_batches, _env))
            for batch in batches:
                out = model(*model_inputs(model, batch))
                logits.append(out.detach().float().reshape(-1).cpu())
                labels.append(batch.labels.detach().float().reshape(-1).cpu())
    finally:
        model.train(was_training)
    if _env is not None:  # the ranks' eval batches, back in the split's order
        logits, labels = D.gather_rows(logits, _env), D.gather_rows(labels, _env)
    if not logits:
        raise DataError(
            f"data source {getattr(source, 'name', source)!r} yielded no eval batches: "
            "it needs a non-empty eval split"
        )
    z = torch.cat(logits)  # (n,)
    y = torch.cat(labels)  # (n,)
    return {
        "logloss": log_loss(y, z),
        "ne": normalized_entropy(y, z),
        "auc": auc(y, z),
        "count": int(y.numel()),
        "ctr": float(y.double().mean()),
    }


# --------------------------------------------------------------------------------------------
# training


def _windows(losses: list[float], window: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    curve, ends = [], []
    for start in range(0, len(losses), window):
        chunk = losses[start : start + window]
        curve.append(math.fsum(chunk) / len(chunk))
        ends.append(start + len(chunk))
    return tuple(curve), tuple(ends)


@dataclass
class _Run:
    """What the step loop of one run gathered."""

    losses: list[float] = field(default_factory=list)  # per step, pulled to the host
    times: list[float] = field(default_factory=list)  # seconds per step
    first_step_wall_s: float = math.nan  # wall time of the first step, the device synchronised after it
    status: str = "ok"
    nonfinite_step: int | None = None
    steps_run: int = 0
    profiled: int = 0  # the last steps, timed under the profiler
    profile: dict[str, Any] | None = None
    compile_s: dict[str, float] = field(default_factory=dict)  # the first step's compile (compile_split)


def train(
    model: nn.Module,
    source: Any,
    cfg: TrainConfig | None = None,
    *,
    on_step: OnStep | None = None,
    progress: bool | ProgressFn = True,
    after_step: Callable[[int], None] | None = None,
    on_batch: Callable[[int, Any], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``cfg.steps`` steps on ``source`` and evaluate it.

    ``model(dense, sparse) -> (B,) logits``; ``source`` follows
    :class:`loka_tune.data.base.DataSource`. The model is moved to the run's device.

    ``on_step(step, window_loss)`` is called each time a loss window of ``cfg.window`` steps
    completes (``step`` = steps done so far, ``window_loss`` = that window's mean training
    log loss); returning True stops the run with status "pruned" (no evaluation then).

    ``progress``: True = a tqdm bar on stderr with the running loss; False = silent; a
    callable ``progress(step, running_loss)`` is called every ``cfg.log_every`` steps instead.
    ``after_step(steps_done)`` is called after every step (e.g. ``Probe.step`` of a manual probe);
    ``on_batch(steps_done, batch)`` too, with the step's batch, under the run's autocast (e.g. a
    ``Probe(step_on="batch")``'s side collection on a compiled or CUDA-graph step). Both run
    outside the step's timing: ``step_time_s`` is the training step's alone.

    A non-finite training loss (or non-finite eval logits) ends the run with status
    "nonfinite" instead of raising. Errors in the model or the data source still raise.
    """
    cfg = cfg or TrainConfig()
    t_wall = time.perf_counter()
    dev = resolve_device(cfg.device)
    env, dev = D.join(dev, cfg.batch_size, cfg.cuda_graphs)  # under torchrun: data-parallel over its ranks
    dtype = autocast_for(cfg.autocast, dev)
    deterministic = (dev.type != "cuda") if cfg.deterministic == "auto" else bool(cfg.deterministic)
    group = D.process_group(env, dev) if env is not None else contextlib.nullcontext()
    with _RunSettings(deterministic, cfg.cpu_threads), group:
        _seed_everything(cfg.seed)
        model.to(dev)
        model.train()
        emb, dense = split_parameters(model)
        ddp = D.wrap_model(model, dev) if env is not None else model
        src = D.RankSource(source, env) if env is not None else source
        step = TrainStep(ddp, build_optimizers(model, cfg), device=dev, dtype=dtype, compile=cfg.compile,
                         cuda_graphs=cfg.cuda_graphs, lr_warmup_steps=cfg.lr_warmup_steps,
                         lr_cooldown_steps=cfg.lr_cooldown_steps, total_steps=cfg.steps)
        t_loop = time.perf_counter()
        run = _run_steps(step, src, cfg, dev, on_step, progress if env is None or env.is_main else False,
                         f"train {type(model).__name__}", after_step, env=env, on_batch=on_batch)
        t_eval = time.perf_counter()
        ev = {"logloss": math.nan, "ne": math.nan, "auc": math.nan, "count": 0, "ctr": math.nan}
        if run.status == "ok":
            ev = evaluate(model, src, batch_size=cfg.eval_batch_size or cfg.batch_size, device=dev,
                          seed=cfg.eval_seed, max_batches=cfg.eval_batches, autocast=cfg.autocast, _env=env)
            if not math.isfinite(ev["logloss"]):
                run.status, run.nonfinite_step = "nonfinite", run.steps_run

    t_end = time.perf_counter()
    first = run.first_step_wall_s if math.isfinite(run.first_step_wall_s) else 0.0
    phases = {"setup": t_loop - t_wall, "first_step": first, "steps": max(t_eval - t_loop - first, 0.0),
              "eval": t_end - t_eval}
    unprofiled = run.times[: len(run.times) - run.profiled]
    timed = next((t for t in (unprofiled[cfg.warmup_steps :], run.times[cfg.warmup_steps :], run.times) if t), [])
    step_time = statistics.median(timed) if timed else math.nan
    curve, ends = _windows(run.losses, cfg.window)  # losses end with the non-finite value, if any
    gpu_ms = (run.profile or {}).get("gpu_ms")
    return TrainResult(
        status=run.status, steps_run=run.steps_run, nonfinite_step=run.nonfinite_step,
        step_losses=tuple(run.losses), loss_curve=curve, curve_steps=ends,
        train_logloss=math.fsum(run.losses[-cfg.window:]) / len(run.losses[-cfg.window:]) if run.losses else math.nan,
        eval_logloss=ev["logloss"], eval_ne=ev["ne"], eval_auc=ev["auc"], eval_count=int(ev["count"]), eval_ctr=ev["ctr"],
        step_time_s=step_time,
        examples_per_s=cfg.batch_size / step_time if step_time and math.isfinite(step_time) else math.nan,
        wall_s=t_end - t_wall,
        num_params=_count(emb) + _count(dense), num_sparse_params=_count(emb),
        device=str(dev), precision="bf16" if dtype is not None else "fp32", config=cfg,
        gpu_time_s=gpu_ms / 1e3 if gpu_ms is not None else math.nan, profile=run.profile, phases_s=phases,
        compile_s=run.compile_s,
    )


def _run_steps(step: TrainStep, source: Any, cfg: TrainConfig, dev: torch.device, on_step: OnStep | None,
               progress: bool | ProgressFn, desc: str, after_step: Callable[[int], None] | None = None, *,
               env: DistEnv | None = None, on_batch: Callable[[int, Any], None] | None = None) -> _Run:
    """The step loop: time each step, pull losses to the host at sync points, fire callbacks."""
    on_cuda = dev.type == "cuda"
    bar, progress_fn = _make_progress(progress, cfg.steps, desc)
    it: Iterator[Any] = iter(source.batches("train", cfg.batch_size, seed=cfg.seed, device=dev))
    loss_buf = torch.empty(cfg.steps, dtype=torch.float32, device=dev)  # per-step losses
    events: list[tuple[Any, Any]] = []
    run = _Run()
    profiler = StepProfiler(cfg.profile_steps, dev) if cfg.profile_steps else None
    first_profiled = cfg.steps - cfg.profile_steps
    try:
        for i in range(cfg.steps):
            try:
                batch = next(it)
            except StopIteration:
                raise DataError(
                    f"data source {getattr(source, 'name', source)!r} ended its train split "
                    f"after {i} batches: train iterators must cycle forever"
                ) from None
            if profiler is not None and i == first_profiled:
                profiler.start()
            if on_cuda:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
            else:
                t0 = time.perf_counter()
            if i == 0:
                t_first = time.perf_counter()
            loss_buf[i] = step(batch)
            if on_cuda:
                ev1.record()
                events.append((ev0, ev1))
            else:
                run.times.append(time.perf_counter() - t0)
            if i == 0:  # once: what compiling (or loading it from the caches) cost, in wall time
                if on_cuda:
                    torch.cuda.synchronize(dev)
                run.first_step_wall_s = time.perf_counter() - t_first
                if cfg.compile:
                    from loka_tune.objectives.compiled import compile_split

                    run.compile_s = compile_split()
            run.steps_run = i + 1
            if after_step is not None:
                after_step(run.steps_run)
            if on_batch is not None:
                with autocast_context(dev, step.dtype):
                    on_batch(run.steps_run, batch)
            if profiler is not None and run.steps_run == cfg.steps:
                run.profile, run.profiled, profiler = profiler.stop(), cfg.profile_steps, None
            if _sync_point(run, loss_buf, cfg, on_cuda, bar, progress_fn, on_step, env):
                break
    finally:
        if bar is not None:
            bar.close()
        if profiler is not None and profiler.running:
            profiler.stop()  # a run that stopped early: its partial profile is not reported
    if on_cuda:
        torch.cuda.synchronize(dev)
        run.times = [a.elapsed_time(b) / 1e3 for a, b in events]
    return run


def _sync_point(run: _Run, loss_buf: torch.Tensor, cfg: TrainConfig, on_cuda: bool, bar: Any,
                progress_fn: ProgressFn | None, on_step: OnStep | None, env: DistEnv | None = None) -> bool:
    """Every step on the CPU (free there), every ``log_every`` steps and at window ends on
    CUDA: pull new losses to the host, check them, report progress, ask ``on_step``.
    Returns True when the run must stop (non-finite loss, or pruned)."""
    done = run.steps_run
    at_window = done % cfg.window == 0
    at_log = done % cfg.log_every == 0 or done == cfg.steps
    if on_cuda and not (at_window or at_log):
        return False
    base = len(run.losses)
    if env is not None:  # each rank's loss is the mean of its rows: their mean is the global batch's
        D.mean_over_ranks(loss_buf[base:done])
    run.losses.extend(loss_buf[base:done].tolist())
    bad = [i for i in range(base, done) if not math.isfinite(run.losses[i])]
    if bad:
        run.status, run.nonfinite_step = "nonfinite", bad[0]
        del run.losses[bad[0] + 1 :]
        return True
    if at_log:
        tail = run.losses[-cfg.window :]
        running = math.fsum(tail) / len(tail)
        if bar is not None:
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{running:.4f}", refresh=False)
        if progress_fn is not None:
            progress_fn(done, running)
    if at_window and on_step is not None and on_step(done, math.fsum(run.losses[-cfg.window :]) / cfg.window):
        run.status = "pruned"
        return True
    return False
