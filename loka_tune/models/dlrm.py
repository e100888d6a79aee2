"""DLRM (Naumov et al., 2019): bottom MLP, embedding tables, dot interaction, top MLP.

dense (B, num_dense) -> bottom MLP -> (B, d); each sparse feature -> EmbeddingBag -> (B, d);
the n + 1 vectors interact by pairwise dot products (strict upper triangle, no diagonal),
those (n+1)n/2 products and the bottom output go through the top MLP to one logit.
Without dense features (num_dense = 0) there is no bottom MLP and only the n embeddings
interact.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from loka_tune.errors import ConfigError
from loka_tune.models.base import MLP, EmbeddingTables, RecModel, check_options, check_positive, check_sizes

__all__ = ["DLRM"]


class DLRM(RecModel):
    """DLRM with a dot-product interaction.

    Args:
        num_dense: number of dense features (0 allowed: no bottom MLP).
        cardinalities: one embedding-table size per sparse feature.
        embedding_dim: width d of every embedding and of the bottom MLP's output.
        bottom_mlp: hidden widths of the bottom MLP; a last layer to ``embedding_dim`` is
            appended (so ``(512, 256, 64)`` with d = 16 is the paper's 13-512-256-64-16).
            Every bottom layer has the activation, as in the reference implementation.
        top_mlp: hidden widths of the top MLP; the prediction head (-> 1) is appended.
        norm, activation, bias: options of every hidden layer (``head`` always has a bias).
    """

    _tri_i: torch.Tensor  # buffers: the strict upper triangle's row and column indices
    _tri_j: torch.Tensor

    def __init__(
        self,
        num_dense: int,
        cardinalities: Sequence[int],
        *,
        embedding_dim: int = 16,
        bottom_mlp: Sequence[int] = (512, 256, 64),
        top_mlp: Sequence[int] = (512, 256),
        norm: str = "none",
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__(num_dense, cardinalities)
        check_options(norm, activation, bias)
        d = check_positive("embedding_dim", embedding_dim)
        bottom = check_sizes("bottom_mlp", bottom_mlp)
        top = check_sizes("top_mlp", top_mlp)
        self.hparams = dict(
            embedding_dim=d, bottom_mlp=bottom, top_mlp=top, norm=norm, activation=activation, bias=bias
        )
        opts: dict[str, Any] = dict(norm=norm, activation=activation, bias=bias)

        self.embeddings = EmbeddingTables(self.cardinalities, d)
        self.bottom_mlp = MLP(num_dense, (*bottom, d), **opts) if self.num_dense > 0 else None
        n_vec = self.num_sparse + (1 if self.num_dense > 0 else 0)  # vectors that interact
        if n_vec < 2:
            raise ConfigError(
                "DLRM needs at least two vectors to interact: give >= 2 sparse features, "
                "or >= 1 sparse feature and some dense features",
                key="cardinalities",
            )
        li, lj = torch.triu_indices(n_vec, n_vec, offset=1)  # strict upper triangle: i < j
        self.register_buffer("_tri_i", li, persistent=False)
        self.register_buffer("_tri_j", lj, persistent=False)
        top_in = n_vec * (n_vec - 1) // 2 + (d if self.num_dense > 0 else 0)
        self.top_mlp = MLP(top_in, top, **opts)
        self.head = nn.Linear(self.top_mlp.out_dim, 1, bias=True)  # prediction head keeps its bias

    def interact(self, vectors: torch.Tensor) -> torch.Tensor:
        """Pairwise dot products of ``vectors`` (B, m, d): the strict upper triangle (B, m(m-1)/2)."""
        z = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, m, m)
        return z[:, self._tri_i, self._tri_j]  # (B, m(m-1)/2)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, sparse)
        emb = self.embeddings(sparse)  # (B, n, d)
        if self.bottom_mlp is not None:
            x = self.bottom_mlp(dense)  # (B, d)
            vectors = torch.cat([x.unsqueeze(1), emb], dim=1)  # (B, n+1, d)
            top_in = torch.cat([x, self.interact(vectors)], dim=1)  # (B, d + (n+1)n/2)
        else:
            top_in = self.interact(emb)  # (B, n(n-1)/2)
        return self.head(self.top_mlp(top_in)).squeeze(-1)  # (B,)
