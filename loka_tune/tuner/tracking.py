"""MLflow tracking of a study: one parent run, one nested run per trial, plots.

- Parent run (one per study, shared by every worker: its id is stored in the Optuna study):
  the study's settings as params, the baseline's metrics (the noise floor, each noise twin's
  paired relative log loss, the seed-to-seed distance), the probe report, and at the end the
  plots (:mod:`loka_tune.tuner.plots`: speed vs relative log loss with the budget line, the
  noise band and the Pareto front; the per-layer choice map of the exported trial) and the
  leaderboard; the confirmed config's numbers and its ``confirmed_within_noise`` tag.
- Nested run per trial: params ``site.<layer name>`` = the layer's choice (``e4m3.row.emulated``,
  or ``fwd|dgrad|wgrad`` when they differ) and ``mods``; metrics ``step_time_s``, ``speedup``,
  ``rel_logloss_pct``, ``eval_ne``, ``eval_auc``, ``probe_error``; tags ``feasible``,
  ``within_noise`` (|rel_logloss_pct| <= the baseline's noise floor: no measurable difference
  from bf16), ``pruned``, ``cache_hit``, ``state``, ``speed_source``; the PrecisionConfig JSON
  as an artifact.
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
from loka_tune.tuner.plots import (  # noqa: F401 - the plots' public names, importable from here as before
    pareto_front,
    place_labels,
    plot_choice_map,
    plot_speed_vs_loss,
    speed_vs_loss_layout,
    write_plots,
)
from loka_tune.tuner.results import TrialRecord, best_trial, confirmation, leaderboard, within_noise

__all__ = ["Tracker", "retry", "write_plots", "plot_speed_vs_loss", "speed_vs_loss_layout", "plot_choice_map",
           "pareto_front", "place_labels", "site_params"]

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
    def for_study(cls, cfg: Any, study: Any, *, required: bool = False, attach: bool = True) -> Tracker | None:
        """The study's tracker with its parent run (created once, shared through the Optuna study;
        ``attach=False``: later, by :meth:`attach_parent`, as the loop does once the study is
        prepared, so that a preparation that fails leaves no run behind).

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
        if attach:
            tr.attach_parent(study, cfg)
        return tr

    def attach_parent(self, study: Any, cfg: Any) -> str:
        """Reuse the study's parent run, or create it (first worker)."""
        run_id: str | None = study.user_attrs.get(ATTR_PARENT)
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

    def _log_curve(self, run_id: str, key: str, values: Sequence[float]) -> None:
        """A per-step metric (``key`` at steps 1..n): a training loss curve, in batches of 1000."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(key, float(v), ts, i + 1) for i, v in enumerate(values) if _finite(v)]
        for i in range(0, len(items), 1000):
            retry(self.client.log_batch, run_id, metrics=items[i:i + 1000])

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
    def log_baseline(self, baseline: Any, space: Any, probe_report: Path | None, *,
                     curves: Mapping[int, Sequence[float]] | None = None) -> None:
        """The baseline's numbers (the noise floor, each noise twin's ``paired_noise_pct`` at step
        1, 2, ..., the seed-to-seed ``seed_spread_pct``), its seeds' per-step training losses
        (``baseline_train_loss.seed<N>``) and the probe report on the parent run."""
        assert self.parent_run_id is not None
        self._site_names = list(space.site_names)
        self._log_metrics(self.parent_run_id, {
            "baseline_logloss": baseline.logloss, "baseline_ne": baseline.eval_ne, "baseline_auc": baseline.eval_auc,
            "noise_floor_pct": baseline.noise_floor_pct, "seed_spread_pct": getattr(baseline, "seed_spread_pct", None),
            "baseline_step_time_s": baseline.step_time_s,
            "n_sites": len(space.sites), "n_fp8_candidates": space.n_fp8_candidates(),
            "n_recipe_values": space.n_recipe_values()})
        self._log_curve(self.parent_run_id, "paired_noise_pct", getattr(baseline, "paired_noise_pct", ()))
        self._set_tags(self.parent_run_id, {"speed_source": baseline.speed_source, "device": baseline.device,
                                            "noise_floor_kind": getattr(baseline, "noise_floor_kind", None),
                                            "space": "per_gemm" if space.per_gemm else "recipes",
                                            "price_source": space.price_source})
        for seed, losses in (curves or {}).items():
            self._log_curve(self.parent_run_id, f"baseline_train_loss.seed{seed}", losses)
        retry(self.client.log_text, self.parent_run_id, json.dumps(space.to_dict(), indent=1), "search_space.json")
        if probe_report is not None and Path(probe_report).is_file():
            retry(self.client.log_artifact, self.parent_run_id, str(probe_report))

    def log_trial(self, number: int, params: Mapping[str, Any], config: PrecisionConfig, attrs: Mapping[str, Any],
                  state: str, ctx: Any, *, step_losses: Sequence[float] = (), run_status: str | None = None) -> str:
        """One nested run for trial ``number`` (``attrs``: what its end wrote; ``step_losses``: its
        training loss per step, logged as the step metric ``train_loss``); returns its run id. The
        run spans the trial's real duration (``wall_s``: a cache copy's is its lookup's, and its
        ``cache_hit`` tag says so). It ends FINISHED (complete), KILLED (pruned) or FAILED, or as
        ``run_status`` when given (an interrupted trial: KILLED)."""
        assert self.parent_run_id is not None
        names = list(ctx.space.site_names)
        a = TrialRecord.from_attrs(attrs)
        tags = {"mlflow.parentRunId": self.parent_run_id, "loka.study": self.study_name, "loka.trial": number,
                "state": state, "feasible": bool(a.feasible), "pruned": state == "PRUNED",
                "within_noise": (within_noise(a.rel_logloss_pct, getattr(getattr(ctx, "baseline", None),
                                                                         "noise_floor_pct", None))
                                 if state == "COMPLETE" else None),
                "cache_hit": bool(a.cache_hit), "speed_source": a.speed_source or ctx.speed,
                "fail_reason": a.fail_reason or None, "seeded": a.seeded or None, "cached_from": a.cached_from}
        end_ms = int(time.time() * 1000)
        start_ms = end_ms - int(1000 * (a.wall_s or 0.0))
        name = f"trial-{number:04d}" + (f"-cache-of-{a.cached_from:04d}" if a.cache_hit and a.cached_from is not None
                                         else "")
        run = retry(self.client.create_run, self.experiment_id, run_name=name, start_time=start_ms,
                    tags={k: str(v) for k, v in tags.items() if v is not None})
        rid: str = run.info.run_id
        p: dict[str, Any] = dict(site_params(config, names))
        p["mods"] = config.mods.short_str()
        p["n_fp8_gemms"] = sum(1 for n in names for r in ROLES if not config.resolve(n)[r].is_bf16)
        self._log_params(rid, p)
        err = _probe_error(config, ctx.space)
        self._log_metrics(rid, {
            "step_time_s": a.step_time_s, "speedup": a.speedup, "speedup_vs_mods": a.speedup_vs_mods,
            "mods_step_time_s": a.mods_step_time_s, "rel_logloss_pct": a.rel_logloss_pct,
            "eval_logloss": a.eval_logloss, "eval_ne": a.eval_ne, "eval_auc": a.eval_auc, "probe_error": err,
            "measured_step_time_s": a.measured_step_time_s, "wall_s": a.wall_s, "n_fp8_gemms": p["n_fp8_gemms"]})
        self._log_curve(rid, "train_loss", step_losses)
        retry(self.client.log_text, rid, config.to_json(), "precision_config.json")
        status = run_status or {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(state, "FAILED")
        retry(self.client.set_terminated, rid, status, end_time=max(end_ms, start_ms))
        return rid

    def interrupted(self, status: str = "KILLED") -> None:
        """End the study's run as KILLED (Ctrl-C / SIGTERM), or ``status`` ("FAILED": an error);
        the next run of the study reopens it."""
        if self.parent_run_id is not None:
            try:
                retry(self.client.set_terminated, self.parent_run_id, status)
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
                                                   "best_speedup_vs_mods": b.speedup_vs_mods,
                                                   "best_rel_logloss_pct": b.rel_logloss_pct})
            self._set_tags(self.parent_run_id, {"best_trial": best.number})
        self._log_confirmation(confirmation(ctx.study), ctx.baseline.noise_floor_pct)
        if self.plots:
            for path in write_plots(ctx.study, ctx.space, out, budget_pct=ctx.cfg.objective.budget_pct,
                                    speed_source=ctx.speed, noise_floor_pct=ctx.baseline.noise_floor_pct):
                retry(self.client.log_artifact, self.parent_run_id, str(path))
        retry(self.client.set_terminated, self.parent_run_id, "FINISHED")


    def _log_confirmation(self, c: Mapping[str, Any] | None, noise_floor_pct: float | None = None) -> None:
        """The confirmation stage on the parent run: the chosen config's confirmed numbers, the table."""
        assert self.parent_run_id is not None
        if not c:
            return
        retry(self.client.log_text, self.parent_run_id, json.dumps(c, indent=1), "confirmation.json")
        row = next((r for r in c.get("rows", []) if r.get("trial") == c.get("chosen")), None)
        self._set_tags(self.parent_run_id, {"confirmed_trial": c.get("chosen", "none") if row else "none"})
        if row is not None:
            self._set_tags(self.parent_run_id, {
                "confirmed_within_noise": within_noise(row.get("rel_logloss_pct"), noise_floor_pct)})
        if row is not None:
            self._log_metrics(self.parent_run_id, {
                "confirmed_speedup_vs_mods": row.get("speedup_vs_mods"), "confirmed_speedup": row.get("speedup"),
                "claimed_speedup_vs_mods": row.get("claimed_speedup_vs_mods"),
                "confirmed_rel_logloss_pct": row.get("rel_logloss_pct"),
                "confirmed_rel_logloss_sd_pct": row.get("rel_logloss_sd_pct")})


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
