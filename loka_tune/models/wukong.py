"""Wukong (Zhang et al., 2024): stacked factorization-machine interaction layers.

X0 (B, n, d) = the sparse embeddings plus ``dense_embeddings`` rows that an MLP projects the
dense features into. Each of ``num_layers`` layers maps X (B, n_i, d) to (B, nF + nL, d):

- Factorization Machine Block (optimized FM): Y = X^T projected over the feature axis
  (an ``nn.Linear(n_i, k)`` on the (B, d, n_i) transpose), F = X Y = X (X^T W^T), (B, n_i, k),
  flattened (B, n_i k), normalized, MLP -> nF d, reshaped (B, nF, d);
- Linear Compress Block: an ``nn.Linear(n_i, nL)`` over the feature axis, (B, nL, d);
- concatenate, add the residual (X itself, or X projected over the feature axis by an
  ``nn.Linear(n_i, nF + nL)`` when widths differ), normalize over d.

Head: flatten (B, (nF + nL) d) -> MLP -> prediction head -> 1. Every weight GEMM is an
``nn.Linear`` (3-D inputs included); the interaction ``bmm`` has no weight.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from loka_tune.layers import make_norm
from loka_tune.models.base import MLP, EmbeddingTables, RecModel, check_options, check_positive, check_sizes

__all__ = ["Wukong", "WukongLayer", "FactorizationMachineBlock", "LinearCompressBlock"]


class FactorizationMachineBlock(nn.Module):
    """Optimized FM: ``F = X (X^T Y)`` with a learned (n_in, k) projection, then norm + MLP.

    Children: ``proj`` (n_in -> k over the feature axis), ``norm`` (over n_in k), ``mlp``
    (hidden layers), ``out`` (-> nF d).
    """

    def __init__(
        self, n_in: int, dim: int, num_out: int, rank: int, hidden: Sequence[int],
        *, norm: str, activation: str, bias: bool,
    ) -> None:
        super().__init__()
        self.num_out, self.dim = num_out, dim
        self.proj = nn.Linear(n_in, rank, bias=bias)
        self.norm = make_norm(norm, n_in * rank)
        self.mlp = MLP(n_in * rank, hidden, norm=norm, activation=activation, bias=bias)
        self.out = nn.Linear(self.mlp.out_dim, num_out * dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xy = self.proj(x.transpose(1, 2))  # (B, d, k) = X^T Y
        f = torch.bmm(x, xy)  # (B, n_in, k) = X (X^T Y)
        h = self.mlp(self.norm(f.flatten(1)))  # (B, hidden)
        return self.out(h).view(x.shape[0], self.num_out, self.dim)  # (B, nF, d)


class LinearCompressBlock(nn.Module):
    """A linear map over the feature axis, n_in -> nL (child ``proj``)."""

    def __init__(self, n_in: int, num_out: int, *, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(n_in, num_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.transpose(1, 2)).transpose(1, 2)  # (B, nL, d)


class WukongLayer(nn.Module):
    """``norm(concat(FMB(X), LCB(X)) + residual(X))``: (B, n_in, d) -> (B, nF + nL, d)."""

    def __init__(
        self, n_in: int, dim: int, num_fmb: int, num_lcb: int, rank: int, hidden: Sequence[int],
        *, norm: str, activation: str, bias: bool,
    ) -> None:
        super().__init__()
        n_out = num_fmb + num_lcb
        self.fmb = FactorizationMachineBlock(
            n_in, dim, num_fmb, rank, hidden, norm=norm, activation=activation, bias=bias
        )
        self.lcb = LinearCompressBlock(n_in, num_lcb, bias=bias)
        # widths differ -> project the residual over the feature axis; else add X itself
        self.residual = nn.Linear(n_in, n_out, bias=bias) if n_in != n_out else None
        self.norm = make_norm(norm, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.fmb(x), self.lcb(x)], dim=1)  # (B, nF + nL, d)
        res = x if self.residual is None else self.residual(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(y + res)  # (B, nF + nL, d)


class Wukong(RecModel):
    """Wukong with ``num_layers`` interaction layers.

    Args:
        num_dense: number of dense features (0 allowed: no dense embedding rows).
        cardinalities: one embedding-table size per sparse feature.
        embedding_dim: d.
        num_layers: L >= 1.
        num_fmb, num_lcb: nF and nL, the output rows of the FMB and the LCB.
        fmb_rank: k, the rank of the FM projection.
        fmb_mlp: hidden widths of the FMB's MLP (its last linear, -> nF d, is appended).
        dense_mlp: hidden widths of the dense-feature MLP (its last linear, -> m d, appended).
        dense_embeddings: m, the number of embedding rows made from the dense features.
        head_mlp: hidden widths before the prediction head.
        norm, activation, bias: options of every layer (``head`` always has a bias).
    """

    def __init__(
        self,
        num_dense: int,
        cardinalities: Sequence[int],
        *,
        embedding_dim: int = 128,
        num_layers: int = 3,
        num_fmb: int = 16,
        num_lcb: int = 16,
        fmb_rank: int = 24,
        fmb_mlp: Sequence[int] = (512, 512),
        dense_mlp: Sequence[int] = (512, 512),
        dense_embeddings: int = 1,
        head_mlp: Sequence[int] = (512, 512),
        norm: str = "layernorm",
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__(num_dense, cardinalities)
        check_options(norm, activation, bias)
        d = check_positive("embedding_dim", embedding_dim)
        n_layers = check_positive("num_layers", num_layers)
        n_f = check_positive("num_fmb", num_fmb)
        n_l = check_positive("num_lcb", num_lcb)
        k = check_positive("fmb_rank", fmb_rank)
        fmb_hidden = check_sizes("fmb_mlp", fmb_mlp)
        dense_hidden = check_sizes("dense_mlp", dense_mlp)
        m = check_positive("dense_embeddings", dense_embeddings)
        head_hidden = check_sizes("head_mlp", head_mlp)
        self.hparams = dict(
            embedding_dim=d, num_layers=n_layers, num_fmb=n_f, num_lcb=n_l, fmb_rank=k,
            fmb_mlp=fmb_hidden, dense_mlp=dense_hidden, dense_embeddings=m, head_mlp=head_hidden,
            norm=norm, activation=activation, bias=bias,
        )
        self.embedding_dim = d
        opts: dict[str, Any] = dict(norm=norm, activation=activation, bias=bias)

        self.embeddings = EmbeddingTables(self.cardinalities, d)
        if self.num_dense > 0:
            self.dense_embeddings = m
            self.dense_mlp: MLP | None = MLP(self.num_dense, dense_hidden, **opts)
            self.dense_proj: nn.Linear | None = nn.Linear(self.dense_mlp.out_dim, m * d, bias=bias)
        else:
            self.dense_embeddings = 0
            self.dense_mlp = None
            self.dense_proj = None
        n_in = self.num_sparse + self.dense_embeddings  # rows of X0
        layers = []
        for _ in range(n_layers):
            layers.append(WukongLayer(n_in, d, n_f, n_l, k, fmb_hidden, **opts))
            n_in = n_f + n_l
        self.layers = nn.ModuleList(layers)
        self.head_mlp = MLP(n_in * d, head_hidden, **opts)
        self.head = nn.Linear(self.head_mlp.out_dim, 1, bias=True)  # prediction head keeps its bias

    def mlp_chains(self) -> list[tuple[str, str | None]]:
        """Every MLP; an FMB's MLP with the FMB's ``out`` as its tail (it takes the MLP's output only)."""
        chains: list[tuple[str, str | None]] = []
        for name, parent_name, tail in ((n, n.rpartition(".")[0], None) for n, _ in super().mlp_chains()):
            parent = self.get_submodule(parent_name) if parent_name else self
            chains.append((name, f"{parent_name}.out" if isinstance(parent, FactorizationMachineBlock) else tail))
        return chains

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, sparse)
        x = self.embeddings(sparse)  # (B, n, d)
        if self.dense_proj is not None and self.dense_mlp is not None:
            rows = self.dense_proj(self.dense_mlp(dense))  # (B, m d)
            x = torch.cat([rows.view(-1, self.dense_embeddings, self.embedding_dim), x], dim=1)  # (B, m + n, d)
        for layer in self.layers:
            x = layer(x)  # (B, nF + nL, d)
        return self.head(self.head_mlp(x.flatten(1))).squeeze(-1)  # (B,)
