"""Encode / decode between a :class:`~loka_tune.config.PrecisionConfig` and Optuna parameters.

In a recipe space (the default, :mod:`loka_tune.space.recipe_space`): one categorical parameter
per site with more than one value (``"<site>@site"``, values are the site's recipes as
:meth:`SitePrecision.short_str` strings: ``"bf16"``, ``"e4m3.tensor.torch_scaled_mm"``, or
``"fwd|dgrad|wgrad"`` where the three differ). In a per-GEMM space (``[space] per_gemm = true``):
one per site x role with more than one surviving choice
(``"<site>@<role>"``, values are choice ids such as ``"e4m3.row.emulated"``), or per site
(``"<site>@all"``) when the space ties the three GEMMs together. In both, one per Mods dimension
(``"mods.<field>"``, e.g. ``"mods.fuse_epilogue"``: False / True, kept only with
``blocknorm`` and ``hardswish`` on; ``"mods.fp8_chain"``, kept only with ``no_bias``,
``blocknorm = 256`` and ``hardswish`` on). Sites (site x roles) with bf16 as their only choice
get no parameter: they are bf16 in every trial. Decoding is deterministic, so a config's
:meth:`PrecisionConfig.key` identifies a trial across workers and restarts.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from loka_tune.config import ROLES, GemmChoice, ModsConfig, PrecisionConfig, SitePrecision
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices, tied_choices

__all__ = [
    "param_name",
    "distributions",
    "suggest",
    "config_from_params",
    "params_from_config",
    "params_picking",
    "mods_from_params",
    "mods_dims",
    "fusable",
]

ALL = "all"
SITE = "site"  # the parameter of a recipe space's site: "<site>@site"


def param_name(site: str, role: str | None) -> str:
    """The Optuna parameter of ``site``'s ``role`` GEMM (``role=None``: the tied parameter;
    ``role="site"``: a recipe space's site parameter)."""
    return f"{site}@{role or ALL}"


def _dims(space: SearchSpace) -> dict[str, tuple[Any, ...]]:
    dims: dict[str, tuple[Any, ...]] = {}
    for sc in space.sites:
        if not space.per_gemm:
            if len(sc.values) > 1:
                dims[param_name(sc.name, SITE)] = sc.values
        elif space.per_role:
            for r in ROLES:
                ch = sc.choices[r.value]
                if len(ch) > 1:
                    dims[param_name(sc.name, r.value)] = tuple(ch)
        else:
            ch = tied_choices(sc)
            if len(ch) > 1:
                dims[param_name(sc.name, None)] = ch
    for k, v in space.mods.items():
        if len(v) > 1:
            dims[k] = tuple(v)
    return dims


def distributions(space: SearchSpace) -> dict[str, Any]:
    """Parameter name -> ``optuna.distributions.CategoricalDistribution`` (in a stable order)."""
    from optuna.distributions import CategoricalDistribution

    return {k: CategoricalDistribution(list(v)) for k, v in _dims(space).items()}


def suggest(trial: Any, space: SearchSpace) -> PrecisionConfig:
    """Ask ``trial`` for every parameter of ``space`` and decode the answer."""
    params = {k: trial.suggest_categorical(k, list(v)) for k, v in _dims(space).items()}
    return config_from_params(space, params)


def mods_dims(allowed: Sequence[str], *, blocknorm_sizes: Sequence[int] = (128,),
              pad_multiples: Sequence[int] = (16,)) -> dict[str, tuple[Any, ...]]:
    """The Mods the sampler may switch on, as categorical choices (off first), named
    ``mods.<field>`` (:func:`loka_tune.mods.mod_choices` restricted to ``allowed``)."""
    if not allowed:
        return {}
    from loka_tune.mods.search import mod_choices

    ch = mod_choices(blocknorm=tuple(blocknorm_sizes), pad=tuple(pad_multiples), include=tuple(allowed))
    return {f"mods.{k}": tuple(v) for k, v in ch.items()}


def mods_from_params(params: Mapping[str, Any]) -> ModsConfig:
    """The :class:`ModsConfig` of the ``mods.<field>`` parameters (absent ones are off).

    ``mods.fuse_epilogue`` is kept only when ``blocknorm`` and ``hardswish`` are on too:
    without both there is no (Linear, BlockNorm, Hard Swish) chain to fuse, and dropping it
    gives such a trial the config (and cache key) of the same trial unfused.
    """
    from loka_tune.mods.search import mods_from_params as _decode

    mods = _decode({k: v for k, v in params.items() if k.startswith("mods.")})
    if mods.fuse_epilogue and not fusable(mods):
        mods = replace(mods, fuse_epilogue=False)
    return mods


def fusable(mods: ModsConfig) -> bool:
    """Whether ``mods`` makes the chains ``fuse_epilogue`` fuses (BlockNorm and Hard Swish on)."""
    return mods.blocknorm is not None and mods.hardswish


def _pattern(site: str, mods: ModsConfig) -> str:
    """The rule pattern of ``site``: with padding on, the padded GEMM is the child ``<site>.linear``."""
    if mods.pad is None:
        return site
    return "re:" + re.escape(site) + r"(?:\.linear)?"


def config_from_params(space: SearchSpace, params: Mapping[str, Any]) -> PrecisionConfig:
    """Decode Optuna parameters into a PrecisionConfig: default bf16, one rule per non-bf16 site.

    Raises ``KeyError``-free: parameters the space does not have are ignored, missing ones are bf16.
    """
    rules: dict[str, SitePrecision] = {}
    mods = mods_from_params(params)
    for sc in space.sites:
        if not space.per_gemm:
            name = param_name(sc.name, SITE)
            prec = SitePrecision.parse(params.get(name, BF16_ID), key=name)
        else:
            if space.per_role:
                ids = [params.get(param_name(sc.name, r.value), BF16_ID) for r in ROLES]
            else:
                ids = [params.get(param_name(sc.name, None), BF16_ID)] * 3
            prec = SitePrecision(*(GemmChoice.parse(i, key=param_name(sc.name, r.value)) for i, r in zip(ids, ROLES)))
        if not prec.is_bf16:
            rules[_pattern(sc.name, mods)] = prec
    return PrecisionConfig.from_sites(rules, mods=mods)


def params_from_config(space: SearchSpace, config: PrecisionConfig) -> tuple[dict[str, Any], list[str]]:
    """The parameters encoding ``config`` in ``space`` and notes for what did not fit.

    A choice the space does not offer for that site x role (in a recipe space: a site
    precision that is none of the site's values) becomes bf16 (noted); so does a Mods setting
    outside the space's dimensions.
    """
    dims = _dims(space)
    params: dict[str, Any] = {}
    notes: list[str] = []
    for sc in space.sites:
        prec = config.resolve(sc.name)
        if not space.per_gemm:
            pairs = [(param_name(sc.name, SITE), prec.short_str())]
        elif space.per_role:
            pairs = [(param_name(sc.name, r.value), prec[r].short_str()) for r in ROLES]
        else:
            ids = {prec[r].short_str() for r in ROLES}
            cid = ids.pop() if len(ids) == 1 else BF16_ID
            if not prec.is_bf16 and cid == BF16_ID:
                notes.append(f"{sc.name}: roles differ ({prec.short_str()}) in a tied space -> bf16")
            pairs = [(param_name(sc.name, None), cid)]
        for name, cid in pairs:
            if name in dims:
                if cid in dims[name]:
                    params[name] = cid
                else:
                    params[name] = BF16_ID
                    notes.append(f"{name}: {cid} not in the space -> bf16")
            elif cid != BF16_ID:
                notes.append(f"{name}: {cid} not in the space (bf16 only there) -> bf16")
    mods = config.mods.to_dict()
    for name, choices in space.mods.items():
        if name not in dims:
            continue
        v = mods.get(name.split(".", 1)[1])
        if v in choices:
            params[name] = v
        else:
            params[name] = choices[0]
            notes.append(f"{name}: {v!r} not among {list(choices)} -> {choices[0]!r}")
    for field_ in ("no_bias", "blocknorm", "hardswish", "pad", "fuse_epilogue", "fp8_chain"):
        if f"mods.{field_}" not in dims and mods.get(field_) not in (None, False):
            notes.append(f"mods.{field_}: {mods[field_]!r} not searched -> off")
    if config.mods.fuse_epilogue and "mods.fuse_epilogue" in dims and not fusable(mods_from_params(params)):
        notes.append("mods.fuse_epilogue: needs blocknorm and hardswish on in the space's encoding -> off")
    return params, notes


def params_picking(space: SearchSpace, pick: Callable[[SiteChoices, str, tuple[str, ...]], str],
                   mods: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parameters choosing ``pick(site_choices, role, choices)`` at every site parameter.

    ``role`` is ``"all"`` in a tied space, ``"site"`` in a recipe space (``choices``: the site's
    values). ``mods`` gives Mods parameter values (default: off).
    """
    dims = _dims(space)
    params: dict[str, Any] = {}
    for sc in space.sites:
        if not space.per_gemm:
            name = param_name(sc.name, SITE)
            if name in dims:
                params[name] = pick(sc, SITE, dims[name])
        elif space.per_role:
            for r in ROLES:
                name = param_name(sc.name, r.value)
                if name in dims:
                    params[name] = pick(sc, r.value, dims[name])
        else:
            name = param_name(sc.name, None)
            if name in dims:
                params[name] = pick(sc, ALL, dims[name])
    for name, choices in space.mods.items():
        if name in dims:
            params[name] = (mods or {}).get(name, choices[0])
    return params
