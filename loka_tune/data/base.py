"""The batch type every data source yields, and the data-source protocol.

All sources (synthetic, Criteo, Avazu, a user's own) yield :class:`Batch` objects with the
same layout, so models, the trainer and the probe never care where data came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Batch", "DataSource"]


@dataclass
class Batch:
    """One mini-batch of CTR examples.

    dense:  (B, num_dense) float32, already transformed (e.g. log(1 + max(x, 0))), missing -> 0
    sparse: (B, num_sparse) int64, one id per categorical feature, each in [0, cardinality)
    labels: (B,) float32 in {0, 1}
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )


@runtime_checkable
class DataSource(Protocol):
    """A deterministic source of CTR batches.

    ``batches(split, batch_size, seed)`` must yield the same batches in the same order for the
    same arguments, whatever model consumes them: this is what makes two short runs that
    differ only in numerics a paired comparison. ``split`` is ``"train"`` or ``"eval"``; the
    two are disjoint. Train iterators are infinite (the source cycles, reshuffling per epoch
    deterministically from ``seed``); eval iterators are finite (one pass over the eval split,
    or ``eval_examples`` synthetic rows).
    """

    name: str
    num_dense: int

    @property
    def cardinalities(self) -> Sequence[int]:  # read-only: a tuple or a list satisfies it
        ...

    def batches(
        self,
        split: str,
        batch_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> Iterator[Batch]: ...
