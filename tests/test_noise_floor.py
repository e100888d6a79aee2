"""The paired noise floor: noise twins (a seed's bf16 baseline from perturbed initial weights),
the floor they give on a deterministic CPU, the refusal of a budget below it, old baselines,
and the "within noise" label wherever a relative log loss is shown."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from loka_tune.errors import StudyError
from loka_tune.objectives.metrics import relative_log_loss
from loka_tune.tuner.baseline import (
    NOISE_EPS,
    Baseline,
    check_budget,
    paired_noise_floor,
    perturb_weights,
    run_baseline,
)
from loka_tune.tuner.build import make_source
from loka_tune.tuner.results import leaderboard, noise_note, within_noise
from loka_tune.tuner.study import load_study
from tests.test_tune import write_study


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.a = nn.Linear(8, 256)
        self.b = nn.Linear(256, 1)


def test_perturb_weights_rounds_every_linear_weight_at_bf16_scale_deterministically() -> None:
    torch.manual_seed(0)
    ref = _Net()
    nets = []
    for twin in (0, 0, 1):
        torch.manual_seed(0)
        nets.append(perturb_weights(_Net(), seed=3, twin=twin))
    same, again, other = nets
    for name, p in ref.named_parameters():
        p = p.detach()
        q = dict(same.named_parameters())[name].detach()
        if name in ("a.weight", "b.weight"):
            rel = (q.double() / p.double() - 1.0)  # (1 + eps z) - 1 = eps z, z ~ N(0, 1)
            assert 0.9 * NOISE_EPS < float(rel.std()) < 1.1 * NOISE_EPS, name
            assert abs(float(rel.mean())) < 0.2 * NOISE_EPS
        else:  # embeddings and biases: not what FP8 rounds, left alone
            assert torch.equal(p, q), name
        assert torch.equal(q, dict(again.named_parameters())[name].detach())  # same (seed, twin): same bits
    assert not torch.equal(same.a.weight, other.a.weight)  # another twin: another draw
    # the documented draw, bit for bit: W * (1 + eps z), z from (seed, twin) on the CPU in module order
    from loka_tune.data.hashing import mix_seed

    gen = torch.Generator(device="cpu").manual_seed(mix_seed(3, "noise-twin", 0))
    for lin, got in ((ref.a, same.a), (ref.b, same.b)):
        z = torch.randn(lin.weight.shape, generator=gen, dtype=torch.float32)
        assert torch.equal(got.weight.detach(), lin.weight.detach() * (1.0 + NOISE_EPS * z))


def test_perturb_weights_without_linears_perturbs_every_parameter() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(40, 4)
    before = emb.weight.detach().clone()
    perturb_weights(emb, seed=0)
    rel = emb.weight.detach().double() / before.double() - 1.0
    assert 0.7 * NOISE_EPS < float(rel.std()) < 1.3 * NOISE_EPS


def test_paired_floor_is_the_largest_paired_difference() -> None:
    assert paired_noise_floor([0.1, -0.3, 0.2]) == pytest.approx(0.3)
    assert paired_noise_floor([]) == 0.0


@pytest.fixture(scope="module")
def cpu_baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Baseline]:
    """The tiny study's baseline on the CPU: deterministic runs, no nondeterminism to lean on."""
    tmp = tmp_path_factory.mktemp("floor")
    text = write_study(tmp, budget=1.0).read_text().replace("[objective]\n", "[objective]\nnoise_twins = 2\n")
    p = tmp / "t.toml"
    p.write_text(text)
    cfg = load_study(p)
    bl, _stats, _model = run_baseline(cfg, make_source(cfg), "cpu")
    return cfg, bl


def test_cpu_baseline_gets_a_computed_nonzero_paired_floor(cpu_baseline: tuple[object, Baseline]) -> None:
    _cfg, bl = cpu_baseline
    assert bl.noise_floor_kind == "paired" and len(bl.seeds) == 2
    assert len(bl.paired_logloss) == len(bl.paired_noise_pct) == 2 * 2  # 2 twins per seed, seed by seed
    for i, (ll, pct) in enumerate(zip(bl.paired_logloss, bl.paired_noise_pct)):
        base = bl.eval_logloss[i // 2]
        assert ll != base  # the twin's init differs: its run too, even on a deterministic CPU
        assert pct == pytest.approx(relative_log_loss(ll, base) * 100, rel=1e-12)
    assert math.isfinite(bl.noise_floor_pct) and bl.noise_floor_pct > 0
    assert bl.noise_floor_pct == pytest.approx(max(abs(x) for x in bl.paired_noise_pct))
    # the seed-to-seed distance is kept as information, and is not the floor
    assert bl.seed_spread_pct == pytest.approx(abs(relative_log_loss(bl.eval_logloss[1], bl.eval_logloss[0])) * 100)


def test_budget_above_the_floor_passes_and_below_is_refused_with_its_size_and_fix(
        cpu_baseline: tuple[object, Baseline]) -> None:
    cfg, bl = cpu_baseline
    floor = bl.noise_floor_pct
    above = replace(cfg, objective=replace(cfg.objective, budget_pct=2 * floor))
    check_budget(above, bl, force=False)  # no refusal, no warning
    below = replace(cfg, objective=replace(cfg.objective, budget_pct=floor / 2))
    with pytest.raises(StudyError) as ei:
        check_budget(below, bl, force=False)
    msg = str(ei.value)
    assert f"{floor / 2}%" in msg and f"{floor:.4g}%" in msg  # the budget and how big the floor is
    assert "paired" in msg and "seed to seed" in msg  # what it measures (and the unpaired distance beside it)
    assert "objective.budget_pct" in msg and "training.batch_size" in msg and "--force" in msg  # what moves it
    assert f"training.lr_dense (now {cfg.training.lr_dense:g})" in msg and "lr_cooldown_steps" in msg
    with pytest.warns(UserWarning, match="forced"):
        check_budget(below, bl, force=True)


def test_baseline_round_trips_and_an_old_stored_one_loads_as_a_seed_floor(cpu_baseline: tuple[object, Baseline]) -> None:
    _cfg, bl = cpu_baseline
    import json

    assert Baseline.from_dict(json.loads(json.dumps(bl.to_dict()))) == bl
    old = {k: v for k, v in json.loads(json.dumps(bl.to_dict())).items()
           if k not in ("paired_logloss", "paired_noise_pct", "seed_spread_pct", "noise_floor_kind")}
    old["noise_floor_pct"] = 4.6
    loaded = Baseline.from_dict(old)  # a baseline stored before noise twins
    assert loaded.noise_floor_kind == "seeds" and loaded.noise_floor_pct == 4.6 and loaded.seed_spread_pct == 4.6
    assert loaded.paired_noise_pct == () and "between bf16 baseline seeds" in loaded.noise_floor_what()


def test_within_noise_rule_and_label() -> None:
    assert within_noise(-0.2, 0.3) and within_noise(0.3, 0.3)
    assert within_noise(0.31, 0.3) is False and within_noise(-1.6, 0.3) is False  # better than bf16 beyond the floor
    assert within_noise(None, 0.3) is None and within_noise(0.1, None) is None and within_noise(math.nan, 0.3) is None
    assert noise_note(-0.1, 0.25) == " (within noise +-0.25%)" and noise_note(0.5, 0.25) == ""


class _Trial(SimpleNamespace):
    pass


class _Study:
    study_name = "s"

    def __init__(self, floor: float, rels: list[float]) -> None:
        self.user_attrs = {"loka.baseline": {"noise_floor_pct": floor, "eval_logloss": [0.5]}}
        self.trials = [_Trial(number=i, state=SimpleNamespace(name="COMPLETE"), value=1.0 - 0.1 * i,
                              user_attrs={"rel_logloss_pct": r, "feasible": True, "budget_pct": 5.0, "speedup": 1.0,
                                          "config": {}})
                       for i, r in enumerate(rels)]

    def get_trials(self, deepcopy: bool = False, states: tuple = ()) -> list[_Trial]:  # noqa: ARG002
        return [t for t in self.trials if not states or t.state in states]


def test_leaderboard_and_report_label_results_within_noise() -> None:
    from loka_tune.commands.report import format_confirmation, format_leaderboard, legend

    rows = leaderboard(_Study(0.3, [0.0, -1.6, 0.25]))
    by_trial = {r["trial"]: r for r in rows}
    assert by_trial[0]["within_noise"] and by_trial[2]["within_noise"] and by_trial[1]["within_noise"] is False
    text = format_leaderboard(rows).splitlines()
    line = {int(x.split()[0].lstrip("*")): x for x in text[2:] if x.strip()[:1].isdigit()}
    assert "within noise" in line[0] and "within noise" in line[2] and "within noise" not in line[1]
    conf = format_confirmation({"seeds": [0, 1], "rows": [{"trial": 2, "rel_logloss_pct": -0.2, "feasible": True},
                                                         {"trial": 1, "rel_logloss_pct": -1.6, "feasible": True}],
                                "chosen": 2}, 0.3)
    assert "within noise" in conf.splitlines()[2] and "within noise" not in conf.splitlines()[3]
    leg = legend(5.0, 0.3)
    for term in ("NE", "AUC", "relLL%", "noise", "budget", "0.3%", "5%"):
        assert term in leg


def test_within_noise_in_the_trial_lines_report_and_mlflow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI: the enqueued all-bf16 trial reproduces the baseline exactly on a CPU
    (relative log loss 0): its trial line, its leaderboard row and its MLflow run say "within noise"."""
    from loka_tune.cli import main

    study_file = write_study(tmp_path, n_trials=2, tracking="true")
    assert main(["tune", str(study_file)]) == 0
    err = capsys.readouterr().err
    first = next(x for x in err.splitlines() if x.startswith("[loka-tune] trial 0 "))
    assert "rel.LL +0.0000% (within noise +-" in first
    assert main(["report", str(study_file), "--no-plots"]) == 0
    out = capsys.readouterr().out
    row0 = next(x for x in out.splitlines() if x.split()[:2] in (["0", "COMPLETE"], ["*", "0"]))
    assert "within noise" in row0 and "noise floor" in out and "how to read it" in out
    import mlflow

    cfg = load_study(study_file)
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`loka.trial` = '0'")
    assert runs and runs[0].data.tags["within_noise"] == "True"
    parent = client.search_runs([exp.experiment_id], filter_string="tags.`loka.kind` = 'study'")[0]
    assert parent.data.metrics["noise_floor_pct"] > 0 and "seed_spread_pct" in parent.data.metrics


def test_a_baseline_runs_line_says_where_its_time_went_and_how_its_graphs_were_had(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline and twin lines end with the run's phases and, for a compiled run, the graphs
    it found in inductor's and AOTAutograd's caches (the run's own counters: read right after it);
    an eager run says nothing of graphs."""
    import loka_tune.objectives.compiled as compiled
    from loka_tune.tuner import baseline

    counts = {"hits": 2, "misses": 1, "bypass": 0, "aot_hits": 0, "aot_misses": 0, "aot_bypass": 1}
    monkeypatch.setattr(compiled, "compile_cache_counts", lambda: counts)
    res = SimpleNamespace(phases_s={"setup": 0.5, "first_step": 20.25, "steps": 6.0, "eval": 3.0}, steps_run=200,
                          config=SimpleNamespace(compile=True))
    note = baseline._run_note(res, SimpleNamespace(compile=True))
    assert note == ("first step 20.2s (compiling), 199 steps 6.0s, eval 3.0s, setup 0.5s; graphs: 2 from"
                    " inductor's cache, 1 compiled, AOT 0 hit / 0 miss / 1 bypassed")
    eager = SimpleNamespace(phases_s=res.phases_s, steps_run=200, config=SimpleNamespace(compile=False))
    assert baseline._run_note(eager, SimpleNamespace(compile=False)) == (
        "first step 20.2s, 199 steps 6.0s, eval 3.0s, setup 0.5s")


def test_a_baseline_line_says_how_much_of_its_time_lay_outside_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds a baseline line reports beside the trainer's own wall time: over half a second
    outside it (imports, the probe's read-back) is named; less, or no wall time, is not."""
    from loka_tune.tuner import baseline

    now = [100.0]
    monkeypatch.setattr(baseline.time, "perf_counter", lambda: now[0])
    assert baseline._took(60.0, SimpleNamespace(wall_s=31.7)) == "40.0s, 8.3s of it outside the run"
    assert baseline._took(60.0, SimpleNamespace(wall_s=39.8)) == "40.0s"
    assert baseline._took(60.0, SimpleNamespace(wall_s=float("nan"))) == "40.0s"
    assert baseline._took(60.0, SimpleNamespace()) == "40.0s"
