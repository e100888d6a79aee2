"""``torch.ops.loka.gemm``: one canonical GEMM as a ``torch.library`` custom op.

``loka::gemm(a, b, choice, role, tag="") -> Tensor`` computes ``a @ b.T`` (``a`` ``(m, k)``,
``b`` ``(n, k)``) with the backend and recipe named by the ``choice`` string
(:meth:`GemmChoice.short_str`) for the GEMM ``role`` (``fwd`` / ``dgrad`` / ``wgrad``), in
``a.dtype``. Being a custom op with a fake (meta) implementation, it is opaque to
``torch.compile``: graphs capture it whole (no graph break), and the backend's Python code
(quantization, kernel launches, checks) runs at execution time.

Non-finite operands: for FP8 choices the op first checks that ``a`` and ``b`` are finite
(when the check is on: by default on CPU tensors only, see :func:`set_nonfinite_check`).
If not, that call runs the plain
unquantized GEMM instead (so ``inf``/``NaN`` propagate exactly as in bf16 rather than
poisoning whole quantization tiles) and increments the count for ``tag`` (read with
:func:`nonfinite_count`; :class:`~loka_tune.kernels.linear.LokaLinear` exposes its own as
``nonfinite_fallbacks``). On GPU the check would cost one device synchronization per GEMM
and break CUDA-graph capture, so by default it is off for CUDA tensors: there a non-finite
operand gives NaN tiles (see :mod:`loka_tune.kernels.quant`) and the trainer stops the run
with status "nonfinite". ``set_nonfinite_check(True)`` forces it on everywhere (debugging),
``False`` off everywhere, ``None`` restores the default.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch

from loka_tune.config import GemmChoice, GemmRole
from loka_tune.kernels.registry import get_backend

__all__ = ["gemm", "nonfinite_count", "reset_nonfinite", "set_nonfinite_check", "nonfinite_check_forced",
           "parse_choice"]

_NONFINITE: Counter[str] = Counter()
_CHECK: dict[str, bool | None] = {"enabled": None}  # None: on for CPU tensors only


@lru_cache(maxsize=4096)
def parse_choice(choice: str) -> GemmChoice:
    """Cached :meth:`GemmChoice.parse` (the op receives choices as strings)."""
    return GemmChoice.parse(choice)


def set_nonfinite_check(enabled: bool | None) -> bool | None:
    """Force the per-GEMM non-finite operand check on (True) or off (False) on every device,
    or restore the default (None: on for CPU tensors, off for GPU ones); returns the previous
    setting."""
    prev = _CHECK["enabled"]
    _CHECK["enabled"] = None if enabled is None else bool(enabled)
    return prev


def nonfinite_check_forced() -> bool:
    """True after ``set_nonfinite_check(True)``: LokaLinear then routes every GEMM through the op."""
    return _CHECK["enabled"] is True


def _check_enabled(a: torch.Tensor) -> bool:
    enabled = _CHECK["enabled"]
    return a.device.type == "cpu" if enabled is None else enabled


def nonfinite_count(tag: str) -> int:
    """How many GEMM calls with ``tag`` fell back to the unquantized GEMM (non-finite operand)."""
    return _NONFINITE[tag]


def reset_nonfinite(tag: str | None = None) -> None:
    """Zero the fallback count of ``tag`` (all tags when ``None``)."""
    if tag is None:
        _NONFINITE.clear()
    else:
        _NONFINITE.pop(tag, None)


@torch.library.custom_op("loka::gemm", mutates_args=())
def gemm(a: torch.Tensor, b: torch.Tensor, choice: str, role: str, tag: str = "") -> torch.Tensor:
    """``a @ b.T`` under ``choice`` for ``role`` (see the module docstring), in ``a.dtype``."""
    c = parse_choice(choice)
    r = GemmRole(role)
    if not c.is_bf16 and _check_enabled(a):
        finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
        if not finite:
            _NONFINITE[tag] += 1
            return a @ b.t()  # (m, n): the unquantized GEMM, inf/NaN propagate as in bf16
    out = get_backend(c.backend).gemm(a, b, c, r)
    assert out.shape == (a.shape[0], b.shape[0]) and out.dtype == a.dtype, (
        f"backend {c.backend!r} returned {tuple(out.shape)} {out.dtype} for {tuple(a.shape)} @ {tuple(b.shape)}.T"
    )
    return out


@gemm.register_fake
def _gemm_fake(a: torch.Tensor, b: torch.Tensor, choice: str, role: str, tag: str = "") -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "loka::gemm takes 2-D operands")
    torch._check(a.shape[1] == b.shape[1], lambda: "loka::gemm: a and b must share the reduction (last) dim")
    return a.new_empty((a.shape[0], b.shape[0]))
