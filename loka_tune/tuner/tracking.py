"""MLflow tracking of a study: one parent run, one nested run per trial, plots.

- Parent run (one per study, shared by every worker: its id is stored in the Optuna study):
  the study's settings as params, the baseline's metrics, the probe report, and at the end the
  plots (speed vs relative log loss with the budget line and the Pareto front; the per-layer
  choice map of the best trial) and the leaderboard.
- Nested run per trial: params ``site.<layer name>`` = the layer's choice (``e4m3.row.emulated``,
  or ``fwd|dgrad|wgrad`` when they differ) and ``mods``; metrics ``step_time_s``, ``speedup``,
  ``rel_logloss_pct``, ``eval_ne``, ``eval_auc``, ``probe_error``; tags ``feasible``,
  ``pruned``, ``cache_hit``, ``state``, ``speed_source``; the PrecisionConfig JSON as an artifact.
  Search them with e.g. ``mlflow.search_runs(filter_string="params.`site.top.0` LIKE 'e4m3%'")``.

Every call goes through :class:`mlflow.MlflowClient` with explicit run ids (no global active
run), so threads and processes never step on each other; calls on a local SQLite store are
retried when the database is locked. mlflow and matplotlib are imported lazily.

Default store: ``sqlite:///<output_dir>/mlflow.db`` with artifacts in
``<output_dir>/mlartifacts``; browse with ``mlflow ui --backend-store-uri sqlite:///runs/<study>/mlflow.db``.
A tracking server: ``[tracking] uri = "http://host:5000"``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from loka_tune.config import ROLES, PrecisionConfig
from loka_tune.errors import StudyError
from loka_tune.tuner.results import TrialRecord, best_trial, leaderboard

__all__ = ["Tracker", "retry", "write_plots", "plot_speed_vs_loss", "plot_choice_map", "pareto_front", "site_params"]

ATTR_PARENT = "loka.mlflow_parent_run"
T = TypeVar("T")


def retry(fn: Callable[..., T], *args: Any, tries: int = 12, **kw: Any) -> T:
    """Call ``fn``, retrying with jittered backoff while a (SQLite) database is locked or busy."""
    delay = 0.05
    for i in range(tries):
        try:
            return fn(*args, **kw)
        except Exception as e:  # mlflow wraps sqlalchemy errors in MlflowException
            msg = str(e).lower()
            transient = any(s in msg for s in ("locked", "busy", "unique constraint", "already exists",
                                               "could not serialize", "deadlock", "timed out"))
            if not transient or i == tries - 1:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as e:
        raise StudyError("MLflow tracking needs mlflow: `pip install mlflow`, or set [tracking] enabled ="
                         " false") from e
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.ERROR)
    return mlflow


def site_params(config: PrecisionConfig, site_names: Iterable[str]) -> dict[str, str]:
    """``{"site.<name>": choice}`` for every site (compact: one id when the three GEMMs agree)."""
    return {f"site.{n}": config.resolve(n).short_str() for n in site_names}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Tracker:
    """Logs one study to MLflow. Build it with :meth:`for_study` (None when tracking is off)."""

    def __init__(self, uri: str, experiment: str, *, artifact_dir: Path | None = None, study_name: str,
                 output_dir: Path, plots: bool = True) -> None:
        mlflow = _import_mlflow()
        self.mlflow = mlflow
        self.uri = uri
        self.study_name = study_name
        self.output_dir = Path(output_dir)
        self.plots = plots
        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.client = retry(mlflow.MlflowClient, tracking_uri=uri)
        exp = retry(self.client.get_experiment_by_name, experiment)
        if exp is None:
            loc = None
            if artifact_dir is not None and (uri.startswith(("sqlite:", "file:")) or "://" not in uri):
                artifact_dir.mkdir(parents=True, exist_ok=True)
                loc = artifact_dir.resolve().as_uri()
            try:
                self.experiment_id = retry(self.client.create_experiment, experiment, artifact_location=loc)
            except Exception:  # another worker created it first
                exp = retry(self.client.get_experiment_by_name, experiment)
                if exp is None:
                    raise
                self.experiment_id = exp.experiment_id
        else:
            self.experiment_id = exp.experiment_id
        self.parent_run_id: str | None = None
        self._site_names: list[str] = []

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_study(cls, cfg: Any, study: Any, *, required: bool = False) -> Tracker | None:
        """The study's tracker with its parent run (created once, shared through the Optuna study).

        With ``[tracking] enabled = "auto"`` a missing mlflow gives a warning and None.
        """
        try:
            tr = cls(cfg.tracking.uri, cfg.tracking.experiment, artifact_dir=cfg.output_dir / "mlartifacts",
                     study_name=cfg.name, output_dir=cfg.output_dir, plots=cfg.tracking.plots)
        except StudyError:
            if required:
                raise
            warnings.warn("mlflow is not installed: this study is not tracked (pip install mlflow)", stacklevel=2)
            return None
        tr.attach_parent(study, cfg)
        return tr

    def attach_parent(self, study: Any, cfg: Any) -> str:
        """Reuse the study's parent run, or create it (first worker)."""
        run_id = study.user_attrs.get(ATTR_PARENT)
        if run_id is None:
            run = retry(self.client.create_run, self.experiment_id, run_name=f"study-{cfg.name}",
                        tags={"loka.study": cfg.name, "loka.kind": "study",
                              "loka.storage": _redact(cfg.storage.url)})
            run_id = run.info.run_id
            again = study.user_attrs.get(ATTR_PARENT)  # another worker raced us: keep theirs
            if again is not None:
                retry(self.client.delete_run, run_id)
                run_id = again
            else:
                study.set_user_attr(ATTR_PARENT, run_id)
                params = _flatten(cfg.to_dict())
                self._log_params(run_id, params)
        elif retry(self.client.get_run, run_id).info.status != "RUNNING":  # a resume: running again
            retry(self.client.update_run, run_id, status="RUNNING")
        self.parent_run_id = run_id
        return run_id

    # ------------------------------------------------------------------ low level
    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k)[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            retry(self.client.log_batch, run_id, params=items[i:i + 100])

    def _log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if _finite(v)]
        if items:
            retry(self.client.log_batch, run_id, metrics=items)

    def _set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:5000]) for k, v in tags.items() if v is not None]
        if items:
            retry(self.client.log_batch, run_id, tags=items)

    # ------------------------------------------------------------------ study level
    def log_baseline(self, baseline: Any, space: Any, probe_report: Path | None) -> None:
        """The baseline's numbers and the probe report on the parent run."""
        assert self.parent_run_id is not None
        self._site_names = list(space.site_names)
        self._log_metrics(self.parent_run_id, {
            "baseline_logloss": baseline.logloss, "baseline_ne": baseline.eval_ne, "baseline_auc": baseline.eval_auc,
            "noise_floor_pct": baseline.noise_floor_pct, "baseline_step_time_s": baseline.step_time_s,
            "n_sites": len(space.sites), "n_fp8_candidates": space.n_fp8_candidates()})
        self._set_tags(self.parent_run_id, {"speed_source": baseline.speed_source, "device": baseline.device})
        retry(self.client.log_text, self.parent_run_id, json.dumps(space.to_dict(), indent=1), "search_space.json")
        if probe_report is not None and Path(probe_report).is_file():
            retry(self.client.log_artifact, self.parent_run_id, str(probe_report))

    def log_trial(self, number: int, params: Mapping[str, Any], config: PrecisionConfig, attrs: Mapping[str, Any],
                  state: str, ctx: Any, *, run_status: str | None = None) -> str:
        """One nested run for trial ``number`` (``attrs``: what its end wrote); returns its run id.
        It ends FINISHED (complete), KILLED (pruned) or FAILED, or as ``run_status`` when given
        (an interrupted trial: KILLED)."""
        assert self.parent_run_id is not None
        names = list(ctx.space.site_names)
        a = TrialRecord.from_attrs(attrs)
        tags = {"mlflow.parentRunId": self.parent_run_id, "loka.study": self.study_name, "loka.trial": number,
                "state": state, "feasible": bool(a.feasible), "pruned": state == "PRUNED",
                "cache_hit": bool(a.cache_hit), "speed_source": a.speed_source or ctx.speed,
                "fail_reason": a.fail_reason or None, "seeded": a.seeded or None, "cached_from": a.cached_from}
        run = retry(self.client.create_run, self.experiment_id, run_name=f"trial-{number:04d}",
                    tags={k: str(v) for k, v in tags.items() if v is not None})
        rid = run.info.run_id
        p: dict[str, Any] = dict(site_params(config, names))
        p["mods"] = config.mods.short_str()
        p["n_fp8_gemms"] = sum(1 for n in names for r in ROLES if not config.resolve(n)[r].is_bf16)
        self._log_params(rid, p)
        err = _probe_error(config, ctx.space)
        self._log_metrics(rid, {
            "step_time_s": a.step_time_s, "speedup": a.speedup, "rel_logloss_pct": a.rel_logloss_pct,
            "eval_logloss": a.eval_logloss, "eval_ne": a.eval_ne, "eval_auc": a.eval_auc, "probe_error": err,
            "measured_step_time_s": a.measured_step_time_s, "wall_s": a.wall_s, "n_fp8_gemms": p["n_fp8_gemms"]})
        retry(self.client.log_text, rid, config.to_json(), "precision_config.json")
        status = run_status or {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(state, "FAILED")
        retry(self.client.set_terminated, rid, status)
        return rid

    def interrupted(self) -> None:
        """End the study's run as KILLED (Ctrl-C / SIGTERM); the next run of the study reopens it."""
        if self.parent_run_id is not None:
            try:
                retry(self.client.set_terminated, self.parent_run_id, "KILLED")
            except Exception:  # noqa: BLE001 - never hide the interrupt
                pass

    def finish(self, ctx: Any) -> None:
        """Plots and leaderboard on the parent run (and in the output dir); mark it finished."""
        assert self.parent_run_id is not None
        rows = leaderboard(ctx.study)
        out = self.output_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "leaderboard.json").write_text(json.dumps(rows, indent=1))
        retry(self.client.log_artifact, self.parent_run_id, str(out / "leaderboard.json"))
        best = best_trial(ctx.study, raise_if_none=False)
        if best is not None:
            b = TrialRecord.of(best)
            self._log_metrics(self.parent_run_id, {"best_speedup": b.speedup, "best_step_time_s": best.value,
                                                   "best_rel_logloss_pct": b.rel_logloss_pct})
            self._set_tags(self.parent_run_id, {"best_trial": best.number})
        if self.plots:
            for path in write_plots(ctx.study, ctx.space, out, budget_pct=ctx.cfg.objective.budget_pct,
                                    speed_source=ctx.speed):
                retry(self.client.log_artifact, self.parent_run_id, str(path))
        retry(self.client.set_terminated, self.parent_run_id, "FINISHED")


def _probe_error(config: PrecisionConfig, space: Any) -> float | None:
    """Geometric mean of the probe's error over the trial's FP8 GEMMs (None if none measured)."""
    logs = []
    for sc in space.sites:
        prec = config.resolve(sc.name)
        for r in ROLES:
            cid = prec[r].short_str()
            e = sc.error.get(r.value, {}).get(cid)
            if e is not None and e > 0 and math.isfinite(e):
                logs.append(math.log(e))
    return math.exp(sum(logs) / len(logs)) if logs else None


def _redact(url: str) -> str:
    """Hide a password in a database URL."""
    import re

    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = _redact(v) if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, tuple, dict)) else v
    return out


# ---------------------------------------------------------------------------------------------
# plots (matplotlib, Agg, imported lazily)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (loss, speed-up) points no other point beats on both (lower loss, higher speed-up), by loss."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_speed_vs_loss(rows: Sequence[Mapping[str, Any]], budget_pct: float, path: str | Path, *,
                       speed_source: str = "modeled", title: str = "") -> Path:
    """Speed-up vs relative log loss of the completed trials, the budget line and the Pareto front."""
    plt = _plt()
    pts = [(r["rel_logloss_pct"], r["speedup"], r["feasible"]) for r in rows
           if r.get("state") == "COMPLETE" and _finite(r.get("rel_logloss_pct")) and _finite(r.get("speedup"))]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if pts:
        for feas, color, label in ((True, "tab:green", "feasible"), (False, "tab:red", "over budget")):
            xs = [p[0] for p in pts if p[2] == feas]
            ys = [p[1] for p in pts if p[2] == feas]
            if xs:
                ax.scatter(xs, ys, c=color, s=22, label=label, alpha=0.8)
        front = pareto_front([(p[0], p[1]) for p in pts])
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="k", lw=1, label="Pareto front")
    ax.axvline(budget_pct, color="tab:orange", ls="--", label=f"budget {budget_pct:g}%")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("relative log loss vs bf16 baseline (%)")
    ax.set_ylabel(f"speed-up over bf16 ({speed_source})")
    ax.set_title(title or "trials: speed vs loss")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_choice_map(config: PrecisionConfig, site_names: Sequence[str], path: str | Path, *, title: str = "") -> Path:
    """A table of the best trial's choice per layer (rows) and GEMM (columns), colored by format."""
    plt = _plt()
    colors = {"bf16": "#dddddd", "e4m3": "#8fd18f", "e5m2": "#f2c46d", "mxfp8": "#8fb8e8"}
    n = max(1, len(site_names))
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.32 * n))
    for i, name in enumerate(site_names):
        prec = config.resolve(name)
        for j, r in enumerate(ROLES):
            c = prec[r]
            label = c.short_str()
            fmt = c.a_format.value
            ax.add_patch(plt.Rectangle((j, n - 1 - i), 1, 1, color=colors.get(fmt, "#cccccc"), ec="white"))
            ax.text(j + 0.5, n - 0.5 - i, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, 3)
    ax.set_ylim(0, n)
    ax.set_xticks([0.5, 1.5, 2.5], [r.value for r in ROLES])
    ax.set_yticks([n - 0.5 - i for i in range(len(site_names))], list(site_names), fontsize=7)
    ax.set_title(title or f"per-layer choices (mods: {config.mods.short_str()})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(study: Any, space: Any, out_dir: str | Path, *, budget_pct: float, speed_source: str) -> list[Path]:
    """Both plots of a study into ``out_dir`` (the choice map only when a feasible trial exists)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = leaderboard(study)
    paths = [plot_speed_vs_loss(rows, budget_pct, out / "speed_vs_loss.png", speed_source=speed_source,
                                title=f"{study.study_name}: {len(rows)} trials")]
    best = best_trial(study, raise_if_none=False)
    if best is not None:
        r = TrialRecord.of(best)
        paths.append(plot_choice_map(PrecisionConfig.from_dict(r.config), space.site_names,
                                     out / "best_choice_map.png",
                                     title=f"trial {best.number}: {r.speedup or 0:.3f}x,"
                                           f" rel. LL {r.rel_logloss_pct or 0:+.4f}%"))
    return paths
