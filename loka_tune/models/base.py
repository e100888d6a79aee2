"""Pieces shared by the reference models: the model base class, MLPs, embedding tables.

Every weight-carrying GEMM is an ``nn.Linear`` (that is what precision configs swap); the
normalizations and activations come from :mod:`loka_tune.layers` so that the Mods passes
recognise them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch
from torch import nn

from loka_tune.errors import ConfigError, DataError
from loka_tune.layers import ACTIVATIONS, NORMS, make_activation, make_norm

__all__ = [
    "RecModel",
    "MLPBlock",
    "MLP",
    "EmbeddingTables",
    "check_options",
    "check_positive",
    "check_sizes",
    "check_inputs_spec",
]


def check_options(norm: str, activation: str, bias: bool) -> None:
    """Raise :class:`ConfigError` for an unknown ``norm`` / ``activation`` or a non-bool ``bias``."""
    if norm not in NORMS:
        raise ConfigError(f"unknown norm {norm!r}: choose one of {', '.join(NORMS)}", key="norm")
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}",
            key="activation",
        )
    if not isinstance(bias, bool):
        raise ConfigError(f"bias must be True or False, got {bias!r}", key="bias")


def check_positive(key: str, value: Any) -> int:
    """``value`` (any integer type, numpy included) as a positive int, else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ConfigError(f"must be a positive integer, got {value!r}", key=key)
    return int(value)


def check_sizes(key: str, value: Any) -> tuple[int, ...]:
    """``value`` (a sequence of layer widths, possibly empty) as a tuple of positive ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"must be a list of layer widths such as [512, 256], got {value!r}", key=key)
    return tuple(check_positive(f"{key}[{i}]", v) for i, v in enumerate(value))


def check_inputs_spec(num_dense: Any, cardinalities: Any) -> tuple[int, tuple[int, ...]]:
    """Validate the caller-given input spec: ``num_dense >= 0``, one cardinality >= 1 per feature."""
    if isinstance(num_dense, bool) or not isinstance(num_dense, numbers.Integral) or num_dense < 0:
        raise ConfigError(f"must be an integer >= 0, got {num_dense!r}", key="num_dense")
    if isinstance(cardinalities, (str, bytes)) or not isinstance(cardinalities, Sequence):
        raise ConfigError(
            f"must be a list with one table size per sparse feature, got {cardinalities!r}",
            key="cardinalities",
        )
    if len(cardinalities) == 0:
        raise ConfigError("needs at least one sparse feature, got an empty list", key="cardinalities")
    cards = tuple(check_positive(f"cardinalities[{i}]", c) for i, c in enumerate(cardinalities))
    return int(num_dense), cards


class RecModel(nn.Module):
    """Base class of the reference models.

    ``forward(dense (B, num_dense) float, sparse (B, n_sparse) int64) -> (B,) logits``.
    ``prediction_head`` is the fully qualified name of the final ``nn.Linear`` (out 1), which
    the No Bias pass and the precision configs leave alone. ``hparams`` holds the resolved
    architecture hyperparameters (what a preset plus overrides gave). A model with a
    behaviour-sequence arm sets ``takes_sequence = True`` and takes
    ``forward(dense, sparse, seq=None, seq_mask=None)`` (see
    :func:`loka_tune.data.base.model_inputs`, the one calling convention).
    """

    prediction_head: str = "head"
    takes_sequence: bool = False

    def __init__(self, num_dense: int, cardinalities: Sequence[int]) -> None:
        super().__init__()
        self.num_dense, self.cardinalities = check_inputs_spec(num_dense, cardinalities)
        self.num_sparse = len(self.cardinalities)
        self.hparams: dict[str, Any] = {}

    def check_inputs(self, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """Raise :class:`DataError` when the batch layout does not match the model's inputs."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise DataError(
                f"dense features must have shape (B, {self.num_dense}), got {tuple(dense.shape)}: "
                "build the model with the data source's num_dense"
            )
        if sparse.dim() != 2 or sparse.shape[1] != self.num_sparse:
            raise DataError(
                f"sparse features must have shape (B, {self.num_sparse}), got {tuple(sparse.shape)}: "
                "build the model with the data source's cardinalities"
            )
        if dense.shape[0] != sparse.shape[0]:
            raise DataError(
                f"dense and sparse batch sizes differ: {dense.shape[0]} vs {sparse.shape[0]}"
            )

    def init_output_bias(self, base_rate: float) -> None:
        """Set the prediction head's bias to ``logit(base_rate)``: the model starts out predicting
        the training data's click rate instead of 0.5 (standard for CTR models; on skewed data,
        e.g. 2% positives, a head at 0 spends its first steps only learning the base rate, and a
        tiny model may not get past it). ``base_rate`` is clipped to [1e-4, 1 - 1e-4]."""
        if isinstance(base_rate, bool) or not isinstance(base_rate, numbers.Real) or not 0.0 <= base_rate <= 1.0:
            raise ConfigError(f"must be a click rate in [0, 1], got {base_rate!r}: pass the data source's"
                              " base_rate (its training mean label)", key="base_rate")
        head = self.get_submodule(self.prediction_head)
        if not isinstance(head, nn.Linear) or head.bias is None or head.out_features != 1:
            raise ConfigError(f"{type(self).__name__}.prediction_head {self.prediction_head!r} is not an"
                              " nn.Linear(..., 1) with a bias", key="prediction_head")
        p = min(max(float(base_rate), 1e-4), 1.0 - 1e-4)
        with torch.no_grad():
            head.bias.fill_(math.log(p / (1.0 - p)))

    def mlp_chains(self) -> list[tuple[str, str | None]]:
        """The MLPs that may run as FP8 chains (the ``fp8_chain`` Mod), each with the linear that
        takes its output where that linear may join the chain as its last GEMM (``None``: none).
        Here every :class:`MLP` of the model, without a tail; models name their tails."""
        return [(n, None) for n, m in self.named_modules() if isinstance(m, MLP)]

    def forward_batch(self, batch: Any) -> torch.Tensor:
        """Logits (B,) for a :class:`loka_tune.data.base.Batch`, called as :func:`model_inputs` says."""
        from loka_tune.data.base import model_inputs

        return self(*model_inputs(self, batch))


class MLPBlock(nn.Module):
    """One hidden layer: ``linear -> norm -> act`` (children named so that passes find them)."""

    def __init__(self, in_dim: int, out_dim: int, *, norm: str, activation: str, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim, bias=bias)
        self.norm = make_norm(norm, out_dim)
        self.act = make_activation(activation, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(x)))  # (..., out_dim)


class MLP(nn.Sequential):
    """A stack of :class:`MLPBlock` hidden layers (possibly none: then the identity).

    ``out_dim`` is the width of the last block (``in_dim`` when there is none).
    """

    def __init__(
        self, in_dim: int, hidden: Sequence[int], *, norm: str, activation: str, bias: bool
    ) -> None:
        blocks = []
        d = in_dim
        for h in hidden:
            blocks.append(MLPBlock(d, h, norm=norm, activation=activation, bias=bias))
            d = h
        super().__init__(*blocks)
        self.out_dim = d


class EmbeddingTables(nn.Module):
    """The embedding tables of all sparse features, stored as one table (as FBGEMM's
    table-batched embeddings and torchrec do).

    ``table`` is one ``nn.Embedding(sum(cardinalities), dim, sparse=True)``; feature ``f``
    owns rows ``offsets[f] : offsets[f] + cardinalities[f]`` (see :meth:`table_weight`).
    Forward takes one id per feature per row, ``(B, n)`` int64, and returns ``(B, n, dim)``:
    one gather for all features, and one sparse gradient for all tables, which the trainer's
    row-wise optimizer updates in one pass (40 tables were 40 lookups, 40 sparse gradients
    and 40 optimizer loops per step, host-bound on a GPU).

    Tables are initialised uniform in +-sqrt(1/card) (the DLRM / torchrec default), which
    keeps dot-product interactions of order one whatever the table size; the random draws
    are the same as those of one ``nn.EmbeddingBag`` per feature, so seeded models are
    unchanged. Ids outside ``[0, card)`` raise :class:`DataError` on the CPU and fail a device
    assert on a GPU (no host sync) instead of reading another feature's rows. State dicts of
    the per-feature layout (``0.weight``, ``1.weight``, ...) load into this one.
    """

    offsets: torch.Tensor  # buffers: each feature's first row in ``table``, and its cardinality
    limits: torch.Tensor

    def __init__(self, cardinalities: Sequence[int], dim: int) -> None:
        super().__init__()
        cards = tuple(int(c) for c in cardinalities)
        self.cardinalities, self.embedding_dim = cards, int(dim)
        starts = [0]
        for c in cards:
            starts.append(starts[-1] + c)
        self.starts = tuple(starts)  # row offset of each feature, then the total
        weight = torch.empty(starts[-1], dim)
        with torch.no_grad():
            for f in range(len(cards)):  # nn.EmbeddingBag's own N(0, 1) init, table by table
                self._rows(weight, f).normal_()
            for f, card in enumerate(cards):
                bound = math.sqrt(1.0 / card)
                self._rows(weight, f).uniform_(-bound, bound)
        self.table = nn.Embedding(starts[-1], dim, sparse=True, _weight=weight)
        self.register_buffer("offsets", torch.tensor(starts[:-1], dtype=torch.int64), persistent=False)
        self.register_buffer("limits", torch.tensor(cards, dtype=torch.int64), persistent=False)

    def _rows(self, weight: torch.Tensor, f: int) -> torch.Tensor:
        return weight[self.starts[f] : self.starts[f + 1]]

    def __len__(self) -> int:
        return len(self.cardinalities)

    def table_weight(self, f: int) -> torch.Tensor:
        """Feature ``f``'s table, ``(cardinalities[f], dim)``: a view of the shared weight."""
        return self._rows(self.table.weight, f)

    def _check_ids(self, sparse: torch.Tensor) -> None:
        bad = (sparse < 0) | (sparse >= self.limits)  # (B, n)
        if sparse.device.type != "cpu" or torch.compiler.is_compiling():
            torch._assert_async(~bad.any(), "sparse id out of range of its embedding table")
            return
        if bool(bad.any()):
            r, f = (int(i) for i in bad.nonzero()[0])
            raise DataError(
                f"sparse feature {f} has id {int(sparse[r, f])} at row {r}, outside its table of "
                f"{self.cardinalities[f]} rows: build the model with the data source's cardinalities"
            )

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        self._check_ids(sparse)
        return self.table(sparse + self.offsets)  # (B, n) ids -> (B, n, dim)

    def lookup_with(self, sparse: torch.Tensor, feature: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(sparse) (B, n, dim), feature f's rows of ids (B, L, dim))`` from ONE gather.

        ``ids`` (B, L) index feature ``feature``'s table and must already be checked (in
        ``[0, cardinalities[feature])``) by the caller, whose error can say what they are (a
        behaviour sequence, say). Two lookups of the table would give autograd two sparse
        gradients to add (``aten.add`` of two COO tensors), which inductor lowers as a dense
        op: its generated code asserts dense strides on the sparse sum ("expected size
        381520==381520, stride 0==256 ... aten.add.Tensor" on the H200); one gather of the
        concatenated ids gives the same outputs and one sparse gradient (the same rows and,
        coalesced, the same sums), which the optimizer updates in one pass.
        """
        self._check_ids(sparse)
        n = sparse.shape[1]
        rows = torch.cat([sparse + self.offsets, ids + self.starts[feature]], dim=1)  # (B, n + L)
        # torch.split, not slicing: a split's backward is a cat, a slice's is a scatter into zeros that
        # inductor re-inplaces, and its fake-tensor update then trips on the sparse gradient after it
        x, s = torch.split(self.table(rows), [n, ids.shape[1]], dim=1)
        return x, s  # (B, n, dim), (B, L, dim)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        old = [f"{prefix}{f}.weight" for f in range(len(self.cardinalities))]
        if f"{prefix}table.weight" not in state_dict and all(k in state_dict for k in old):
            state_dict[f"{prefix}table.weight"] = torch.cat([state_dict.pop(k) for k in old])  # per-feature layout
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
