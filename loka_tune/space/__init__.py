"""The search space: sites (linears and their GEMM shapes), candidates per site x role
(enumerated, filtered for eligibility, pruned by the probe) and the encoding of a
PrecisionConfig as Optuna parameters."""

from __future__ import annotations

from loka_tune.space.candidates import SearchSpace, build_space, prune_by_probe
from loka_tune.space.encode import config_from_params, params_from_config
from loka_tune.space.sites import discover_sites

# what a user calls; the other names imported above are importable but internal (they may change)
__all__ = [
    "SearchSpace",
    "build_space",
    "discover_sites",
    "prune_by_probe",
    "config_from_params",
    "params_from_config",
]
