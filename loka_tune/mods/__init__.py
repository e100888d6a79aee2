"""Mods: model adaptations that make more of a model safe and fast in FP8 (LoKA).

Passes over any ``nn.Module``, each returning a :class:`PassReport` (what changed, what was
skipped and why), each idempotent:

- :func:`no_bias` — drop linear biases except the prediction head;
- :func:`blocknorm` — LayerNorm / RMSNorm over the last dim -> :class:`BlockNorm`;
- :func:`hardswish` — SiLU / SwishLayerNorm -> ``nn.Hardswish``;
- :func:`pad` — pad linear K and N to a multiple with :class:`PaddedLinear` (exact);

and :func:`apply_mods` running the passes a :class:`~loka_tune.config.ModsConfig` enables in
the order of :data:`PASS_ORDER`. :func:`fuse_epilogues` / :func:`unfuse_epilogues` (the
``fuse_epilogue`` Mod) run after the precision swap instead, in :func:`loka_tune.apply`:
each Linear -> BlockNorm -> Hard Swish chain as one fused FP8 GEMM epilogue
(:mod:`loka_tune.kernels.fused`). Mods change the model (except ``pad``, which is exact): they
are meant for training from scratch, and the tuner evaluates them by training.
:func:`mod_choices` / :func:`mods_from_params` put them into a search space.
"""

from __future__ import annotations

from loka_tune.mods.activation import hardswish
from loka_tune.mods.bias import no_bias
from loka_tune.mods.fuse import FuseReport, fuse_epilogues, unfuse_epilogues
from loka_tune.mods.norm import BlockNorm, block_layout, blocknorm
from loka_tune.mods.padding import PaddedLinear, pad, padding_violations, rezero_padding_, round_up, unpad
from loka_tune.mods.pipeline import PASS_ORDER, apply_mods
from loka_tune.mods.report import Change, ModsReport, PassReport, Skip
from loka_tune.mods.search import MOD_NAMES, mod_choices, mods_from_params, mods_to_params

__all__ = [
    "apply_mods",
    "PASS_ORDER",
    "no_bias",
    "blocknorm",
    "hardswish",
    "pad",
    "fuse_epilogues",
    "unfuse_epilogues",
    "FuseReport",
    "unpad",
    "rezero_padding_",
    "padding_violations",
    "round_up",
    "BlockNorm",
    "block_layout",
    "PaddedLinear",
    "Change",
    "Skip",
    "PassReport",
    "ModsReport",
    "MOD_NAMES",
    "mod_choices",
    "mods_from_params",
    "mods_to_params",
]
