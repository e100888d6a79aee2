"""MLflow tracking helpers: retries, the Pareto front, plots, the shared parent run."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from loka_tune.config import PrecisionConfig
from loka_tune.tuner.tracking import Tracker, pareto_front, plot_choice_map, plot_speed_vs_loss, retry, site_params


def test_retry_retries_only_transient_errors() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "ok"

    assert retry(flaky) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):
        retry(lambda: (_ for _ in ()).throw(ValueError("bad value")))


def test_pareto_front() -> None:
    pts = [(0.1, 1.2), (0.0, 1.0), (0.2, 1.1), (0.3, 1.5), (0.05, 1.0)]
    assert pareto_front(pts) == [(0.0, 1.0), (0.1, 1.2), (0.3, 1.5)]
    assert pareto_front([]) == []


def test_site_params_are_compact() -> None:
    cfg = PrecisionConfig.from_sites({"a.b": "e4m3.row.emulated|e4m3.row.emulated|bf16", "c": "e4m3.row.emulated"})
    p = site_params(cfg, ["a.b", "c", "d"])
    assert p == {"site.a.b": "e4m3.row.emulated|e4m3.row.emulated|bf16", "site.c": "e4m3.row.emulated",
                 "site.d": "bf16"}


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = [{"state": "COMPLETE", "rel_logloss_pct": x, "speedup": y, "feasible": x <= 0.2}
            for x, y in [(0.0, 1.0), (0.1, 1.1), (0.3, 1.3), (0.15, 1.05)]]
    p = plot_speed_vs_loss(rows, 0.2, tmp_path / "s.png")
    cfg = PrecisionConfig.from_sites({"top.0": "e4m3.row.emulated"})
    q = plot_choice_map(cfg, ["bottom.0", "top.0", "head"], tmp_path / "m.png")
    for f in (p, q):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 1000


class _FakeStudy:
    """Just the user-attr part of an Optuna study (the parent run id is shared through it)."""

    def __init__(self) -> None:
        self.user_attrs: dict = {}

    def set_user_attr(self, k: str, v: object) -> None:
        self.user_attrs[k] = v


def _cfg(tmp_path: Path) -> SimpleNamespace:
    from loka_tune.tuner.study import load_study

    p = tmp_path / "trk.toml"
    p.write_text('[model]\nname = "dlrm"\n[data]\nsource = "synthetic"\n')
    return load_study(p, cwd=tmp_path)


def test_tracker_parent_shared_and_threads_log_concurrently(tmp_path: Path) -> None:
    from loka_tune.space.candidates import SearchSpace, SiteChoices
    from loka_tune.space.sites import Site

    cfg = _cfg(tmp_path)
    study = _FakeStudy()
    t1 = Tracker.for_study(cfg, study, required=True)
    t2 = Tracker.for_study(cfg, study, required=True)  # a second worker joins the same parent
    assert t1.parent_run_id == t2.parent_run_id == study.user_attrs["loka.mlflow_parent_run"]
    space = SearchSpace((SiteChoices(Site("top.0", 64, 64, 1.0), {"fwd": ("bf16", "e4m3.row.emulated"),
                                                                  "dgrad": ("bf16",), "wgrad": ("bf16",)},
                                     error={"fwd": {"e4m3.row.emulated": 0.04}}),))
    ctx = SimpleNamespace(space=space, speed="modeled")
    cfgs = [PrecisionConfig(), PrecisionConfig.from_sites({"top.0": "e4m3.row.emulated|bf16|bf16"})]
    errors: list[BaseException] = []

    def log(i: int) -> None:
        try:
            tr = (t1, t2)[i % 2]
            tr.log_trial(i, {}, cfgs[i % 2], {"step_time_s": 1.0 - 0.01 * i, "speedup": 1 + 0.01 * i,
                                              "rel_logloss_pct": 0.01 * i, "feasible": True, "cache_hit": False},
                         "COMPLETE", ctx)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=log, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    runs = t1.client.search_runs([t1.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{t1.parent_run_id}'")
    assert sorted(int(r.data.tags["loka.trial"]) for r in runs) == list(range(6))
    fp8 = [r for r in runs if r.data.params["site.top.0"] == "e4m3.row.emulated|bf16|bf16"]
    assert len(fp8) == 3 and all(abs(r.data.metrics["probe_error"] - 0.04) < 1e-12 for r in fp8)
    assert all(r.data.tags["feasible"] == "True" and r.data.tags["cache_hit"] == "False" for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs)


def test_speed_vs_loss_layout_marks_labels_band_front_and_fits_axes() -> None:
    from loka_tune.tuner.tracking import speed_vs_loss_layout

    rows = [{"trial": n, "state": "COMPLETE", "rel_logloss_pct": x, "speedup": y, "feasible": x <= 0.2,
             "exported": n == 2, "speedup_vs_mods": y - 0.02 if n == 3 else None}
            for n, (x, y) in enumerate([(0.0, 1.0), (0.1, 1.1), (0.15, 1.2), (0.3, 1.3), (0.12, 1.05)])]
    rows.append({"trial": 5, "state": "PRUNED", "rel_logloss_pct": 9.0, "speedup": None, "feasible": False})
    lay = speed_vs_loss_layout(rows, 0.2, noise_floor_pct=0.05)
    assert [p[0] for p in lay["points"]] == [0, 1, 2, 3, 4]  # every completed trial, by number (its label)
    assert lay["exported"] == (2, 0.15, 1.2)
    assert lay["front"] == [(0.0, 1.0), (0.1, 1.1), (0.15, 1.2), (0.3, 1.3)]
    assert lay["band"] == (-0.05, 0.05)
    assert lay["vs_mods"] == [(3, 0.3, pytest.approx(1.28))]  # both speed-ups of a trial with Mods
    (x0, x1), (y0, y1) = lay["xlim"], lay["ylim"]
    # fitted: the points, the budget and the band inside, no more than a margin around them
    assert -0.1 < x0 < -0.05 and 0.3 < x1 < 0.35 and 0.95 < y0 < 1.0 and 1.3 < y1 < 1.35


def test_trial_runs_log_loss_curves_real_durations_and_cache_copies(tmp_path: Path) -> None:
    from loka_tune.space.candidates import SearchSpace, SiteChoices
    from loka_tune.space.sites import Site

    cfg = _cfg(tmp_path)
    tr = Tracker.for_study(cfg, _FakeStudy(), required=True)
    space = SearchSpace((SiteChoices(Site("top.0", 64, 64, 1.0), {"fwd": ("bf16",), "dgrad": ("bf16",),
                                                                  "wgrad": ("bf16",)}),))
    ctx = SimpleNamespace(space=space, speed="measured")
    losses = [0.7 - 0.01 * i for i in range(30)]
    rid = tr.log_trial(0, {}, PrecisionConfig(), {"step_time_s": 1.0, "speedup": 1.2, "speedup_vs_mods": 1.1,
                                                  "wall_s": 12.5, "feasible": True}, "COMPLETE", ctx,
                       step_losses=losses)
    hist = tr.client.get_metric_history(rid, "train_loss")
    assert sorted((m.step, m.value) for m in hist) == [(i + 1, pytest.approx(v)) for i, v in enumerate(losses)]
    run = tr.client.get_run(rid)
    assert run.info.end_time - run.info.start_time == pytest.approx(12500, abs=50)
    assert run.data.metrics["speedup_vs_mods"] == pytest.approx(1.1)
    cid = tr.log_trial(1, {}, PrecisionConfig(), {"step_time_s": 1.0, "wall_s": 0.01, "cache_hit": True,
                                                  "cached_from": 0, "feasible": True}, "COMPLETE", ctx)
    cached = tr.client.get_run(cid)
    assert cached.info.run_name == "trial-0001-cache-of-0000" and cached.data.tags["cache_hit"] == "True"
    assert cached.info.end_time - cached.info.start_time < 1000
    # the baseline seeds' curves on the parent run
    tr.log_baseline(SimpleNamespace(logloss=0.5, eval_ne=1.0, eval_auc=0.6, noise_floor_pct=0.1, step_time_s=1.0,
                                    speed_source="measured", device="cpu"), space, None, curves={0: losses, 1: losses})
    assert len(tr.client.get_metric_history(tr.parent_run_id, "baseline_train_loss.seed1")) == 30
