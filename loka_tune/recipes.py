"""Named whole-model precision recipes as plain data: the counterpart of torchao's recipe names.

A recipe is a starting point, not a tuned result: the uniform ones run every Linear the same
way, ``dispatch`` is LoKA's per-GEMM plan from a probe report. A study (``loka-tune tune``)
searches for the fastest config within the loss budget, and starts from these recipes.

This module is data only (it imports nothing of loka-tune): :mod:`loka_tune.config` builds the
uniform recipes from it (:meth:`~loka_tune.config.PrecisionConfig.from_recipe`), and
:mod:`loka_tune.dispatch`, a layer above, builds the ``dispatch`` one
(:func:`loka_tune.dispatch.recipe_config`, public as ``loka_tune.recipe_config``).

>>> from loka_tune import PrecisionConfig
>>> PrecisionConfig.from_recipe("rowwise").default.short_str()
'e4m3.row.pow2.torch_scaled_mm'
>>> PrecisionConfig.from_recipe("tensorwise_fa").default.short_str()
'e4m3.tensor.fa.torch_scaled_mm'
>>> SIZE_FILTERS["tensorwise"].keeps(2048, 2048), SIZE_FILTERS["rowwise"].keeps(2048, 2048)
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RECIPES", "DISPATCH", "RECIPE_NAMES", "SizeFilter", "SIZE_FILTERS"]

#: Named uniform recipes: a site id whose ``{backend}`` the recipe's backend fills in.
RECIPES: dict[str, str] = {
    "bf16": "bf16",
    "tensorwise": "e4m3.tensor.{backend}",
    # tensorwise with fast accumulation in all three GEMMs (torchao's tensorwise has it in fwd only):
    # cuBLAS's FP8 GEMM without it promotes its partial sums every few k-steps, ~10% of the GEMM;
    # on the large Wukong's filter sites it made the compiled step 1.3% faster than torchao's line
    # at B = 8192 and 1.2% at 32768 (BENCHMARKS.md, 2026-12-04). The study's loss budget decides.
    "tensorwise_fa": "e4m3.tensor.fa.{backend}",
    "rowwise": "e4m3.row.pow2.{backend}",
    "rowwise_with_gw_hp": "e4m3.row.pow2.{backend}|e4m3.row.pow2.{backend}|bf16",
}

#: The per-GEMM recipe built from a probe report (by :mod:`loka_tune.dispatch`).
DISPATCH = "dispatch"

#: Every recipe name, in the order errors list them.
RECIPE_NAMES: tuple[str, ...] = (*RECIPES, DISPATCH)


@dataclass(frozen=True)
class SizeFilter:
    """Which Linears a recipe converts, by their weight's shape: torchao's size filter as data.

    A Linear is kept when both ``in_features`` and ``out_features`` are multiples of ``align``
    (FP8 GEMMs need it) and it lies in none of the ``skip`` boxes: ``(max_in, max_out)`` means
    "skipped when ``in_features <= max_in`` and ``out_features <= max_out``" (``None``: no bound
    on that side). The boxes are torchao's H100 heuristics (``_auto_filter_for_recipe`` in
    ``torchao/float8/float8_linear_utils.py``: where the FP8 GEMM and its casts cost more than
    they save), restated here so that a study can start from torchao's choice of Linears
    without importing torchao.
    """

    align: int = 16
    skip: tuple[tuple[int | None, int | None], ...] = ()

    def keeps(self, in_features: int, out_features: int) -> bool:
        if in_features % self.align or out_features % self.align:
            return False
        return not any((mi is None or in_features <= mi) and (mo is None or out_features <= mo)
                       for mi, mo in self.skip)


_TENSORWISE_FILTER = SizeFilter(skip=((4096, 1024),))  # small in and out at once lose (in <= 4096 and out <= 1024)

#: torchao's size filter per recipe (its rowwise_with_gw_hp recipe has none), as torchao 0.17
#: states it: ``N, K = weight.shape``, so K is ``in_features`` and N ``out_features`` (older
#: releases read ``K, N = weight.shape``, the same bounds on the other sides; restated from
#: those, this table converted ``dense_proj`` (2048 -> 1024) of the large Wukong, which torchao's
#: own filter leaves in bf16, and kept 1 of the 5 Linears its rowwise filter converts).
SIZE_FILTERS: dict[str, SizeFilter] = {
    "tensorwise": _TENSORWISE_FILTER,
    # tensorwise_fa: the same Linears (torchao has no such recipe; its GEMMs are tensorwise's, faster)
    "tensorwise_fa": _TENSORWISE_FILTER,
    # rowwise: its scales cost more, so it needs out > 2048, in > 1024, and not both in <= 2048, out <= 4096
    "rowwise": SizeFilter(skip=((None, 2048), (1024, None), (2048, 4096))),
}
