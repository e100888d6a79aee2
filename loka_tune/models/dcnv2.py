"""DCN-V2 (Wang et al., 2021): explicit cross layers and a deep MLP.

x0 = [dense projection, embedding_1, ..., embedding_n] flattened, (B, D) with D = (n+1) d
(n d without dense features). Cross layer i: x_{i+1} = x0 * (W x_i + b) + x_i with W full
(one ``nn.Linear(D, D)``) or low rank W = U V (``down``: D -> r without bias, ``up``: r -> D
carrying b). ``structure="stacked"``: deep MLP on the cross output; ``"parallel"``: deep MLP
on x0 beside the cross network, outputs concatenated. Then the prediction head -> 1.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from loka_tune.errors import ConfigError
from loka_tune.models.base import MLP, EmbeddingTables, RecModel, check_options, check_positive, check_sizes

__all__ = ["DCNv2", "CrossLayer", "STRUCTURES"]

STRUCTURES = ("stacked", "parallel")


class CrossLayer(nn.Module):
    """``x0 * (W x + b) + x`` with ``W`` full (``linear``) or low rank (``up(down(x))``)."""

    def __init__(self, dim: int, low_rank: int | None, bias: bool) -> None:
        super().__init__()
        self.low_rank = low_rank
        if low_rank is None:
            self.linear = nn.Linear(dim, dim, bias=bias)
        else:
            self.down = nn.Linear(dim, low_rank, bias=False)  # V: b is added once, by `up`
            self.up = nn.Linear(low_rank, dim, bias=bias)  # U

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        wx = self.linear(x) if self.low_rank is None else self.up(self.down(x))  # (B, D)
        return x0 * wx + x  # (B, D)


class DCNv2(RecModel):
    """DCN-V2 with a dense projection, ``num_cross_layers`` cross layers and a deep MLP.

    Args:
        num_dense: number of dense features (0 allowed: x0 holds the embeddings only).
        cardinalities: one embedding-table size per sparse feature.
        embedding_dim: width d of every embedding and of the dense projection.
        dense_mlp: hidden widths before the dense projection (``()``: one linear projection).
        num_cross_layers: number of cross layers (>= 1).
        low_rank: rank r of W = U V, or ``None`` for a full D x D matrix.
        deep_mlp: hidden widths of the deep network; the prediction head (-> 1) follows.
        structure: ``"stacked"`` or ``"parallel"``.
        norm, activation, bias: options of every hidden MLP layer; ``bias`` also sets the
            cross layers' b and the dense projection's bias (``head`` always has a bias).
    """

    def __init__(
        self,
        num_dense: int,
        cardinalities: Sequence[int],
        *,
        embedding_dim: int = 16,
        dense_mlp: Sequence[int] = (),
        num_cross_layers: int = 3,
        low_rank: int | None = None,
        deep_mlp: Sequence[int] = (1024, 1024),
        structure: str = "stacked",
        norm: str = "none",
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__(num_dense, cardinalities)
        check_options(norm, activation, bias)
        d = check_positive("embedding_dim", embedding_dim)
        dense_hidden = check_sizes("dense_mlp", dense_mlp)
        n_cross = check_positive("num_cross_layers", num_cross_layers)
        rank = None if low_rank is None else check_positive("low_rank", low_rank)
        deep = check_sizes("deep_mlp", deep_mlp)
        if structure not in STRUCTURES:
            raise ConfigError(
                f"unknown structure {structure!r}: choose one of {', '.join(STRUCTURES)}", key="structure"
            )
        self.hparams = dict(
            embedding_dim=d, dense_mlp=dense_hidden, num_cross_layers=n_cross, low_rank=rank,
            deep_mlp=deep, structure=structure, norm=norm, activation=activation, bias=bias,
        )
        self.structure = structure
        opts: dict[str, Any] = dict(norm=norm, activation=activation, bias=bias)

        self.embeddings = EmbeddingTables(self.cardinalities, d)
        if self.num_dense > 0:
            self.dense_mlp: MLP | None = MLP(self.num_dense, dense_hidden, **opts)
            self.dense_proj: nn.Linear | None = nn.Linear(self.dense_mlp.out_dim, d, bias=bias)
        else:
            self.dense_mlp = None
            self.dense_proj = None
        x0_dim = (self.num_sparse + (1 if self.num_dense > 0 else 0)) * d  # D
        self.cross = nn.ModuleList(CrossLayer(x0_dim, rank, bias) for _ in range(n_cross))
        self.deep_mlp = MLP(x0_dim, deep, **opts)
        head_in = self.deep_mlp.out_dim + (x0_dim if structure == "parallel" else 0)
        self.head = nn.Linear(head_in, 1, bias=True)  # prediction head keeps its bias

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, sparse)
        emb = self.embeddings(sparse)  # (B, n, d)
        parts = [emb.flatten(1)]  # (B, n d)
        if self.dense_proj is not None and self.dense_mlp is not None:
            parts.insert(0, self.dense_proj(self.dense_mlp(dense)))  # (B, d)
        x0 = torch.cat(parts, dim=1)  # (B, D)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)  # (B, D)
        if self.structure == "stacked":
            out = self.deep_mlp(x)  # (B, deep_out)
        else:
            out = torch.cat([x, self.deep_mlp(x0)], dim=1)  # (B, D + deep_out)
        return self.head(out).squeeze(-1)  # (B,)
