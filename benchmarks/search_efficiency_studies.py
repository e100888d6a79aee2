"""Search efficiency with real studies (issue #8, point 3): short runs to the best feasible config,
probe-pruned vs plain TPE. (Issue 21's comparison on a binding space, with modeled composition,
is ``benchmarks/search_efficiency.py``; this script was that file's name until then.)

For one fixed trial budget, each *arm* is a real ``loka_tune.tuner.run_study`` on a variant of one
base study, repeated for several sampler seeds (``[study] seed``):

* ``loka``: what ``loka-tune tune`` does today: probe pruning (``[probe] enabled = true``), the
  base study's space (the recipe space unless it sets ``[space] per_gemm = true``) and the
  enqueued first trials (:mod:`loka_tune.tuner.starts`: bf16 under each Mods set, then the named
  recipes, then the model's proposals; the results recorded in
  ``benchmarks/results/search_efficiency_studies.md`` predate all of these: per-GEMM space,
  all-bf16, the Dispatch plan, all-FP8 at the fastest safe choices).
* ``tpe``: plain Optuna TPE over the unpruned per-GEMM space (``[space] per_gemm = true``,
  ``[probe] enabled = false``: no probe, no pruning, no Dispatch plan) with no enqueued trials
  (``[trials] enqueue_starts = false``).
* ``pruned_tpe`` (optional ablation, ``--arms loka,tpe,pruned_tpe``): probe pruning, per-GEMM
  space, no enqueued trials.

Everything else is the same in every arm: the model, data, loss budget, the TPE sampler with the
loss constraint (``n_startup_trials`` random trials first), the hopeless pruner, the structural
eligibility of candidates (``align``/``min_dim``: a GEMM that no FP8 kernel can run is never a
candidate), and the trial budget ``n_trials`` (cache hits, i.e. a configuration asked again, count
toward it but are not short runs). Speed is *modeled* (the calibrated H200 cost model), so a
configuration's step time is a deterministic function of the configuration, and its feasibility
(relative log loss of its paired CPU short run <= the budget) is deterministic too (fixed seeds).

Per run it reports the short runs (trials actually evaluated, not cache hits) until the run's own
best feasible step time was first reached, that best (and its speed-up over bf16), whether it
equals the best over all runs (within ``--tol``, default 0.5%), and the short runs until that
overall best was first reached (censored at the run's total short runs when never reached).

    python benchmarks/search_efficiency_studies.py --n-trials 36 --seeds 0,1,2 --arms loka,tpe,pruned_tpe \\
        --out benchmarks/results   # writes search_efficiency_studies.json and .md there (~25 min, 2 cores)

The default base study is ``BASE_STUDY`` below: studies/quickstart.toml with a deeper DLRM (1024x2048
and 2048x1024 top GEMMs, where FP8 pays off on an H200 for some roles and granularities, and a
256-64-16 bottom MLP, where it does not) and a richer space (e4m3/e5m2, tensor/row/block, exact/pow2 scales, all four Mods),
with the quickstart's training settings of the day it was run (30 steps x 64; the quickstart
now trains 40 x 128); ``--study FILE`` uses another study file instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["BASE_STUDY", "ARMS", "arm_config", "run_arm", "run_benchmark", "summarize", "to_markdown", "main"]

BASE_STUDY = """\
# quickstart.toml with a deeper DLRM and a richer space (see benchmarks/search_efficiency_studies.py)
[study]
name = "search_efficiency"
seed = 0

[model]
name = "dlrm"
preset = "tiny"
[model.overrides]
embedding_dim = 16
bottom_mlp = [256, 64]         # 256x64 and 64x16 GEMMs: FP8 loses on an H200 (the probe drops them)
top_mlp = [1024, 2048, 1024]   # 1024x2048 and 2048x1024 GEMMs: where FP8 pays off (some roles, some
                               # granularities; 52x1024 and the 1024x1 head are not FP8-eligible)

[data]
source = "synthetic"
[data.params]
num_dense = 13
cardinalities = [1000, 1000, 500, 500, 200, 200, 100, 100]
eval_examples = 4096

[training]
steps = 30
batch_size = 64
lr_dense = 3e-3
lr_sparse = 3e-2
seeds = [0, 1]
eval_batches = 4
window = 10
warmup_steps = 3
device = "cpu"

[objective]
kind = "train_step"
budget_pct = 3.0               # as quickstart: above the ~2% noise floor of such short runs
speed = "modeled"
cost_device = "h200"
cost_batch_size = 65536
non_gemm_fraction = 0.3

[space]
formats = ["e4m3", "e5m2"]
granularities = ["tensor", "row", "block"]
backends = ["emulated"]
roundings = ["exact", "pow2"]
mods = ["no_bias", "blocknorm", "hardswish", "pad"]

[probe]
max_error = 0.2
min_speedup = 1.0
samples = 4
every = 10

[trials]
n_trials = 36
pruner = "hopeless"
n_startup_trials = 6

[tracking]
enabled = false
"""

# arm -> ([probe] enabled, [trials] enqueue_starts, [space] per_gemm: None = the base study's)
ARMS: dict[str, tuple[bool, bool, bool | None]] = {
    "loka": (True, True, None),
    "tpe": (False, False, True),
    "pruned_tpe": (True, False, True),
}
ARM_LABELS = {
    "loka": "loka-tune (probe pruning + enqueued starts)",
    "tpe": "plain TPE (unpruned per-GEMM space, no enqueued trials)",
    "pruned_tpe": "TPE on the probe-pruned per-GEMM space, no enqueued trials",
}


def arm_config(base: Mapping[str, Any], arm: str, seed: int, n_trials: int, workdir: Path) -> Any:
    """The validated StudyConfig of ``arm`` for sampler ``seed``: the base study document with only
    ``[study]`` name/output_dir/seed, ``[probe] enabled``, ``[trials]`` n_trials/enqueue_starts,
    ``[space] per_gemm`` for the TPE arms and ``[tracking] enabled = false`` (and a storage in
    ``workdir``) changed."""
    from loka_tune.tuner.study import parse_study

    probe_on, enqueue, per_gemm = ARMS[arm]
    doc = copy.deepcopy(dict(base))
    name = f"{arm}-seed{seed}"
    doc["study"] = {**doc.get("study", {}), "name": name, "output_dir": str(workdir / name), "seed": seed}
    doc["probe"] = {**doc.get("probe", {}), "enabled": probe_on}
    if per_gemm is not None:
        doc["space"] = {**doc.get("space", {}), "per_gemm": per_gemm}
    trials = {k: v for k, v in doc.get("trials", {}).items() if k != "timeout_s"}
    doc["trials"] = {**trials, "n_trials": n_trials, "enqueue_starts": enqueue}
    doc["storage"] = {**doc.get("storage", {}), "url": f"sqlite:///{workdir / name / 'optuna.db'}"}
    doc["tracking"] = {"enabled": False}
    return parse_study(doc, cwd=workdir)


def _space_facts(space: Any) -> dict[str, Any]:
    from loka_tune.space.encode import distributions

    reasons: dict[str, int] = {}
    for sc in space.sites:
        for d in sc.dropped.values():
            for why in d.values():
                k = why.split(":", 1)[0]
                reasons[k] = reasons.get(k, 0) + 1
    return {"sites": len(space.sites), "fp8_candidates": space.n_fp8_candidates(),
            "parameters": len(distributions(space)), "configs": space.size(), "dropped": reasons}


def run_arm(base: Mapping[str, Any], arm: str, seed: int, n_trials: int, workdir: Path) -> dict[str, Any]:
    """One real study of ``arm`` (``loka_tune.tuner.run_study``, no tracking); its trial records."""
    from loka_tune.space.candidates import SearchSpace
    from loka_tune.tuner import results
    from loka_tune.tuner.loop import run_study

    cfg = arm_config(base, arm, seed, n_trials, workdir)
    t0 = time.perf_counter()
    study = run_study(cfg, tracking=False, progress=False)
    wall = time.perf_counter() - t0
    records = []
    n_eval = 0
    for t in sorted(study.trials, key=lambda t: t.number):
        if t.state.name not in results.STATES_DONE:
            continue
        a = t.user_attrs
        evaluated = not a.get("cache_hit", False)
        n_eval += int(evaluated)
        records.append({
            "trial": t.number, "state": t.state.name, "evaluated": evaluated, "n_evaluated": n_eval,
            "cached_from": a.get("cached_from"), "seeded": a.get("seeded"),
            "feasible": bool(a.get("feasible")) and t.state.name == "COMPLETE",
            "step_time_s": t.value, "speedup": a.get("speedup"), "rel_logloss_pct": a.get("rel_logloss_pct"),
            "config_key": a.get("config_key"), "wall_s": a.get("wall_s"),
        })
    bl = study.user_attrs[results.ATTR_BASELINE]
    space = SearchSpace.from_dict(study.user_attrs[results.ATTR_SPACE])
    return {"arm": arm, "seed": seed, "n_trials": n_trials, "wall_s": wall, "records": records,
            "space": _space_facts(space), "baseline": {"eval_logloss": bl["eval_logloss"],
                                                       "noise_floor_pct": bl["noise_floor_pct"],
                                                       "step_time_s": bl["step_time_s"]}}


def _first_reaching(records: Sequence[Mapping[str, Any]], target: float, tol: float) -> Mapping[str, Any] | None:
    """The first feasible record with step time <= target * (1 + tol)."""
    for r in records:
        if r["feasible"] and r["step_time_s"] is not None and r["step_time_s"] <= target * (1.0 + tol):
            return r
    return None


def _stats(xs: Sequence[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "mean": None, "min": None, "max": None, "std": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def summarize(runs: Sequence[dict[str, Any]], *, tol: float = 0.005) -> dict[str, Any]:
    """Per run: short runs to its own best and to the overall best; per arm: mean and spread.

    ``evals_to_run_best``: short runs (evaluated trials, cache hits excluded) up to and including
    the first trial whose feasible step time equals the run's best (relative 1e-9).
    ``evals_to_overall_best``: the same for the best over all runs within ``tol``; None when the
    run never got there (then ``censored_at`` is its total number of short runs).
    """
    bests = [min((r["step_time_s"] for r in run["records"] if r["feasible"]), default=None) for run in runs]
    overall = min((b for b in bests if b is not None), default=None)
    per_run = []
    for run, best in zip(runs, bests):
        recs = run["records"]
        n_eval = sum(1 for r in recs if r["evaluated"])
        row: dict[str, Any] = {"arm": run["arm"], "seed": run["seed"], "n_trials": len(recs),
                               "n_evaluated": n_eval, "n_cache_hits": len(recs) - n_eval,
                               "n_feasible": sum(1 for r in recs if r["feasible"] and r["evaluated"]),
                               "wall_s": run["wall_s"], "best_step_time_s": best, "best_speedup": None,
                               "best_trial": None, "best_seeded": None, "evals_to_run_best": None,
                               "reaches_overall_best": False, "evals_to_overall_best": None,
                               "censored_at": None, "evals_to_overall_best_exact": None}
        if best is not None:
            first = _first_reaching(recs, best, 1e-9)
            assert first is not None and first["evaluated"]  # a cache hit copies an earlier evaluated trial
            row.update(best_speedup=first["speedup"], best_trial=first["trial"], best_seeded=first["seeded"],
                       evals_to_run_best=first["n_evaluated"])
        hit = _first_reaching(recs, overall, tol) if overall is not None else None
        if hit is not None:
            row.update(reaches_overall_best=True, evals_to_overall_best=hit["n_evaluated"])
        else:
            row["censored_at"] = n_eval
        exact = _first_reaching(recs, overall, 1e-9) if overall is not None else None
        row["evals_to_overall_best_exact"] = None if exact is None else exact["n_evaluated"]
        per_run.append(row)
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in per_run):
        rows = [r for r in per_run if r["arm"] == arm]
        reached = [r["evals_to_overall_best"] for r in rows if r["reaches_overall_best"]]
        censored = [r["censored_at"] for r in rows if not r["reaches_overall_best"]]
        exact = [r["evals_to_overall_best_exact"] for r in rows]
        arms[arm] = {
            "runs": len(rows),
            "reached_overall_best": len(reached),
            "evals_to_run_best": _stats([r["evals_to_run_best"] for r in rows if r["evals_to_run_best"] is not None]),
            # censored runs enter at their total short runs: with any censored run this mean is a lower bound
            "evals_to_overall_best": _stats(reached + censored),
            "evals_to_overall_best_is_lower_bound": bool(censored),
            "reached_overall_best_exact": sum(1 for x in exact if x is not None),
            # never reached exactly: counted at the run's total short runs (a lower bound again)
            "evals_to_overall_best_exact": _stats([x if x is not None else r["n_evaluated"]
                                                   for x, r in zip(exact, rows)]),
            "best_speedup": _stats([r["best_speedup"] for r in rows if r["best_speedup"] is not None]),
            "n_evaluated": _stats([r["n_evaluated"] for r in rows]),
            "wall_s": _stats([r["wall_s"] for r in rows]),
        }
    # determinism check: a configuration evaluated in several runs must give the same numbers
    seen: dict[str, tuple[float | None, float | None]] = {}
    max_dt = max_drel = 0.0
    repeated = 0
    for run in runs:
        for r in run["records"]:
            if not r["evaluated"] or r["state"] != "COMPLETE":
                continue
            v = (r["step_time_s"], r["rel_logloss_pct"])
            if r["config_key"] in seen:
                repeated += 1
                o = seen[r["config_key"]]
                max_dt = max(max_dt, abs(v[0] - o[0]) / o[0])
                max_drel = max(max_drel, abs(v[1] - o[1]))
            else:
                seen[r["config_key"]] = v
    out: dict[str, Any] = {"tol": tol, "overall_best_step_time_s": overall, "per_run": per_run, "arms": arms,
                           "determinism": {"configs_evaluated_in_several_runs": repeated,
                                           "max_rel_diff_step_time": max_dt,
                                           "max_abs_diff_rel_logloss_pct": max_drel}}
    if "loka" in arms and "tpe" in arms:
        lk, tp = arms["loka"], arms["tpe"]
        ok = None
        if lk["reached_overall_best"] == lk["runs"] and tp["evals_to_overall_best"]["mean"]:
            # with censored tpe runs its mean is a lower bound, so meeting the target against it is conclusive
            ok = lk["evals_to_overall_best"]["mean"] <= tp["evals_to_overall_best"]["mean"] / 3.0
        elif lk["reached_overall_best"] < lk["runs"]:
            ok = False
        out["acceptance"] = {"target": "loka reaches the overall best in <= 1/3 of the short runs plain TPE needs",
                             "loka_mean": lk["evals_to_overall_best"]["mean"],
                             "tpe_mean": tp["evals_to_overall_best"]["mean"],
                             "tpe_mean_is_lower_bound": tp["evals_to_overall_best_is_lower_bound"],
                             "met": ok}
    return out


def run_benchmark(base: Mapping[str, Any] | str, *, n_trials: int, seeds: Sequence[int],
                  arms: Sequence[str] = ("loka", "tpe"), tol: float = 0.005, workdir: Path | None = None,
                  log: bool = True) -> dict[str, Any]:
    """Run every arm for every sampler seed with the same trial budget; the raw runs and the summary.

    ``base``: a study TOML text or a parsed document. Optuna storages live in ``workdir``
    (default: a temporary folder, removed afterwards).
    """
    import optuna
    import torch

    doc = tomllib.loads(base) if isinstance(base, str) else dict(base)
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="loka-search-eff-")
        workdir = Path(tmp.name)
    runs = []
    t0 = time.perf_counter()
    try:
        for seed in seeds:
            for arm in arms:
                if log:
                    print(f"[search-efficiency] {arm} seed {seed} ({n_trials} trials) ...", file=sys.stderr, flush=True)
                run = run_arm(doc, arm, seed, n_trials, Path(workdir))
                if log:
                    s = summarize([run], tol=tol)["per_run"][0]
                    print(f"[search-efficiency] {arm} seed {seed}: best speed-up {s['best_speedup']}, "
                          f"{s['n_evaluated']} short runs, best at short run {s['evals_to_run_best']}"
                          f" ({run['wall_s']:.0f}s)", file=sys.stderr, flush=True)
                runs.append(run)
    finally:
        if tmp is not None:
            tmp.cleanup()
    summary = summarize(runs, tol=tol)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.node(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "optuna": optuna.__version__,
            "torch_threads": torch.get_num_threads(),
            "n_trials": n_trials, "seeds": list(seeds), "arms": list(arms), "tol": tol,
            "total_wall_s": time.perf_counter() - t0}
    return {"meta": meta, "base_study": doc, "runs": runs, "summary": summary}


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _stat_str(s: Mapping[str, Any], nd: int = 1) -> str:
    if not s["n"]:
        return "-"
    return f"{s['mean']:.{nd}f} ({_fmt(s['min'], nd)}-{_fmt(s['max'], nd)}, sd {s['std']:.{nd}f})"


def to_markdown(result: Mapping[str, Any], command: str | None = None) -> str:
    """The per-run and per-arm tables (markdown)."""
    m, s = result["meta"], result["summary"]
    ov = s["overall_best_step_time_s"]
    bl = result["runs"][0]["baseline"]["step_time_s"] if result["runs"] else None
    lines = ["## Search efficiency: probe pruning + enqueued starts vs plain TPE (issue #8, point 3)", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"Date {m['date']}; machine {m['machine']} ({m['cpu_count']}-core CPU, no GPU), {m['platform']};"
              f" Python {m['python']}, torch {m['torch']} ({m.get('torch_threads', '?')} thread), optuna {m['optuna']}. Total wall time"
              f" {m['total_wall_s'] / 60:.1f} min.", "",
              f"Budget: {m['n_trials']} trials per run (cache hits count toward it, but are not short runs),"
              f" sampler seeds {m['seeds']}. Speed modeled (H200 cost model), so the optimum of a space is"
              f" deterministic. \"Short runs\" = trials actually trained (not cache hits). Overall best ="
              f" fastest feasible step time over all runs: {_fmt(ov and ov * 1e3, 4)} ms"
              + (f" (speed-up {bl / ov:.3f}x over bf16)" if ov and bl else "") +
              f"; a run reaches it when within {m['tol'] * 100:.1f}%.", ""]
    spaces = {}
    for run in result["runs"]:
        spaces.setdefault(run["arm"], run["space"])
    lines += ["| arm | sites | parameters | FP8 candidates | configurations | dropped (why: count) |",
              "|---|---|---|---|---|---|"]
    for arm, sp in spaces.items():
        dropped = ", ".join(f"{k}: {v}" for k, v in sorted(sp["dropped"].items())) or "-"
        lines.append(f"| {arm} | {sp['sites']} | {sp['parameters']} | {sp['fp8_candidates']} |"
                     f" {sp['configs']:.3g} | {dropped} |")
    lines += ["", "Per run:", "",
              "| arm | seed | short runs (cache hits) | feasible | best speed-up | best found at short run"
              f" (trial, seeded) | = overall best | short runs to overall best (within {m['tol'] * 100:.1f}%)"
              " | ... exactly | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["per_run"]:
        where = (f"{r['evals_to_run_best']} (#{r['best_trial']}{', ' + r['best_seeded'] if r['best_seeded'] else ''})"
                 if r["evals_to_run_best"] is not None else "-")
        to_ov = (str(r["evals_to_overall_best"]) if r["reaches_overall_best"]
                 else f"not reached (> {r['censored_at']}, censored)")
        lines.append(f"| {r['arm']} | {r['seed']} | {r['n_evaluated']} ({r['n_cache_hits']}) | {r['n_feasible']} |"
                     f" {_fmt(r['best_speedup'], 4)}x | {where} | {'yes' if r['reaches_overall_best'] else 'no'} |"
                     f" {to_ov} | {_fmt(r['evals_to_overall_best_exact']) if r['evals_to_overall_best_exact'] else 'no'} |"
                     f" {r['wall_s']:.0f} |")
    lines += ["", "Per arm (mean (min-max, sd) over seeds; a run that never reached the overall best enters at"
              " its total short runs, which makes that mean a lower bound, marked >=):", "",
              f"| arm | reached overall best (within {m['tol'] * 100:.1f}%) | short runs to overall best |"
              " reached exactly | short runs to overall best, exactly | short runs to own best |"
              " best speed-up | short runs in budget |", "|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        lb = ">= " if a["evals_to_overall_best_is_lower_bound"] else ""
        lbx = ">= " if a["reached_overall_best_exact"] < a["runs"] else ""
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | {a['reached_overall_best']}/{a['runs']} |"
                     f" {lb}{_stat_str(a['evals_to_overall_best'])} | {a['reached_overall_best_exact']}/{a['runs']} |"
                     f" {lbx}{_stat_str(a['evals_to_overall_best_exact'])} | {_stat_str(a['evals_to_run_best'])} |"
                     f" {_stat_str(a['best_speedup'], 4)} | {_stat_str(a['n_evaluated'])} |")
    d = s["determinism"]
    lines += ["", f"Determinism check: {d['configs_evaluated_in_several_runs']} evaluations repeated a configuration"
              f" of another run; largest differences: step time {d['max_rel_diff_step_time']:.2g} (relative),"
              f" relative log loss {d['max_abs_diff_rel_logloss_pct']:.2g} percentage points."]
    acc = s.get("acceptance")
    if acc:
        verdict = {True: "MET", False: "NOT MET", None: "undecided"}[acc["met"]]
        lines += ["", f"Acceptance target ({acc['target']}): **{verdict}**: loka {_fmt(acc['loka_mean'])} vs plain"
                  f" TPE {_fmt(acc['tpe_mean'])}{' (a lower bound)' if acc['tpe_mean_is_lower_bound'] else ''}"
                  " short runs on average."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=None, help="base study file (default: BASE_STUDY above)")
    ap.add_argument("--n-trials", type=int, default=36)
    ap.add_argument("--seeds", default="0,1,2", help="sampler seeds, comma-separated")
    ap.add_argument("--arms", default="loka,tpe", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--tol", type=float, default=0.005, help="relative tolerance of 'reached the overall best'")
    ap.add_argument("--out", type=Path, required=True, help="folder for NAME.json and NAME.md")
    ap.add_argument("--name", default="search_efficiency_studies", help="file name stem of the results")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the Optuna storages here (default: temp)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: two-thread GEMMs on a shared 2-core box stall each other)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    base = args.study.read_text() if args.study else BASE_STUDY
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    result = run_benchmark(base, n_trials=args.n_trials, seeds=seeds, arms=arms, tol=args.tol, workdir=args.workdir)
    command = "python benchmarks/search_efficiency_studies.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["meta"]["command"] = command
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = to_markdown(result, command)
    (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
