"""The batch type every data source yields, and the data-source protocol.

All sources (synthetic, Criteo, Avazu, a user's own) yield :class:`Batch` objects with the
same layout, so models, the trainer and the probe never care where data came from.

The calling convention of every model is :func:`model_inputs`: ``model(dense, sparse)``, and
``model(dense, sparse, seq, seq_mask)`` for a model that declares ``takes_sequence = True``
when the batch carries behaviour sequences. A sequence model given no sequence runs with its
sequence arm empty; a model without a sequence arm never sees the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch

from ..errors import DataError

__all__ = ["Batch", "DataSource", "model_inputs"]


@dataclass
class Batch:
    """One mini-batch of CTR examples.

    dense:  (B, num_dense) float32, already transformed (e.g. log(1 + max(x, 0))), missing -> 0
    sparse: (B, num_sparse) int64, one id per categorical feature, each in [0, cardinality)
    labels: (B,) float32 in {0, 1}
    seq:    (B, L) int64 or None: each row's behaviour sequence, ids of sparse feature 0's
            table (the target item's id space), oldest to newest and left-padded, so the most
            recent event is at position L - 1; padded positions hold id 0
    seq_mask: (B, L) bool or None (given with ``seq``): True at real events. A row may have
            no events (a cold-start user): its mask row is all False
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    seq: torch.Tensor | None = None
    seq_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            move(self.seq),
            move(self.seq_mask),
        )

    def rows(self, start: int, end: int) -> "Batch":
        """Rows ``start:end`` (views), sequences included."""
        sl = slice(start, end)
        return Batch(
            self.dense[sl], self.sparse[sl], self.labels[sl],
            None if self.seq is None else self.seq[sl],
            None if self.seq_mask is None else self.seq_mask[sl],
        )


def model_inputs(model: Any, batch: Any) -> tuple[torch.Tensor, ...]:
    """The positional arguments of ``model`` for ``batch``: ``(dense, sparse)``, or
    ``(dense, sparse, seq, seq_mask)`` when the model declares ``takes_sequence = True`` and
    the batch has sequences. Every caller (trainer, probe, site discovery, speed, harnesses)
    calls models through this, so a model opts in to sequences with one class attribute.
    ``batch`` is a :class:`Batch` or anything with ``.dense`` / ``.sparse`` (and optionally
    ``.seq`` / ``.seq_mask``).
    """
    seq = getattr(batch, "seq", None)
    if seq is not None and _takes_sequence(model):
        if getattr(batch, "seq_mask", None) is None:
            raise DataError("a batch with seq needs seq_mask (True at real events): build it with both")
        return batch.dense, batch.sparse, batch.seq, batch.seq_mask
    return batch.dense, batch.sparse


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


def _takes_sequence(model: Any) -> bool:
    """``model.takes_sequence``, looking through DataParallel / DistributedDataParallel wrappers
    (their ``.module``; ``torch.compile``'s wrapper forwards attributes itself)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DataParallel, DistributedDataParallel)):
        model = model.module
    return bool(getattr(model, "takes_sequence", False))
