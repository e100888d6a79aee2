"""Data-parallel short runs (issue 16): ``loka-tune train --nproc N`` under torchrun with gloo
on the CPU matches one process at the same global batch; the pieces that make it so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loka_tune.errors import ConfigError
from loka_tune.objectives.distributed import (
    DistEnv,
    RankSource,
    check_batch,
    dist_env,
    local_rows,
    rank_share,
    strip_nproc,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass
class _Batch:
    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _batch(n: int, start: int = 0) -> _Batch:
    idx = torch.arange(start, start + n)
    return _Batch(idx[:, None].float().repeat(1, 3), idx[:, None].repeat(1, 2), idx.float())


def test_local_rows_cut_the_global_batch_into_contiguous_equal_slices() -> None:
    b = _batch(8)
    parts = [local_rows(b, DistEnv(r, 4, r)) for r in range(4)]
    assert [p.labels.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert torch.equal(torch.cat([p.dense for p in parts]), b.dense)
    assert torch.equal(torch.cat([p.sparse for p in parts]), b.sparse)


def test_a_batch_that_does_not_split_evenly_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="batch_size=10 on 4 processes.*multiple of 4"):
        check_batch(10, DistEnv(0, 4, 0))


class _Source:
    name = "fake"

    def batches(self, split: str, batch_size: int, *, seed: int = 0, device: object = None):
        start = 0
        for _ in range(5 if split == "eval" else 3):
            yield _batch(batch_size, start)
            start += batch_size


def test_rank_source_train_slices_and_eval_round_robin() -> None:
    src = [RankSource(_Source(), DistEnv(r, 2, r)) for r in range(2)]
    assert src[1].name == "fake"  # everything else is the wrapped source's
    train = [[b.labels.tolist() for b in s.batches("train", 4)] for s in src]
    assert train[0] == [[0, 1], [4, 5], [8, 9]] and train[1] == [[2, 3], [6, 7], [10, 11]]
    ev = [[int(b.labels[0]) for b in s.batches("eval", 4)] for s in src]
    assert ev == [[0, 8, 16], [4, 12]]  # batches 0, 2, 4 and 1, 3
    assert [rank_share(3, DistEnv(r, 2, r)) for r in range(2)] == [2, 1]
    assert rank_share(3, None) == 3


def test_strip_nproc_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert strip_nproc(["train", "--nproc", "2", "--steps", "5", "--nproc=3"]) == ["train", "--steps", "5"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist_env() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist_env() == DistEnv(1, 2, 1)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="RANK=2, WORLD_SIZE=2"):
        dist_env()


def _train(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "loka_tune", "train", "--model", "dlrm", "--preset", "tiny", "--data", "synthetic",
           "--steps", "30", "--batch-size", "64", "--eval-batches", "3", "--no-progress", "--cpu-threads", "1",
           "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, _failure(proc.stderr)
    return json.loads(out.read_text())


def _failure(stderr: str) -> str:
    """What a failed torchrun job printed that says why: every rank's own lines (a rank that
    aborts prints its reason above the other ranks' tracebacks), then the end."""
    lines = stderr.splitlines()
    why = [ln for ln in lines if any(k in ln for k in ("[rank1]", "terminate", "what()", "Abort", "Fatal", "core dumped"))]
    return "\n".join(["-- lines naming a rank's abort:", *why[:60], "-- the end:", stderr[-2500:]])


def test_train_nproc_2_matches_one_process_at_the_same_global_batch(tmp_path: Path) -> None:
    one = _train(tmp_path, "one")
    two = _train(tmp_path, "two", "--nproc", "2")
    assert (one["nproc"], two["nproc"]) == (1, 2)
    assert one["eval_count"] == two["eval_count"] == 3 * 64  # the ranks' eval batches gathered
    # the bar is 0.5%; the same steps on the same examples agree to float noise
    assert abs(two["eval_logloss"] - one["eval_logloss"]) / one["eval_logloss"] < 1e-4
    assert abs(two["eval_auc"] - one["eval_auc"]) < 1e-3
    assert two["loss_curve"] == pytest.approx(one["loss_curve"], rel=1e-4)  # the global batch's loss, not a rank's


def test_train_nproc_with_a_batch_that_does_not_split_fails_before_launching(tmp_path: Path) -> None:
    from loka_tune.cli import main

    rc = main(["train", "--model", "dlrm", "--data", "synthetic", "--steps", "2", "--batch-size", "63",
               "--nproc", "2", "--no-progress"])
    assert rc == 2


def test_e2e_nproc_2_and_the_scaling_receipt(tmp_path: Path) -> None:
    """benchmarks/e2e.py --nproc 2 runs its variants data-parallel (torchrun, gloo here) and
    scaling.py merges it with the one-process run into the e2e_h200x2.json layout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    common = [sys.executable, str(REPO / "benchmarks" / "e2e.py"), "--study", str(REPO / "studies" / "quickstart.toml"),
              "--steps", "4", "--warmup", "1", "--variants", "bf16,bf16_mods", "--eval-batches", "2"]
    for n in (1, 2):
        proc = subprocess.run([*common, "--nproc", str(n), "--out", str(tmp_path / f"n{n}")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"n{n}" / "results.json").read_text()) for n in (1, 2))
    assert (one["meta"]["nproc"], two["meta"]["nproc"]) == (1, 2)
    ll1 = {r["variant"]: r["eval_logloss"] for r in one["runs"]}
    ll2 = {r["variant"]: r["eval_logloss"] for r in two["runs"]}
    for v in ("bf16", "bf16_mods"):  # the same steps on the same examples
        assert ll2[v] == pytest.approx(ll1[v], rel=1e-4)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scaling.py"), str(tmp_path / "n1" / "results.json"),
                           str(tmp_path / "n2" / "results.json"), "--out", str(tmp_path / "x2.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["variant"]: r for r in json.loads((tmp_path / "x2.json").read_text())["rows"]}
    r = rows["bf16_mods"]
    assert r["scaling_efficiency"] == pytest.approx(r["step_ms_1gpu"] / (2 * r["step_ms_2gpu"]))
    assert rows["bf16_mods"]["speedup_vs_bf16_mods_2gpu"] == 1.0


def test_teardown_meets_at_a_barrier_and_keeps_the_group_alive_but_not_after_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that drops the group while gloo's threads still free the last collective's tensors
    deadlocks on the GIL (the CI hang of stop 17; one run in 20 here before this): a clean exit passes a barrier first;
    the group object itself stays referenced past its destruction, so that DDP's reducer, which
    joins gloo's threads with the GIL held, never frees it last; an error exit must not wait for
    ranks that may be gone."""
    import torch.distributed as dist

    from loka_tune.objectives import distributed as D

    calls: list[str] = []
    groups = iter([object(), object()])
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: next(groups))
    monkeypatch.setattr(D, "_RETIRED", [])
    with D.torn_down():
        calls.append("work")
    assert calls == ["work", "barrier", "destroy"]
    assert len(D._RETIRED) == 1
    calls.clear()
    with pytest.raises(RuntimeError, match="rank 1 died"), D.torn_down():
        raise RuntimeError("rank 1 died")
    assert calls == ["destroy"]
    assert len(D._RETIRED) == 2 and D._RETIRED[0] is not D._RETIRED[1]


@pytest.mark.parametrize("world, code, status", [("2", "3", 3), ("2", "None", 0), ("2", "'bad input'", 1),
                                                 ("1", "3", 3), (None, "None", 0)])
def test_a_rank_ends_flushed_and_without_finalization(world: str | None, code: str, status: int) -> None:
    """exit_rank: under torchrun (WORLD_SIZE > 1) the process ends by os._exit after flushing what
    it printed and logged, so no atexit work (and no destructor of a retired process group) runs;
    alone it returns and the process exits as usual."""
    prog = (
        "import atexit, logging, sys\n"
        "from loka_tune.objectives.distributed import exit_rank\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s'); logging.warning('logged')\n"
        "print('printed', end='')\n"
        f"code = {code}\n"
        "exit_rank(code)\n"
        "sys.exit(code)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "RANK": "0", "LOCAL_RANK": "0"}
    env.pop("WORLD_SIZE", None)
    if world is not None:
        env["WORLD_SIZE"] = world
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.startswith("printed") and "logged" in proc.stderr
    assert ("finalized" in proc.stdout) == (world != "2")
    if code == "'bad input'":
        assert "bad input" in proc.stderr
