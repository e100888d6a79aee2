"""A study whose every training run is data-parallel over N processes: ``[regime] nproc = N``.

``loka-tune tune STUDY`` with ``nproc = N > 1`` re-runs itself under torchrun (N processes of
this host, one GPU each; gloo on a CPU). Rank 0 runs the study as one process would (storage,
Optuna, MLflow, the probe, printing); the other ranks *follow*: they hold no study, and for
each training run of rank 0 (a bf16 baseline, a trial, a reference timing, a confirmation run)
they receive a :class:`TrainJob` and train the same model beside it. ``train()`` is then
data-parallel over the N ranks at the same global batch (each rank keeps its ``1/N`` of every
batch; DDP averages the gradients; the losses and eval outputs are gathered), so the run's
losses and metrics are the one-process run's within float noise.

Every training run of the tuner goes through :func:`train_in_study` (below), which
announces the job first (:func:`announce`): which seed the model is built under
(:func:`~loka_tune.tuner.build.make_model`), which :class:`~loka_tune.config.PrecisionConfig`
is applied to it on the run's device, and the :class:`~loka_tune.objectives.trainer.TrainConfig`.
A follower rebuilds the model the same way (DDP broadcasts rank 0's initial weights anyway).
A trial's pruning decision (``on_step``, rank 0's Optuna pruner) is broadcast at each loss
window, so every rank stops at the same step. Callbacks that only watch (the probe's
``after_step``, progress) run on rank 0 alone: they start no collective. After the study
rank 0 sends a stop and every rank exits. A rank that fails ends the whole torchrun job.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loka_tune.errors import BackendError, UnsupportedChoiceError

if TYPE_CHECKING:
    from torch import nn

    from loka_tune.config import PrecisionConfig
    from loka_tune.objectives.distributed import DistEnv
    from loka_tune.objectives.trainer import OnStep, TrainConfig, TrainResult
    from loka_tune.tuner.study import StudyConfig

__all__ = ["TrainJob", "ranks", "leading", "announce", "shared_on_step", "follow", "is_leading", "train_in_study"]

#: how long a follower waits for rank 0's next job (rank 0's bookkeeping between runs: Optuna,
#: MLflow, plots, the probe's measurements): generous, a dead rank 0 ends the job through torchrun
_WAIT = datetime.timedelta(hours=12)
_leading = False


@dataclass(frozen=True)
class TrainJob:
    """One training run, as a follower rebuilds it: ``make_model(cfg, source, seed=seed)`` moved
    to ``tcfg.device``, ``config`` applied, ``train(model, source, tcfg)``; ``prune``: rank 0
    asks a pruner at each loss window (its answers are broadcast)."""

    seed: int | None
    config: PrecisionConfig
    tcfg: TrainConfig
    prune: bool = False


def _send(obj: Any) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([obj], src=0)


def _receive() -> Any:
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def ranks(env: DistEnv, device: str) -> Iterator[None]:
    """The default process group for the whole study (every run's ``train()`` joins it): gloo
    on a CPU, NCCL on CUDA with rank ``r`` on ``cuda:LOCAL_RANK``."""
    import torch
    import torch.distributed as dist

    from loka_tune.objectives.distributed import rank_device, torn_down

    dev = rank_device(env, torch.device(device))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # "cuda" is this rank's GPU from now on
    kw: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=env.rank,
                            world_size=env.world_size, timeout=_WAIT, **kw)
    with torn_down():
        yield


def is_leading() -> bool:
    """Whether this process is rank 0 of a study with followers (its runs are announced)."""
    return _leading


@contextlib.contextmanager
def leading() -> Iterator[None]:
    """Rank 0 runs the study inside: every ``train_in_study`` announces its job; at a normal end the
    followers get the stop (after an error torchrun ends them: a stop sent while they wait in a
    run's collective would not match)."""
    global _leading
    _leading = True
    try:
        yield
        _send(None)
    finally:
        _leading = False


def announce(job: TrainJob) -> None:
    """Rank 0: tell the followers to train ``job`` beside it."""
    _send(job)


def shared_on_step(on_step: OnStep | None) -> OnStep | None:
    """Rank 0's ``on_step`` with its answer broadcast (None stays None: no pruner, no message)."""
    if on_step is None:
        return None
    ask = on_step

    def shared(step: int, window_loss: float) -> bool:
        stop = bool(ask(step, window_loss))
        _send(stop)
        return stop

    return shared


def _follower_on_step(_step: int, _window_loss: float) -> bool:
    return bool(_receive())


def follow(cfg: StudyConfig) -> int:
    """A follower rank: train each job rank 0 announces, until the stop; returns the runs trained."""
    import torch

    from loka_tune.applier import apply
    from loka_tune.tuner.build import make_model, make_source, resolve_device, run_train

    source = make_source(cfg)
    n = 0
    while True:
        job = _receive()
        if job is None:
            return n
        model = make_model(cfg, source, seed=job.seed).to(resolve_device(job.tcfg.device))
        apply(model, job.config)
        try:
            run_train(model, source, job.tcfg, on_step=_follower_on_step if job.prune else None)
        except (UnsupportedChoiceError, BackendError, torch.cuda.OutOfMemoryError):
            pass  # rank 0 met the same failure at the same point and records it
        n += 1
        del model


def train_in_study(model: nn.Module, source: Any, tcfg: TrainConfig, *, seed: int | None, config: PrecisionConfig,
                   on_step: OnStep | None = None, after_step: Callable[[int], None] | None = None,
                   progress: Callable[[int, float], None] | bool = False,
                   on_batch: Callable[[int, Any], None] | None = None) -> TrainResult:
    """Every training run of the tuner: ``model`` is ``make_model(cfg, source, seed=seed)`` with
    ``config`` applied. In a study of ``[regime] nproc > 1`` rank 0 first announces the run, and
    the other ranks train it beside this one (this module). It lives here, above :mod:`~loka_tune.tuner.build`, whose
    :func:`~loka_tune.tuner.build.run_train` it calls: build never imports parallel."""
    from loka_tune.tuner.build import run_train

    if is_leading():
        announce(TrainJob(seed=seed, config=config, tcfg=tcfg, prune=on_step is not None))
        on_step = shared_on_step(on_step)
    return run_train(model, source, tcfg, on_step=on_step, after_step=after_step, progress=progress,
                     on_batch=on_batch)
