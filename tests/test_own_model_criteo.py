"""A user's own model on real Criteo rows, tuned through the CLI without ``--force``.

Issue 20: such a study (the user's model, 30 steps, budget 5%, 2 seeds, CPU) was refused
because its noise floor was the distance between two seeds' baselines (7.2% there). Trials are
paired, so the floor is now the paired one (noise twins: :mod:`loka_tune.tuner.baseline`),
and the study runs through to an export. The model is the README's "Tune your own model"
TwoTower, written into the study's folder as the user would; its hash tables are 2,000 rows
per feature instead of 100,000 so that the test runs in about a minute (on this sample,
measured 2026-12-01: paired floor 0.13% at 100,000 rows, 0.067% at 2,000; seed to seed 2.5% and
0.86%).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

MODEL = '''
import torch
from torch import nn


class TwoTower(nn.Module):
    def __init__(self, num_dense, cardinalities, width=256, dim=16):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum") for c in cardinalities)
        self.dense = nn.Sequential(nn.Linear(num_dense, width), nn.ReLU(), nn.Linear(width, dim))
        self.mlp = nn.Sequential(nn.Linear(2 * dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.out = nn.Linear(width, 1)

    def forward(self, dense, sparse):  # (B, num_dense) float, (B, n_tables) int64 -> (B,)
        emb = sum(t(sparse[:, i : i + 1]) for i, t in enumerate(self.tables))  # (B, dim)
        return self.out(self.mlp(torch.cat([self.dense(dense), emb], dim=1))).squeeze(-1)


def build(num_dense, cardinalities, width=256):
    return TwoTower(num_dense, cardinalities, width=width)
'''

STUDY = """
[study]
name = "{name}"

[model]
name = "{module}:build"
[model.overrides]
width = 512

[data]
source = "criteo:{data}"
[data.params]
hash_size = 2000

[training]
steps = 30
batch_size = 128
seeds = [0, 1]
device = "cpu"

[objective]
budget_pct = 5.0
speed = "modeled"

[space]
formats = ["e4m3", "e5m2"]
granularities = ["tensor", "row"]
backends = ["emulated"]
mods = ["no_bias"]

[probe]
samples = 2

[trials]
n_trials = 2

[tracking]
enabled = false
"""


@pytest.mark.slow
def test_own_model_on_criteo_rows_tunes_and_exports_without_force(
        shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    from loka_tune.cli import main
    from loka_tune.tuner.study import load_study

    module = f"ownmodel_{tmp_path.name.replace('-', '_')}"  # a fresh module name per run
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(MODEL))
    study_file = tmp_path / "mymodel.toml"
    study_file.write_text(STUDY.format(name="mymodel", module=module, data=shared_data / "criteo_kaggle_head2k.tsv"))
    monkeypatch.chdir(tmp_path)  # run from the folder that holds the model, as the README says
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])

    assert main(["tune", "mymodel.toml"]) == 0  # no --force
    err = capsys.readouterr().err
    assert "below the noise floor" not in err
    assert main(["export", "mymodel.toml", "--out", "best.json"]) == 0
    exported = json.loads((tmp_path / "best.json").read_text())
    assert exported["provenance"]["study"] == "mymodel" and exported["provenance"]["budget_pct"] == 5.0

    cfg = load_study(study_file, cwd=tmp_path)
    bl = optuna.load_study(study_name=cfg.name, storage=cfg.storage.url).user_attrs["loka.baseline"]
    assert bl["noise_floor_kind"] == "paired" and 0 < bl["noise_floor_pct"] < 5.0
    assert len(bl["paired_noise_pct"]) == 2 and bl["seed_spread_pct"] is not None  # both kept in the baseline
    assert exported["provenance"]["noise_floor_pct"] == pytest.approx(bl["noise_floor_pct"])
