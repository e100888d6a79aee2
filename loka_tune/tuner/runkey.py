"""The key of a configuration as it trains: two configurations that train the same model are one trial.

:meth:`PrecisionConfig.key() <loka_tune.config.PrecisionConfig.key>` is the configuration as
written. Under the ``fp8_chain`` Mod, every site an FP8 chain takes runs the chain's own kernels
(:class:`~loka_tune.kernels.chain.ChainMLP`: tensorwise e4m3 through ``torch._scaled_mm``, fast
accumulation in the forward GEMM, gradients in :data:`~loka_tune.kernels.chain.GRAD_FORMAT`),
whichever e4m3 tensorwise variant the configuration names there. So ``tensorwise@filter`` and
``tensorwise_fa@filter`` under that Mod train the same model: the H100 study of 2026-12-07
(seventh session, ``benchmarks/results/study_h100_s36_report.txt``) ran them as trials 2 and 3 and
confirmed both, with the same relative log loss to four places, one trial and one confirmation
run spent twice.

:func:`run_key` is ``config.key()`` where no chain forms; where one does, the Mods and each
Linear site's resolved precision, the chained sites' written ``"fp8_chain"``. Which sites chain
is what :func:`loka_tune.apply` does: it runs on a copy of the study's model built on the
``meta`` device (no memory, no kernel; for large Wukong on a 2-core CPU 1.8 s for the first
trial under the Mod, its build and imports included, then 17 ms a trial), where a chain is decided
by what the configuration asks (as on a CPU; on a GPU ``apply`` also needs the sites' backend to
run there, which ``torch_scaled_mm`` does on every FP8 GPU the chain runs on). The loop records it
as the trial's ``run_key`` where it differs from ``config_key``, and the duplicate check,
``n_trials`` and the confirmation's one trial per configuration read it
(:attr:`~loka_tune.tuner.results.TrialRecord.trains_as`); the model's proposals still compare
written keys, so a proposal that trains as a tried trial is one cache copy, not a stream of them.
A model that cannot be built on ``meta`` (a user's factory that runs a forward pass, say) keeps
``config.key()``, said once in the log. The chain reads no precision of its own sites
(:class:`~loka_tune.kernels.chain.ChainMLP` takes the blocks and a margin only), so a chained
site's scale rounding and fast accumulation change nothing it runs.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from torch import nn

from loka_tune.config import PrecisionConfig
from loka_tune.tuner.log import log

__all__ = ["CHAINED", "run_key", "chained_sites"]

#: a chained site's precision in :func:`run_key`
CHAINED = "fp8_chain"
_META_ATTR = "_loka_meta_model"  # the study context's meta-device model (or the reason it has none)


def _meta_model(ctx: Any) -> nn.Module | None:
    """The study's model built on the meta device, once per context (None: it cannot be)."""
    got = getattr(ctx, _META_ATTR, None)
    if isinstance(got, nn.Module):
        return got
    if got is not None:  # the reason it failed, said already
        return None
    from loka_tune.tuner.build import meta_model

    try:
        model = meta_model(ctx.cfg, ctx.source)
    except Exception as e:  # noqa: BLE001 - a user's factory may not build on meta: keep the written key
        reason = f"{type(e).__name__}: {e}"
        log(f"[loka-tune] trials under fp8_chain are told apart by their configs as written: the model"
            f" does not build on the meta device ({reason})")
        setattr(ctx, _META_ATTR, reason)
        return None
    setattr(ctx, _META_ATTR, model)
    return model


def chained_sites(model: nn.Module, config: PrecisionConfig) -> tuple[list[str], set[str]]:
    """``(linear sites, chained sites)`` of ``model`` (on the meta device) under ``config``: its
    ``nn.Linear`` names, and those :func:`loka_tune.apply` puts in an FP8 chain."""
    from loka_tune.applier import apply

    sites = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    summary = apply(copy.deepcopy(model), config, strict=False)  # a choice a site cannot run fails the trial itself
    return sites, set(summary.chained)


def run_key(ctx: Any, config: PrecisionConfig) -> str:
    """The key of ``config`` as it trains in the study of ``ctx`` (see the module's docstring)."""
    if not config.mods.fp8_chain:
        return config.key()
    model = _meta_model(ctx)
    if model is None:
        return config.key()
    try:
        sites, chained = chained_sites(model, config)
    except Exception:  # noqa: BLE001 - a config apply rejects: its trial fails and says why
        return config.key()
    if not chained:
        return config.key()
    body = {"mods": config.mods.to_dict(),
            "sites": {s: CHAINED if s in chained else config.resolve(s).to_dict() for s in sites}}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))
