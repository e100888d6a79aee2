"""``apply``: put a :class:`~loka_tune.config.PrecisionConfig` into a model, in place.

>>> summary = apply(model, "best.json")          # doctest: +SKIP
>>> print(summary)                               # doctest: +SKIP

Steps: (1) run the config's Mods (``loka_tune.mods.apply_mods``) when any is enabled and not
already applied to this model; (2) find the eligible linear layers
(:func:`~loka_tune.kernels.linear.find_linears`); (3) check that every per-site rule matches
one of them; (4) resolve each site's :class:`SitePrecision` (exact name, then ``re:`` rule,
then default), check each GEMM choice against its backend on the layer's device and shape;
(5) swap: a site that resolves to plain bf16 for all three GEMMs is (or becomes again) a plain
``nn.Linear``; every other site becomes a :class:`~loka_tune.kernels.linear.LokaLinear`
sharing the layer's parameters (or, if it already is one, gets the new precision); (6) with
``mods.fuse_epilogue`` on, every (Linear, BlockNorm, Hard Swish) container chain (``MLPBlock``)
whose linear site's fwd choice the fused kernel runs on the layer's device (rowwise
e4m3/e5m2 ``.triton`` on CUDA, any ``.emulated`` choice) becomes one
:class:`~loka_tune.kernels.fused.FusedLinearBlockNormHardswish` with that site's own fwd /
dgrad / wgrad choices; the fused module keeps the three modules as children, so parameter
names and the state dict do not change. Other chains (a bf16 site, an unsupported choice, an
``nn.Sequential`` run, hooks) stay unfused and the summary says why: fusion is the same
arithmetic in one kernel, so it is never an error, ``strict`` or not. A model applied before
is first unfused (step 0), so applying again with another config just updates precisions
(and fusion): ``apply`` is idempotent. With ``mods.fp8_chain`` on, between (4) and (5): each MLP
the model names (``mlp_chains()``) whose blocks, from the first that can join, are all e4m3
tensorwise sites on ``torch_scaled_mm`` becomes a :class:`~loka_tune.kernels.chain.ChainMLP`
(with the model's tail linear after it where that site is tensorwise too, folded into it); its
linears stay plain ``nn.Linear`` inside it, the state dict keeps its keys, and other MLPs stay
as they are with the reason in the summary. A model applied before is unchained first.

All or nothing: on any error the model is restored to what it was before the call (its
module tree, parameters, buffers and attributes, the Mods mark included), so a corrected config
can be applied to the same model.

Serving (``serving=True``, :mod:`loka_tune.serving`): the same Mods and site resolution, but each
site whose fwd choice is FP8 becomes an inference-only
:class:`~loka_tune.kernels.serving.ServingLinear` (its weight quantized once, only the
activation per call, no dgrad / wgrad); ``batch=B`` takes the fwd choices of the config's
serving plan at the smallest bucket holding ``B`` rows. A model already applied (for training
or serving) is refused with :class:`ServingError`, and so is a served model given to a training
``apply``: its high-precision weights are gone.

Errors: a per-site rule that matches no layer -> :class:`ConfigError` naming the rule and
listing real site names; an unknown backend name -> :class:`BackendError`; a choice its
backend cannot run here (device, alignment, format, missing install) ->
:class:`UnsupportedChoiceError` naming the site. With ``strict=False``, a rule that matches no
layer is skipped (``ApplySummary.unmatched`` lists it and the summary says so), and a choice its
backend cannot run here runs that GEMM in bf16 (``ApplySummary.fallbacks`` says why); an
unknown backend name is an error either way (a typo, not a missing install).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from loka_tune.applying import (
    NO_CHAIN_NOTE,
    ApplySummary,
    as_config,
    check_rules,
    load_config,
    module_parents,
    restore_modules,
    run_mods,
    snapshot_modules,
    to_plain_linear,
)
from loka_tune.config import BF16, ROLES, Format, Granularity, PrecisionConfig, SitePrecision
from loka_tune.errors import BackendError, ConfigError, UnsupportedChoiceError

__all__ = ["ApplySummary", "apply", "export", "load_config", "as_config"]

def export(config: PrecisionConfig | Mapping[str, Any] | str | Path, path: str | Path) -> Path:
    """Write ``config`` as JSON to ``path`` (atomically); returns the path."""
    return as_config(config).save(path)


def _check_site(
    site: str, lin: nn.Linear, prec: SitePrecision, strict: bool
) -> tuple[SitePrecision, dict[str, str]]:
    """Check each GEMM choice of ``site``; returns the precision to use and its fallbacks."""
    from loka_tune.kernels.registry import check_supported, get_backend, list_backends

    dev = lin.weight.device
    k, n = lin.in_features, lin.out_features
    fallbacks: dict[str, str] = {}
    new: dict[str, Any] = {}
    for role in ROLES:
        choice = prec[role]
        if choice == BF16:
            continue
        if choice.backend not in list_backends():
            raise BackendError(
                f"site {site!r}, {role.value} GEMM {choice.short_str()!r}: unknown backend"
                f" {choice.backend!r}; known backends: {', '.join(list_backends())}"
            )
        try:
            backend = get_backend(choice.backend)
            devices = sorted(backend.devices) if dev.type == "meta" else [dev]
            last: UnsupportedChoiceError | None = None
            for d in devices:
                try:
                    check_supported(choice, role, d, role.shape(None, k, n), site=site)  # batch unknown here
                    last = None
                    break
                except UnsupportedChoiceError as e:
                    last = e
            if last is not None:
                raise last
        except BackendError as e:  # includes UnsupportedChoiceError
            if strict:
                if isinstance(e, UnsupportedChoiceError):
                    raise
                raise UnsupportedChoiceError(
                    f"site {site!r}, {role.value} GEMM {choice.short_str()!r}: {e}."
                    " Install it, choose another backend, or apply with strict=False to use bf16 here."
                ) from e
            fallbacks[role.value] = str(e)
            new[role.value] = BF16
    return (replace(prec, **new) if new else prec), fallbacks


def apply(
    model: nn.Module,
    config: PrecisionConfig | Mapping[str, Any] | str | Path,
    *,
    strict: bool = True,
    serving: bool = False,
    batch: int | None = None,
) -> ApplySummary:
    """Apply ``config`` (a PrecisionConfig, its dict form or a JSON path) to ``model`` in place.

    All or nothing: on any error the model is left as it was. ``strict=False`` skips per-site
    rules that match no layer and runs in bf16 the GEMMs whose backend cannot run here; the
    summary lists both. See the module docstring for the steps and errors. Returns an
    :class:`ApplySummary`.

    ``serving=True``: the inference-only serving form (static FP8 weights, fwd GEMMs only; see
    :mod:`loka_tune.serving`); ``batch``: with ``serving``, the batch size to serve, which
    picks the bucket of the config's serving plan.
    """
    if batch is not None and not serving:
        raise ConfigError(f"got batch={batch!r} without serving=True: the batch picks a bucket of the config's"
                          " serving plan; pass serving=True too (training takes no batch here)", key="batch")
    cfg = as_config(config)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"apply takes an nn.Module, got {type(model).__name__}", key="(model)")
    if isinstance(model, nn.Linear):
        raise ConfigError(
            "the model is itself a single nn.Linear, which cannot be swapped in place; wrap it in a"
            " module (e.g. nn.Sequential(linear)) or use LokaLinear.from_linear(linear, precision)",
            key="(model)",
        )
    snap = snapshot_modules(model)
    try:
        if serving:
            from loka_tune.serving import apply_serving

            return apply_serving(model, cfg, strict=strict, batch=batch)
        return _apply(model, cfg, strict)
    except BaseException:
        restore_modules(snap)
        raise


def _tensorwise(prec: SitePrecision) -> bool:
    """Whether all three GEMMs of ``prec`` are e4m3 tensorwise on ``torch_scaled_mm`` (what an FP8
    chain runs: torchao's tensorwise recipe, fast accumulation in the forward GEMM)."""
    return all(prec[r].a_format == prec[r].b_format == Format.E4M3 and prec[r].granularity == Granularity.TENSOR
               and prec[r].backend == "torch_scaled_mm" for r in ROLES)


def _chain_mlps(model: nn.Module, requested: dict[str, SitePrecision], plan: dict[str, SitePrecision],
                linears: dict[str, nn.Linear], summary: ApplySummary) -> None:
    """The ``fp8_chain`` Mod: each MLP the model names (``mlp_chains()``; without that method, every
    ``nn.Sequential`` named ``*mlp``) whose blocks from the first that can join are all e4m3
    tensorwise sites becomes a :class:`~loka_tune.kernels.chain.ChainMLP`, with its tail where the
    tail's site is tensorwise too; the rest is reported in ``summary.chain_skipped``. A site counts
    where the config asks it (``requested``) and its backend runs here (``plan``, after the
    backend checks), or, on a CPU, where only the config asks it: the chain's CPU path is the
    torch reference, which runs anywhere (its fallback note is then dropped)."""
    from loka_tune.kernels.chain import chain_start, swap_chain
    from loka_tune.kernels.linear import LokaLinear

    declared = getattr(model, "mlp_chains", None)
    if callable(declared):
        pairs: list[tuple[str, str | None]] = list(declared())
    else:
        pairs = [(n, None) for n, m in model.named_modules() if isinstance(m, nn.Sequential) and n.endswith("mlp")]
    for mlp, tail in pairs:
        seq = model.get_submodule(mlp)
        if not isinstance(seq, nn.Sequential) or len(seq) == 0:
            continue
        for j, block in enumerate(seq):  # a LokaLinear from an earlier apply: plain again (shared weights)
            lin = getattr(block, "linear", None)
            if isinstance(lin, LokaLinear):
                block.linear = linears[f"{mlp}.{j}.linear"] = to_plain_linear(lin)
        start, why = chain_start(seq)
        if start is None:
            summary.chain_skipped[mlp] = why
            continue
        sites = [f"{mlp}.{j}.linear" for j in range(start, len(seq))]
        on_cpu = all(not p.is_cuda for p in seq.parameters())

        def ok(site: str) -> bool:
            return _tensorwise(requested[site]) and (on_cpu or _tensorwise(plan[site]))

        bad = [s for s in sites if not ok(s)]
        if bad:
            summary.chain_skipped[mlp] = (f"{bad[0]} is {plan[bad[0]].short_str()} here (asked:"
                                          f" {requested[bad[0]].short_str()}), not e4m3 tensorwise on torch_scaled_mm"
                                          " in all three GEMMs")
            continue
        if tail is not None and isinstance(linears.get(tail), LokaLinear):
            plain = linears[tail] = to_plain_linear(linears[tail])
            parent_name, _, child = tail.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
        if tail is not None and not (tail in plan and ok(tail)
                                     and type(linears.get(tail)) is nn.Linear and linears[tail].bias is None):
            tail = None  # the MLP chains without it
        names = swap_chain(model, mlp, tail)
        summary.chains[mlp] = names
        for site in names:
            plan[site] = requested[site]
            summary.chained[site] = requested[site].short_str()
            summary.fallbacks.pop(site, None)


def _apply(model: nn.Module, cfg: PrecisionConfig, strict: bool) -> ApplySummary:
    from loka_tune.kernels.chain import ChainMLP, FoldedTail, unchain
    from loka_tune.kernels.fused import FusedLinearBlockNormHardswish
    from loka_tune.kernels.linear import LokaLinear, find_linears
    from loka_tune.mods.fuse import fuse_epilogues, unfuse_epilogues
    from loka_tune.serving import refuse_served

    refuse_served(model, serving=False)
    summary = ApplySummary(config_key=cfg.key(), fuse_epilogue=cfg.mods.fuse_epilogue, fp8_chain=cfg.mods.fp8_chain)
    if any(isinstance(m, FusedLinearBlockNormHardswish) for m in model.modules()):
        unfuse_epilogues(model)  # a model applied before: back to plain chains, fused again below if asked
    if any(isinstance(m, (ChainMLP, FoldedTail)) for m in model.modules()):
        unchain(model)  # the same for FP8 chains: back to the model's MLPs, chained again below if asked
    summary.mods, summary.mods_note = run_mods(model, cfg)

    linears = find_linears(model)
    check_rules(cfg, list(linears), strict, summary)

    plan: dict[str, SitePrecision] = {}
    for site, lin in linears.items():
        prec, fb = _check_site(site, lin, cfg.resolve(site), strict)
        plan[site] = prec
        if fb:
            summary.fallbacks[site] = fb
    if cfg.mods.fp8_chain:
        _chain_mlps(model, {site: cfg.resolve(site) for site in linears}, plan, linears, summary)

    parents = module_parents(model)
    counts: Counter[str] = Counter()
    for site, lin in linears.items():
        prec = plan[site]
        summary.shapes[site] = (lin.in_features, lin.out_features)
        for r in ROLES:
            counts[prec[r].short_str()] += 1
        if site in summary.chained:
            continue  # a plain nn.Linear inside (or folded into) an FP8 chain
        plain = all(prec[r] == BF16 for r in ROLES)
        if plain:
            new: nn.Module = to_plain_linear(lin) if isinstance(lin, LokaLinear) else lin
            summary.unchanged.append(site)
        elif isinstance(lin, LokaLinear):
            lin.precision = prec
            lin.site_name = site
            new = lin
            summary.replaced[site] = prec.short_str()
        else:
            new = LokaLinear.from_linear(lin, prec, name=site)
            summary.replaced[site] = prec.short_str()
        if new is not lin:
            for parent, key in parents.get(id(lin), []):
                parent._modules[key] = new
    summary.counts = dict(counts)
    if cfg.mods.fuse_epilogue:
        rep = fuse_epilogues(model, choice=None, sequential=False)
        summary.fused = list(rep.fused)
        summary.fuse_skipped = dict(rep.skipped)
        if not rep.fused and not rep.skipped:
            summary.fuse_note = NO_CHAIN_NOTE
    return summary
