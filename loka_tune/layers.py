"""Small building blocks shared by the reference models and the Mods passes.

They live at the bottom of the package (no loka_tune imports) so that ``mods`` can recognise
and replace them without importing ``models``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SwishLayerNorm", "make_norm", "make_activation", "NORMS", "ACTIVATIONS"]

NORMS = ("layernorm", "rmsnorm", "none")
ACTIVATIONS = ("relu", "silu", "swish_layernorm", "hardswish")


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(LayerNorm(x))``, the gated activation of Wukong-style LRMs.

    The normalization is the submodule ``norm`` (an ``nn.LayerNorm``) so that a pass that
    swaps normalizations (BlockNorm) finds it like any other LayerNorm.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.norm(x))


def make_norm(kind: str, dim: int) -> nn.Module:
    """A normalization over the last dimension: ``layernorm``, ``rmsnorm`` or ``none``."""
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}: choose one of {', '.join(NORMS)}")


def make_activation(kind: str, dim: int) -> nn.Module:
    """An activation: ``relu``, ``silu``, ``swish_layernorm`` (needs ``dim``) or ``hardswish``."""
    if kind == "relu":
        return nn.ReLU()
    if kind == "silu":
        return nn.SiLU()
    if kind == "swish_layernorm":
        return SwishLayerNorm(dim)
    if kind == "hardswish":
        return nn.Hardswish()
    raise ValueError(f"unknown activation {kind!r}: choose one of {', '.join(ACTIVATIONS)}")
