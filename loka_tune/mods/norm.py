"""BlockNorm: parameter-free RMS normalization over fixed blocks of the last dimension.

``y = x.view(..., N // b, b) * rsqrt(mean(x^2 over each block) + eps)``, viewed back to
``(..., N)`` (LoKA, "Mods"). No mean subtraction (no cancellation error in low precision), and
each block of ``b`` features normalizes itself, so a GEMM epilogue can apply it per output
tile without a cross-tile reduction; one outlier only squashes its own block.

Widths that are not a multiple of ``b`` (our choice, documented and tested): blocks of ``b``
features are taken from the left and the **last block is ragged**: it holds the remaining
``N mod b`` features and is normalized over its own size. A width ``N <= b`` is therefore one
block, i.e. plain RMSNorm over the row. (The alternative, the largest divisor of N that is
``<= b``, degenerates for prime widths: N = 97 would give blocks of 1, i.e. ``sign(x)``.)

Affine parameters: BlockNorm is parameter-free, as in the paper. The :func:`blocknorm` pass
drops the LayerNorm / RMSNorm affine weight and bias by default (the Mods are model changes
for training from scratch); ``affine=True`` keeps an elementwise weight (initialised from
the replaced norm's weight) and still drops a LayerNorm bias. The report records the choice.
"""

from __future__ import annotations

import torch
from torch import nn

from loka_tune.errors import ModError
from loka_tune.mods._walk import (
    check_model,
    has_hooks,
    overrides_forward,
    Walk,
)
from loka_tune.mods.report import Change, PassReport, Skip

__all__ = ["BlockNorm", "blocknorm", "block_layout"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_block(block: object, what: str = "block") -> int:
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
        self.block = _check_block(block)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0):
            raise ModError(f"BlockNorm eps must be a float >= 0 or None; got {eps!r}")
        self.eps = None if eps is None else float(eps)
        if weight_dim is not None:
            _check_block(weight_dim, "weight_dim")
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
    _check_block(block)
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
