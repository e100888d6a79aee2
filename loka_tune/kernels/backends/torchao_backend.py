"""``torchao``: torchao's float8 training numerics (``torchao.float8``), GEMM by GEMM.

Each operand is scaled and cast with torchao's own functions (``tensor_to_scale``: amax in
eager torch ops, scale ``fmax / clamp(amax, 1e-12)`` in float64, optional power-of-two
rounding; ``to_fp8_saturated``), laid out as torchao's float8 mm does (a contiguous copy
when a transposed view arrives), and multiplied by ``addmm_float8_unwrapped``, the
``torch._scaled_mm`` call that torchao's ``Float8TrainingTensor`` matmul makes.

torchao's recipes are whole-layer choices; :data:`RECIPES` maps each onto a
:class:`~loka_tune.config.SitePrecision` of this backend:

- ``tensorwise``: e4m3 tensorwise for all three GEMMs (torchao's default config);
- ``rowwise``: e4m3 rowwise with power-of-two scales for all three GEMMs;
- ``rowwise_with_gw_hp``: e4m3 rowwise (pow2) for fwd and dgrad, wgrad in bf16. torchao
  scales dgrad's weight *tensorwise* there (a rowwise A with a tensorwise B), which a single
  granularity per GEMM cannot express: we use rowwise for both operands (at least as
  accurate, same kernel).

Serving (a static weight): the weight is cast once with torchao's functions (its data and
torchao's scale), each call casts only the activation; traceable, as torchao's casts are.
"""

from __future__ import annotations

import torch
from torchao.float8.config import ScalingGranularity  # optional dependency: the registry imports us lazily
from torchao.float8.float8_ops import addmm_float8_unwrapped
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

from loka_tune.config import Format, GemmChoice, GemmRole, Granularity, SitePrecision
from loka_tune.errors import ConfigError
from loka_tune.kernels.backends import GPUBackend
from loka_tune.kernels.registry import Shape, register_backend
from loka_tune.recipes import RECIPES as _UNIFORM

__all__ = ["TorchAOBackend", "RECIPES", "recipe_precision"]

_DT = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}

#: torchao's own recipe names (``Float8LinearRecipeName``): loka-tune's uniform recipes of the same
#: names (the table: loka_tune.recipes) on this backend; loka-tune's ``tensorwise_fa`` is not one
TORCHAO_RECIPE_NAMES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
RECIPES: dict[str, SitePrecision] = {
    name: SitePrecision.parse(_UNIFORM[name].format(backend="torchao"), key="recipe")
    for name in TORCHAO_RECIPE_NAMES
}


def recipe_precision(name: str) -> SitePrecision:
    """The :class:`SitePrecision` of torchao recipe ``name`` (see :data:`RECIPES`)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown torchao recipe {name!r}; choose one of {', '.join(RECIPES)}", key="recipe")
    return RECIPES[name]


def _cast(x: torch.Tensor, fmt: Format, gran: Granularity, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if gran == Granularity.TENSOR:
        scale = tensor_to_scale(x, _DT[fmt], round_scales_to_power_of_2=pow2)
    else:
        scale = tensor_to_scale(x, _DT[fmt], scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                                round_scales_to_power_of_2=pow2)  # (rows, 1)
    data = to_fp8_saturated(x.to(torch.float32) * scale, _DT[fmt])
    if data.stride(-1) != 1:  # torchao's mm makes A row-major and B column-major
        data = data.contiguous()
    return data, scale


@register_backend("torchao")
class TorchAOBackend(GPUBackend):
    formats = frozenset({Format.E4M3, Format.E5M2})
    granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
    fast_accum_modes = (False, True)
    alignment = 16
    install_hint = "torchao (`pip install torchao`)"
    traceable = True  # torchao's casts are torch ops made for torch.compile
    static_granularities = frozenset({Granularity.TENSOR, Granularity.ROW})
    static_traceable = True

    def extra_reason(self, choice: GemmChoice, role: GemmRole, shape: Shape | None) -> str | None:
        if choice.a_format == Format.E5M2 and choice.b_format == Format.E5M2:
            return "cuBLASLt has no e5m2 x e5m2 FP8 GEMM"
        if choice.granularity == Granularity.ROW and Format.E5M2 in (choice.a_format, choice.b_format):
            return "torch's rowwise-scaled FP8 GEMM takes e4m3 operands only"
        return None

    def gemm_impl(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        pow2 = choice.rounding.value == "pow2"
        a8, sa = _cast(a, choice.a_format, choice.granularity, pow2)  # (m, k), scale () or (m, 1)
        b8, sb = _cast(b, choice.b_format, choice.granularity, pow2)  # (n, k), scale () or (n, 1)
        out = addmm_float8_unwrapped(a8, sa, b8.t(), sb.t() if sb.dim() == 2 else sb, output_dtype=a.dtype,
                                     use_fast_accum=choice.fast_accum)
        return out

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """torchao's cast of the weight: ``(data (N, K), torchao's scale () or (N, 1))``."""
        return _cast(w, choice.b_format, choice.granularity, choice.rounding.value == "pow2")

    def static_gemm_impl(self, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         choice: GemmChoice) -> torch.Tensor:
        a8, sa = _cast(a, choice.a_format, choice.granularity, choice.rounding.value == "pow2")  # (m, k)
        return addmm_float8_unwrapped(a8, sa, w.t(), w_scale.t() if w_scale.dim() == 2 else w_scale,
                                      output_dtype=a.dtype, use_fast_accum=choice.fast_accum)
