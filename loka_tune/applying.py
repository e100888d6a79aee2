"""The mechanics :func:`loka_tune.applier.apply` and :mod:`loka_tune.serving` share: the summary an
apply returns, a config from any of its forms, the Mods run once per model, a model's linears by
parent, a LokaLinear back to a plain ``nn.Linear``, the all-or-nothing snapshot of a model, and
the check that every per-site rule matches a layer.

Below both (``serving`` builds its form with these; ``applier.apply`` dispatches to either), so
neither imports the other's way back: ``applier -> serving -> applying``, no cycle
(``tests/test_layers.py``). The public names are re-exported by :mod:`loka_tune.applier`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from loka_tune.config import ROLES, PrecisionConfig, SitePrecision
from loka_tune.errors import ConfigError
from loka_tune.layers import carry_hooks

__all__ = ["ApplySummary", "as_config", "load_config", "run_mods", "module_parents", "to_plain_linear",
           "snapshot_modules", "restore_modules", "check_rules", "NO_CHAIN_NOTE"]

_MODS_ATTR = "_loka_mods_applied"  # set on the model: the ModsConfig already applied


@dataclass
class ApplySummary:
    """What :func:`apply` did.

    ``replaced``: site -> precision id (``SitePrecision.short_str``) of every layer that is now a
    LokaLinear. ``unchanged``: sites left (or turned back into) plain ``nn.Linear`` (bf16).
    ``shapes``: site -> ``(in_features, out_features)``. ``counts``: GEMM choice id -> number of
    GEMMs using it over all sites (three per site). ``fallbacks``: site -> {role: reason} for the
    GEMMs that ``strict=False`` sent to bf16. ``mods``: the ``ModsReport`` of the Mods run
    (``None`` if none ran); ``mods_note`` says why they did not run, if enabled.
    ``fuse_epilogue``: whether the config asked for fused epilogues; then ``fused``: the
    (Linear, BlockNorm, Hard Swish) chains (container names; the site is ``<chain>.linear``)
    now running as one fused GEMM epilogue, ``fuse_skipped``: chain -> why it stays unfused,
    ``fuse_note``: a remark (e.g. no chain found). ``unmatched``: the per-site rules that matched no
    layer and were skipped (``strict=False`` only). ``serving``: the model was applied for
    serving (``replaced`` then lists the sites serving a static FP8 weight, by fwd choice;
    ``fallbacks`` the fwd GEMMs ``strict=False`` serves in bf16); ``bucket``: the serving plan's
    bucket used (``None``: the config's own fwd choices). ``fp8_chain``: whether the config asked for
    FP8 chains; then ``chained``: site -> precision id of every linear now run by an FP8 chain
    (:class:`loka_tune.kernels.chain.ChainMLP`, plain ``nn.Linear`` modules inside it), ``chains``:
    MLP -> its sites in the chain, ``chain_skipped``: MLP -> why it is not one.
    """

    replaced: dict[str, str] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, dict[str, str]] = field(default_factory=dict)
    mods: Any = None
    mods_note: str = ""
    config_key: str = ""
    fuse_epilogue: bool = False
    fused: list[str] = field(default_factory=list)
    fuse_skipped: dict[str, str] = field(default_factory=dict)
    fuse_note: str = ""
    unmatched: list[str] = field(default_factory=list)
    serving: bool = False
    bucket: int | None = None
    fp8_chain: bool = False
    chained: dict[str, str] = field(default_factory=dict)
    chains: dict[str, list[str]] = field(default_factory=dict)
    chain_skipped: dict[str, str] = field(default_factory=dict)

    @property
    def n_sites(self) -> int:
        return len(self.replaced) + len(self.unchanged) + len(self.chained)

    def to_dict(self) -> dict[str, Any]:
        mods = self.mods.to_dict() if hasattr(self.mods, "to_dict") else (None if self.mods is None else str(self.mods))
        return {
            "replaced": dict(self.replaced),
            "unchanged": list(self.unchanged),
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "counts": dict(self.counts),
            "fallbacks": {k: dict(v) for k, v in self.fallbacks.items()},
            "mods": mods,
            "mods_note": self.mods_note,
            "fuse_epilogue": self.fuse_epilogue,
            "fused": list(self.fused),
            "fuse_skipped": dict(self.fuse_skipped),
            "fuse_note": self.fuse_note,
            "unmatched": list(self.unmatched),
            "serving": self.serving,
            "bucket": self.bucket,
            "fp8_chain": self.fp8_chain,
            "chained": dict(self.chained),
            "chains": {k: list(v) for k, v in self.chains.items()},
            "chain_skipped": dict(self.chain_skipped),
        }

    def _serving_lines(self) -> list[str]:
        fused_sites = {f"{c}.linear" for c in self.fused}
        head = ("site", "K x N", "fwd (served)", "note")
        table: list[tuple[str, ...]] = [head]
        for site, (k, n) in self.shapes.items():
            note = "static FP8 weight" if site in self.replaced else "bf16 (nn.Linear)"
            if site in self.fallbacks:
                note = "fallback to bf16: " + "; ".join(self.fallbacks[site].values())[:100]
            if site in fused_sites:
                note += "; fused epilogue"
            table.append((site, f"{k} x {n}", self.replaced.get(site, "bf16"), note))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        where = "the config's own fwd choices" if self.bucket is None else f"serving plan bucket {self.bucket}"
        lines = [f"apply (serving, {where}): {len(self.replaced)} of {self.n_sites} linear site(s) serve a static"
                 f" FP8 weight, {len(self.unchanged)} bf16; inference only (no backward)"]
        for i, r in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if not self.replaced:
            lines.append("no site has an FP8 fwd choice here: the model serves in bf16 (a config whose FP8 choices"
                         " are all in dgrad / wgrad speeds up training only)")
        return lines

    def __str__(self) -> str:
        if self.serving:
            lines = self._serving_lines()
            if self.unmatched:
                lines.append(f"skipped {len(self.unmatched)} rule(s) / plan site(s) that match no linear layer"
                             " (strict=False): " + ", ".join(repr(r) for r in self.unmatched))
            return "\n".join(lines + self._mods_and_fuse_lines(list_fused=False))
        rows = [(s, self.replaced.get(s, self.chained.get(s))) for s in self.shapes]
        fused_sites = {f"{c}.linear" for c in self.fused}
        chain_of = {site: mlp for mlp, sites in self.chains.items() for site in sites}
        head = ("site", "K x N", "fwd", "dgrad", "wgrad", "note")
        table: list[tuple[str, ...]] = [head]
        for site, pid in rows:
            k, n = self.shapes[site]
            prec = SitePrecision.parse(pid) if pid else SitePrecision()
            fb = self.fallbacks.get(site, {})
            note = "bf16 (nn.Linear)" if pid is None else ""
            if fb:
                note = "fallback to bf16: " + ", ".join(sorted(fb))
            if site in fused_sites:
                note = "; ".join(x for x in (note, "fused epilogue") if x)
            if site in chain_of:
                note = f"FP8 chain {chain_of[site]}"
            table.append((site, f"{k} x {n}", *(prec[r].short_str() for r in ROLES), note))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines = [
            f"apply: {len(self.replaced)} of {self.n_sites} linear site(s) replaced by LokaLinear,"
            + (f" {len(self.chained)} in FP8 chains," if self.chained else "")
            + f" {len(self.unchanged)} unchanged (bf16)"
        ]
        for i, r in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("GEMMs per choice: " + ", ".join(f"{c}: {n}" for c, n in sorted(self.counts.items())))
        if self.unmatched:
            lines.append(f"skipped {len(self.unmatched)} rule(s) that match no linear layer (strict=False): "
                         + ", ".join(repr(r) for r in self.unmatched))
        return "\n".join(lines + self._mods_and_fuse_lines(list_fused=True))

    def _mods_and_fuse_lines(self, *, list_fused: bool) -> list[str]:
        """The summary's closing lines: the Mods applied (or why none) and the fused chains
        (``list_fused``: each fused chain named, as well as each skipped one)."""
        lines = []
        if self.mods is not None:
            lines.append(str(self.mods))
        elif self.mods_note:
            lines.append(f"Mods: {self.mods_note}")
        if self.fuse_epilogue:
            lines.append(f"Fused epilogue (Linear -> BlockNorm -> Hard Swish): {len(self.fused)} chain(s) fused,"
                         f" {len(self.fuse_skipped)} skipped" + (f" ({self.fuse_note})" if self.fuse_note else ""))
            if list_fused:
                lines += [f"  fused   {c}" for c in self.fused]
            lines += [f"  skipped {c}: {r}" for c, r in self.fuse_skipped.items()]
        if self.fp8_chain:
            lines.append(f"FP8 chains (MLPs whose norms write the FP8 operands, delayed scales): {len(self.chains)}"
                         f" chain(s), {len(self.chain_skipped)} MLP(s) skipped")
            lines += [f"  chained {c}: {len(v)} linear(s)" for c, v in self.chains.items()]
            lines += [f"  skipped {c}: {r}" for c, r in self.chain_skipped.items()]
        return lines


def as_config(config: PrecisionConfig | Mapping[str, Any] | str | Path) -> PrecisionConfig:
    """A PrecisionConfig from itself, its dict form, or the path of its JSON file."""
    if isinstance(config, PrecisionConfig):
        return config
    if isinstance(config, Mapping):
        return PrecisionConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return PrecisionConfig.load(config)
    raise ConfigError(
        f"got {type(config).__name__} {config!r:.80}; expected a PrecisionConfig, a dict or the path of a JSON file",
        key="(config)",
    )


def load_config(path: str | Path) -> PrecisionConfig:
    """Read a PrecisionConfig JSON file (:class:`ConfigError` naming the bad key if malformed)."""
    return PrecisionConfig.load(path)


def run_mods(model: nn.Module, cfg: PrecisionConfig) -> tuple[Any, str]:
    """Run ``cfg``'s Mods passes on ``model`` once (skipped if already applied); returns (report, note)."""
    mods = cfg.mods.passes  # fuse_epilogue is not a pass: apply fuses after the swap
    if not mods.any:
        return None, ""
    prev = model.__dict__.get(_MODS_ATTR)
    if prev == mods:
        return None, f"{mods.short_str()} already applied to this model (skipped)"
    from loka_tune.mods import apply_mods

    report = apply_mods(model, mods)
    if prev is not None:
        note = f"Mods {prev.short_str()} had been applied before; now also ran {mods.short_str()}"
    else:
        note = ""
    model.__dict__[_MODS_ATTR] = mods
    return report, note


def module_parents(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(child) -> every (parent, key) that holds it (Sequential, ModuleDict, attributes...)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for key, child in parent._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((parent, key))
    return out


def to_plain_linear(lin: nn.Linear) -> nn.Linear:
    """A plain nn.Linear sharing ``lin``'s parameters and forward hooks."""
    plain = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    plain.weight = lin.weight
    plain.bias = lin.bias
    carry_hooks(lin, plain)  # its train mode and forward hooks
    return plain


#: ApplySummary.fuse_note of a fuse_epilogue config on a model without the chain it fuses
NO_CHAIN_NOTE = ("no Linear -> BlockNorm -> Hard Swish chain in this model: turn on the"
                 " blocknorm and hardswish Mods (or build the model with them)")

_STATE_DICTS = ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks")


def snapshot_modules(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Every module's attributes, with its children / parameters / buffers / hooks dicts copied:
    what the Mods, the swap and the fusion change (they replace entries, never tensor data)."""
    snap = []
    for m in model.modules():
        d = dict(m.__dict__)
        for k in _STATE_DICTS:
            if isinstance(d.get(k), dict):
                d[k] = type(d[k])(d[k])  # OrderedDict stays OrderedDict
        snap.append((m, d))
    return snap


def restore_modules(snap: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put every module of a :func:`_snapshot` back as it was."""
    for m, d in snap:
        m.__dict__.clear()
        m.__dict__.update({k: type(v)(v) if k in _STATE_DICTS and isinstance(v, dict) else v for k, v in d.items()})


def check_rules(cfg: PrecisionConfig, names: list[str], strict: bool, summary: ApplySummary) -> None:
    """Raise :class:`ConfigError` for per-site rules that match none of ``names`` (``strict``),
    or list them in ``summary.unmatched``."""
    unmatched = cfg.unmatched_rules(names)
    if unmatched and not strict:
        summary.unmatched = list(unmatched)  # resolve() never picks them: they match nothing
    elif unmatched:
        pat = unmatched[0]
        close = difflib.get_close_matches(pat.removeprefix("re:"), names, n=3, cutoff=0.5)
        some = close or names[:5]
        raise ConfigError(
            f"the rule {pat!r} matches no linear layer of this model"
            + (f" ({len(unmatched) - 1} more rule(s) match nothing either: {unmatched[1:4]})" if len(unmatched) > 1 else "")
            + f"; the model has {len(names)} linear site(s), e.g. {some}"
            + (" (did you mean one of these?)" if close else "")
            + ". Fix the name, use a 're:' pattern, remove the rule (a config for another model?), or apply"
            " with strict=False to skip rules that match nothing",
            key=f"sites.{pat}",
        )
