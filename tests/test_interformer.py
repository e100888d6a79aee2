"""Interformer: shapes, the sequence mask, the empty arm, determinism, 3-D sites, errors, learning.

The generic model tests (test_models.py) and the Mods reference-model tests (test_mods.py) run
on it too, through MODEL_NAMES; these are the sequence-specific checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.data.base import Batch, model_inputs
from loka_tune.errors import ConfigError, DataError
from loka_tune.models import build_model
from loka_tune.models.interformer import Attention, rotary

CARDS = [30, 11, 13, 17]  # feature 0 is the item: the sequences' id space
NUM_DENSE = 5


def _model(**kw):
    torch.manual_seed(0)
    return build_model("interformer", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS, **kw)


def _inputs(batch: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, NUM_DENSE, generator=g)
    sparse = torch.stack([torch.randint(0, c, (batch,), generator=g) for c in CARDS], 1)
    seq = torch.randint(0, CARDS[0], (batch, L), generator=g)
    length = torch.randint(0, L + 1, (batch,), generator=g)
    mask = torch.arange(L)[None, :] >= (L - length)[:, None]  # left-padded
    return dense, sparse, torch.where(mask, seq, 0), mask


@pytest.mark.parametrize("L", [0, 1, 7])
def test_shapes_and_gradients_with_sequences(L):
    model = _model()
    dense, sparse, seq, mask = _inputs(6, L)
    logits = model(dense, sparse, seq, mask)
    assert logits.shape == (6,) and torch.isfinite(logits).all()
    logits.sum().backward()
    table = model.embeddings.table.weight.grad.coalesce()
    rows = set(table.indices()[0].tolist())
    used = set(seq[mask].tolist())  # feature 0 starts at row 0 of the shared table
    assert used <= rows  # the events' embeddings get gradients


def test_padded_positions_do_not_matter_and_real_events_do():
    model = _model().double()
    dense, sparse, seq, mask = _inputs(8, 6)
    mask[0] = torch.tensor([False, False, True, True, True, True])  # row 0: 4 events, 2 padded
    mask[1] = False  # row 1: a cold user
    ref = model(dense.double(), sparse, seq, mask)
    other = torch.where(mask, seq, (seq + 7) % CARDS[0])  # change only the padded ids
    torch.testing.assert_close(model(dense.double(), sparse, other, mask), ref, rtol=0, atol=1e-12)
    changed = seq.clone()
    changed[0, -1] = (seq[0, -1] + 1) % CARDS[0]  # the most recent event of row 0
    out = model(dense.double(), sparse, changed, mask)
    assert (out[0] - ref[0]).abs() > 1e-9
    torch.testing.assert_close(out[1:], ref[1:], rtol=0, atol=1e-12)  # rows are independent


def test_empty_arm_is_the_same_with_no_all_masked_or_empty_sequences():
    model = _model().double()
    dense, sparse, seq, _ = _inputs(5, 4)
    none = model(dense.double(), sparse)
    empty = model(dense.double(), sparse, seq[:, :0], torch.zeros(5, 0, dtype=torch.bool))
    masked = model(dense.double(), sparse, seq, torch.zeros(5, 4, dtype=torch.bool))
    torch.testing.assert_close(empty, none, rtol=0, atol=1e-12)
    # all-masked positions sit between the CLS tokens and nothing: only RoPE positions of
    # padded queries move, and those never reach a key or a summary
    torch.testing.assert_close(masked, none, rtol=0, atol=1e-12)


def test_one_gather_gives_what_two_lookups_gave():
    """The features and the events come from one gather of the shared table (what lets inductor
    compile the backward, see EmbeddingTables.lookup_with): the model's outputs are those of the
    former two lookups, bit for bit, and its one sparse gradient coalesces to their sum."""
    model = _model().double()
    dense, sparse, seq, mask = _inputs(8, 5)
    fused = model(dense.double(), sparse, seq, mask)
    fused.sum().backward()
    one = model.embeddings.table.weight.grad
    n, L = sparse.shape[1], seq.shape[1]
    assert one.is_sparse and one._nnz() == 8 * (n + L)  # one gradient: the features' and the events' slices
    model.zero_grad(set_to_none=True)
    emb = model.embeddings

    def two_lookups(sp: torch.Tensor, feature: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return emb(sp), emb.table(ids + emb.starts[feature])  # the former code: two sparse gradients

    emb.lookup_with = two_lookups  # type: ignore[method-assign]
    ref = model(dense.double(), sparse, seq, mask)
    ref.sum().backward()
    assert torch.equal(fused, ref)
    two, one = model.embeddings.table.weight.grad.coalesce(), one.coalesce()
    assert torch.equal(one.indices(), two.indices())
    torch.testing.assert_close(one.values(), two.values(), rtol=1e-12, atol=1e-14)


def test_deterministic_init_and_forward():
    a, b = _model(), _model()
    inputs = _inputs(4, 5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    torch.testing.assert_close(a(*inputs), b(*inputs), rtol=0, atol=0)
    torch.testing.assert_close(a(*inputs), a(*inputs), rtol=0, atol=0)


def test_model_inputs_is_the_calling_convention():
    dense, sparse, seq, mask = _inputs(4, 3)
    with_seq = Batch(dense, sparse, torch.zeros(4), seq, mask)
    plain = Batch(dense, sparse, torch.zeros(4))
    inter = _model()
    dlrm = build_model("dlrm", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    assert len(model_inputs(inter, with_seq)) == 4 and len(model_inputs(inter, plain)) == 2
    assert len(model_inputs(dlrm, with_seq)) == 2  # a model without a sequence arm never sees them
    assert len(model_inputs(nn.DataParallel(inter), with_seq)) == 4  # wrappers (DDP too) are looked through
    torch.testing.assert_close(inter.forward_batch(with_seq), inter(dense, sparse, seq, mask), rtol=0, atol=0)
    torch.testing.assert_close(dlrm.forward_batch(with_seq), dlrm(dense, sparse), rtol=0, atol=0)
    with pytest.raises(DataError, match="seq_mask"):
        model_inputs(inter, Batch(dense, sparse, torch.zeros(4), seq, None))
    moved = with_seq.to("cpu")
    assert moved.seq is not None and torch.equal(moved.seq_mask, mask)
    assert torch.equal(with_seq.rows(1, 3).seq, seq[1:3])


def test_attention_and_sequence_linears_see_3d_inputs():
    from loka_tune.space.sites import discover_sites

    model = _model()
    dense, sparse, seq, mask = _inputs(4, 6)
    sites = {s.name: s for s in discover_sites(model, dense, sparse, seq, mask)}
    T = 2 + 6  # CLS tokens + events
    for name in ("layers.0.attn.q", "layers.0.attn.o", "layers.0.pffn_out", "layers.1.ffn_out"):
        assert sites[name].rows_per_example == T, name
    # the Cross Arch runs once in each layer and once more on the last layer for the head
    assert sites["layers.0.pma.k"].rows_per_example == T and sites["layers.1.pma.k"].rows_per_example == 2 * T
    assert sites["head"].rows_per_example == 1
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(sites) == every  # every Linear is used, so every one is a site


def test_precision_config_applies_to_every_linear_and_runs_with_sequences():
    from loka_tune import apply
    from loka_tune.config import PrecisionConfig, SitePrecision
    from loka_tune.kernels.linear import LokaLinear

    model = _model()
    inputs = _inputs(4, 5)
    ref = model(*inputs).detach()
    apply(model, PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated")))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "head"}
    assert len(linears) > 30 and all(isinstance(m, LokaLinear) for m in linears.values())
    out = model(*inputs)
    assert torch.isfinite(out).all() and (out - ref).abs().max() < 0.25 * ref.abs().max() + 0.05
    out.sum().backward()


def test_rotary_is_relative_and_attention_masks_keys():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 6, 4, dtype=torch.float64), torch.randn(1, 1, 6, 4, dtype=torch.float64)
    rq, rk = rotary(q), rotary(k)
    # <R_i q, R_j k> depends on j - i only: shift both by one position
    qq, kk = torch.cat([q[:, :, :1], q], 2), torch.cat([k[:, :, :1], k], 2)
    torch.testing.assert_close(rotary(qq)[:, :, 1:] @ rotary(kk)[:, :, 1:].transpose(-1, -2),
                               rq @ rk.transpose(-1, -2), rtol=1e-12, atol=1e-12)
    att = Attention(4, 2, bias=True).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False, True], [True] * 5])
    y = att(x, x, mask, rope=False)
    x2 = x.clone()
    x2[0, 2:4] = 100.0  # masked keys / values of row 0
    torch.testing.assert_close(att(x2, x2, mask, rope=False)[0, [0, 1, 4]], y[0, [0, 1, 4]], rtol=0, atol=1e-12)


def test_errors_quote_the_value_and_the_fix():
    model = _model()
    dense, sparse, seq, mask = _inputs(3, 4)
    bad = seq.clone()
    bad[1, -1], mask[1, -1] = CARDS[0], True
    with pytest.raises(DataError, match=r"sequence id 30 at row 1.*seq_feature=0"):
        model(dense, sparse, bad, mask)
    with pytest.raises(DataError, match=r"\(B, L\)"):
        model(dense, sparse, seq[:2], mask[:2])
    with pytest.raises(DataError, match="seq_mask"):
        model(dense, sparse, seq)
    with pytest.raises(ConfigError, match="even") as e:
        _model(num_heads=4)  # d = 8: head width 2 is even, 8 / 3 is not an integer
        _model(num_heads=3)
    assert e.value.key == "num_heads"
    with pytest.raises(ConfigError) as e:
        _model(seq_feature=4)
    assert e.value.key == "seq_feature"


def test_sequence_arm_learns_what_only_the_sequence_tells():
    """The label is 'the target item is among the user's events': invisible without the sequence."""
    g = torch.Generator().manual_seed(1)

    def make(n):
        dense, sparse, seq, mask = _inputs(n, 6, seed=int(torch.randint(1 << 30, (1,), generator=g)))
        y = ((seq == sparse[:, :1]) & mask).any(1)
        flip = torch.rand(n, generator=g) < 0.5  # half the rows: plant the target in the history
        seq[flip, -1], mask[flip, -1] = sparse[flip, 0], True
        return dense, sparse, seq, mask, (y | flip).float()

    test = make(512)
    torch.manual_seed(0)
    model = build_model("interformer", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    emb = {id(p) for p in model.embeddings.parameters()}
    opts = [torch.optim.SparseAdam([p for p in model.parameters() if id(p) in emb], lr=0.02),
            torch.optim.Adam([p for p in model.parameters() if id(p) not in emb], lr=0.01)]

    def loss_of(batch, with_seq=True):
        d, s, q, m, y = batch
        out = model(d, s, q, m) if with_seq else model(d, s)
        return F.binary_cross_entropy_with_logits(out, y)

    for _ in range(200):
        loss = loss_of(make(128))
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    with torch.no_grad():
        seen, blind = loss_of(test).item(), loss_of(test, with_seq=False).item()
    assert seen < 0.45 and seen < 0.75 * blind, (seen, blind)


def test_fused_epilogue_covers_the_3d_ffn_and_matches_the_unfused_model():
    from loka_tune import apply
    from loka_tune.config import ModsConfig, PrecisionConfig, SitePrecision

    def build():
        return _model(embedding_dim=16, pffn_rank=16, seq_ffn=[32], interaction_mlp=[64], head_mlp=[32],
                      activation="silu")

    choice = SitePrecision.parse("e4m3.row.emulated")
    fused, plain = build(), build()
    summary = apply(fused, PrecisionConfig(default=choice, mods=ModsConfig(blocknorm=16, hardswish=True,
                                                                           fuse_epilogue=True)))
    apply(plain, PrecisionConfig(default=choice, mods=ModsConfig(blocknorm=16, hardswish=True)))
    assert {"layers.0.ffn.0", "layers.1.ffn.0", "layers.0.interaction.0", "head_mlp.0"} <= set(summary.fused)
    inputs = _inputs(4, 6)
    torch.testing.assert_close(fused(*inputs), plain(*inputs), rtol=0, atol=1e-6)
