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

Optimizers follow LRM practice: embedding tables (``nn.Embedding`` / ``nn.EmbeddingBag``)
get a sparse-aware optimizer that only touches the rows a batch used (row-wise Adagrad, the
torchrec/FBGEMM default, or ``torch.optim.SparseAdam``); every other parameter gets Adam.
Training runs under bf16 autocast on CUDA and in fp32 on the CPU (``cfg.autocast``).

A non-finite loss never raises: the run stops with ``status="nonfinite"`` and the step it
happened at. ``on_step(step, window_loss) -> bool`` is called at the end of every loss window
and stops the run (``status="pruned"``) when it returns True: the tuner's pruner hook.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.errors import ConfigError, DataError
from loka_tune.objectives.metrics import auc, log_loss, normalized_entropy

__all__ = [
    "TrainConfig",
    "TrainResult",
    "RowwiseAdagrad",
    "SPARSE_OPTIMIZERS",
    "split_parameters",
    "build_optimizers",
    "resolve_device",
    "train",
    "evaluate",
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
    warmup_steps:     steps left out of the step-time median (allocation, caches, autotuning)
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
    device: str = "auto"
    autocast: str = "auto"
    compile: bool = False
    sparse_optimizer: str = "rowwise_adagrad"
    deterministic: bool | str = "auto"
    log_every: int = 10
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "window", "log_every"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"must be an integer >= 1, got {v!r}", key=key)
        for key in ("seed", "eval_seed", "warmup_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"must be an integer >= 0, got {v!r}", key=key)
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


# --------------------------------------------------------------------------------------------
# result


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


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
    train_logloss:     the last loss_curve entry (nan if no step ran)
    eval_logloss, eval_ne, eval_auc, eval_count, eval_ctr:
                       held-out metrics (nan / 0 when the run did not finish "ok")
    step_time_s:       median seconds per training step after ``cfg.warmup_steps`` (fwd + bwd
                       + optimizer; data loading excluded); CUDA-event timed on GPU
    examples_per_s:    batch_size / step_time_s
    wall_s:            seconds for the whole call, evaluation included
    num_params, num_sparse_params: parameter counts (all; in embedding tables)
    device, precision: where and how it ran ("cpu"/"cuda:0", "fp32"/"bf16")
    config:            the TrainConfig
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
        }
        if step_losses:
            d["step_losses"] = [_json_float(x) for x in self.step_losses]
        return d


# --------------------------------------------------------------------------------------------
# optimizers


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for embedding tables (the torchrec / FBGEMM default for LRMs).

    One accumulator per table row (the mean of the squared gradient over the row), so the
    state is ``num_rows`` floats instead of a full copy of the table. Sparse gradients (from
    ``sparse=True`` embeddings) update only the rows they touch; dense gradients are
    accepted too (rows with a zero gradient are left unchanged, as with sparse ones).

        acc[r] += mean_j g[r, j]^2 ;   w[r] -= lr * g[r] / (sqrt(acc[r]) + eps)
    """

    def __init__(self, params: Any, lr: float = 1e-2, eps: float = 1e-8) -> None:
        if not lr > 0:
            raise ConfigError(f"must be > 0, got {lr!r}", key="lr_sparse")
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # noqa: D102
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                assert p.dim() == 2, "RowwiseAdagrad updates 2-d embedding tables"
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                acc = state["sum"]  # (rows,)
                g = p.grad
                if g.is_sparse:
                    g = g.coalesce()  # unique sorted row ids, duplicate rows summed
                    rows, vals = g.indices()[0], g.values().float()  # (nnz,), (nnz, dim)
                else:
                    touched = g.ne(0).any(dim=1)
                    rows = touched.nonzero().squeeze(1)  # (nnz,)
                    vals = g[rows].float()  # (nnz, dim)
                if rows.numel() == 0:
                    continue
                acc_rows = acc.index_select(0, rows) + vals.pow(2).mean(dim=1)  # (nnz,)
                acc.index_copy_(0, rows, acc_rows)
                upd = vals / (acc_rows.sqrt() + eps).unsqueeze(1)  # (nnz, dim)
                p.index_add_(0, rows, upd.to(p.dtype), alpha=-lr)  # rows unique: deterministic
        return loss


def _sparse_adam(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SparseAdam(params, lr=lr)


def _rowwise_adagrad(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return RowwiseAdagrad(params, lr=lr)


# name -> factory(params, lr)
SPARSE_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], float], torch.optim.Optimizer]] = {
    "rowwise_adagrad": _rowwise_adagrad,
    "sparse_adam": _sparse_adam,
}


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(embedding_params, dense_params)``: the weights of every ``nn.Embedding`` /
    ``nn.EmbeddingBag`` versus every other trainable parameter (each listed once, in order)."""
    emb_ids: set[int] = set()
    emb: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight.requires_grad:
            if id(m.weight) not in emb_ids:
                emb_ids.add(id(m.weight))
                emb.append(m.weight)
    dense: list[nn.Parameter] = []
    seen: set[int] = set(emb_ids)
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            dense.append(p)
    return emb, dense


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The run's optimizers: the sparse one over embedding tables, Adam over the rest.

    SparseAdam needs sparse gradients: an embedding built with ``sparse=False`` raises a
    :class:`ConfigError` naming the table (use ``rowwise_adagrad``, which takes both).
    """
    emb, dense = split_parameters(model)
    opts: list[torch.optim.Optimizer] = []
    if emb:
        if cfg.sparse_optimizer == "sparse_adam":
            dense_tables = [
                name
                for name, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and not m.sparse
            ]
            if dense_tables:
                raise ConfigError(
                    f"sparse_adam needs embeddings built with sparse=True; {dense_tables[0]!r} is "
                    "dense: build it with sparse=True or use sparse_optimizer='rowwise_adagrad'",
                    key="sparse_optimizer",
                )
        opts.append(SPARSE_OPTIMIZERS[cfg.sparse_optimizer](emb, cfg.lr_sparse))
    if dense:
        opts.append(torch.optim.Adam(dense, lr=cfg.lr_dense, foreach=False))
    return opts


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


def _autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=dtype)


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
            for i, batch in enumerate(source.batches("eval", batch_size, seed=seed, device=dev)):
                if max_batches is not None and i >= max_batches:
                    break
                out = model(batch.dense, batch.sparse)
                logits.append(out.detach().float().reshape(-1).cpu())
                labels.append(batch.labels.detach().float().reshape(-1).cpu())
    finally:
        model.train(was_training)
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


def train(
    model: nn.Module,
    source: Any,
    cfg: TrainConfig | None = None,
    *,
    on_step: OnStep | None = None,
    progress: bool | ProgressFn = True,
) -> TrainResult:
    """Train ``model`` in place for ``cfg.steps`` steps on ``source`` and evaluate it.

    ``model(dense, sparse) -> (B,) logits``; ``source`` follows
    :class:`loka_tune.data.base.DataSource`. The model is moved to the run's device.

    ``on_step(step, window_loss)`` is called each time a loss window of ``cfg.window`` steps
    completes (``step`` = steps done so far, ``window_loss`` = that window's mean training
    log loss); returning True stops the run with status "pruned" (no evaluation then).

    ``progress``: True = a tqdm bar on stderr with the running loss; False = silent; a
    callable ``progress(step, running_loss)`` is called every ``cfg.log_every`` steps instead.

    A non-finite training loss (or non-finite eval logits) ends the run with status
    "nonfinite" instead of raising. Errors in the model or the data source still raise.
    """
    cfg = cfg or TrainConfig()
    t_wall = time.perf_counter()
    dev = resolve_device(cfg.device)
    dtype = _autocast_dtype(cfg.autocast, dev)
    precision = "bf16" if dtype is not None else "fp32"
    on_cuda = dev.type == "cuda"

    deterministic = (not on_cuda) if cfg.deterministic == "auto" else bool(cfg.deterministic)
    with _RunSettings(deterministic, cfg.cpu_threads):
        _seed_everything(cfg.seed)
        model.to(dev)
        model.train()
        emb, dense = split_parameters(model)
        optimizers = build_optimizers(model, cfg)
        fwd: Callable[..., torch.Tensor] = model
        if cfg.compile:
            fwd = torch.compile(model)

        bar, progress_fn = _make_progress(progress, cfg.steps, f"train {type(model).__name__}")
        it: Iterator[Any] = iter(source.batches("train", cfg.batch_size, seed=cfg.seed, device=dev))
        loss_buf = torch.empty(cfg.steps, dtype=torch.float32, device=dev)  # per-step losses
        host_losses: list[float] = []  # losses already pulled to the host
        cpu_times: list[float] = []
        events: list[tuple[Any, Any]] = []
        status, nonfinite_step = "ok", None
        steps_run = 0

        try:
            for step in range(cfg.steps):
                try:
                    batch = next(it)
                except StopIteration:
                    raise DataError(
                        f"data source {getattr(source, 'name', source)!r} ended its train split "
                        f"after {step} batches: train iterators must cycle forever"
                    ) from None
                if on_cuda:
                    ev0 = torch.cuda.Event(enable_timing=True)
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev0.record()
                else:
                    t0 = time.perf_counter()

                with _autocast(dev, dtype):
                    logits = fwd(batch.dense, batch.sparse)  # (B,)
                loss = F.binary_cross_entropy_with_logits(
                    logits.float().reshape(-1), batch.labels.float().reshape(-1)
                )
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                loss.backward()
                for opt in optimizers:
                    opt.step()
                loss_buf[step] = loss.detach()

                if on_cuda:
                    ev1.record()
                    events.append((ev0, ev1))
                else:
                    cpu_times.append(time.perf_counter() - t0)
                steps_run = step + 1

                # sync point (every step on CPU, where it is free; every log_every steps and
                # at window ends on CUDA): pull new losses to the host, check, fire callbacks
                at_window = steps_run % cfg.window == 0
                at_log = steps_run % cfg.log_every == 0 or steps_run == cfg.steps
                if on_cuda and not (at_window or at_log):
                    continue
                base = len(host_losses)
                host_losses.extend(loss_buf[base:steps_run].tolist())
                bad = [i for i in range(base, steps_run) if not math.isfinite(host_losses[i])]
                if bad:
                    status, nonfinite_step = "nonfinite", bad[0]
                    del host_losses[bad[0] + 1 :]
                    break
                if at_log:
                    tail = host_losses[-cfg.window :]
                    running = math.fsum(tail) / len(tail)
                    if bar is not None:
                        bar.update(steps_run - bar.n)
                        bar.set_postfix(loss=f"{running:.4f}", refresh=False)
                    if progress_fn is not None:
                        progress_fn(steps_run, running)
                if at_window and on_step is not None:
                    if on_step(steps_run, math.fsum(host_losses[-cfg.window :]) / cfg.window):
                        status = "pruned"
                        break
        finally:
            if bar is not None:
                bar.close()

        if on_cuda:
            torch.cuda.synchronize(dev)
            times = [a.elapsed_time(b) / 1e3 for a, b in events]
        else:
            times = cpu_times
        timed = times[cfg.warmup_steps :] if len(times) > cfg.warmup_steps else times
        step_time = statistics.median(timed) if timed else math.nan

        losses = host_losses  # ends with the non-finite value when status is nonfinite
        curve, ends = _windows(losses, cfg.window)

        ev = {"logloss": math.nan, "ne": math.nan, "auc": math.nan, "count": 0, "ctr": math.nan}
        if status == "ok":
            ev = evaluate(
                model,
                source,
                batch_size=cfg.eval_batch_size or cfg.batch_size,
                device=dev,
                seed=cfg.eval_seed,
                max_batches=cfg.eval_batches,
                autocast=cfg.autocast,
            )
            if not math.isfinite(ev["logloss"]):
                status, nonfinite_step = "nonfinite", steps_run

    return TrainResult(
        status=status,
        steps_run=steps_run,
        nonfinite_step=nonfinite_step,
        step_losses=tuple(losses),
        loss_curve=curve,
        curve_steps=ends,
        train_logloss=curve[-1] if curve else math.nan,
        eval_logloss=ev["logloss"],
        eval_ne=ev["ne"],
        eval_auc=ev["auc"],
        eval_count=ev["count"],
        eval_ctr=ev["ctr"],
        step_time_s=step_time,
        examples_per_s=cfg.batch_size / step_time if step_time and math.isfinite(step_time) else math.nan,
        wall_s=time.perf_counter() - t_wall,
        num_params=_count(emb) + _count(dense),
        num_sparse_params=_count(emb),
        device=str(dev),
        precision=precision,
        config=cfg,
    )
