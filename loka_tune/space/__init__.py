"""The search space: sites (linears and their GEMM shapes), candidates per site x role
(enumerated, filtered for eligibility, pruned by the probe) and the encoding of a
PrecisionConfig as Optuna parameters."""

from __future__ import annotations

from loka_tune.space.candidates import (
    SearchSpace,
    SiteChoices,
    build_space,
    eligibility,
    enumerate_candidates,
    prune_by_probe,
)
from loka_tune.space.encode import (
    config_from_params,
    distributions,
    fusable,
    mods_dims,
    mods_from_params,
    param_name,
    params_from_config,
    params_picking,
    suggest,
)
from loka_tune.space.sites import Site, discover_sites

__all__ = [
    "Site", "discover_sites",
    "SearchSpace", "SiteChoices", "build_space", "eligibility", "enumerate_candidates",
    "prune_by_probe",
    "config_from_params", "distributions", "fusable", "mods_dims", "mods_from_params", "param_name", "params_from_config",
    "params_picking", "suggest",
]
