"""The short-run trainer: determinism, pairing, sparse optimizers, stopping rules, metrics.

Uses a tiny local model and an in-test data source, so it tests the trainer alone (the
reference models and data sources have their own tests; the CLI tests use those).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from loka_tune.data.base import Batch
from loka_tune.errors import ConfigError, DataError
from loka_tune.objectives import TrainConfig, evaluate, train
from loka_tune.objectives.metrics import auc, log_loss
from loka_tune.objectives.trainer import RowwiseAdagrad, build_optimizers, phases_note, split_parameters

NUM_DENSE = 4
CARDS = (50, 20, 7)


class TinySource:
    """A deterministic CTR source: a fixed logistic teacher over dense + sparse features.

    Train: infinite, reshuffled each epoch from ``seed``; eval: a fixed disjoint set.
    """

    name = "tiny"
    num_dense = NUM_DENSE
    cardinalities = CARDS

    def __init__(self, n_train: int = 2048, n_eval: int = 1024) -> None:
        g = torch.Generator().manual_seed(123)
        n = n_train + n_eval
        dense = torch.randn(n, NUM_DENSE, generator=g)
        sparse = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], dim=1)
        w = torch.randn(NUM_DENSE, generator=g)
        tables = [torch.randn(c, generator=g) * 1.5 for c in CARDS]
        logit = dense @ w + sum(t[sparse[:, i]] for i, t in enumerate(tables)) - 1.0
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        self.train_rows = (dense[:n_train], sparse[:n_train], labels[:n_train])
        self.eval_rows = (dense[n_train:], sparse[n_train:], labels[n_train:])

    def batches(self, split: str, batch_size: int, seed: int = 0, device="cpu") -> Iterator[Batch]:
        d, s, y = self.train_rows if split == "train" else self.eval_rows
        if split == "eval":
            for i in range(0, len(y), batch_size):
                yield Batch(d[i : i + batch_size], s[i : i + batch_size], y[i : i + batch_size]).to(device)
            return
        g = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(len(y), generator=g)
            for i in range(0, len(y) - batch_size + 1, batch_size):
                idx = perm[i : i + batch_size]
                yield Batch(d[idx], s[idx], y[idx]).to(device)


class RecordingSource:
    """Wraps a source and records a checksum of every train batch it yields."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_dense = inner.num_dense
        self.cardinalities = inner.cardinalities
        self.checksums: list[str] = []

    def batches(self, split, batch_size, seed=0, device="cpu"):
        for b in self.inner.batches(split, batch_size, seed, device):
            if split == "train":
                h = hashlib.sha256()
                for t in (b.dense, b.sparse, b.labels):
                    h.update(t.detach().cpu().contiguous().numpy().tobytes())
                self.checksums.append(h.hexdigest())
            yield b


class TinyModel(nn.Module):
    """Sparse embedding bags + a small MLP; ``forward(dense, sparse) -> (B,) logits``."""

    def __init__(self, dim: int = 4, scale: float = 1.0, sparse: bool = True) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum", sparse=sparse) for c in CARDS)
        self.bottom = nn.Linear(NUM_DENSE, dim)
        self.top = nn.Sequential(nn.Linear(dim * (len(CARDS) + 1), 16), nn.ReLU(), nn.Linear(16, 1))
        self.scale = scale  # multiplies the first top layer's output: the "numerics" knob

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        embs = [t(sparse[:, i : i + 1]) for i, t in enumerate(self.tables)]  # each (B, dim)
        x = torch.cat([self.bottom(dense), *embs], dim=1)  # (B, dim * (n + 1))
        h = self.top[0](x) * self.scale
        return self.top[2](self.top[1](h)).squeeze(1)  # (B,)


class NaNAfter(TinyModel):
    """Returns NaN logits from training forward call ``k`` on (0-based)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.calls = k, 0

    def forward(self, dense, sparse):
        out = super().forward(dense, sparse)
        if self.training:
            self.calls += 1
            if self.calls > self.k:
                out = out * float("nan")
        return out


def fresh(seed: int = 0, **kw) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel(**kw)


CFG = TrainConfig(steps=60, batch_size=64, window=20, lr_dense=3e-3, lr_sparse=5e-2, device="cpu")


def test_repeated_cpu_runs_are_bit_identical():
    src = TinySource()
    a = train(fresh(), src, CFG, progress=False)
    b = train(fresh(), src, CFG, progress=False)
    assert a.status == b.status == "ok"
    assert a.steps_run == 60 and len(a.step_losses) == 60 and len(a.loss_curve) == 3
    assert torch.equal(torch.tensor(a.step_losses), torch.tensor(b.step_losses))
    assert torch.equal(torch.tensor(a.loss_curve, dtype=torch.float64), torch.tensor(b.loss_curve, dtype=torch.float64))
    assert a.eval_logloss == b.eval_logloss and a.eval_auc == b.eval_auc
    # a different seed gives a different data order, hence a different curve
    c = train(fresh(), src, TrainConfig(**{**CFG.__dict__, "seed": 1}), progress=False)
    assert c.step_losses != a.step_losses


def test_paired_runs_see_identical_batches():
    """Two runs that differ only in one layer's numerics consume the same batches in order."""
    rec_a, rec_b = RecordingSource(TinySource()), RecordingSource(TinySource())
    a = train(fresh(scale=1.0), rec_a, CFG, progress=False)
    b = train(fresh(scale=0.5), rec_b, CFG, progress=False)
    assert rec_a.checksums == rec_b.checksums and len(rec_a.checksums) == CFG.steps
    assert a.step_losses != b.step_losses  # the numerics did differ
    assert len(set(rec_a.checksums)) > 1


def test_learns_and_reports_consistent_metrics():
    src = TinySource()
    model = fresh()
    res = train(model, src, TrainConfig(**{**CFG.__dict__, "steps": 150}), progress=False)
    assert res.ok
    assert res.loss_curve[-1] < res.loss_curve[0]
    assert res.eval_ne < 0.95 and res.eval_auc > 0.7
    assert res.eval_count == 1024
    # curve entries are the exact window means of the per-step losses
    assert res.loss_curve[1] == pytest.approx(float(np.mean(res.step_losses[20:40])), rel=1e-12)
    assert res.curve_steps[:2] == (20, 40) and res.curve_steps[-1] == 150  # the last window: 10 steps
    # the reported train loss is a full window's mean (the last 20 steps), not the 10-step leftover
    assert res.train_logloss == pytest.approx(float(np.mean(res.step_losses[-20:])), rel=1e-12)
    assert res.train_logloss != res.loss_curve[-1]
    # eval metrics agree with recomputing them from the trained model's logits
    d, s, y = src.eval_rows
    with torch.no_grad():
        model.eval()
        z = model(d, s)
    assert res.eval_logloss == pytest.approx(log_loss(y, z), rel=1e-9)
    assert res.eval_auc == pytest.approx(auc(y, z), rel=1e-9)
    ev = evaluate(model, src, batch_size=100, device="cpu")  # batch size does not matter
    assert ev["logloss"] == pytest.approx(res.eval_logloss, rel=1e-6) and ev["count"] == 1024
    assert 0 < ev["ctr"] < 1
    # timing and counts
    assert res.step_time_s > 0 and res.examples_per_s == pytest.approx(64 / res.step_time_s)
    assert res.num_params == sum(p.numel() for p in model.parameters())
    assert res.num_sparse_params == 4 * sum(CARDS)
    assert res.device == "cpu" and res.precision == "fp32"
    d = json.loads(json.dumps(res.to_dict()))
    assert d["status"] == "ok" and d["config"]["steps"] == 150 and len(d["loss_curve"]) == 8


class SlowOnce(TinyModel):
    """Sleeps ``first`` seconds in its first training forward and ``eval_s`` in its first eval one."""

    def __init__(self, first: float, eval_s: float) -> None:
        super().__init__()
        self.first, self.eval_s, self.seen = first, eval_s, set()

    def forward(self, dense, sparse):
        mode = "train" if self.training else "eval"
        if mode not in self.seen:
            self.seen.add(mode)
            time.sleep(self.first if self.training else self.eval_s)
        return super().forward(dense, sparse)


def test_phases_say_where_the_wall_time_went():
    """``phases_s`` splits ``wall_s`` into setup, the first step (where a compiled run compiles),
    the later steps and the evaluation: a second spent in the first training forward lands in
    ``first_step``, half a second in the first eval forward in ``eval``, and the parts add up to
    the whole; ``phases_note`` says so in a line, and the JSON carries them."""
    torch.manual_seed(0)
    res = train(SlowOnce(first=1.0, eval_s=0.5), TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 30}),
                progress=False)
    ph = res.phases_s
    assert set(ph) == {"setup", "first_step", "steps", "eval"} and all(v >= 0 for v in ph.values())
    assert ph["first_step"] >= 1.0 and ph["eval"] >= 0.5
    assert sum(ph.values()) == pytest.approx(res.wall_s, abs=1e-6)
    note = phases_note(res)
    assert note.startswith(f"first step {ph['first_step']:.1f}s, 29 steps ") and "eval" in note
    assert "(compiling)" not in note  # an eager run
    assert json.loads(json.dumps(res.to_dict()))["phases_s"]["first_step"] == pytest.approx(ph["first_step"])


def test_partial_last_window():
    res = train(fresh(), TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 45}), progress=False)
    assert res.curve_steps == (20, 40, 45)
    assert res.loss_curve[-1] == pytest.approx(float(np.mean(res.step_losses[40:])), rel=1e-12)


def test_nonfinite_forward_stops_without_raising():
    res = train(NaNAfter(k=7), TinySource(), CFG, progress=False)
    assert res.status == "nonfinite" and res.nonfinite_step == 7
    assert res.steps_run == 8 and len(res.step_losses) == 8
    assert math.isnan(res.step_losses[-1]) and all(math.isfinite(v) for v in res.step_losses[:-1])
    assert math.isnan(res.eval_logloss) and res.eval_count == 0
    d = json.loads(json.dumps(res.to_dict(step_losses=True)))  # strict JSON: nan -> null
    assert d["eval_logloss"] is None and d["step_losses"][-1] is None


def test_absurd_learning_rate_is_nonfinite_not_an_exception():
    cfg = TrainConfig(**{**CFG.__dict__, "lr_dense": 1e30, "lr_sparse": 1e30})
    res = train(fresh(), TinySource(), cfg, progress=False)
    assert res.status == "nonfinite" and res.nonfinite_step is not None
    assert res.nonfinite_step < cfg.steps and not res.ok


def test_embeddings_use_a_sparse_optimizer_and_get_sparse_grads():
    model = fresh()
    emb, dense = split_parameters(model)
    assert {id(p) for p in emb} == {id(t.weight) for t in model.tables}
    assert len(emb) + len(dense) == len(list(model.parameters()))
    opts = build_optimizers(model, CFG)
    assert isinstance(opts[0], RowwiseAdagrad) and isinstance(opts[1], torch.optim.Adam)
    sparse_ids = {id(p) for g in opts[0].param_groups for p in g["params"]}
    dense_ids = {id(p) for g in opts[1].param_groups for p in g["params"]}
    assert sparse_ids == {id(p) for p in emb} and not (sparse_ids & dense_ids)
    cfg_sa = TrainConfig(**{**CFG.__dict__, "sparse_optimizer": "sparse_adam"})
    assert isinstance(build_optimizers(model, cfg_sa)[0], torch.optim.SparseAdam)

    # during a real run the embedding gradients are sparse, and only touched rows move
    seen: list[bool] = []
    orig = RowwiseAdagrad.step

    def spy(self, closure=None):
        seen.extend(p.grad.is_sparse for g in self.param_groups for p in g["params"] if p.grad is not None)
        return orig(self, closure)

    RowwiseAdagrad.step = spy
    try:
        train(model, TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 3}), progress=False)
    finally:
        RowwiseAdagrad.step = orig
    assert seen and all(seen)


def test_rowwise_adagrad_matches_float64_reference():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(10, 3))
    w0 = w.detach().double().clone()
    opt = RowwiseAdagrad([w], lr=0.1)
    acc = torch.zeros(10, dtype=torch.float64)
    for ids in ([1, 4, 4, 7], [4, 9]):
        emb = nn.functional.embedding_bag
        g = torch.randn(len(ids), 3)
        out = emb(torch.tensor(ids).unsqueeze(1), w, mode="sum", sparse=True)  # (n, 3)
        opt.zero_grad()
        (out * g).sum().backward()
        opt.step()
        # reference: dense row gradients summed over duplicates
        gd = torch.zeros(10, 3, dtype=torch.float64)
        for i, r in enumerate(ids):
            gd[r] += g[i].double()
        rows = sorted(set(ids))
        for r in rows:
            acc[r] += (gd[r] ** 2).mean()
            w0[r] -= 0.1 * gd[r] / (acc[r].sqrt() + 1e-8)
    assert torch.allclose(w.detach().double(), w0, rtol=1e-6, atol=1e-6)
    untouched = [r for r in range(10) if r not in (1, 4, 7, 9)]
    assert torch.equal(opt.state[w]["sum"][untouched], torch.zeros(len(untouched)))


def test_sparse_adam_needs_sparse_tables_and_rowwise_adagrad_takes_dense():
    cfg_sa = TrainConfig(**{**CFG.__dict__, "sparse_optimizer": "sparse_adam"})
    with pytest.raises(ConfigError, match="sparse=True"):
        build_optimizers(fresh(sparse=False), cfg_sa)
    res = train(fresh(sparse=False), TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 20}), progress=False)
    assert res.ok and res.loss_curve[0] > 0
    res = train(fresh(), TinySource(), TrainConfig(**{**cfg_sa.__dict__, "steps": 20}), progress=False)
    assert res.ok


def test_on_step_prunes_at_window_ends():
    calls: list[tuple[int, float]] = []

    def prune(step: int, window_loss: float) -> bool:
        calls.append((step, window_loss))
        return step >= 40

    res = train(fresh(), TinySource(), CFG, on_step=prune, progress=False)
    assert res.status == "pruned" and res.steps_run == 40
    assert [c[0] for c in calls] == [20, 40]
    assert calls[0][1] == pytest.approx(res.loss_curve[0], rel=1e-12)
    assert math.isnan(res.eval_logloss)  # a pruned run is not evaluated


def test_progress_callable_and_silence(capsys):
    seen: list[int] = []
    train(fresh(), TinySource(), CFG, progress=lambda step, loss: seen.append(step))
    assert seen == [10, 20, 30, 40, 50, 60]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    train(fresh(), TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 10}), progress=True)
    assert "train TinyModel" in capsys.readouterr().err  # the tqdm bar went to stderr


def test_global_settings_are_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    seen = []
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 2, "cpu_threads": 2})
    train(fresh(), TinySource(), cfg, progress=lambda step, loss: seen.append(
        (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())))
    assert seen and all(x == (True, 2) for x in seen)
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before


def test_finite_train_iterator_is_a_data_error():
    class Finite(TinySource):
        def batches(self, split, batch_size, seed=0, device="cpu"):
            it = super().batches(split, batch_size, seed, device)
            for _ in range(3) if split == "train" else iter(int, 1):
                yield next(it)

    with pytest.raises(DataError, match="after 3 batches"):
        train(fresh(), Finite(), CFG, progress=False)


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"steps": 0}, "steps"),
        ({"batch_size": -1}, "batch_size"),
        ({"lr_dense": float("nan")}, "lr_dense"),
        ({"lr_sparse": 0.0}, "lr_sparse"),
        ({"autocast": "fp16"}, "autocast"),
        ({"device": "tpu"}, "device"),
        ({"sparse_optimizer": "adam"}, "sparse_optimizer"),
        ({"eval_batches": 0}, "eval_batches"),
        ({"seed": -1}, "seed"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps"),
        ({"lr_warmup_steps": True}, "lr_warmup_steps"),
        ({"lr_warmup_steps": 2.5}, "lr_warmup_steps"),
        ({"lr_cooldown_steps": -1}, "lr_cooldown_steps"),
        ({"lr_cooldown_steps": 1.5}, "lr_cooldown_steps"),
        ({"lr_cooldown_steps": 301}, "lr_cooldown_steps"),  # longer than the run (steps 300)
    ],
)
def test_config_validation(kw, key):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw)
    assert e.value.key == key and repr(next(iter(kw.values())))[:3] in str(e.value)


def test_eval_batches_limits_eval():
    res = train(fresh(), TinySource(), TrainConfig(**{**CFG.__dict__, "steps": 5, "eval_batches": 2, "eval_batch_size": 100}), progress=False)
    assert res.eval_count == 200


def test_cuda_request_without_cuda_is_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        train(fresh(), TinySource(), TrainConfig(device="cuda", steps=1), progress=False)


@pytest.mark.gpu
def test_cuda_bf16_run():
    res = train(fresh(), TinySource(), TrainConfig(**{**CFG.__dict__, "device": "cuda"}), progress=False)
    assert res.ok and res.precision == "bf16" and res.device.startswith("cuda")
    assert res.step_time_s > 0 and res.eval_ne < 1.0


# ---- the GPU-bound step: sync-free optimizers, CUDA graphs, profiling --------------------------


def _sparse_grad(rows: torch.Tensor, vals: torch.Tensor, n: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows[None], vals, (n, vals.shape[1]))  # uncoalesced, repeats


def test_fused_rowwise_adagrad_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(40, 6, generator=g)
    ref, fus = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    o_ref, o_fus = RowwiseAdagrad([ref], lr=0.1, fused=False), RowwiseAdagrad([fus], lr=0.1, fused=True)
    for step in range(5):
        rows = torch.randint(0, 40, (150,), generator=g)  # repeats and any order
        rows[:3] = 0  # row 0 is also where empty segments add their zeros
        vals = torch.randn(150, 6, generator=g)
        ref.grad, fus.grad = _sparse_grad(rows, vals, 40), _sparse_grad(rows, vals, 40)
        o_ref.step()
        o_fus.step()
        torch.testing.assert_close(fus, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o_fus.state[fus]["sum"], o_ref.state[ref]["sum"], rtol=1e-5, atol=1e-6)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    dense = torch.randn(40, 6, generator=g) * ~untouched.unsqueeze(1)  # a dense gradient with zero rows
    before = fus.detach().clone()
    ref.grad, fus.grad = dense.clone(), dense.clone()
    o_ref.step()
    o_fus.step()
    torch.testing.assert_close(fus, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(fus.detach()[untouched], before[untouched])  # rows with no gradient unchanged


def test_fused_rowwise_adagrad_has_no_data_dependent_shapes():
    """fullgraph compilation fails on any op whose output size depends on the data (nonzero,
    unique, coalesce): those are the host syncs the fused update must not have."""
    from loka_tune.objectives.optim import rowwise_adagrad_update_

    w, acc = torch.randn(30, 4), torch.zeros(30)
    rows, vals = torch.randint(0, 30, (64,)), torch.randn(64, 4)
    w_ref, acc_ref = w.clone(), acc.clone()
    rowwise_adagrad_update_(w_ref, acc_ref, rows, vals, 0.1, 1e-8)
    torch._dynamo.reset()
    torch.compile(rowwise_adagrad_update_, fullgraph=True, backend="aot_eager")(w, acc, rows, vals, 0.1, 1e-8)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(acc, acc_ref)


def test_profile_steps_are_reported_and_left_out_of_the_step_time():
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 12, "warmup_steps": 2, "profile_steps": 3})
    res = train(fresh(), TinySource(), cfg, progress=False)
    assert res.ok and res.profile is not None and res.profile["steps"] == 3
    assert res.profile["gpu_ms"] is None and math.isnan(res.gpu_time_s)  # no GPU here
    assert res.profile["host_ms"] > 0
    assert res.to_dict()["profile"]["steps"] == 3


def test_profile_steps_and_cuda_graphs_validation():
    with pytest.raises(ConfigError, match="must be < steps") as e:
        TrainConfig(steps=5, profile_steps=5)
    assert e.value.key == "profile_steps"
    with pytest.raises(ConfigError, match="CUDA graphs need device 'cuda'") as e:
        TrainConfig(device="cpu", cuda_graphs=True)
    assert e.value.key == "cuda_graphs"
    with pytest.raises(ConfigError, match="must be true or false"):
        TrainConfig(cuda_graphs="yes")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
            train(fresh(), TinySource(), TrainConfig(**{**CFG.__dict__, "device": "auto", "cuda_graphs": True}),
                  progress=False)


def test_kernel_summary_per_step():
    from loka_tune.objectives.profiling import kernel_summary

    k = [("nvjet_hsh_128x256_gemm", 300.0), ("triton_poi_fused_relu_0", 50.0), ("nvjet_hsh_128x256_gemm", 300.0),
         ("Memcpy HtoD", 10.0), ("void cutlass::device_kernel<f8f8bf16_rowwise>", 140.0)] * 2
    s = kernel_summary(k, steps=2)
    assert s["gpu_ms"] == pytest.approx(0.8) and s["gemm_ms"] == pytest.approx(0.74)
    assert s["kernels_per_step"] == 5
    assert s["top"][0] == {"name": "nvjet_hsh_128x256_gemm", "ms": 0.6, "calls": 2.0, "kind": "gemm"}
    assert s["kinds"]["gemm"] == pytest.approx(0.6) and s["kinds"]["gemm_fp8"] == pytest.approx(0.14)
    assert sum(s["kinds"].values()) == pytest.approx(s["gpu_ms"])  # every kernel counted once


@pytest.mark.gpu
@pytest.mark.parametrize("compile_, lr_warmup", [(False, 0), (True, 0), (False, 10)])
def test_cuda_graph_steps_train_like_eager_steps(compile_, lr_warmup):
    """With a learning-rate warm-up the captured optimizers read their rates from device tensors
    that each step fills: the replayed steps follow the same schedule as the eager ones."""
    base = {**CFG.__dict__, "device": "cuda", "steps": 30, "compile": compile_, "profile_steps": 4,
            "lr_warmup_steps": lr_warmup}
    eager = train(fresh(), TinySource(), TrainConfig(**base), progress=False)
    graphs = train(fresh(), TinySource(), TrainConfig(**{**base, "cuda_graphs": True}), progress=False)
    assert graphs.ok and eager.ok
    # the same steps on the same data: losses agree up to GPU rounding (atomics, fused kernels)
    np.testing.assert_allclose(graphs.step_losses, eager.step_losses, rtol=2e-2, atol=2e-3)
    assert abs(graphs.eval_logloss - eager.eval_logloss) < 5e-3
    assert graphs.gpu_time_s > 0 and graphs.profile["kernels_per_step"] > 0


def test_gpu_activity_leaves_out_annotation_ranges():
    """Optimizer.step#... ranges sit on the GPU timeline over the kernels they launched:
    counting them too inflated the GPU time per step by ~20% on the H200."""
    from types import SimpleNamespace

    from loka_tune.objectives.profiling import is_gpu_activity

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, dev=cuda, ann=False: SimpleNamespace(name=name, device_type=dev, is_user_annotation=ann)  # noqa: E731
    assert is_gpu_activity(ev("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"))
    assert is_gpu_activity(ev("Memcpy DtoD (Device -> Device)"))
    assert not is_gpu_activity(ev("Optimizer.step#RowwiseAdagrad.step"))
    assert not is_gpu_activity(ev("my_range", ann=True))
    assert not is_gpu_activity(ev("aten::mm", dev=cpu))


# ---- the learning-rate warm-up (lr_warmup_steps; warmup_steps is the timing warm-up) ---------------


def test_warmup_factor_is_linear_then_one():
    from loka_tune.objectives.step import warmup_factor

    assert [warmup_factor(i, 4) for i in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert [warmup_factor(i, 1) for i in range(3)] == [1.0, 1.0, 1.0]
    assert all(warmup_factor(i, 0) == 1.0 for i in range(5))  # off: the full rate from the first step


def test_lr_warmup_ramps_every_optimizer_then_holds_its_rate():
    from loka_tune.objectives.step import TrainStep

    model = fresh()
    cfg = TrainConfig(**{**CFG.__dict__, "lr_warmup_steps": 4})
    opts = build_optimizers(model, cfg)
    step = TrainStep(model, opts, device=torch.device("cpu"), dtype=None, lr_warmup_steps=cfg.lr_warmup_steps)
    it = TinySource().batches("train", 64)
    used = []
    for _ in range(7):
        step(next(it))
        used.append([g["lr"] for o in opts for g in o.param_groups])  # what the step just ran at
    sparse, dense = cfg.lr_sparse, cfg.lr_dense
    assert used == [[sparse * f, dense * f] for f in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0)]
    assert all(isinstance(v, float) for row in used for v in row)  # eager steps: plain floats


def assert_one_step_scaled(changes: dict[str, int], scale: float) -> None:
    """A 1-step run with ``changes`` moves every parameter by exactly ``scale`` times the
    full-rate step (the changes, taken in float64 from float32 weights, agree up to the rounding
    of those weights: 2 ulp of the largest), and every parameter moves."""
    src = TinySource()
    full = fresh()
    w0 = {n: p.detach().double().clone() for n, p in full.named_parameters()}
    train(full, src, TrainConfig(**{**CFG.__dict__, "steps": 1}), progress=False)
    scaled = fresh()
    train(scaled, src, TrainConfig(**{**CFG.__dict__, "steps": 1, **changes}), progress=False)
    moved = 0
    for (n, pf), (_, ps) in zip(full.named_parameters(), scaled.named_parameters()):
        d_full, d_scaled = pf.detach().double() - w0[n], ps.detach().double() - w0[n]
        ulp = torch.finfo(torch.float32).eps * float(w0[n].abs().max())
        torch.testing.assert_close(d_scaled, d_full * scale, rtol=1e-5, atol=2 * ulp)
        moved += int(d_full.abs().max() > 0)
    assert moved == len(w0)  # every parameter (embedding tables included) took a step


def test_lr_warmup_scales_the_first_updates_exactly():
    """Adam's first step moves each weight by lr * g / (|g| + eps) and row-wise Adagrad's by
    lr * g / (rms(g) + eps): both linear in lr, so a warm-up of W steps makes step 0 exactly 1/W
    of the full-rate step."""
    assert_one_step_scaled({"lr_warmup_steps": 8}, 1 / 8)


# ---- the learning-rate cool-down (lr_cooldown_steps) ------------------------------------------------


def test_cooldown_factor_falls_linearly_over_the_last_steps():
    from loka_tune.objectives.step import cooldown_factor, lr_factor

    assert [cooldown_factor(i, 8, 3) for i in range(8)] == [1.0] * 5 + [0.75, 0.5, 0.25]
    assert all(cooldown_factor(i, 8, 0) == 1.0 for i in range(8))  # off
    assert [cooldown_factor(i, 3, 3) for i in range(3)] == [0.75, 0.5, 0.25]  # the whole run
    assert cooldown_factor(9, 8, 3) == 0.25  # a step past the run's end stays at the last rate
    # with a warm-up: the smaller factor where they meet
    assert [lr_factor(i, warmup_steps=4, total_steps=6, cooldown_steps=3) for i in range(6)] \
        == [0.25, 0.5, 0.75, 0.75, 0.5, 0.25]
    assert lr_factor(5, warmup_steps=0, total_steps=0, cooldown_steps=0) == 1.0


def test_lr_cooldown_lowers_every_optimizer_over_the_last_steps():
    from loka_tune.objectives.step import TrainStep

    model = fresh()
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 7, "lr_warmup_steps": 2, "lr_cooldown_steps": 3})
    opts = build_optimizers(model, cfg)
    step = TrainStep(model, opts, device=torch.device("cpu"), dtype=None, lr_warmup_steps=2,
                     lr_cooldown_steps=3, total_steps=7)
    it = TinySource().batches("train", 64)
    used = []
    for _ in range(7):
        step(next(it))
        used.append([g["lr"] for o in opts for g in o.param_groups])
    sparse, dense = cfg.lr_sparse, cfg.lr_dense
    assert used == [[sparse * f, dense * f] for f in (0.5, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25)]


def test_lr_cooldown_needs_the_run_length():
    from loka_tune.objectives.step import TrainStep

    model = fresh()
    with pytest.raises(ValueError, match="total_steps"):
        TrainStep(model, build_optimizers(model, CFG), device=torch.device("cpu"), dtype=None, lr_cooldown_steps=3)


def test_train_cools_the_last_updates_exactly():
    """``train`` hands the run's length to the step: with a cool-down over the whole of a 1-step
    run that step is exactly half of the full-rate step (factor 1 / (1 + 1))."""
    assert_one_step_scaled({"lr_cooldown_steps": 1}, 1 / 2)


def test_rowwise_adagrad_takes_a_tensor_rate():
    """A CUDA-graph step's warm-up hands the fused update its rate as a 0-d tensor."""
    from loka_tune.objectives.optim import rowwise_adagrad_update_

    g = torch.Generator().manual_seed(1)
    w, acc = torch.randn(20, 4, generator=g), torch.zeros(20)
    rows, vals = torch.randint(0, 20, (50,), generator=g), torch.randn(50, 4, generator=g)
    w_t, acc_t = w.clone(), acc.clone()
    rowwise_adagrad_update_(w, acc, rows, vals, 0.05, 1e-8)
    rowwise_adagrad_update_(w_t, acc_t, rows, vals, torch.tensor(0.05), 1e-8)
    torch.testing.assert_close(w_t, w, rtol=0, atol=1e-7)
    assert torch.equal(acc_t, acc)


class WideNet(nn.Module):
    """Embeddings -> one wide concatenation (fan-in 1088) -> Linear -> LayerNorm -> SiLU (x2) -> head:
    the shape of the large presets' MLPs at a CPU test's size."""

    def __init__(self, num_dense: int, cards: list[int], dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        from loka_tune.models.base import EmbeddingTables

        self.embeddings = EmbeddingTables(cards, dim)
        self.dense = nn.Linear(num_dense, dim)
        fan_in = (len(cards) + 1) * dim
        self.mlp = nn.Sequential(nn.Linear(fan_in, hidden), nn.LayerNorm(hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.SiLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.dense(dense)[:, None], self.embeddings(sparse)], 1).flatten(1)  # (B, fan_in)
        return self.head(self.mlp(x)).squeeze(-1)  # (B,)


def test_lr_warmup_lets_a_wide_model_learn_where_full_rate_adam_stalls():
    """Issue 20's failure at a CPU test's size. Adam's first steps move every weight by ~lr
    whatever its gradient, so a layer's outputs shift by ~lr * fan_in times its inputs, the same
    way for every example: at lr * fan_in ~ 11 (lr 1e-2, fan-in 1088; the large Wukong's head MLP
    at lr 1e-3 has 16) LayerNorm then maps every example to nearly the same vector and the run
    ends near the base rate (NE ~0.98-1.0). A 10-step linear warm-up lets Adam's moments settle
    first: the same model, data and rate learn (NE ~0.93, as at a 10x lower rate)."""
    from loka_tune.data.synthetic import SyntheticCTR

    cards = [1000, 500, 200, 100, 50, 20, 10, 10] * 2
    src = SyntheticCTR(num_dense=13, cardinalities=cards, eval_examples=4096)
    base = dict(steps=40, batch_size=256, window=40, lr_dense=1e-2, device="cpu", cpu_threads=1)
    ne: dict[int, list[float]] = {0: [], 10: []}
    for warmup in ne:
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = WideNet(13, cards)
            with torch.no_grad():
                model.head.bias.fill_(math.log(src.base_rate / (1 - src.base_rate)))
            res = train(model, src, TrainConfig(**base, seed=seed, lr_warmup_steps=warmup), progress=False)
            assert res.ok
            ne[warmup].append(res.eval_ne)
    assert max(ne[10]) < 0.96, ne  # both seeds learn with the warm-up
    assert min(ne[0]) > max(ne[10]) + 0.02, ne  # and neither does as well without it


@pytest.mark.gpu
def test_cuda_graph_step_follows_the_warmup_schedule():
    """A captured step must not freeze the rate it was captured at: after a 6-step warm-up over
    10 steps, the graph's weights match eager steps' (a frozen rate of step 3 would leave them
    ~40% short of the eager update in the later steps)."""
    from loka_tune.objectives.step import TrainStep

    dev = torch.device("cuda")
    src = TinySource()
    weights = []
    for graphs in (False, True):
        model = fresh().to(dev)
        cfg = TrainConfig(**{**CFG.__dict__, "device": "cuda", "lr_warmup_steps": 6, "cuda_graphs": graphs})
        opts = build_optimizers(model, cfg)
        step = TrainStep(model, opts, device=dev, dtype=None, cuda_graphs=graphs, lr_warmup_steps=6)
        it = src.batches("train", 64, device=dev)
        for _ in range(10):
            step(next(it))
        torch.cuda.synchronize()
        lrs = [float(g["lr"]) for o in opts for g in o.param_groups]
        assert lrs == pytest.approx([cfg.lr_sparse, cfg.lr_dense], rel=1e-6)  # the full rates at the end
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager_w, graph_w in zip(*weights):
        torch.testing.assert_close(graph_w, eager_w, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_step_follows_the_cooldown_schedule():
    """The cool-down through a captured step: a 2-step warm-up and a 5-step cool-down over 10
    steps give the eager steps' weights and end at the last step's rate, 1/6 of the full one."""
    from loka_tune.objectives.step import TrainStep

    dev = torch.device("cuda")
    src = TinySource()
    weights = []
    for graphs in (False, True):
        model = fresh().to(dev)
        cfg = TrainConfig(**{**CFG.__dict__, "device": "cuda", "steps": 10, "lr_warmup_steps": 2,
                             "lr_cooldown_steps": 5, "cuda_graphs": graphs})
        opts = build_optimizers(model, cfg)
        step = TrainStep(model, opts, device=dev, dtype=None, cuda_graphs=graphs, lr_warmup_steps=2,
                         lr_cooldown_steps=5, total_steps=10)
        it = src.batches("train", 64, device=dev)
        for _ in range(10):
            step(next(it))
        torch.cuda.synchronize()
        lrs = [float(g["lr"]) for o in opts for g in o.param_groups]
        assert lrs == pytest.approx([cfg.lr_sparse / 6, cfg.lr_dense / 6], rel=1e-6)
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager_w, graph_w in zip(*weights):
        torch.testing.assert_close(graph_w, eager_w, rtol=1e-3, atol=1e-4)
