"""Interformer through the whole product on sequence data: probe, tune, export, apply, the e2e harness."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from _bench import load_bench

from loka_tune.cli import main

REPO = Path(__file__).resolve().parents[1]
DATA = "synthetic:num_dense=4,cardinalities=60/40/30,eval_examples=256,seq_len=6"

STUDY = """
[study]
name = "inter"
output_dir = "{out}"

[model]
name = "interformer"
preset = "tiny"
[model.overrides]            # widths of 16 and more: FP8-eligible GEMMs in every arch
embedding_dim = 16
pffn_rank = 16
seq_ffn = [32]
interaction_mlp = [64]
head_mlp = [32]

[data]
source = "synthetic"
[data.params]
num_dense = 4
cardinalities = [60, 40, 30]
eval_examples = 256
seq_len = 6

[training]
steps = 6
batch_size = 16
seeds = [0, 1]
eval_batches = 4
window = 3
warmup_steps = 1
device = "cpu"

[objective]
budget_pct = 50.0
speed = "modeled"
cost_batch_size = 65536

[space]
formats = ["e4m3"]
granularities = ["row"]
backends = ["emulated"]

[probe]
samples = 2
every = 3
min_speedup = 0.0

[trials]
n_trials = 2
n_startup_trials = 2

[tracking]
enabled = false
"""


def test_probe_sees_the_sequence_arch(tmp_path, capsys):
    from loka_tune.probe import ProbeStats

    out = tmp_path / "probe"
    rc = main(["probe", "--model", "interformer", "--preset", "tiny", "--data", DATA, "--steps", "6",
               "--every", "3", "--batch-size", "16", "--samples", "2", "--candidates", "e4m3.row.emulated",
               "--device", "cpu", "--out", str(out), "--no-progress", "--no-heatmap"])
    capsys.readouterr()
    assert rc == 0
    stats = ProbeStats.load(out / "probe_stats.npz")
    assert stats.collections == 2 and "layers.0.attn.q" in stats.sites and "layers.1.ffn_out" in stats.sites


def test_tune_export_apply_on_sequence_data(tmp_path, capsys):
    from loka_tune import apply
    from loka_tune.data import parse_data_spec
    from loka_tune.kernels.linear import LokaLinear
    from loka_tune.models import build_model
    from loka_tune.objectives.trainer import TrainConfig, train

    study = tmp_path / "inter.toml"
    study.write_text(textwrap.dedent(STUDY.format(out=tmp_path / "runs")))
    assert main(["tune", str(study), "--no-tracking"]) == 0
    err = capsys.readouterr().err
    best = tmp_path / "best.json"
    assert main(["export", str(study), "--out", str(best)]) == 0
    capsys.readouterr()
    cfg = json.loads(best.read_text())
    assert cfg["provenance"]["study"] == "inter"
    src = parse_data_spec(DATA)
    torch.manual_seed(0)
    model = build_model("interformer", "tiny", num_dense=src.num_dense, cardinalities=list(src.cardinalities),
                        embedding_dim=16, pffn_rank=16, seq_ffn=[32], interaction_mlp=[64], head_mlp=[32])
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert f"space: {n_linear} sites" in err  # every Linear, the sequence arch's 3-D ones included
    # at these widths the modeled H200 prefers bf16 everywhere: the best config may be all-bf16;
    # whatever it is, it applies to a fresh model, which trains on sequences
    summary = apply(model, best)
    assert set(summary.replaced) | set(summary.unchanged) >= {"layers.0.attn.q", "layers.1.ffn_out"}
    assert all(isinstance(m, LokaLinear) for n, m in model.named_modules() if n in summary.replaced)
    res = train(model, src, TrainConfig(steps=4, batch_size=16, window=2), progress=False)
    assert res.status == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (GPU variants skipped)")
def test_e2e_harness_takes_model_interformer(tmp_path):
    e2e = load_bench('e2e.py', 'e2e_bench_inter')
    study = tmp_path / "inter.toml"
    text = textwrap.dedent(STUDY.format(out=tmp_path / "runs"))
    study.write_text(text.replace('"interformer"', '"dlrm"').split("[model.overrides]")[0]
                     + "[data]" + text.split("[data]")[1])  # a DLRM study, run as Interformer
    rc = e2e.main(["--study", str(study), "--model", "interformer", "--preset", "tiny", "--steps", "3",
                   "--warmup", "1", "--seeds", "0", "--variants", "bf16,bf16_mods", "--infer-batches", "8",
                   "--infer-reps", "1", "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["meta"]["model"] == "interformer"
    assert all(r["status"] == "ok" and "8" in r["infer_s"] for r in res["runs"])
