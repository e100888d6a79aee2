"""No Bias: remove the biases of the linear layers, except the prediction head (LoKA, "Mods").

Biases were seen to diverge and feed out-of-range values into the next FP8 GEMM, and under
FSDP2 each tiny bias costs its own padded collective. Removing a bias **changes the model's
function**: this pass is meant for a model trained from scratch (the tuner evaluates it by
training); on a trained model it is not a no-op.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from loka_tune.errors import ModError
from loka_tune.mods._walk import (
    check_model,
    find_prediction_head,
    is_parametrized,
    is_uninitialized_lazy,
    param_owner_count,
    resolve_names,
    walk,
)
from loka_tune.mods.report import Change, PassReport, Skip

__all__ = ["no_bias"]


def _linears_under(mod: nn.Module) -> set[int]:
    return {id(m) for m in mod.modules() if isinstance(m, nn.Linear)}


def _check_keep(keep: object) -> tuple[str, ...]:
    if isinstance(keep, str):
        return (keep,)
    try:
        return tuple(keep)  # type: ignore[arg-type]
    except TypeError:
        raise ModError(f"no_bias keep must be a list of module names; got {keep!r}") from None


def no_bias(model: nn.Module, keep: Iterable[str] = (), *, keep_head: bool = True) -> PassReport:
    """Set ``bias=None`` on every ``nn.Linear`` (``LokaLinear`` and other subclasses included),
    keeping the weights as they are, except the linears under the modules named in ``keep``
    and (``keep_head=True``) the prediction head.

    The head is the model's ``prediction_head`` attribute (a module name) if it has one, else
    the last ``nn.Linear`` with ``out_features == 1``, else the last ``nn.Linear``. A kept name
    may be a linear or any container (every linear under it is kept). Unknown names raise
    :class:`ModError`. Skipped and reported: linears inside ``nn.MultiheadAttention`` (which
    reads their tensors directly), uninitialized lazy linears, parametrized or shared biases.
    Conv / bilinear biases are not linear biases: left alone and reported.

    Removing a bias changes the model's function: meant for training from scratch. Apply
    before building the optimizer. Idempotent.
    """
    check_model(model)
    keep = _check_keep(keep)
    head, how = find_prediction_head(model) if keep_head else (None, "keep_head=False")
    report = PassReport("no_bias", params={"keep": list(keep), "head": head})
    report.notes.append(f"prediction head: {head!r} ({how})")
    report.notes.append("removing biases changes the function: meant for training from scratch")

    kept: dict[int, str] = {}
    for name, mod in zip(keep, resolve_names(model, keep, what="no_bias keep")):
        for i in _linears_under(mod):
            kept.setdefault(i, f"kept: under {name!r} (keep)")
    if head is not None:
        for i in _linears_under(model.get_submodule(head)):
            kept[i] = f"kept: the prediction head ({how})"
    owners = param_owner_count(model)

    for site in walk(model):
        m = site.module
        if isinstance(m, nn.Linear):
            if m.bias is None:
                continue
            parent = site.parent
            if id(m) in kept:
                reason = kept[id(m)]
            elif isinstance(parent, nn.MultiheadAttention):
                reason = "inside nn.MultiheadAttention, which reads the projection tensors directly"
            elif is_uninitialized_lazy(m):
                reason = "uninitialized lazy module: run one forward pass first"
            elif is_parametrized(m, "bias"):
                reason = "its bias is parametrized (torch.nn.utils.parametrize)"
            elif owners.get(id(m.bias), 1) > 1:
                reason = "its bias tensor is shared with another module"
            else:
                reason = None
            if reason is not None:
                report.skipped.append(Skip(site.name, site.kind, reason))
                continue
            b = m.bias.detach()
            with torch.no_grad():
                amax = float(b.abs().max()) if b.numel() and b.device.type != "meta" else 0.0
            m.bias = None  # type: ignore[assignment]  # torch infers Linear.bias as Parameter; None drops it
            report.changed.append(
                Change(site.name, site.kind, f"bias {tuple(b.shape)} (max |b| {amax:.3g})", "bias None", site.aliases)
            )
        elif isinstance(m, (nn.modules.conv._ConvNd, nn.Bilinear)) and getattr(m, "bias", None) is not None:
            report.skipped.append(Skip(site.name, site.kind, "not a linear layer: its bias is left alone"))
    return report
