"""The fused-epilogue pass: (Linear, BlockNorm, Hard Swish) chains <-> one fused FP8 GEMM.

:func:`fuse_epilogues` finds (Linear, BlockNorm, Hardswish) chains in ``MLPBlock``-like
containers (children ``linear``, ``norm``, ``act``, forward ``act(norm(linear(x)))``) and in
``nn.Sequential`` runs, and swaps them for
:class:`~loka_tune.kernels.fused.FusedLinearBlockNormHardswish` (which keeps the original
modules as children, so the parameter names and the state dict do not change for
containers); :func:`unfuse_epilogues` undoes it. As a Mod (``ModsConfig.fuse_epilogue``),
:func:`loka_tune.apply` runs the pass with ``choice=None`` after the precision swap: each
chain with its own LokaLinear's choices.

The kernel, its autograd function and the fused module live in :mod:`loka_tune.kernels.fused`
(mods may import kernels, never the reverse). :func:`fuse_serving_epilogues` is the same pass
for a served model (``apply(..., serving=True)``): chains whose linear is a
:class:`~loka_tune.kernels.serving.ServingLinear` become
:class:`~loka_tune.kernels.serving.ServingFusedBlock`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from loka_tune.config import GemmChoice
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.kernels.fused import (
    DEFAULT_CHOICE,
    FusedLinearBlockNormHardswish,
    any_hooked,
    epilogue_supports,
)
from loka_tune.kernels.linear import is_eligible
from loka_tune.layers import BlockNorm

__all__ = ["FuseReport", "fuse_epilogues", "unfuse_epilogues", "fuse_serving_epilogues"]


@dataclass
class FuseReport:
    """What :func:`fuse_epilogues` changed: ``fused`` container names, ``skipped`` (name, reason)."""

    choice: str
    fused: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fuse_epilogues({self.choice}): {len(self.fused)} fused, {len(self.skipped)} skipped"]
        lines += [f"  fused   {n}" for n in self.fused]
        lines += [f"  skipped {n}: {r}" for n, r in self.skipped]
        return "\n".join(lines)


def _chain_reason(lin: nn.Module, norm: BlockNorm, act: nn.Module, fwd: GemmChoice | None) -> str | None:
    """Why the chain cannot be fused (``None``: it can). ``fwd=None``: the linear's own fwd choice."""
    if not is_eligible(lin):
        return f"{type(lin).__name__} is not a plain nn.Linear / LokaLinear"
    assert isinstance(lin, nn.Linear)  # what is_eligible accepts (LokaLinear is one)
    if getattr(norm, "weight", None) is not None:
        return "BlockNorm has an affine weight: the fused epilogue is parameter-free"
    if any_hooked(lin, norm, act):
        return "a module of the chain has hooks attached: fuse before attaching hooks"
    if fwd is None:
        own = getattr(lin, "precision", None)
        if own is None:
            return "the linear is a plain nn.Linear (a bf16 site): nothing to fuse"
        fwd = own.fwd
    dev = lin.weight.device
    return epilogue_supports(fwd, n=lin.out_features, block=norm.block, device=None if dev.type == "meta" else dev)


def fuse_epilogues(model: nn.Module, *, choice: GemmChoice | str | None = DEFAULT_CHOICE,
                   dgrad: GemmChoice | str | None = None, wgrad: GemmChoice | str | None = None,
                   containers: tuple[str, ...] = ("MLPBlock",), sequential: bool = True) -> FuseReport:
    """Swap every (Linear, BlockNorm, Hardswish) chain of ``model`` for a
    :class:`FusedLinearBlockNormHardswish`; returns a :class:`FuseReport`.

    ``choice``: the fused fwd choice of every chain, with ``dgrad`` / ``wgrad`` (see
    :class:`FusedLinearBlockNormHardswish`); ``choice=None``: each chain runs its own
    :class:`LokaLinear`'s precision (what :func:`loka_tune.apply` uses), and a chain whose
    linear is a plain ``nn.Linear`` (bf16) or whose fwd choice the fused kernel does not run
    is skipped with the reason. The fused kernel must run the choice on the linear's device
    (Triton: CUDA; fuse after moving the model), unless the model is on ``meta``.

    Chains are found in containers whose class name is in ``containers`` (their children
    ``linear``, ``norm``, ``act``; the container is replaced, the fused module keeps the three
    children so parameter names do not change) and as consecutive children of an
    ``nn.Sequential`` (the fused module takes the Linear's index, the BlockNorm's and the
    Hardswish's become ``nn.Identity``; the Linear's parameters then live under
    ``<i>.linear.``; ``sequential=False`` skips such runs instead, keeping every parameter
    name). Chains the fused kernel cannot run (ragged blocks, affine BlockNorm,
    hooks, an unsupported choice) are skipped and reported. Idempotent (chains already fused
    are left as they are). :func:`unfuse_epilogues` undoes it.
    Run after :func:`loka_tune.mods.blocknorm` / ``hardswish`` and before building the optimizer.
    """
    if choice is None and (dgrad is not None or wgrad is not None):
        raise ValueError("choice=None takes all three GEMMs from each LokaLinear: leave dgrad and wgrad None")
    fwd = None if choice is None else (GemmChoice.parse(choice) if isinstance(choice, str) else choice)
    report = FuseReport("per site" if fwd is None else fwd.short_str())
    named = dict(model.named_modules(remove_duplicate=False))

    def make(lin: nn.Module, norm: nn.Module, act: nn.Module) -> FusedLinearBlockNormHardswish:
        return FusedLinearBlockNormHardswish(lin, norm, act, choice=fwd, dgrad=dgrad, wgrad=wgrad)  # type: ignore[arg-type]

    for name, m in list(named.items()):
        if isinstance(m, FusedLinearBlockNormHardswish):
            continue
        if type(m).__name__ in containers:
            kids = dict(m.named_children())
            lin, norm, act = kids.get("linear"), kids.get("norm"), kids.get("act")
            if lin is None or norm is None or act is None or not isinstance(norm, BlockNorm) or type(act) is not nn.Hardswish:
                continue  # not a Linear -> BlockNorm -> Hardswish container: nothing to say
            if name == "":
                report.skipped.append((name, "the model itself is the chain: wrap it in a container"))
                continue
            reason = _chain_reason(lin, norm, act, fwd)
            if reason is None and any_hooked(m):
                reason = "the container has hooks attached"
            if reason is not None:
                report.skipped.append((name, reason))
                continue
            parent_name, _, attr = name.rpartition(".")
            fused = make(lin, norm, act)
            fused.train(m.training)
            fused.__dict__["_origin"] = m  # not a submodule: the state dict keeps its names
            setattr(named[parent_name], attr, fused)
            report.fused.append(name)
        elif isinstance(m, nn.Sequential):
            keys = list(m._modules.keys())
            i = 0
            while i + 2 < len(keys):
                lin, norm, act = (m._modules[k] for k in keys[i:i + 3])
                if (isinstance(lin, nn.Linear) and isinstance(norm, BlockNorm)
                        and type(act) is nn.Hardswish):
                    where = f"{name}.{keys[i]}" if name else keys[i]
                    reason = _chain_reason(lin, norm, act, fwd)
                    if reason is None and not sequential:
                        reason = ("a run of nn.Sequential entries: fusing it would move the linear's parameters"
                                  " to '<i>.linear.' (new state dict names); wrap the three in a container")
                    if reason is not None:
                        report.skipped.append((where, reason))
                    else:
                        fused = make(lin, norm, act)
                        fused.train(lin.training)
                        fused.__dict__["_seq_keys"] = tuple(keys[i:i + 3])
                        m._modules[keys[i]] = fused
                        m._modules[keys[i + 1]] = nn.Identity()
                        m._modules[keys[i + 2]] = nn.Identity()
                        report.fused.append(where)
                    i += 3
                else:
                    i += 1
    return report


def unfuse_epilogues(model: nn.Module) -> list[str]:
    """Undo :func:`fuse_epilogues`: every :class:`FusedLinearBlockNormHardswish` it made becomes
    again the container (or the three ``nn.Sequential`` entries) it replaced, holding the fused
    module's current ``linear`` / ``norm`` / ``act`` (a linear swapped since, e.g. by
    :func:`loka_tune.apply`, stays swapped) and its forward hooks. Returns the names restored.
    Fused modules built by hand (not by the pass) are left alone. Idempotent."""
    out: list[str] = []
    for pname, parent in list(model.named_modules()):
        for key, child in list(parent._modules.items()):
            if not isinstance(child, FusedLinearBlockNormHardswish):
                continue
            name = f"{pname}.{key}" if pname else key
            origin, seq_keys = child.__dict__.get("_origin"), child.__dict__.get("_seq_keys")
            if origin is not None:
                origin.linear, origin.norm, origin.act = child.linear, child.norm, child.act
                origin.train(child.training)
                for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                             "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
                    if getattr(child, attr, None):
                        getattr(origin, attr).update(getattr(child, attr))
                parent._modules[key] = origin
                out.append(name)
            elif (seq_keys is not None and isinstance(parent, nn.Sequential) and seq_keys[0] == key
                  and all(isinstance(parent._modules.get(k), nn.Identity) for k in seq_keys[1:])):
                if any_hooked(child):
                    raise UnsupportedChoiceError(
                        f"the fused chain {name!r} of an nn.Sequential has hooks attached, which cannot be moved"
                        " to the three unfused modules: remove them first")
                parent._modules[seq_keys[0]] = child.linear
                parent._modules[seq_keys[1]] = child.norm
                parent._modules[seq_keys[2]] = child.act
                out.append(name)
    return out


def fuse_serving_epilogues(model: nn.Module, *, containers: tuple[str, ...] = ("MLPBlock",)) -> FuseReport:
    """Swap every (ServingLinear, BlockNorm, Hardswish) container chain of a served ``model`` for
    a :class:`~loka_tune.kernels.serving.ServingFusedBlock` (children kept: the state dict's
    names do not change); returns a :class:`FuseReport`. Chains whose linear serves bf16, whose
    choice the fused kernel does not run on its device, or with hooks are skipped and reported;
    ``nn.Sequential`` runs are left alone (their parameters would move)."""
    from loka_tune.kernels.serving import ServingFusedBlock, ServingLinear

    report = FuseReport("per site (serving)")
    named = dict(model.named_modules(remove_duplicate=False))
    for name, m in list(named.items()):
        if type(m).__name__ not in containers or name == "":
            continue
        kids = dict(m.named_children())
        lin, norm, act = kids.get("linear"), kids.get("norm"), kids.get("act")
        if lin is None or not isinstance(norm, BlockNorm) or type(act) is not nn.Hardswish:
            continue
        if isinstance(lin, ServingLinear):
            reason = None
            if getattr(norm, "weight", None) is not None:
                reason = "BlockNorm has an affine weight: the fused epilogue is parameter-free"
            elif any_hooked(lin, norm, act, m):
                reason = "a module of the chain has hooks attached: fuse before attaching hooks"
            else:
                reason = epilogue_supports(lin.choice, n=lin.out_features, block=norm.block,
                                           device=lin.weight_fp8.device)
        else:
            reason = "the linear serves bf16 (a plain nn.Linear): nothing to fuse"
        if reason is not None:
            report.skipped.append((name, reason))
            continue
        assert isinstance(lin, ServingLinear) and isinstance(act, nn.Module)
        fused = ServingFusedBlock(lin, norm, act)
        fused.train(m.training)
        fused.__dict__["_origin"] = m
        parent_name, _, attr = name.rpartition(".")
        setattr(named[parent_name], attr, fused)
        report.fused.append(name)
    return report
