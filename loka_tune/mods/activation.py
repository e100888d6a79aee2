"""Hard Swish in place of Swish / SwishLayerNorm (LoKA, "Mods").

``hardswish(x) = x * relu6(x + 3) / 6``: no exponential, bounded gate, fuses into the same
GEMM epilogue as BlockNorm. Only the Swish family is replaced: ``nn.SiLU`` and
:class:`loka_tune.layers.SwishLayerNorm` (the whole gated activation ``x * sigmoid(LN(x))``,
its LayerNorm included). GELU, ReLU and the rest are left alone.
"""

from __future__ import annotations

from torch import nn

from loka_tune.layers import SwishLayerNorm
from loka_tune.mods._walk import Walk, check_model, has_hooks, overrides_forward
from loka_tune.mods.report import Change, PassReport, Skip

__all__ = ["hardswish"]


def hardswish(model: nn.Module) -> PassReport:
    """Replace every ``nn.SiLU`` and :class:`SwishLayerNorm` with ``nn.Hardswish``.

    ``SiLU(inplace=True)`` becomes ``Hardswish(inplace=True)``. A ``SwishLayerNorm``'s
    LayerNorm parameters leave the model (apply before building the optimizer). Skipped and
    reported: subclasses with their own ``forward``, modules with hooks attached, and modules
    of unknown types whose class name says Swish/SiLU (a custom Swish is not replaced blindly).
    Functional ``F.silu`` calls inside a ``forward`` cannot be seen by a module pass.

    Changes the function (meant for training from scratch). Idempotent.
    """
    check_model(model)
    report = PassReport("hardswish")
    tree = Walk(model)
    for site in tree:
        m = site.module
        if isinstance(m, (nn.SiLU, SwishLayerNorm)):
            if overrides_forward(m, nn.SiLU, SwishLayerNorm):
                reason = f"{site.kind} subclass with its own forward: not known to be a plain Swish"
            elif has_hooks(m):
                reason = "has hooks attached (a probe, a profiler?): apply Mods before attaching hooks"
            elif site.name == "":
                reason = "the model itself is the activation: wrap it in a container to replace it"
            else:
                reason = None
            if reason is not None:
                report.skipped.append(Skip(site.name, site.kind, reason))
                continue
            inplace = bool(getattr(m, "inplace", False))
            new = nn.Hardswish(inplace=inplace)
            if isinstance(m, SwishLayerNorm):
                before = f"SwishLayerNorm(x * sigmoid({m.norm!r}))"
            else:
                before = f"SiLU(inplace={inplace})"
            tree.replace(site, new)
            report.changed.append(Change(site.name, site.kind, before, f"Hardswish(inplace={inplace})", site.aliases))
        elif not isinstance(m, nn.Hardswish):
            cls = site.kind.lower()
            if ("swish" in cls or "silu" in cls) and "hard" not in cls:
                report.skipped.append(
                    Skip(site.name, site.kind, "looks like a Swish of an unknown type: not replaced (only nn.SiLU"
                         " and SwishLayerNorm are)")
                )
    return report
