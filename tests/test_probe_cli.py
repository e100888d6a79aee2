"""``loka-tune probe``: train with the probe, write stats / report / table / heatmap; re-analyse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loka_tune.cli import main
from loka_tune.probe import ProbeReport, ProbeStats

DATA = "synthetic:num_sparse=4,cardinality=100,eval_examples=128"


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    rc = main([
        "probe", "--model", "wukong", "--preset", "tiny", "--data", DATA, "--steps", "10", "--every", "5",
        "--batch-size", "32", "--samples", "2", "--candidates", "e4m3.row.emulated,e5m2+e4m3.row.emulated",
        "--device", "cpu", "--out", str(out), "--no-progress",
    ])
    return rc, out


def test_probe_command_writes_every_output(probed, capsys) -> None:
    rc, out = probed
    assert rc == 0
    stats = ProbeStats.load(out / "probe_stats.npz")
    assert stats.collections == 2 and stats.steps == 10 and stats.meta["model"] == "wukong"
    rep = ProbeReport.load(out / "probe_report.json")
    assert set(rep.dists) == {"learned", "normal"}
    assert rep.candidates == ["bf16", "e4m3.row.emulated", "e5m2+e4m3.row.emulated"]
    assert set(rep.sites) == set(stats.sites)  # every linear of the model, the head included
    fwd_e4 = [r for r in rep.results if r.role == "fwd" and r.choice == "e4m3.row.emulated"]
    assert fwd_e4 and all(np.isfinite(r.mere) and 0 < r.mere < 1 for r in fwd_e4)
    assert (out / "probe_table.txt").read_text().startswith("probe report [learned]")
    assert (out / "probe_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    meta = json.loads((out / "probe_report.json").read_text())["meta"]
    assert meta["samples"] == 2 and meta["stats"]["collections"] == 2


def test_probe_command_reanalyses_saved_stats(probed, tmp_path, capsys) -> None:
    _, out = probed
    rc = main([
        "probe", "--model", "wukong", "--preset", "tiny", "--data", DATA, "--stats", str(out / "probe_stats.npz"),
        "--samples", "2", "--candidates", "e4m3.row.emulated,e5m2+e4m3.row.emulated", "--dists", "learned",
        "--max-error", "0.05", "--out", str(tmp_path), "--no-heatmap", "--no-progress",
    ])
    assert rc == 0
    assert "probe report [learned]: max_error 0.05" in capsys.readouterr().out
    assert not (tmp_path / "probe_stats.npz").exists() and not (tmp_path / "probe_heatmap.png").exists()
    rep = ProbeReport.load(tmp_path / "probe_report.json")
    first = ProbeReport.load(out / "probe_report.json")
    same = {(r.site, r.role, r.choice): r.mere for r in first.results if r.dist == "learned"}
    # the same stats and seed give the same draws, so the same errors; verdicts follow the threshold
    assert all(same[(r.site, r.role, r.choice)] == r.mere for r in rep.results)
    assert all(r.safe == (r.mere <= 0.05) for r in rep.results)


def test_probe_command_rejects_stats_of_another_model(probed, tmp_path, capsys) -> None:
    _, out = probed
    rc = main([
        "probe", "--model", "dlrm", "--preset", "tiny", "--data", DATA, "--stats", str(out / "probe_stats.npz"),
        "--out", str(tmp_path), "--no-progress",
    ])
    assert rc == 2
    err = capsys.readouterr().err
    assert "collected on another model" in err and "bottom_mlp.0.linear" in err
    rc = main(["probe", "--model", "dlrm", "--data", DATA, "--stats", str(tmp_path / "none.npz"),
               "--out", str(tmp_path)])
    assert rc == 2 and "no probe stats" in capsys.readouterr().err
