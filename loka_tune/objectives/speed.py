"""Speed, the tuner's objective: modeled from the cost model (any machine) or measured (a GPU).

- :func:`modeled_gemm_seconds`: the cost model's seconds for every linear site x GEMM of a
  model at its applied precision, with the rows scaled to a (production) batch size;
- :func:`measure_forward_seconds`: the median wall (CUDA-event) time of a forward pass, under
  the trainer's autocast rule.

The ``inference`` objective prices the serving form (``apply(..., serving=True)``): weights
are quantized once, so the modeled fwd GEMMs leave the weight's quantization out
(``static_b``) and the measured forward runs :func:`loka_tune.serving.serving_form` of the
trial's model (static FP8 weights; a fwd choice that cannot serve statically runs bf16).

A training step's measured time comes from the trainer itself (``TrainResult.step_time_s``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from loka_tune.config import BF16, ROLES, GemmRole
from loka_tune.data.base import model_inputs
from loka_tune.kernels.linear import LokaLinear
from loka_tune.objectives.step import autocast_context, autocast_for
from loka_tune.space.sites import discover_sites

__all__ = ["modeled_gemm_seconds", "measure_forward_seconds"]


def _roles_for(kind: str) -> tuple[GemmRole, ...]:
    return (GemmRole.FWD,) if kind == "inference" else ROLES


def modeled_gemm_seconds(model: nn.Module, batch: Any, *, batch_size: int, cost_batch_size: int,
                         device: str, kind: str = "train_step") -> float:
    """Sum over the model's linear sites x roles of the cost model's seconds at ``cost_batch_size``.

    Each site's precision is the one actually applied (``LokaLinear.precision``; plain
    ``nn.Linear`` = bf16), its shape the one a forward pass on ``batch`` shows, with the rows
    scaled from ``batch_size`` to ``cost_batch_size``. ``kind="inference"``: the fwd GEMMs
    only, each with a static weight (its quantization is done once, when serving).
    """
    from loka_tune.kernels.costmodel import estimate_gemm_seconds
    from loka_tune.kernels.linear import find_linears

    lin = find_linears(model)
    sites = discover_sites(model, *model_inputs(model, batch), linears=lin)
    total = 0.0
    for s in sites:
        prec = getattr(lin[s.name], "precision", None)
        for role in _roles_for(kind):
            choice = BF16 if prec is None else prec[role]
            m, k, n = s.shape(role, cost_batch_size)
            total += estimate_gemm_seconds(choice, m, k, n, role, device, static_b=kind == "inference")
    return total


@torch.no_grad()
def measure_forward_seconds(model: nn.Module, batch: Any, *, reps: int = 20, warmup: int = 5,
                            autocast: str = "auto", serving: bool = True) -> float:
    """Median seconds of the model's forward (``model_inputs``) in eval mode (CUDA events on a GPU), under the
    trainer's autocast rule for ``autocast`` ("auto": bf16 on CUDA, fp32 on the CPU; pass the
    study's ``training.autocast``): the bf16 baseline is then timed in bf16, as it trains.
    ``serving`` (default): a model applied for training is timed in its serving form (static FP8
    weights, :func:`loka_tune.serving.serving_form`; tensors shared, ``model`` unchanged)."""
    if serving and any(isinstance(m, LokaLinear) for m in model.modules()):
        from loka_tune.serving import serving_form

        model = serving_form(model, strict=False)
    was = model.training
    model.eval()
    inputs = model_inputs(model, batch)
    on_cuda = batch.dense.is_cuda
    dev = batch.dense.device
    times = []
    try:
        for i in range(warmup + reps):
            if on_cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                with autocast_context(dev, autocast_for(autocast, dev)):
                    model(*inputs)
                b.record()
                torch.cuda.synchronize()
                dt = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                with autocast_context(dev, autocast_for(autocast, dev)):
                    model(*inputs)
                dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
    finally:
        model.train(was)
    return float(statistics.median(times))
