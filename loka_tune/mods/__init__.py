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
from loka_tune.mods.fuse import fuse_epilogues, unfuse_epilogues
from loka_tune.mods.norm import blocknorm
from loka_tune.mods.padding import pad, unpad
from loka_tune.mods.pipeline import apply_mods
from loka_tune.mods.report import ModsReport
from loka_tune.mods.search import MOD_NAMES

# what a user calls; the other names imported above are importable but internal (they may change)
__all__ = [
    "apply_mods",
    "no_bias",
    "blocknorm",
    "hardswish",
    "pad",
    "unpad",
    "fuse_epilogues",
    "unfuse_epilogues",
    "ModsReport",
    "MOD_NAMES",
]
