"""Site discovery: every eligible linear layer of a model and the shapes of its three GEMMs.

A *site* is an ``nn.Linear`` by its fully qualified module name (as
:func:`loka_tune.kernels.linear.find_linears` lists them). Its GEMM shape comes from one
forward pass with hooks on one real batch: ``M`` = rows of its input (the product of all
input dims but the last), ``K`` = in_features, ``N`` = out_features. Per role, the canonical
``(m, k, n)`` of ``A @ B.T`` (rows of A, reduction, rows of B) is
:meth:`loka_tune.config.GemmRole.shape`::

    fwd   (M, K, N)      Y  = X W^T
    dgrad (M, N, K)      dX = dY W
    wgrad (N, M, K)      dW = dY^T X
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from loka_tune.config import ROLES, GemmRole
from loka_tune.errors import StudyError

__all__ = ["Site", "discover_sites", "sites_to_json", "sites_from_json"]


@dataclass(frozen=True)
class Site:
    """One linear layer: its name, ``K`` (in), ``N`` (out) and ``rows_per_example``.

    ``rows_per_example`` is ``M / batch_size`` as seen in the discovery pass (1 for a plain
    MLP on (B, K) inputs; ``n`` for a linear applied to (B, n, K)), so shapes can be given at
    any batch size: the training one or the one the cost model targets.
    """

    name: str
    in_features: int  # K
    out_features: int  # N
    rows_per_example: float
    has_bias: bool = True

    def rows(self, batch_size: int) -> int:
        """``M`` at ``batch_size``."""
        return max(1, int(round(self.rows_per_example * batch_size)))

    def shape(self, role: GemmRole | str, batch_size: int) -> tuple[int, int, int]:
        """The canonical ``(m, k, n)`` of ``role`` at ``batch_size``."""
        return GemmRole(role).shape(self.rows(batch_size), self.in_features, self.out_features)

    def shapes(self, batch_size: int) -> dict[str, tuple[int, int, int]]:
        return {r.value: self.shape(r, batch_size) for r in ROLES}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "K": self.in_features, "N": self.out_features,
                "rows_per_example": self.rows_per_example, "has_bias": self.has_bias}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Site":
        return cls(str(d["name"]), int(d["K"]), int(d["N"]), float(d["rows_per_example"]),
                   bool(d.get("has_bias", True)))


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    from loka_tune.kernels.linear import find_linears

    return dict(find_linears(model))


@torch.no_grad()
def discover_sites(model: nn.Module, *inputs: torch.Tensor,
                   linears: Mapping[str, nn.Linear] | None = None) -> list[Site]:
    """Run ``model(*inputs)`` once with hooks and return every linear site it used, in module order.

    ``inputs`` are the model's positional inputs, batch-major: ``dense, sparse`` (and
    ``seq, seq_mask`` for a sequence model; pass ``*model_inputs(model, batch)``).

    ``linears`` defaults to :func:`loka_tune.kernels.linear.find_linears` (eligible sites).
    A linear the forward pass never calls is left out (it has no GEMM to tune). The model's
    training mode is restored afterwards.
    """
    lin = dict(linears) if linears is not None else _linears(model)
    if not lin:
        raise StudyError(f"the model {type(model).__name__} has no eligible nn.Linear layers: nothing to tune")
    if len(inputs) < 2:
        raise StudyError(f"discover_sites needs the model's inputs (dense, sparse, ...), got {len(inputs)} tensor(s)")
    batch = int(inputs[0].shape[0]) if inputs[0].dim() > 0 else int(inputs[1].shape[0])
    rows: dict[str, int] = {}
    handles = []

    def hook(name: str):
        def fn(mod: nn.Module, inputs: tuple[Any, ...], _out: Any) -> None:
            x = inputs[0]
            m = x.numel() // x.shape[-1]  # (..., K) -> prod of leading dims
            rows[name] = rows.get(name, 0) + int(m)  # a layer called twice does twice the rows
        return fn

    for name, mod in lin.items():
        handles.append(mod.register_forward_hook(hook(name)))
    was_training = model.training
    model.eval()
    try:
        model(*inputs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    sites = []
    for name, mod in lin.items():
        if name not in rows:
            continue
        sites.append(Site(name, int(mod.in_features), int(mod.out_features), rows[name] / batch,
                          getattr(mod, "bias", None) is not None))
    return sites


def sites_to_json(sites: Iterable[Site]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in sites]


def sites_from_json(obj: Iterable[Mapping[str, Any]]) -> list[Site]:
    return [Site.from_dict(d) for d in obj]
