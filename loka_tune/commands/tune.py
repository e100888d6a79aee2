"""``loka-tune tune STUDY.toml``: run (or join, or resume) a tuning study."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

HELP = "search the fastest FP8 precision config under a loss budget (an Optuna study)"

DESCRIPTION = """\
Run a study file (see studies/quickstart.toml; every table and key of one: --help-schema
or docs/study-schema.md): bf16 baseline runs on 2-3 seeds, each with its noise twins (the
same run from initial weights perturbed at bf16 rounding: their paired relative log loss is
the noise floor, which objective.budget_pct must exceed), the Probe
during the first, the search space pruned by the probe: by default per site a few whole-site
recipes (bf16, tensorwise, tensorwise with fast accumulation everywhere, rowwise, rowwise with a
bf16 wgrad, Dispatch's per-GEMM choice),
each priced in seconds saved per step (measured compiled on a GPU, the cost model on a CPU);
[space] per_gemm = true searches every kept choice per site x GEMM instead. Then Optuna trials
(each a fresh model + a precision config + a paired short run, timed in the study's
[regime]: compiled on CUDA by default, at its production batch) until the trial budget is
spent: first the enqueued starts (bf16 without and with the space's Mods, then under the
faster feasible of those the recipes tensorwise / tensorwise_fa / rowwise on torchao's size-filter Linears,
torchao's own with the torchao backend in a per-GEMM space, and the Dispatch plan; then, in
the recipe space, the additive model's proposals: the fastest predicted configs within the
budget, refitted after each trial ('model:1', ...); labelled in report and MLflow;
[trials] enqueue_starts = false: none), then the sampler's (TPE), then the confirmation stage
([confirm]: the best 3 feasible configs re-run on 2+ seeds against bf16 with the same Mods). Prints progress and one line per trial to stderr;
results live in the study's output dir (runs/<name>/: optuna.db, mlflow.db, plots).

Resume: run the same command again; completed trials are kept and never re-run, and the
resumed study draws what an uninterrupted one would (the sampler is seeded per trial position).
--n-trials counts distinct configurations evaluated: a repeated one is a cache copy, recorded
but not counted. The stored
study remembers the settings it was made with ([model], [data], [training], [objective],
[space], [probe], [regime]); after an edit of those, tune stops and says what changed: --fresh starts
over (deletes the stored study), --resume-anyway goes on with the stored baseline, space and
trials. [trials] (e.g. a larger n_trials), [confirm], [storage] and [tracking] may change freely.
A preparation that failed (a bad setting, a budget below the noise floor) stores nothing but its
reason (`loka-tune report` prints it): fix the study file and run the same command again.
Ctrl-C (or SIGTERM) marks the running trial failed ("interrupted", not counted), queues its
configuration again, ends its MLflow run and the study's as KILLED and exits with status 130.
Trial numbers are Optuna's, from 0, in the progress lines as in report, export and MLflow.
Several workers (one per GPU, or across machines) share one study through its storage:
  loka-tune tune study.toml --workers 4                       # 4 local processes (SQLite)
  loka-tune tune study.toml --storage postgresql://user:pw@db-host:5432/loka   # on each machine
With --workers N the first process prepares the study (baseline, probe, space), then N
worker processes share the trials. A killed worker's trial is marked failed after
[storage] grace_s without a heartbeat and re-queued.
Or every training run on N GPUs: a study file with [regime] nproc = N re-runs this command
under torchrun (N processes, one GPU each; gloo on a CPU); rank 0 runs the study and the
other ranks train each run with it, data-parallel at the same global batch (not with --workers).

examples:
  loka-tune tune studies/quickstart.toml
  loka-tune tune studies/wukong_h200.toml --device cuda --n-trials 40
"""


class _HelpSchema(argparse.Action):
    """``--help-schema``: print every table and key of a study file (docs/study-schema.md) and exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from loka_tune.tuner.schema import schema_markdown

        sys.stdout.write(schema_markdown())
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loka_tune.commands._args import integer, number

    parser.add_argument("--help-schema", action=_HelpSchema,
                        help="print every table and key of a study file, with its type, default and meaning"
                             " (markdown: docs/study-schema.md), and exit")
    parser.add_argument("study", help="the study file (TOML)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the study's training.device)")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage URL: sqlite:///PATH (its folder must exist) or"
                             " postgresql://USER:PW@HOST:PORT/DB (psycopg 3: pip install \"loka-tune[postgres]\")"
                             " (default: the study's [storage] url, a SQLite file in its output dir)")
    parser.add_argument("--n-trials", type=integer("a number of trials", minimum=1), default=None,
                        help="total trials of the study: distinct configurations evaluated (overrides the file)")
    parser.add_argument("--timeout", type=number("seconds", minimum=0.0, strict=True), default=None,
                        help="stop starting trials after this many seconds (> 0)")
    parser.add_argument("--workers", type=integer("a number of worker processes", minimum=1), default=1,
                        help="local worker processes (default 1)")
    parser.add_argument("--force", action="store_true",
                        help="run even if the loss budget is below the baseline's (paired) noise floor")
    parser.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    parser.add_argument("--out-dir", default=None, help="the study's output dir (overrides [study] output_dir)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--fresh", action="store_true",
                       help="start the study over: delete its stored trials, baseline and space first (and the"
                            " baseline runs an unfinished preparation kept)")
    again.add_argument("--resume-anyway", action="store_true",
                       help="resume even though the study file's settings differ from the stored study's")
    parser.add_argument("--worker-index", type=integer("a worker index", minimum=0), default=0,
                        help="this worker's index (worker 0 runs the confirmation stage)")


def _load(args: argparse.Namespace):  # noqa: ANN202
    from loka_tune.tuner.study import load_study

    cfg = load_study(args.study)
    return cfg.with_output_dir(args.out_dir) if args.out_dir else cfg


def run(args: argparse.Namespace) -> int:
    from loka_tune.errors import StudyError

    cfg = _load(args)
    if args.storage is not None:  # before any work (and before torchrun starts ranks that would open it)
        from loka_tune.tuner.storage import check_storage_url

        check_storage_url(args.storage, option="--storage", own_dir=cfg.output_dir)
    nproc = cfg.regime.nproc
    if nproc > 1 and args.workers > 1:
        raise StudyError(f"got --workers {args.workers} for a study of [regime] nproc = {nproc}: its every run"
                         f" already trains on {nproc} processes; drop --workers (or set nproc = 1 in the study"
                         " file for one worker per GPU)")
    from loka_tune.objectives.distributed import dist_env, launch

    env = dist_env()
    if env is None and nproc > 1:  # this process launches the job and waits for it
        return launch(nproc, ["-m", "loka_tune", *args._argv])
    if env is not None:
        if env.world_size != nproc:
            raise StudyError(f"started as {env.world_size} processes (torchrun) for a study of [regime] nproc ="
                             f" {nproc}: set nproc = {env.world_size} in the study file or start {nproc}")
        from loka_tune.tuner import parallel
        from loka_tune.tuner.build import resolve_device

        with parallel.ranks(env, resolve_device(args.device or cfg.training.device)):
            if not env.is_main:
                parallel.follow(cfg)
                return 0
            with parallel.leading():
                return _run(args, cfg)
    return _run(args, cfg)


def _run(args: argparse.Namespace, cfg: Any) -> int:
    from loka_tune.tuner.loop import run_study
    from loka_tune.tuner.results import best_trial, noise_floor, noise_note

    t0 = time.time()
    tracking = False if args.no_tracking else None
    on_change = "fresh" if args.fresh else "resume" if args.resume_anyway else "stop"
    if args.workers == 1:
        study = run_study(cfg, device=args.device, storage_url=args.storage, n_trials=args.n_trials,
                          timeout_s=args.timeout, force=args.force, tracking=tracking,
                          worker_index=args.worker_index, on_change=on_change)
    else:
        # prepare once here (baseline, probe, space, first trials), then N workers share the trials
        study = run_study(cfg, device=args.device, storage_url=args.storage, n_trials=0,
                          force=args.force, tracking=tracking, progress=False, on_change=on_change, confirm=False)
        cmd = [sys.executable, "-m", "loka_tune", "tune", args.study]
        for flag, v in (("--device", args.device), ("--storage", args.storage), ("--n-trials", args.n_trials),
                        ("--timeout", args.timeout), ("--out-dir", args.out_dir)):
            if v is not None:
                cmd += [flag, str(v)]
        cmd += ["--force"] if args.force else []
        cmd += ["--no-tracking"] if args.no_tracking else []
        cmd += ["--resume-anyway"] if args.resume_anyway else []  # --fresh: done once, above
        env = dict(os.environ)
        procs = []
        for i in range(args.workers):
            e = dict(env)
            if (args.device or "").startswith("cuda") and args.device == "cuda":
                e.setdefault("CUDA_VISIBLE_DEVICES", str(i))  # one GPU per worker
            procs.append(subprocess.Popen(cmd + ["--worker-index", str(i + 1)], env=e))
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"loka-tune tune: worker exit codes {codes}", file=sys.stderr)
        # the confirmation (and the plots) once every worker is done: a run of no new trial
        study = run_study(cfg, device=args.device, storage_url=args.storage, n_trials=0,
                          force=args.force, tracking=tracking, progress=False,
                          on_change="resume" if args.resume_anyway else "stop")
    best = best_trial(study, raise_if_none=False)
    wall = time.time() - t0
    if best is None:
        print(f"study {cfg.name!r}: no feasible trial yet ({wall:.0f}s); see `loka-tune report {args.study}`")
        return 1
    a = best.user_attrs
    floor = noise_floor(study)
    print(f"study {cfg.name!r}: best trial {best.number}: step {best.value:.6g}s ({a.get('speed_source')}),"
          f" speed-up {a.get('speedup'):.3f}x, rel. log loss {a.get('rel_logloss_pct'):+.4f}%"
          f"{noise_note(a.get('rel_logloss_pct'), floor)} (budget {cfg.objective.budget_pct}%) [{wall:.0f}s]")
    c = study.user_attrs.get("loka.confirmation")
    if c and c.get("chosen") is not None:
        row = next(r for r in c["rows"] if r["trial"] == c["chosen"])
        print(f"confirmed: trial {row['trial']}, {row['speedup_vs_mods']:.3f}x vs bf16 + same Mods (claimed"
              f" {row['claimed_speedup_vs_mods']:.3f}x), rel. log loss {row['rel_logloss_pct']:+.4f}% on seeds"
              f" {c['seeds']}{noise_note(row['rel_logloss_pct'], floor)}")
    elif c:
        print("confirmed: no candidate held its loss within the budget on every seed (see `loka-tune report`)")
    print(f"export it: loka-tune export {args.study} --out best.json")
    return 0
