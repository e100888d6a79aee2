"""InterFormer (Zeng et al., 2024): interleaved learning over non-sequence features and a user
behaviour sequence, with bidirectional information flow and a separate summarisation arch.

Inputs: ``dense`` (B, num_dense), ``sparse`` (B, n_sparse) and, optionally, the behaviour
sequence ``seq`` (B, L) (ids of sparse feature ``seq_feature``'s table: the sequence shares
the target item's embeddings) with ``seq_mask`` (B, L) (True at real events; left-padded, most
recent last; see :class:`loka_tune.data.base.Batch`). Without a sequence (Criteo, Avazu) the
sequence arm is empty: it holds only the CLS tokens made from the non-sequence features.

Preprocessing: X0 (B, n, d) = the sparse embeddings plus ``dense_embeddings`` rows made from
the dense features by an MLP; S0 (B, c + L, d) = ``num_cls`` CLS tokens (a Linear over the
flattened X0) followed by the sequence's item embeddings. The sparse features' and the
events' rows come from one gather of the shared table
(:meth:`~loka_tune.models.base.EmbeddingTables.lookup_with`): one sparse gradient, which
torch.compile can build and the trainer's row-wise optimizer updates in one pass.

Each of ``num_layers`` layers maps (X, S) to (X', S') and runs three arches:

- Cross Arch (summaries, the only bridge between the modes): the non-sequence summary
  ``x_sum`` (B, k, d) = a linear compression of X over the feature axis, self-gated
  (``x * sigmoid(gate(x))``); the sequence summary ``s_sum`` (B, c + p + r, d) = the CLS tokens,
  ``num_pma`` PMA tokens (attention pooling of S with queries made from ``x_sum``) and the
  ``num_recent`` most recent events (padding zeroed), self-gated.
- Interaction Arch (behaviour-aware non-sequence learning): X' = norm(X + MLP([flatten(C),
  dots(C)])) with C = [X; s_sum] and dots the pairwise dot products of C's rows (a DOT + MLP
  ensemble).
- Sequence Arch (context-aware sequence learning): a personalised FFN (S @ W(x_sum), a
  per-example (d, r) projection generated from ``x_sum``, then a Linear back to d), multi-head
  self-attention with rotary position embeddings over the valid tokens, then a token-wise FFN,
  each with a residual and a norm.

The head: flatten the last layer's [x_sum; s_sum] -> MLP -> ``head`` (Linear -> 1, with a bias).

Every weight GEMM is a plain ``nn.Linear`` (attention projections, the FFNs over (B, T, d),
the compression over the feature axis, the generated-weight and CLS/PMA-query Linears, the
interaction MLP), so precision configs and every Mods pass reach them; the attention
products, the PFFN's per-example product and the dot interaction are ``bmm`` / SDPA without
weights. Rotary embeddings have no parameters. Written from the paper's description; the
authors' code is not public, so the exact arch internals (gate MLP depth, interaction module)
are our choices, named above.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.errors import ConfigError, DataError
from loka_tune.layers import make_norm
from loka_tune.models.base import MLP, EmbeddingTables, RecModel, check_options, check_positive, check_sizes

__all__ = ["Interformer", "InterformerLayer", "Attention", "rotary"]


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, h, T, e) over positions 0..T-1 (e even); same dtype."""
    T, e = x.shape[-2], x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)  # bf16 in, fp32 math; fp64 stays fp64
    inv = 1.0 / (10000.0 ** (torch.arange(0, e, 2, device=x.device, dtype=dt) / e))  # (e/2,)
    ang = torch.arange(T, device=x.device, dtype=dt)[:, None] * inv  # (T, e/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.to(dt)[..., 0::2], x.to(dt)[..., 1::2]  # (B, h, T, e/2)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with ``nn.Linear`` projections (``q``, ``k``, ``v``, ``o``, each d -> d).

    ``forward(q_in (B, Tq, d), kv_in (B, Tk, d), key_mask (B, Tk) bool, rope)`` -> (B, Tq, d);
    every query must see at least one valid key (the CLS tokens guarantee it).
    """

    def __init__(self, dim: int, heads: int, *, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim, bias=bias)
        self.v = nn.Linear(dim, dim, bias=bias)
        self.o = nn.Linear(dim, dim, bias=bias)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        return x.view(B, T, self.heads, d // self.heads).transpose(1, 2)  # (B, h, T, e)

    def forward(self, q_in: torch.Tensor, kv_in: torch.Tensor, key_mask: torch.Tensor, *, rope: bool) -> torch.Tensor:
        q, k, v = self._split(self.q(q_in)), self._split(self.k(kv_in)), self._split(self.v(kv_in))
        if rope:
            q, k = rotary(q), rotary(k)
        mask = key_mask[:, None, None, :]  # (B, 1, 1, Tk): True = attend
        y = F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask)  # (B, h, Tq, e)
        return self.o(y.transpose(1, 2).flatten(2))  # (B, Tq, d)


class InterformerLayer(nn.Module):
    """One interleaved layer: (X (B, n, d), S (B, T, d), mask (B, T)) -> (X', S'). See the module docstring."""

    _tri_i: torch.Tensor  # buffers: the strict upper triangle of C C^T
    _tri_j: torch.Tensor

    def __init__(
        self, n: int, dim: int, *, heads: int, num_cls: int, num_pma: int, num_recent: int,
        x_summary: int, pffn_rank: int, seq_ffn: Sequence[int], interaction_mlp: Sequence[int],
        norm: str, activation: str, bias: bool,
    ) -> None:
        super().__init__()
        opts: dict[str, Any] = dict(norm=norm, activation=activation, bias=bias)
        self.n, self.dim, self.num_cls, self.num_pma, self.num_recent = n, dim, num_cls, num_pma, num_recent
        self.x_summary, self.pffn_rank = x_summary, pffn_rank
        n_sum = num_cls + num_pma + num_recent
        # Cross Arch
        self.x_compress = nn.Linear(n, x_summary, bias=bias)  # over the feature axis
        self.x_gate = nn.Linear(dim, dim, bias=bias)
        self.pma_query = nn.Linear(x_summary * dim, num_pma * dim, bias=bias)  # personalised PMA seeds
        self.pma = Attention(dim, heads, bias=bias)
        self.s_gate = nn.Linear(dim, dim, bias=bias)
        # Interaction Arch: DOT + MLP over C = [X; s_sum], N rows
        rows = n + n_sum
        li, lj = torch.triu_indices(rows, rows, offset=1)
        self.register_buffer("_tri_i", li, persistent=False)
        self.register_buffer("_tri_j", lj, persistent=False)
        self.interaction = MLP(rows * dim + rows * (rows - 1) // 2, interaction_mlp, **opts)
        self.interaction_out = nn.Linear(self.interaction.out_dim, n * dim, bias=bias)
        self.x_norm = make_norm(norm, dim)
        # Sequence Arch
        self.pffn_weight = nn.Linear(x_summary * dim, dim * pffn_rank, bias=bias)  # W(x_sum): (d, r) per example
        self.pffn_out = nn.Linear(pffn_rank, dim, bias=bias)
        self.pffn_norm = make_norm(norm, dim)
        self.attn = Attention(dim, heads, bias=bias)
        self.attn_norm = make_norm(norm, dim)
        self.ffn = MLP(dim, seq_ffn, **opts)
        self.ffn_out = nn.Linear(self.ffn.out_dim, dim, bias=bias)
        self.ffn_norm = make_norm(norm, dim)

    def summaries(self, x: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross Arch: ``x_sum`` (B, k, d) and ``s_sum`` (B, c + p + r, d)."""
        xc = self.x_compress(x.transpose(1, 2)).transpose(1, 2)  # (B, k, d)
        x_sum = xc * torch.sigmoid(self.x_gate(xc))  # self-gating
        q = self.pma_query(x_sum.flatten(1)).view(-1, self.num_pma, self.dim)  # (B, p, d)
        pma = self.pma(q, s, mask, rope=False)  # (B, p, d)
        recent = s[:, -self.num_recent:] * mask[:, -self.num_recent:, None].to(s.dtype)  # (B, r, d)
        parts = torch.cat([s[:, : self.num_cls], pma, recent], dim=1)  # (B, c + p + r, d)
        return x_sum, parts * torch.sigmoid(self.s_gate(parts))

    def forward(self, x: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_sum, s_sum = self.summaries(x, s, mask)
        # Interaction Arch: behaviour-aware non-sequence learning
        c = torch.cat([x, s_sum.to(x.dtype)], dim=1)  # (B, N, d)
        dots = torch.bmm(c, c.transpose(1, 2))[:, self._tri_i, self._tri_j]  # (B, N(N-1)/2)
        h = self.interaction(torch.cat([c.flatten(1), dots], dim=1))  # (B, hidden)
        x_new = self.x_norm(x + self.interaction_out(h).view_as(x))  # (B, n, d)
        # Sequence Arch: context-aware sequence learning
        w = self.pffn_weight(x_sum.flatten(1)).view(-1, self.dim, self.pffn_rank)  # (B, d, r)
        p = torch.bmm(s, w.to(s.dtype))  # (B, T, r) personalised projection
        s = self.pffn_norm(s + self.pffn_out(p))
        s = self.attn_norm(s + self.attn(s, s, mask, rope=True))
        s = self.ffn_norm(s + self.ffn_out(self.ffn(s)))  # (B, T, d)
        return x_new, s


class Interformer(RecModel):
    """InterFormer with ``num_layers`` interleaved layers (see the module docstring).

    ``forward(dense, sparse, seq=None, seq_mask=None) -> (B,) logits``.

    Args:
        num_dense: number of dense features (0 allowed: no dense rows).
        cardinalities: one embedding-table size per sparse feature.
        embedding_dim: d, the width of every token.
        num_layers: >= 1.
        num_heads: attention heads (d divisible by it, d / heads even for the rotary embedding).
        num_cls, num_pma, num_recent: the sequence summary's CLS, PMA and most-recent tokens.
        x_summary: k, the rows of the non-sequence summary.
        pffn_rank: r, the width of the personalised FFN's generated projection.
        seq_ffn: hidden widths of the token-wise FFN (its last linear, -> d, is appended).
        interaction_mlp: hidden widths of the Interaction Arch MLP (-> n d appended).
        dense_mlp, dense_embeddings: the dense features' MLP and the rows it makes.
        head_mlp: hidden widths before the prediction head.
        seq_feature: the sparse feature whose table the sequence's ids index.
        norm, activation, bias: options of every layer (``head`` always has a bias).
    """

    takes_sequence = True

    def __init__(
        self,
        num_dense: int,
        cardinalities: Sequence[int],
        *,
        embedding_dim: int = 32,
        num_layers: int = 3,
        num_heads: int = 2,
        num_cls: int = 4,
        num_pma: int = 2,
        num_recent: int = 2,
        x_summary: int = 4,
        pffn_rank: int = 32,
        seq_ffn: Sequence[int] = (128,),
        interaction_mlp: Sequence[int] = (256, 256),
        dense_mlp: Sequence[int] = (256,),
        dense_embeddings: int = 1,
        head_mlp: Sequence[int] = (256, 128),
        seq_feature: int = 0,
        norm: str = "layernorm",
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__(num_dense, cardinalities)
        check_options(norm, activation, bias)
        d = check_positive("embedding_dim", embedding_dim)
        heads = check_positive("num_heads", num_heads)
        if d % heads or (d // heads) % 2:
            raise ConfigError(
                f"embedding_dim / num_heads must be an even integer (rotary embeddings), got "
                f"{d} / {heads}: pick num_heads dividing embedding_dim into even head widths",
                key="num_heads",
            )
        ints = {k: check_positive(k, v) for k, v in dict(
            num_layers=num_layers, num_cls=num_cls, num_pma=num_pma, num_recent=num_recent,
            x_summary=x_summary, pffn_rank=pffn_rank, dense_embeddings=dense_embeddings).items()}
        sizes = {k: check_sizes(k, v) for k, v in dict(
            seq_ffn=seq_ffn, interaction_mlp=interaction_mlp, dense_mlp=dense_mlp, head_mlp=head_mlp).items()}
        if isinstance(seq_feature, bool) or not isinstance(seq_feature, int) or not 0 <= seq_feature < self.num_sparse:
            raise ConfigError(
                f"must be the index of a sparse feature in [0, {self.num_sparse}), got {seq_feature!r}",
                key="seq_feature",
            )
        self.hparams = dict(embedding_dim=d, num_heads=heads, **ints, **sizes, seq_feature=seq_feature,
                            norm=norm, activation=activation, bias=bias)
        self.embedding_dim, self.seq_feature = d, seq_feature
        self.num_cls, self.num_recent = ints["num_cls"], ints["num_recent"]
        opts: dict[str, Any] = dict(norm=norm, activation=activation, bias=bias)

        self.embeddings = EmbeddingTables(self.cardinalities, d)
        self.dense_embeddings = ints["dense_embeddings"] if self.num_dense > 0 else 0
        self.dense_mlp = MLP(self.num_dense, sizes["dense_mlp"], **opts) if self.num_dense > 0 else None
        self.dense_proj = (nn.Linear(self.dense_mlp.out_dim, self.dense_embeddings * d, bias=bias)
                           if self.dense_mlp is not None else None)
        n = self.num_sparse + self.dense_embeddings  # rows of X
        self.cls = nn.Linear(n * d, self.num_cls * d, bias=bias)  # CLS tokens from the non-sequence features
        self.layers = nn.ModuleList(
            InterformerLayer(
                n, d, heads=heads, num_cls=self.num_cls, num_pma=ints["num_pma"], num_recent=self.num_recent,
                x_summary=ints["x_summary"], pffn_rank=ints["pffn_rank"], seq_ffn=sizes["seq_ffn"],
                interaction_mlp=sizes["interaction_mlp"], **opts,
            )
            for _ in range(ints["num_layers"])
        )
        n_sum = ints["x_summary"] + self.num_cls + ints["num_pma"] + self.num_recent
        self.head_mlp = MLP(n_sum * d, sizes["head_mlp"], **opts)
        self.head = nn.Linear(self.head_mlp.out_dim, 1, bias=True)  # prediction head keeps its bias

    def _sequence(self, batch: int, seq: torch.Tensor | None, seq_mask: torch.Tensor | None,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's ids and mask, left-padded to at least ``num_recent`` events; checked."""
        if seq is None:
            seq = torch.zeros(batch, 0, dtype=torch.int64, device=device)
            seq_mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        elif seq_mask is None:
            raise DataError("seq needs seq_mask (B, L) bool, True at real events")
        if seq.dim() != 2 or seq.shape[0] != batch or seq_mask.shape != seq.shape:
            raise DataError(
                f"seq and seq_mask must both have shape (B, L) with B = {batch}, got "
                f"{tuple(seq.shape)} and {tuple(seq_mask.shape)}"
            )
        short = self.num_recent - seq.shape[1]
        if short > 0:  # fewer positions than recent tokens: pad on the left (older side)
            seq = F.pad(seq, (short, 0))
            seq_mask = F.pad(seq_mask, (short, 0))
        return seq, seq_mask.bool()

    def _seq_ids(self, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The sequence's ids (B, L) in feature ``seq_feature``'s table, padding at row 0; checked."""
        f = self.seq_feature
        ids = torch.where(mask, seq, torch.zeros_like(seq))  # padding reads row 0 of the table
        card = self.embeddings.cardinalities[f]
        bad = (ids < 0) | (ids >= card)  # (B, L)
        if ids.device.type != "cpu" or torch.compiler.is_compiling():
            torch._assert_async(~bad.any(), "sequence id out of range of its embedding table")  # no host sync
        elif bool(bad.any()):
            r, j = (int(i) for i in bad.nonzero()[0])
            raise DataError(
                f"sequence id {int(ids[r, j])} at row {r}, position {j} is outside sparse feature "
                f"{f}'s table of {card} rows: sequences hold ids of sparse feature seq_feature={f}"
            )
        return ids

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, seq: torch.Tensor | None = None,
                seq_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.check_inputs(dense, sparse)
        B = sparse.shape[0]
        seq, seq_mask = self._sequence(B, seq, seq_mask, sparse.device)
        # one gather for the features and the events: one sparse gradient (see EmbeddingTables.lookup_with)
        x, events = self.embeddings.lookup_with(sparse, self.seq_feature, self._seq_ids(seq, seq_mask))
        events = events * seq_mask[..., None].to(events.dtype)  # (B, L, d), padding zeroed
        if self.dense_proj is not None and self.dense_mlp is not None:
            rows = self.dense_proj(self.dense_mlp(dense))  # (B, m d)
            x = torch.cat([rows.view(B, self.dense_embeddings, self.embedding_dim), x], dim=1)  # (B, n, d)
        cls = self.cls(x.flatten(1)).view(B, self.num_cls, self.embedding_dim)  # (B, c, d)
        s = torch.cat([cls, events.to(cls.dtype)], dim=1)  # (B, c + L, d)
        mask = torch.cat([torch.ones(B, self.num_cls, dtype=torch.bool, device=s.device), seq_mask], dim=1)
        for layer in self.layers:
            x, s = layer(x, s, mask)
        x_sum, s_sum = cast(InterformerLayer, self.layers[-1]).summaries(x, s, mask)  # the last Cross Arch
        h = torch.cat([x_sum, s_sum.to(x_sum.dtype)], dim=1).flatten(1)  # (B, (k + c + p + r) d)
        return self.head(self.head_mlp(h)).squeeze(-1)  # (B,)
