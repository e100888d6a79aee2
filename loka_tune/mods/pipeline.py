"""``apply_mods``: run the enabled Mods passes of a :class:`ModsConfig` in the fixed order."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from loka_tune.config import ModsConfig
from loka_tune.errors import ModError
from loka_tune.mods._walk import check_model
from loka_tune.mods.activation import hardswish
from loka_tune.mods.bias import no_bias
from loka_tune.mods.norm import blocknorm
from loka_tune.mods.padding import pad
from loka_tune.mods.report import ModsReport

__all__ = ["PASS_ORDER", "apply_mods"]

#: The order the passes run in: biases go before the shapes change; norms before the
#: activations (a SwishLayerNorm's LayerNorm becomes a BlockNorm, then Hard Swish replaces the
#: whole gate when enabled); padding last, on the final set of linears.
PASS_ORDER: tuple[str, ...] = ("no_bias", "blocknorm", "hardswish", "pad")


def apply_mods(model: nn.Module, mods: ModsConfig | Mapping[str, Any] | None) -> ModsReport:
    """Apply the Mods enabled in ``mods`` to ``model`` in place, in :data:`PASS_ORDER`.

    ``mods`` is a :class:`ModsConfig` (or its dict form, or ``None`` for no Mods). Returns a
    :class:`ModsReport` with one :class:`PassReport` per enabled pass. Apply to a freshly
    built model, before the precision swap, the optimizer and any hooks (probe). Mods change
    the model's function: they are meant for training from scratch.
    """
    check_model(model)
    if mods is None or isinstance(mods, Mapping):
        mods = ModsConfig.from_dict(mods)
    if not isinstance(mods, ModsConfig):
        raise ModError(f"apply_mods needs a ModsConfig (or its dict form); got {type(mods).__name__} {mods!r:.80}")
    report = ModsReport(mods)
    if mods.no_bias:
        report.passes.append(no_bias(model, keep=mods.keep_bias))
    if mods.blocknorm is not None:
        report.passes.append(blocknorm(model, mods.blocknorm))
    if mods.hardswish:
        report.passes.append(hardswish(model))
    if mods.pad is not None:
        report.passes.append(pad(model, mods.pad))
    assert [p.name for p in report.passes] == [n for n in PASS_ORDER if n in report], "pass order"
    return report
