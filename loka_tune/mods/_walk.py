"""Model traversal shared by the Mods passes (internal).

The passes work on any ``nn.Module``: modules are found with
``named_modules(remove_duplicate=False)`` so that a module registered under several names
(shared between two parents) is seen once and replaced at every name, which keeps the
sharing. Replacement is ``setattr(parent, attr, new)``, which works for plain attributes,
``nn.Sequential`` / ``nn.ModuleList`` indices and ``nn.ModuleDict`` keys alike.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from torch import nn

from loka_tune.errors import ModError

__all__ = [
    "Site",
    "walk",
    "Walk",
    "replace",
    "param_owner_count",
    "has_hooks",
    "is_uninitialized_lazy",
    "is_parametrized",
    "overrides_forward",
    "resolve_names",
    "find_prediction_head",
    "check_model",
]


@dataclass
class Site:
    """One module object of the model, every name it is registered under, and the parent
    of its first name (``None`` for the root) as they were when the model was walked."""

    module: nn.Module
    names: list[str]
    parent: nn.Module | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(self.names[1:])

    @property
    def kind(self) -> str:
        return type(self.module).__name__


def check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ModError(f"Mods work on a torch.nn.Module; got {type(model).__name__} {model!r:.80}")
    return model


def walk(model: nn.Module) -> list[Site]:
    """Every distinct module of ``model`` (root included, name ``""``) in module order."""
    sites: dict[int, Site] = {}
    by_name: dict[str, nn.Module] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        by_name[name] = mod
        site = sites.get(id(mod))
        if site is None:
            parent = None if name == "" else by_name[name.rpartition(".")[0]]
            sites[id(mod)] = Site(mod, [name], parent)
        elif name not in site.names:
            site.names.append(name)
    return list(sites.values())


class Walk:
    """Iterate over :func:`walk`'s sites while replacing some of them.

    Sites inside a subtree that was replaced earlier in the same walk are not yielded
    (they are no longer part of the model).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites = walk(model)
        self._gone: list[str] = []

    def __iter__(self):
        for site in self.sites:
            if self._gone and all(any(n.startswith(g + ".") for g in self._gone) for n in site.names):
                continue
            yield site

    def replace(self, site: Site, new: nn.Module) -> None:
        replace(self.model, site, new)
        self._gone.extend(site.names)


def parent_of(model: nn.Module, name: str) -> nn.Module | None:
    """The module that holds ``name`` as a direct child (``None`` for the root)."""
    if name == "":
        return None
    parent_name = name.rpartition(".")[0]
    return model.get_submodule(parent_name) if parent_name else model


def replace(model: nn.Module, site: Site, new: nn.Module) -> None:
    """Put ``new`` in place of ``site.module`` at every name it is registered under."""
    assert "" not in site.names, "the root module cannot be replaced in place"
    for name in site.names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)


def param_owner_count(model: nn.Module) -> dict[int, int]:
    """``id(parameter) -> number of distinct modules that register it`` (2+ means tied)."""
    owners: dict[int, set[int]] = {}
    for site in walk(model):
        for p in site.module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(site.module))
    return {k: len(v) for k, v in owners.items()}


def has_hooks(module: nn.Module) -> bool:
    """Whether the module carries its own forward/backward hooks (replacing it would drop them)."""
    return bool(
        getattr(module, "_forward_hooks", None)
        or getattr(module, "_forward_pre_hooks", None)
        or getattr(module, "_backward_hooks", None)
        or getattr(module, "_backward_pre_hooks", None)
    )


def is_uninitialized_lazy(module: nn.Module) -> bool:
    from torch.nn.modules.lazy import LazyModuleMixin

    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()


def is_parametrized(module: nn.Module, tensor_name: str | None = None) -> bool:
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(module, tensor_name)


def overrides_forward(module: nn.Module, *bases: type[nn.Module]) -> bool:
    """Whether ``type(module)`` has a ``forward`` other than those of ``bases``."""
    fwd = type(module).forward
    return all(fwd is not b.forward for b in bases)


def resolve_names(model: nn.Module, names: tuple[str, ...] | list[str], *, what: str) -> list[nn.Module]:
    """The modules named ``names``; an unknown name raises :class:`ModError` with close matches."""
    known = {n for n, _ in model.named_modules(remove_duplicate=False)}
    out = []
    for n in names:
        if not isinstance(n, str):
            raise ModError(f"{what}: module names are strings; got {n!r}")
        if n not in known:
            close = difflib.get_close_matches(n, sorted(known), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ModError(f"{what}: the model has no module named {n!r}{hint}")
        out.append(model.get_submodule(n))
    return out


def find_prediction_head(model: nn.Module) -> tuple[str | None, str]:
    """The prediction head's module name and how it was found.

    The model's ``prediction_head`` attribute (a module name, or the module itself) when it
    has one; else the last ``nn.Linear`` in module order with ``out_features == 1``; else the
    last ``nn.Linear``; ``(None, reason)`` for a model without linears.
    """
    attr = getattr(model, "prediction_head", None)
    if isinstance(attr, str):
        resolve_names(model, [attr], what="prediction_head attribute")
        return attr, "the model's prediction_head attribute"
    if isinstance(attr, nn.Module):
        for name, mod in model.named_modules():
            if mod is attr:
                return name, "the model's prediction_head attribute"
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None, "the model has no nn.Linear"
    ones = [(n, m) for n, m in linears if m.out_features == 1]
    if ones:
        return ones[-1][0], "the last nn.Linear with out_features == 1"
    return linears[-1][0], "the last nn.Linear (none has out_features == 1)"
