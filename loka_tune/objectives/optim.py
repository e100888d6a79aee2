"""Optimizers of the short-run trainer, as LRM training runs them.

Embedding tables (``nn.Embedding`` / ``nn.EmbeddingBag``) get a sparse-aware optimizer that
only touches the rows a batch used (row-wise Adagrad, the torchrec/FBGEMM default, or
``torch.optim.SparseAdam``); every other parameter gets Adam. On a GPU both run without a
host synchronization: Adam fused (one kernel for all dense parameters), row-wise Adagrad as
:func:`rowwise_adagrad_update_` over the one sparse gradient of the model's table-batched
embeddings; so a training step can run ahead of the GPU, and be captured in a CUDA graph.
On the CPU they are the reference implementations (bit-for-bit what they always were).
"""

from __future__ import annotations

from typing import Any, Callable, cast

import torch
from torch import nn

from loka_tune.errors import ConfigError

__all__ = [
    "RowwiseAdagrad",
    "rowwise_adagrad_update_",
    "SPARSE_OPTIMIZERS",
    "split_parameters",
    "build_optimizers",
]


def rowwise_adagrad_update_(
    weight: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float | torch.Tensor,
    eps: float,
) -> None:
    """One row-wise Adagrad update of ``weight`` from an *uncoalesced* sparse gradient, with no
    host synchronization (so it can run ahead of the GPU and inside a CUDA graph).

    ``rows`` ``(n,)``: the row of each gradient slice, repeats and any order allowed;
    ``grads`` ``(n, dim)``. Repeated rows are summed first (as ``coalesce()`` would) into a
    buffer of fixed size ``n``: the sorted ids form segments, one per distinct row, so no
    tensor's size depends on the data. The sums use ``index_put_(accumulate=True)``, which on
    a GPU sorts and reduces runs of equal indices (the embedding-backward kernel) instead of
    contending atomics: the small tables of an LRM put thousands of lookups on one row. Every
    sorted position then computes its row's new accumulator and weights and writes them with a
    plain ``index_put_``: the positions of one row write identical values, so the result does
    not depend on which write lands last, and no atomic add touches the table. ``lr`` may be a
    0-d tensor on the table's device (a CUDA-graph step's warm-up fills it before each replay).
    """
    n = rows.numel()
    if n == 0:
        return
    sorted_rows, perm = torch.sort(rows)  # (n,)
    head = torch.ones(n, dtype=torch.bool, device=rows.device)
    head[1:] = sorted_rows[1:] != sorted_rows[:-1]
    seg = torch.cumsum(head, 0) - 1  # (n,) segment of each sorted position
    seg_of = torch.empty_like(seg).scatter_(0, perm, seg)  # (n,) segment of each original slice
    g = torch.zeros(n, grads.shape[1], dtype=torch.float32, device=grads.device)
    g.index_put_((seg_of,), grads.float(), accumulate=True)  # (n, dim): segment s's summed gradient
    g_pos = g.index_select(0, seg)  # (n, dim): the summed gradient of each position's row
    a = acc.index_select(0, sorted_rows) + g_pos.pow(2).mean(dim=1)  # (n,) new accumulators
    acc.index_put_((sorted_rows,), a)
    upd = g_pos / (a.sqrt() + eps).unsqueeze(1)  # (n, dim)
    w = weight.index_select(0, sorted_rows) + upd.to(weight.dtype) * -lr
    weight.index_put_((sorted_rows,), w)


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for embedding tables (the torchrec / FBGEMM default for LRMs).

    One accumulator per table row (the mean of the squared gradient over the row), so the
    state is ``num_rows`` floats instead of a full copy of the table. Sparse gradients (from
    ``sparse=True`` embeddings) update only the rows they touch; dense gradients are
    accepted too (rows with a zero gradient are left unchanged, as with sparse ones).

        acc[r] += mean_j g[r, j]^2 ;   w[r] -= lr * g[r] / (sqrt(acc[r]) + eps)

    ``fused`` (default: on for CUDA tables) runs :func:`rowwise_adagrad_update_`, which never
    synchronizes with the host and can be captured in a CUDA graph; otherwise sparse
    gradients are coalesced and dense ones reduced to their non-zero rows (both read sizes
    back to the host: free on the CPU, where this path is bit-for-bit the reference).
    """

    def __init__(self, params: Any, lr: float = 1e-2, eps: float = 1e-8, *, fused: bool | None = None) -> None:
        if not lr > 0:
            raise ConfigError(f"must be > 0, got {lr!r}", key="lr_sparse")
        super().__init__(params, {"lr": lr, "eps": eps})
        self.fused = fused

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # noqa: D102
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                assert p.dim() == 2, "RowwiseAdagrad updates 2-d embedding tables"
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                fused = p.is_cuda if self.fused is None else self.fused
                (self._fused_step if fused else self._step)(p, state["sum"], lr, eps)
        return loss

    @staticmethod
    def _fused_step(p: torch.Tensor, acc: torch.Tensor, lr: float | torch.Tensor, eps: float) -> None:
        g = p.grad
        assert g is not None
        if g.is_sparse:
            rows, vals = g._indices()[0], g._values()  # uncoalesced: no host sync
        else:
            rows, vals = torch.arange(p.shape[0], device=p.device), g  # every row (zero rows stay)
        rowwise_adagrad_update_(p, acc, rows, vals, lr, eps)

    @staticmethod
    def _step(p: torch.Tensor, acc: torch.Tensor, lr: float, eps: float) -> None:
        g = p.grad
        assert g is not None
        if g.is_sparse:
            g = g.coalesce()  # unique sorted row ids, duplicate rows summed
            rows, vals = g.indices()[0], g.values().float()  # (nnz,), (nnz, dim)
        else:
            touched = g.ne(0).any(dim=1)
            rows = touched.nonzero().squeeze(1)  # (nnz,)
            vals = g[rows].float()  # (nnz, dim)
        if rows.numel() == 0:
            return
        acc_rows = acc.index_select(0, rows) + vals.pow(2).mean(dim=1)  # (nnz,)
        acc.index_copy_(0, rows, acc_rows)
        upd = vals / (acc_rows.sqrt() + eps).unsqueeze(1)  # (nnz, dim)
        p.index_add_(0, rows, upd.to(p.dtype), alpha=-lr)  # rows unique: deterministic


def _sparse_adam(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SparseAdam(params, lr=lr)


def _rowwise_adagrad(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return RowwiseAdagrad(params, lr=lr)


# name -> factory(params, lr)
SPARSE_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], float], torch.optim.Optimizer]] = {
    "rowwise_adagrad": _rowwise_adagrad,
    "sparse_adam": _sparse_adam,
}


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(embedding_params, dense_params)``: the weights of every ``nn.Embedding`` /
    ``nn.EmbeddingBag`` versus every other trainable parameter (each listed once, in order)."""
    emb_ids: set[int] = set()
    emb: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight.requires_grad:
            if id(m.weight) not in emb_ids:
                emb_ids.add(id(m.weight))
                emb.append(cast(nn.Parameter, m.weight))  # torch types Embedding.weight as Tensor
    dense: list[nn.Parameter] = []
    seen: set[int] = set(emb_ids)
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            dense.append(p)
    return emb, dense


def build_optimizers(model: nn.Module, cfg: Any) -> list[torch.optim.Optimizer]:
    """The run's optimizers (``cfg``: a :class:`~loka_tune.objectives.trainer.TrainConfig`):
    the sparse one over embedding tables, Adam over the rest.

    Adam is ``fused`` when the dense parameters are on a GPU (``capturable`` too when
    ``cfg.cuda_graphs``), ``foreach=False`` on the CPU (the reference numerics).
    SparseAdam needs sparse gradients: an embedding built with ``sparse=False`` raises a
    :class:`ConfigError` naming the table (use ``rowwise_adagrad``, which takes both).
    """
    emb, dense = split_parameters(model)
    opts: list[torch.optim.Optimizer] = []
    if emb:
        if cfg.sparse_optimizer == "sparse_adam":
            dense_tables = [
                name
                for name, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and not m.sparse
            ]
            if dense_tables:
                raise ConfigError(
                    f"sparse_adam needs embeddings built with sparse=True; {dense_tables[0]!r} is "
                    "dense: build it with sparse=True or use sparse_optimizer='rowwise_adagrad'",
                    key="sparse_optimizer",
                )
        opts.append(SPARSE_OPTIMIZERS[cfg.sparse_optimizer](emb, cfg.lr_sparse))
    if dense:
        if all(p.is_cuda for p in dense):
            graphs = bool(getattr(cfg, "cuda_graphs", False))
            opts.append(torch.optim.Adam(dense, lr=cfg.lr_dense, fused=True, capturable=graphs))
        else:
            opts.append(torch.optim.Adam(dense, lr=cfg.lr_dense, foreach=False))
    return opts
