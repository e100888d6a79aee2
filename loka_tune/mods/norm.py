"""The BlockNorm pass: LayerNorm / RMSNorm over the last dim -> :class:`~loka_tune.layers.BlockNorm`.

The module itself (parameter-free RMS normalization over blocks of the last dimension, the
ragged last block) lives in :mod:`loka_tune.layers`, the bottom layer, so that the fused
epilogue kernel (:mod:`loka_tune.kernels.fused`) can recognise it with ``isinstance``; it is
re-exported here (``loka_tune.mods.BlockNorm``).

Affine parameters: BlockNorm is parameter-free, as in the paper. The :func:`blocknorm` pass
drops the LayerNorm / RMSNorm affine weight and bias by default (the Mods are model changes
for training from scratch); ``affine=True`` keeps an elementwise weight (initialised from
the replaced norm's weight) and still drops a LayerNorm bias. The report records the choice.
"""

from __future__ import annotations

import torch
from torch import nn

from loka_tune.errors import ModError
from loka_tune.layers import BlockNorm, block_layout, check_block
from loka_tune.mods._walk import Walk, check_model, has_hooks, overrides_forward
from loka_tune.mods.report import Change, PassReport, Skip

__all__ = ["BlockNorm", "blocknorm", "block_layout"]


def _norm_desc(m: nn.Module) -> str:
    shape = tuple(getattr(m, "normalized_shape", ()))
    parts = [f"{type(m).__name__}({shape}", f"eps={getattr(m, 'eps', None)}"]
    params = [n for n, p in m._parameters.items() if p is not None]
    parts.append(f"params={'+'.join(params) or 'none'})")
    return ", ".join(parts)


def blocknorm(model: nn.Module, block: int = 256, *, affine: bool = False) -> PassReport:
    """Replace every ``nn.LayerNorm`` / ``nn.RMSNorm`` over the last dim with :class:`BlockNorm`.

    The LayerNorm inside :class:`loka_tune.layers.SwishLayerNorm` (its ``.norm`` submodule) is
    found and replaced like any other. The replaced norm's ``eps`` is kept. ``affine=False``
    (default, parameter-free as in the paper) drops the norm's weight and bias; ``affine=True``
    keeps an elementwise weight initialised from it (a LayerNorm bias is still dropped).
    Norms over two or more trailing dims, subclasses with their own ``forward``, norms with
    hooks attached, and batch/group/instance norms are skipped and reported. Apply before
    building the optimizer (the replaced norms' parameters leave the model).

    Like every Mod this changes the model's function (no mean subtraction, per-block
    statistics): it is meant for training from scratch, and the tuner evaluates it by training.
    Idempotent: BlockNorm modules are left as they are.
    """
    check_model(model)
    check_block(block)
    if not isinstance(affine, bool):
        raise ModError(f"blocknorm affine must be True or False; got {affine!r}")
    report = PassReport("blocknorm", params={"block": block, "affine": affine})
    report.notes.append(
        "affine parameters kept as an elementwise weight (LayerNorm bias dropped)"
        if affine
        else "affine parameters dropped: BlockNorm is parameter-free"
    )
    report.notes.append("widths not a multiple of the block: ragged last block normalized over its own size")
    other_norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)
    tree = Walk(model)
    for site in tree:
        m = site.module
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            reason = None
            shape = tuple(m.normalized_shape)
            if len(shape) != 1:
                reason = (
                    f"normalizes over the last {len(shape)} dims {shape}: BlockNorm works over the last"
                    " dim only"
                )
            elif overrides_forward(m, nn.LayerNorm, nn.RMSNorm):
                reason = f"{site.kind} subclass with its own forward: not known to be a plain last-dim norm"
            elif has_hooks(m):
                reason = "has hooks attached (a probe, a profiler?): apply Mods before attaching hooks"
            elif site.name == "":
                reason = "the model itself is the norm: wrap it in a container to replace it"
            if reason is not None:
                report.skipped.append(Skip(site.name, site.kind, reason))
                continue
            width = shape[0]
            w = m.weight if affine else None
            new = BlockNorm(
                block,
                eps=m.eps,
                weight_dim=width if w is not None else None,
                device=None if w is None else w.device,
                dtype=None if w is None else w.dtype,
            )
            if w is not None:
                with torch.no_grad():
                    new.weight.copy_(w)
            nfull, b, r = block_layout(width, block)
            layout = f"{nfull} block(s) of {b}" + (f" + a ragged block of {r}" if r else "")
            after = f"BlockNorm(block={block}, eps={m.eps}: {layout}" + (", weight" if w is not None else "") + ")"
            tree.replace(site, new)
            report.changed.append(Change(site.name, site.kind, _norm_desc(m), after, site.aliases))
        elif isinstance(m, other_norms):
            report.skipped.append(
                Skip(site.name, site.kind, "normalizes over the batch / channels, not the last dim: not a BlockNorm site")
            )
    return report
