"""Small building blocks shared by the reference models, the Mods passes and the kernels.

They live at the bottom of the package (no loka_tune imports but the errors) so that
``mods`` can recognise and replace them without importing ``models``, and ``kernels`` (the
fused epilogue) can recognise :class:`BlockNorm` with ``isinstance`` without importing ``mods``.

BlockNorm: parameter-free RMS normalization over fixed blocks of the last dimension.
``y = x.view(..., N // b, b) * rsqrt(mean(x^2 over each block) + eps)``, viewed back to
``(..., N)`` (LoKA, "Mods"). No mean subtraction (no cancellation error in low precision), and
each block of ``b`` features normalizes itself, so a GEMM epilogue can apply it per output
tile without a cross-tile reduction; one outlier only squashes its own block.

Widths that are not a multiple of ``b`` (our choice, documented and tested): blocks of ``b``
features are taken from the left and the **last block is ragged**: it holds the remaining
``N mod b`` features and is normalized over its own size. A width ``N <= b`` is therefore one
block, i.e. plain RMSNorm over the row. (The alternative, the largest divisor of N that is
``<= b``, degenerates for prime widths: N = 97 would give blocks of 1, i.e. ``sign(x)``.)
The pass that puts BlockNorm into a model is :func:`loka_tune.mods.blocknorm`.
"""

from __future__ import annotations

import torch
from torch import nn

from loka_tune.errors import ModError

__all__ = ["SwishLayerNorm", "BlockNorm", "block_layout", "check_block", "make_norm", "make_activation", "NORMS", "ACTIVATIONS", "carry_hooks"]

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


# ----------------------------------------------------------------------------- BlockNorm
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_block(block: object, what: str = "block") -> int:
    """``block`` if it is a positive int (a BlockNorm block or width), else a ModError naming ``what``."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ModError(f"BlockNorm {what} must be a positive integer (e.g. 64, 128, 256); got {block!r}")
    return block


def block_layout(width: int, block: int) -> tuple[int, int, int]:
    """``(num_full_blocks, block, ragged)`` for a row of ``width`` features.

    ``block`` is capped at ``width``; ``ragged`` is the size of the last, short block (0 when
    ``width`` is a multiple of the block).
    """
    b = min(block, width)
    if b == 0:
        return 0, 0, 0
    return width // b, b, width % b


def _rms_blocks(x: torch.Tensor, b: int, eps: float | None) -> torch.Tensor:
    """RMS-normalize consecutive blocks of ``b`` features of the last dim (its size % b == 0)."""
    xb = x.unflatten(-1, (x.shape[-1] // b, b))  # (..., N // b, b): always a view
    xf = xb.float() if xb.dtype in _LOW_PRECISION else xb  # statistics in fp32 at least
    e = torch.finfo(x.dtype).eps if eps is None else eps  # None: F.rms_norm's default
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + e)
    return y.to(x.dtype).flatten(-2)  # (..., N)


class BlockNorm(nn.Module):
    """Parameter-free RMS normalization over blocks of ``block`` features of the last dim.

    Works on inputs of any rank >= 1 (2-D ``(B, N)``, 3-D ``(B, S, N)``, ...); statistics are
    computed in at least fp32. ``eps=None`` uses ``torch.finfo(x.dtype).eps`` like
    ``torch.nn.functional.rms_norm``. See the module docstring for widths that are not a
    multiple of ``block`` (ragged last block). With ``block >= N`` it equals
    ``F.rms_norm(x, (N,), eps=eps)``.

    ``weight_dim`` (optional) adds an elementwise learnable weight of that size (initialised
    to ones); the default, ``None``, is the paper's parameter-free form.

    The forward has only shape-dependent Python branches (static under ``torch.compile``):
    no data-dependent control flow, no graph breaks.
    """

    def __init__(
        self,
        block: int,
        eps: float | None = 1e-6,
        *,
        weight_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.block = check_block(block)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0):
            raise ModError(f"BlockNorm eps must be a float >= 0 or None; got {eps!r}")
        self.eps = None if eps is None else float(eps)
        if weight_dim is not None:
            check_block(weight_dim, "weight_dim")
            self.weight = nn.Parameter(torch.ones(weight_dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        nfull, b, r = block_layout(n, self.block)
        if n == 0:
            y = x
        elif r == 0:
            y = _rms_blocks(x, b, self.eps)
        else:  # ragged last block of r features, normalized over its own size
            y = torch.cat([_rms_blocks(x[..., : n - r], b, self.eps), _rms_blocks(x[..., n - r :], r, self.eps)], dim=-1)
        if self.weight is not None:
            y = y * self.weight
        return y

    def extra_repr(self) -> str:
        s = f"block={self.block}, eps={self.eps}"
        if self.weight is not None:
            s += f", weight_dim={self.weight.shape[0]}"
        return s


#: a module's forward-hook tables (those this torch has), which a replacement module takes over
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def carry_hooks(src: nn.Module, dst: nn.Module) -> None:
    """``dst`` replaces ``src`` in a model: it takes ``src``'s train mode and forward (pre-)hooks
    (LokaLinear, ServingLinear and the plain Linear an apply swaps in, one rule for all three)."""
    dst.train(src.training)
    for attr in _HOOK_TABLES:
        if hasattr(src, attr):
            getattr(dst, attr).update(getattr(src, attr))
