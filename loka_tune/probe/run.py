"""``run_probe``: train with the probe attached (or take saved stats), then measure.

The probe layer never imports :mod:`loka_tune.objectives`: the caller passes ``train_fn``
(the CLI and the tuner pass the short-run trainer), so any training loop can be probed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

from torch import nn

from loka_tune.config import GemmChoice
from loka_tune.errors import ProbeError
from loka_tune.probe.collector import Probe
from loka_tune.probe.measure import measure
from loka_tune.probe.report import ProbeReport
from loka_tune.probe.stats import ProbeStats

__all__ = ["run_probe", "collect"]

TrainFn = Callable[[nn.Module, Any], Any]


def collect(
    model: nn.Module,
    source: Any,
    train_fn: TrainFn,
    *,
    every: int = 100,
    **probe_kwargs: Any,
) -> ProbeStats:
    """Run ``train_fn(model, source)`` with a :class:`Probe` attached; return its stats."""
    if not callable(train_fn):
        raise ProbeError(f"train_fn must be callable as train_fn(model, source), got {train_fn!r}")
    with Probe(model, every=every, **probe_kwargs) as p:
        train_fn(model, source)
    stats = p.stats
    if stats.collections == 0:
        raise ProbeError(
            f"the probe counted {stats.steps} training steps but never collected (every={every}):"
            " train for at least `every` steps, or lower `every`"
        )
    return stats


def run_probe(
    model: nn.Module,
    source: Any = None,
    candidates: Iterable[GemmChoice | str] | None = None,
    *,
    train_fn: TrainFn | None = None,
    stats: ProbeStats | str | Path | None = None,
    every: int = 100,
    probe_kwargs: dict[str, Any] | None = None,
    **measure_kwargs: Any,
) -> ProbeReport:
    """Probe ``model``: collect statistics during ``train_fn(model, source)`` (or use ``stats``,
    a :class:`ProbeStats` or the path of a saved one, checked against ``model``), then
    :func:`~loka_tune.probe.measure` ``candidates`` (``measure_kwargs`` are passed on).

    The returned report carries the stats as ``report.stats`` (save them with
    ``report.stats.save(path)``).
    """
    if stats is None:
        if train_fn is None:
            raise ProbeError(
                "run_probe needs train_fn (called as train_fn(model, source) with the probe attached)"
                " or stats (a ProbeStats or a saved .npz) to re-analyse offline"
            )
        stats = collect(model, source, train_fn, every=every, **(probe_kwargs or {}))
    else:
        if isinstance(stats, (str, Path)):
            stats = ProbeStats.load(stats)
        if not isinstance(stats, ProbeStats):
            raise ProbeError(f"stats must be a ProbeStats or a path, got {type(stats).__name__}")
        stats.check_model(model)
    return measure(stats, candidates, **measure_kwargs)
