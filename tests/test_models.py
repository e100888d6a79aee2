"""Reference models (DLRM, DCNv2, Wukong): shapes, gradients, options, numerics, registry."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.data.base import Batch
from loka_tune.errors import ConfigError, DataError
from loka_tune.layers import ACTIVATIONS, NORMS, SwishLayerNorm
from loka_tune.models import (
    MODEL_NAMES,
    PRESETS,
    build_model,
    model_names,
    preset_config,
    register_model,
)
from loka_tune.models.base import EmbeddingTables
from loka_tune.models.dcnv2 import CrossLayer
from loka_tune.models.wukong import FactorizationMachineBlock, LinearCompressBlock
from loka_tune.objectives.compiled import strict_compile

NUM_DENSE = 5  # a handful of dense features
CARDS = [7, 11, 13, 17]  # four small tables of different sizes


def _inputs(batch: int, num_dense: int = NUM_DENSE, cards=CARDS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, num_dense, generator=g)  # (B, num_dense)
    sparse = torch.stack([torch.randint(0, c, (batch,), generator=g) for c in cards], dim=1)  # (B, n)
    return dense, sparse


def _embedding_params(model: nn.Module) -> set[int]:
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.EmbeddingBag, nn.Embedding))
        for p in m.parameters()
    }


# ---- shapes and gradients -------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_forward_backward_grads(name):
    torch.manual_seed(0)
    model = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    dense, sparse = _inputs(16)
    logits = model(dense, sparse)
    assert logits.shape == (16,)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0  # rows differ

    logits.sum().backward()
    emb = _embedding_params(model)
    assert len(emb) == 1  # all features' tables in one (table-batched)
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        if id(p) in emb:
            assert p.grad.is_sparse, pname
            assert p.grad.coalesce().values().abs().sum() > 0, pname
        else:
            assert not p.grad.is_sparse, pname
            assert torch.isfinite(p.grad).all(), pname
            assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_batch_matches_forward(name):
    torch.manual_seed(0)
    model = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    dense, sparse = _inputs(8)
    batch = Batch(dense, sparse, torch.zeros(8))
    torch.testing.assert_close(model.forward_batch(batch), model(dense, sparse), rtol=0, atol=0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_no_dense_features(name):
    torch.manual_seed(0)
    model = build_model(name, "tiny", num_dense=0, cardinalities=CARDS)
    dense, sparse = _inputs(6, num_dense=0)
    logits = model(dense, sparse)
    assert logits.shape == (6,) and torch.isfinite(logits).all()
    logits.sum().backward()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_wrong_input_shapes_raise_data_error(name):
    model = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    dense, sparse = _inputs(4)
    with pytest.raises(DataError, match=r"\(B, 5\)"):
        model(dense[:, :3], sparse)
    with pytest.raises(DataError, match=r"\(B, 4\)"):
        model(dense, sparse[:, :2])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paper_preset_forward(name):
    torch.manual_seed(0)
    cards = [50] * 26  # Criteo layout, small tables
    model = build_model(name, "paper", num_dense=13, cardinalities=cards)
    dense, sparse = _inputs(8, num_dense=13, cards=cards)
    with torch.no_grad():
        logits = model(dense, sparse)
    assert logits.shape == (8,) and torch.isfinite(logits).all()


def _linear_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_paper_dlrm_is_the_criteo_kaggle_config():
    model = build_model("dlrm", "paper", num_dense=13, cardinalities=[50] * 26)
    dims = [(i, o) for _, i, o in _linear_shapes(model)]
    # bottom 13-512-256-64-16, top (16 + 27*26/2 = 367)-512-256-1
    assert dims == [(13, 512), (512, 256), (256, 64), (64, 16), (367, 512), (512, 256), (256, 1)]
    assert model.embeddings.embedding_dim == 16 and model.embeddings.table.sparse
    assert model.embeddings.cardinalities == (50,) * 26


def test_paper_wukong_is_the_public_config():
    model = build_model("wukong", "paper", num_dense=13, cardinalities=[50] * 26)
    assert len(model.layers) == 3
    n0 = 26 + 1  # sparse rows + one dense row
    first = model.layers[0]
    assert (first.fmb.proj.in_features, first.fmb.proj.out_features) == (n0, 24)
    assert first.fmb.mlp[0].linear.in_features == n0 * 24
    assert [b.linear.out_features for b in first.fmb.mlp] == [512, 512]
    assert first.fmb.out.out_features == 16 * 128
    assert (first.lcb.proj.in_features, first.lcb.proj.out_features) == (n0, 16)
    assert model.layers[1].residual is None  # 32 rows in, 32 out
    assert model.head_mlp[0].linear.in_features == 32 * 128


def test_paper_dcnv2_is_low_rank_stacked():
    model = build_model("dcnv2", "paper", num_dense=13, cardinalities=[50] * 26)
    D = 27 * 128  # (26 sparse + 1 dense) rows of 128
    assert len(model.cross) == 3
    for layer in model.cross:
        assert (layer.down.in_features, layer.down.out_features) == (D, 512)
        assert (layer.up.in_features, layer.up.out_features) == (512, D)
    assert model.structure == "stacked"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_large_preset_builds_and_runs(name):
    torch.manual_seed(0)
    cards = [100] * 40  # 40 sparse features, small tables
    model = build_model(name, "large", num_dense=13, cardinalities=cards)
    widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert max(widths) >= 2048  # production-like widths
    assert model.embeddings.embedding_dim == 256
    dense, sparse = _inputs(4, num_dense=13, cards=cards)
    with torch.no_grad():
        logits = model(dense, sparse)
    assert logits.shape == (4,) and torch.isfinite(logits).all()


# ---- options --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_option_combination_builds_and_runs(name):
    dense, sparse = _inputs(4)
    for norm, act, bias in itertools.product(NORMS, ACTIVATIONS, (True, False)):
        torch.manual_seed(0)
        model = build_model(
            name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS, norm=norm, activation=act, bias=bias
        )
        logits = model(dense, sparse)
        assert logits.shape == (4,) and torch.isfinite(logits).all(), (norm, act, bias)
        logits.sum().backward()
        kinds = {type(m) for m in model.modules()}
        want_norm = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm, "none": None}[norm]
        if want_norm is not None:
            assert want_norm in kinds, (norm, act, bias)
        elif act != "swish_layernorm":
            assert nn.LayerNorm not in kinds and nn.RMSNorm not in kinds
        want_act = {"relu": nn.ReLU, "silu": nn.SiLU, "swish_layernorm": SwishLayerNorm, "hardswish": nn.Hardswish}[act]
        assert want_act in kinds


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
@pytest.mark.parametrize("low_rank", [None, 3])
def test_dcnv2_structures_and_rank(structure, low_rank):
    torch.manual_seed(0)
    model = build_model(
        "dcnv2", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS, structure=structure, low_rank=low_rank
    )
    D = (len(CARDS) + 1) * 8
    assert model.head.in_features == 32 + (D if structure == "parallel" else 0)
    logits = model(*_inputs(4))
    assert logits.shape == (4,) and torch.isfinite(logits).all()
    logits.sum().backward()


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("bias", [True, False])
def test_prediction_head_and_bias_option(name, bias):
    model = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS, bias=bias)
    head = model.get_submodule(model.prediction_head)
    assert isinstance(head, nn.Linear) and head.out_features == 1
    assert head.bias is not None  # the head always keeps its bias
    others = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != model.prediction_head]
    assert others
    if bias:
        assert any(m.bias is not None for _, m in others)
    else:
        assert all(m.bias is None for _, m in others), [n for n, m in others if m.bias is not None]
    # the head is the last module applied: its output is the logit
    seen = {}
    head.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    logits = model(*_inputs(3))
    torch.testing.assert_close(seen["out"].squeeze(-1), logits)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_weight_lives_in_a_linear_embedding_or_norm(name):
    """No raw Parameter matmuls: every GEMM weight must be an nn.Linear that configs can swap."""
    allowed = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)
    for norm in NORMS:
        model = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS, norm=norm, activation="swish_layernorm")
        owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        for pname, p in model.named_parameters():
            assert isinstance(owners[id(p)], allowed), (pname, type(owners[id(p)]))


def test_wukong_residual_identity_when_widths_match():
    # 7 sparse + 1 dense row = 8 = nF + nL: no residual projection in any layer
    model = build_model("wukong", "tiny", num_dense=NUM_DENSE, cardinalities=[5] * 7)
    assert all(layer.residual is None for layer in model.layers)
    model2 = build_model("wukong", "tiny", num_dense=NUM_DENSE, cardinalities=[5] * 4)
    assert isinstance(model2.layers[0].residual, nn.Linear) and model2.layers[1].residual is None
    assert model(*_inputs(3, cards=[5] * 7)).shape == (3,)


# ---- numerics against float64 references ---------------------------------------------------


def test_dlrm_interaction_is_strict_upper_triangle():
    torch.manual_seed(0)
    model = build_model("dlrm", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS).double()
    m = len(CARDS) + 1
    v = torch.randn(3, m, 8, dtype=torch.float64)  # (B, m, d)
    ref = torch.stack([(v[:, i] * v[:, j]).sum(-1) for i in range(m) for j in range(i + 1, m)], dim=1)
    torch.testing.assert_close(model.interact(v), ref, rtol=1e-12, atol=1e-12)


def test_dlrm_forward_matches_reference():
    torch.manual_seed(0)
    model = build_model("dlrm", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS).double()
    dense, sparse = _inputs(5)
    dense = dense.double()
    x = dense
    for blk in model.bottom_mlp:
        x = torch.relu(x @ blk.linear.weight.T + blk.linear.bias)  # (B, d)
    emb = [model.embeddings.table_weight(f)[sparse[:, f]] for f in range(len(CARDS))]
    vecs = [x, *emb]
    pairs = [(vecs[i] * vecs[j]).sum(-1) for i in range(len(vecs)) for j in range(i + 1, len(vecs))]
    h = torch.cat([x, torch.stack(pairs, 1)], 1)
    for blk in model.top_mlp:
        h = torch.relu(h @ blk.linear.weight.T + blk.linear.bias)
    ref = (h @ model.head.weight.T + model.head.bias).squeeze(-1)
    torch.testing.assert_close(model(dense, sparse), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("low_rank", [None, 4])
def test_cross_layer_matches_formula(low_rank):
    torch.manual_seed(0)
    D = 24
    layer = CrossLayer(D, low_rank, bias=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()  # non-zero biases too
    x0 = torch.randn(6, D, dtype=torch.float64)
    x = torch.randn(6, D, dtype=torch.float64)
    if low_rank is None:
        W, b = layer.linear.weight, layer.linear.bias
    else:
        W, b = layer.up.weight @ layer.down.weight, layer.up.bias  # U V: (D, r)(r, D)
    ref = x0 * (x @ W.T + b) + x
    torch.testing.assert_close(layer(x0, x), ref, rtol=1e-10, atol=1e-10)


def test_fmb_is_x_xt_y():
    torch.manual_seed(0)
    n, d, nF, k = 6, 5, 3, 4
    fmb = FactorizationMachineBlock(n, d, nF, k, (), norm="none", activation="relu", bias=True).double()
    with torch.no_grad():
        fmb.proj.bias.normal_()
    X = torch.randn(2, n, d, dtype=torch.float64)  # (B, n, d)
    W, b = fmb.proj.weight, fmb.proj.bias  # (k, n), (k,)
    # F = X (X^T W^T + 1 b^T) = (X X^T) W^T + rowsum(X) b^T
    Fref = (X @ X.transpose(1, 2)) @ W.T + X.sum(-1, keepdim=True) * b  # (B, n, k)
    ref = (Fref.flatten(1) @ fmb.out.weight.T + fmb.out.bias).view(2, nF, d)
    torch.testing.assert_close(fmb(X), ref, rtol=1e-10, atol=1e-10)


def test_lcb_maps_over_the_feature_axis():
    torch.manual_seed(0)
    lcb = LinearCompressBlock(6, 3, bias=True).double()
    X = torch.randn(2, 6, 5, dtype=torch.float64)  # (B, n, d)
    ref = torch.einsum("jn,bnd->bjd", lcb.proj.weight, X) + lcb.proj.bias[None, :, None]
    torch.testing.assert_close(lcb(X), ref, rtol=1e-12, atol=1e-12)


# ---- learning and determinism ---------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_model_learns_a_separable_task(name):
    cards = [20, 20, 20]  # feature 0 carries signal, the others are noise
    g = torch.Generator().manual_seed(1)

    def make(n):
        dense = torch.randn(n, 4, generator=g)  # (n, 4)
        sparse = torch.stack([torch.randint(0, c, (n,), generator=g) for c in cards], 1)  # (n, 3)
        score = 2.0 * dense[:, 0] + 3.0 * (sparse[:, 0] < 10).float() - 1.5
        return dense, sparse, (score > 0).float()

    test_dense, test_sparse, test_y = make(512)
    torch.manual_seed(0)
    model = build_model(name, "tiny", num_dense=4, cardinalities=cards)
    emb = _embedding_params(model)
    sparse_opt = torch.optim.SparseAdam([p for p in model.parameters() if id(p) in emb], lr=0.05)
    dense_opt = torch.optim.Adam([p for p in model.parameters() if id(p) not in emb], lr=0.01)

    def eval_loss():
        with torch.no_grad():
            return F.binary_cross_entropy_with_logits(model(test_dense, test_sparse), test_y).item()

    before = eval_loss()
    for _ in range(150):
        dense, sparse, y = make(128)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
    after = eval_loss()
    assert after < 0.5 * before, (before, after)
    assert after < 0.3, (before, after)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_init_is_deterministic_under_seed(name):
    def params(seed):
        torch.manual_seed(seed)
        m = build_model(name, "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
        return {k: v.clone() for k, v in m.state_dict().items()}

    a, b, c = params(3), params(3), params(4)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


# ---- registry -------------------------------------------------------------------------------


def test_registry_errors_list_choices():
    with pytest.raises(ConfigError, match="dlrm.*dcnv2.*wukong"):
        build_model("dlrn", num_dense=1, cardinalities=[3])
    with pytest.raises(ConfigError, match="tiny.*paper.*large"):
        build_model("dlrm", "huge", num_dense=1, cardinalities=[3])
    with pytest.raises(ConfigError, match="embedding_dim") as exc:
        build_model("dlrm", num_dense=1, cardinalities=[3, 4], embedding_dims=4)
    assert exc.value.key == "embedding_dims"
    with pytest.raises(ConfigError, match="layernorm") as exc:
        build_model("wukong", num_dense=1, cardinalities=[3], norm="batchnorm")
    assert exc.value.key == "norm"
    with pytest.raises(ConfigError, match="stacked") as exc:
        build_model("dcnv2", num_dense=1, cardinalities=[3], structure="side")
    assert exc.value.key == "structure"
    with pytest.raises(ConfigError) as exc:
        build_model("dcnv2", num_dense=1, cardinalities=[3], low_rank=0)
    assert exc.value.key == "low_rank"
    with pytest.raises(ConfigError) as exc:
        build_model("dlrm", num_dense=1, cardinalities=[])
    assert exc.value.key == "cardinalities"
    with pytest.raises(ConfigError) as exc:
        build_model("wukong", num_dense=-1, cardinalities=[3])
    assert exc.value.key == "num_dense"


def test_overrides_and_preset_copies():
    assert set(PRESETS) == {"tiny", "paper", "large"}
    cfg = preset_config("dlrm", "paper")
    assert cfg["embedding_dim"] == 16 and tuple(cfg["bottom_mlp"]) == (512, 256, 64)
    cfg["embedding_dim"] = 99  # a copy: the preset itself is unchanged
    assert preset_config("dlrm", "paper")["embedding_dim"] == 16
    model = build_model("dlrm", "tiny", num_dense=2, cardinalities=[3, 4], embedding_dim=4, top_mlp=(6, 5))
    assert model.embeddings.embedding_dim == 4
    assert [b.linear.out_features for b in model.top_mlp] == [6, 5]
    assert model.hparams["embedding_dim"] == 4
    assert model.embeddings.cardinalities == (3, 4)  # table sizes kept as given
    assert [model.embeddings.table_weight(f).shape[0] for f in range(2)] == [3, 4]


def test_register_custom_model():
    name = "test_models_custom"

    @register_model(name, overwrite=True)
    def factory(*, num_dense, cardinalities, width=4):
        return nn.Linear(num_dense, width)

    assert name in model_names()
    assert build_model(name, num_dense=3, cardinalities=[2], width=5).out_features == 5
    assert preset_config(name, "paper") == {}
    with pytest.raises(ConfigError, match="width"):
        build_model(name, num_dense=3, cardinalities=[2], depth=2)
    with pytest.raises(ConfigError, match="already registered"):
        register_model(name)(factory)

    @register_model(name + "_presets", presets={"small": {"width": 2}}, overwrite=True)
    def factory2(*, num_dense, cardinalities, width):
        return nn.Linear(num_dense, width)

    assert build_model(name + "_presets", "small", num_dense=3, cardinalities=[2]).out_features == 2
    with pytest.raises(ConfigError, match="small"):
        build_model(name + "_presets", "tiny", num_dense=3, cardinalities=[2])


def test_import_is_lazy():
    code = (
        "import sys, loka_tune.models as m; "
        "assert m.build_model; "
        "bad = [k for k in ('loka_tune.models.dlrm', 'loka_tune.models.dcnv2', 'loka_tune.models.wukong') "
        "if k in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- table-batched embeddings -----------------------------------------------------------------


def _per_feature_tables(cards, dim):
    """The layout EmbeddingTables replaced: one nn.EmbeddingBag per feature, uniform +-sqrt(1/card)."""
    tables = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum", sparse=True) for c in cards)
    with torch.no_grad():
        for t, c in zip(tables, cards):
            t.weight.uniform_(-(1.0 / c) ** 0.5, (1.0 / c) ** 0.5)
    return tables


def test_embedding_tables_draw_what_per_feature_tables_drew():
    cards = [20, 1, 17, 300]
    torch.manual_seed(5)
    old = _per_feature_tables(cards, 8)
    torch.manual_seed(5)
    new = EmbeddingTables(cards, 8)
    assert torch.equal(torch.cat([t.weight for t in old]), new.table.weight)  # seeded models unchanged
    for f in range(len(cards)):
        assert torch.equal(new.table_weight(f), old[f].weight)
    _, sparse = _inputs(9, cards=cards)
    ref = torch.stack([t(sparse[:, f : f + 1]) for f, t in enumerate(old)], dim=1)  # (B, n, d)
    assert torch.equal(new(sparse), ref)


def test_embedding_tables_one_sparse_gradient_equal_to_the_per_feature_ones():
    cards = [5, 7, 3]
    torch.manual_seed(0)
    old = _per_feature_tables(cards, 4)
    torch.manual_seed(0)
    new = EmbeddingTables(cards, 4)
    _, sparse = _inputs(32, cards=cards)
    dy = torch.randn(32, 3, 4)
    torch.stack([t(sparse[:, f : f + 1]) for f, t in enumerate(old)], dim=1).backward(dy)
    new(sparse).backward(dy)
    g = new.table.weight.grad
    assert g.is_sparse
    dense = g.to_dense()
    for f, t in enumerate(old):
        torch.testing.assert_close(dense[new.starts[f] : new.starts[f + 1]], t.weight.grad.to_dense())


def test_embedding_tables_lookup_with_is_one_gather_equal_to_two_lookups():
    """lookup_with: the features' rows and another id tensor's rows of feature f's table in ONE
    gather; the same values as two lookups, and one sparse gradient whose coalesced sums are
    the two lookups' (float64: only the order of the sums may differ)."""
    cards = [5, 7, 3]
    torch.manual_seed(0)
    new = EmbeddingTables(cards, 4).double()
    _, sparse = _inputs(16, cards=cards)
    ids = torch.randint(0, cards[1], (16, 6), generator=torch.Generator().manual_seed(2))  # feature 1's ids
    dx, ds = torch.randn(16, 3, 4, dtype=torch.float64), torch.randn(16, 6, 4, dtype=torch.float64)
    x, s = new.lookup_with(sparse, 1, ids)
    assert x.shape == (16, 3, 4) and s.shape == (16, 6, 4)
    (x * dx).sum().add((s * ds).sum()).backward()
    one = new.table.weight.grad
    assert one.is_sparse and one._nnz() == 16 * (3 + 6)  # one gradient: every lookup's slice, uncoalesced
    new.table.weight.grad = None
    x2, s2 = new(sparse), new.table(ids + new.starts[1])  # the two lookups it replaces
    assert torch.equal(x, x2) and torch.equal(s, s2)
    (x2 * dx).sum().add((s2 * ds).sum()).backward()
    two = new.table.weight.grad.coalesce()
    one = one.coalesce()
    assert torch.equal(one.indices(), two.indices())
    torch.testing.assert_close(one.values(), two.values(), rtol=1e-12, atol=1e-14)
    with pytest.raises(DataError, match="sparse feature 2 has id 3"):  # the features' ids are still checked
        new.lookup_with(torch.tensor([[0, 0, 3]]), 1, ids[:1])


def test_embedding_tables_refuse_ids_outside_their_table():
    new = EmbeddingTables([5, 7], 4)
    with pytest.raises(DataError, match=r"sparse feature 0 has id 5 at row 1, outside its table of 5 rows"):
        new(torch.tensor([[0, 0], [5, 0]]))
    with pytest.raises(DataError, match=r"feature 1 has id -1"):
        new(torch.tensor([[0, -1]]))


def test_embedding_tables_load_per_feature_state_dicts():
    cards = [4, 6]
    torch.manual_seed(1)
    old = _per_feature_tables(cards, 3)
    new = EmbeddingTables(cards, 3)
    new.load_state_dict(old.state_dict())
    assert torch.equal(new.table.weight, torch.cat([t.weight for t in old]))


def test_compiled_model_gives_sparse_embedding_gradients():
    """torch.compile keeps the table's gradient sparse (one gather, one sparse gradient)."""
    torch.manual_seed(0)
    model = build_model("wukong", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    dense, sparse = _inputs(8)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    compiled(dense, sparse).sum().backward()
    g = model.embeddings.table.weight.grad
    assert g is not None and g.is_sparse
    ref = build_model("wukong", "tiny", num_dense=NUM_DENSE, cardinalities=CARDS)
    ref.load_state_dict(model.state_dict())
    ref(dense, sparse).sum().backward()
    torch.testing.assert_close(g.to_dense(), ref.embeddings.table.weight.grad.to_dense(), rtol=1e-4, atol=1e-6)


class _Lookup(torch.nn.Module):
    """The Interformer's pattern in small: one gather of features and events, then slices of the
    events (the recent tokens), whose backward inductor re-inplaces before the sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = EmbeddingTables([7, 5, 9], 4)

    def forward(self, sparse: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        x, s = self.emb.lookup_with(sparse, 0, seq)
        return x.sum() + s[:, -2:].pow(2).sum()


@pytest.mark.slow
def test_inductor_compiles_a_sparse_embedding_gradient_behind_reinplaced_ops() -> None:
    """allow_sparse_gradients (which TrainStep applies before compiling): without it torch 2.13's
    inductor fails this backward with "Cannot access storage of SparseTensorImpl"."""
    from torch._inductor import fx_utils

    from loka_tune.objectives.compiled import allow_sparse_gradients
    from loka_tune.objectives.step import TrainStep

    TrainStep(torch.nn.Linear(2, 1), [], device=torch.device("cpu"), dtype=None, compile=True)  # applies it
    sp = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 2), (3, 2),
                                 check_invariants=True)
    assert isinstance(fx_utils.get_storage(sp), int)  # a storage-less tensor has an identity now
    allow_sparse_gradients()  # idempotent
    g = torch.Generator().manual_seed(1)
    sparse = torch.stack([torch.randint(0, c, (6,), generator=g) for c in (7, 5, 9)], 1)
    seq = torch.randint(0, 7, (6, 5), generator=g)
    model, ref = _Lookup(), _Lookup()
    with strict_compile():  # no graph break, no eager fallback
        torch.compile(model)(sparse, seq).backward()
    ref(sparse, seq).backward()
    got = model.emb.table.weight.grad
    assert got is not None and got.is_sparse
    torch.testing.assert_close(got.to_dense(), ref.emb.table.weight.grad.to_dense(), rtol=1e-5, atol=1e-6)
