"""Named whole-model precision recipes: the counterpart of torchao's ``from_recipe_name``.

A recipe is a starting point, not a tuned result: the uniform ones run every Linear the same
way, ``dispatch`` is LoKA's per-GEMM plan from a probe report. A study (``loka-tune tune``)
searches for the fastest config within the loss budget; a recipe is what you compare it with.

>>> from loka_tune import PrecisionConfig
>>> PrecisionConfig.from_recipe("rowwise").default.short_str()
'e4m3.row.pow2.torch_scaled_mm'
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, Mapping

from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.errors import ConfigError

__all__ = ["RECIPES", "recipe_config"]

#: Named uniform recipes: a site id whose ``{backend}`` :func:`recipe_config` fills in.
RECIPES: dict[str, str] = {
    "bf16": "bf16",
    "tensorwise": "e4m3.tensor.{backend}",
    "rowwise": "e4m3.row.pow2.{backend}",
    "rowwise_with_gw_hp": "e4m3.row.pow2.{backend}|e4m3.row.pow2.{backend}|bf16",
}


def recipe_config(
    name: str,
    *,
    backend: str = "torch_scaled_mm",
    mods: ModsConfig | Mapping[str, Any] | None = None,
    report: Any = None,
    **plan_options: Any,
) -> PrecisionConfig:
    """The :class:`PrecisionConfig` of recipe ``name``.

    - ``"bf16"``: every GEMM in bf16 (the baseline; combine it with ``mods``);
    - ``"tensorwise"``: every GEMM e4m3 with one scale per tensor;
    - ``"rowwise"``: every GEMM e4m3 with one power-of-two scale per row;
    - ``"rowwise_with_gw_hp"``: rowwise fwd and dgrad, wgrad kept in bf16;
    - ``"dispatch"``: LoKA's per-GEMM plan built from a probe ``report`` by
      :func:`loka_tune.dispatch.build_plan` (``plan_options``: ``max_error``, ``min_speedup``,
      ``timings``, ``device``).

    ``backend`` names the kernel library of the uniform recipes: ``torch_scaled_mm``
    (cuBLASLt, the default), ``torchao``, ``fbgemm``, ``triton``, or ``emulated`` (runs
    anywhere, for checking numerics). ``mods``: the model adaptations to apply first (a
    :class:`ModsConfig`, or a mapping such as ``{"no_bias": True}`` as in the JSON file).
    """
    if name == "dispatch":
        if report is None:
            raise ConfigError(
                "the 'dispatch' recipe is built from a probe report: pass report=<a Probe's report or a"
                " saved probe report>, or call loka_tune.build_plan(report)", key="recipe")
        # Dispatch sits above the vocabulary: imported when this recipe is asked for
        plan = importlib.import_module("loka_tune.dispatch").build_plan(report, **plan_options)
        return replace(plan, mods=ModsConfig.of(mods))
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join([*RECIPES, 'dispatch'])}",
                          key="recipe")
    if report is not None or plan_options:
        extra = sorted(plan_options) + (["report"] if report is not None else [])
        raise ConfigError(f"{', '.join(extra)} belong(s) to the 'dispatch' recipe, not to {name!r}; drop them",
                          key="recipe")
    if backend == "bf16" and name != "bf16":
        raise ConfigError(f"the {name!r} recipe runs FP8 GEMMs; name an FP8 backend such as 'torch_scaled_mm',"
                          " 'torchao', 'fbgemm', 'triton' or 'emulated'", key="backend")
    site = SitePrecision.parse(RECIPES[name].format(backend=backend), key="recipe")
    return PrecisionConfig(default=site, mods=ModsConfig.of(mods),
                           provenance={"source": f"loka-tune recipe {name}", "recipe": name, "backend": backend})
