"""Do the H200 studies' bf16 baselines learn? (issue 20, point 3) One GPU call, a small grid.

For each study (default: ``studies/wukong_h200.toml`` and ``studies/interformer_h200.toml``) it
trains the study's own bf16 baselines, built as ``loka-tune tune`` builds them: the data source
(``make_source``), a fresh model per seed (``make_model``: the head's bias at logit(base rate)),
bf16 applied, the trainer's config from ``[training]`` put in the study's ``[regime]``
(``train_config``: steps, batch, autocast, compiled on CUDA) and ``run_train`` (a strict compile:
a graph break or an eager fallback fails the run). One difference: a study's probed seed-0
baseline runs eagerly under the probe's hooks; here every seed runs in the regime (the probe off,
as in the issue's runs).

Each variant changes only the learning-rate keys of ``[training]``:

- ``study``: the study file as it is (the shipped default, which must pass the bar);
- ``old``: main 575a6f3's settings (lr_dense 1e-3, lr_sparse 1e-2, no learning-rate warm-up);
- ``warmup_only``: the study's warm-up at the old lr_dense 1e-3;
- ``lr3e-4`` / ``lr3e-5``: the study's warm-up with lr_dense 3e-4 / 3e-5;
- any ``--add NAME:key=value,key=value`` (TrainConfig fields: lr_dense, lr_sparse, lr_warmup_steps,
  lr_cooldown_steps, steps).

The bar (issue 20): every seed of the ``study`` variant ends at eval NE <= 0.97 on the held-out
synthetic rows and the seeds' NE differ by < 0.01. The script prints a table (study, variant, seed,
eval NE, AUC, final train loss, the first 20 steps' worst loss, seconds) and writes every run to
``--out`` (JSON, rewritten after each run), and exits 1 when the ``study`` variant misses the bar
on any study (or could not run). A study that fails (e.g. Interformer's compile) is recorded in its
rows and the next one goes on; ``--eager-fallback`` retries a failed compiled run eagerly (the
learning dynamics do not depend on compilation; the row says ``compiled: false``).

``--twins N`` adds, after each baseline run, N noise twins of it: the same run from initial Linear
weights perturbed as the study's twins are (``loka_tune.tuner.baseline.perturb_weights``, twin k of
the seed), each row with its ``twin`` number and ``rel_logloss_pct`` against its baseline. Each
(study, variant) then gets a noise floor, the largest |rel_logloss_pct| of its twins over its
seeds, beside the study's ``objective.budget_pct`` (the study refuses a budget below its floor),
under ``floors`` in the JSON; with twins, the ``study`` variant passes only when its floor is
below the budget as well.

Runs go in this order: ``study`` for every study, then each other variant, so the bar is decided
first; ``--budget-s`` seconds of wall time (default 300) stop starting new runs (they are recorded
as skipped).

    # on one H200 (< 6 minutes: up to 16 runs of 200 steps, each ~10-25 s once inductor's cache is
    # warm; the default's 4 first, then warmup_only, lr3e-5 and old until --budget-s)
    python benchmarks/baseline_learning.py --eager-fallback --out $OUT/baseline_learning.json
    # is the B = 32768 study's training stable enough for its budget? two seeds, two twins each, at
    # its rates and at twice lr_dense (on one H100 each baseline ~65 s cold, each twin ~23 s)
    python benchmarks/baseline_learning.py --studies studies/wukong_h200_b32768.toml --seeds 0,1 \
        --twins 2 --add lr2e-4:lr_dense=2e-4 --variants study,lr2e-4 --budget-s 400 --out $OUT/bl.json
    # the code path on a CPU (a few minutes on 2 cores: the 40-feature data, bf16 autocast)
    python benchmarks/baseline_learning.py --preset tiny --steps 5 --batch 512 --eval-examples 2048 \
        --device cpu --out /tmp/bl.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STUDIES = ("studies/wukong_h200.toml", "studies/interformer_h200.toml")
NE_BAR, SPREAD_BAR = 0.97, 0.01
# name -> the [training] keys it changes (the study's own values elsewhere); "study" changes none
VARIANTS: dict[str, dict[str, Any]] = {
    "study": {},
    "old": {"lr_dense": 1e-3, "lr_sparse": 1e-2, "lr_warmup_steps": 0},
    "warmup_only": {"lr_dense": 1e-3},
    "lr3e-4": {"lr_dense": 3e-4},
    "lr3e-5": {"lr_dense": 3e-5},
}


def parse_add(spec: str) -> tuple[str, dict[str, Any]]:
    """``"NAME:lr_dense=3e-4,lr_warmup_steps=40"`` -> (name, {key: value}); TrainConfig keys only."""
    name, _, body = spec.partition(":")
    if not name or not body:
        raise SystemExit(f"--add {spec!r}: write NAME:key=value[,key=value], e.g. lr1e-4:lr_dense=1e-4")
    out: dict[str, Any] = {}
    for item in body.split(","):
        key, _, raw = item.partition("=")
        key = key.strip()
        if key not in ("lr_dense", "lr_sparse", "lr_warmup_steps", "lr_cooldown_steps", "steps"):
            raise SystemExit(f"--add {spec!r}: {key!r} is not one of lr_dense, lr_sparse, lr_warmup_steps,"
                             " lr_cooldown_steps, steps")
        out[key] = int(raw) if key in ("lr_warmup_steps", "lr_cooldown_steps", "steps") else float(raw)
    return name, out


def bar_verdict(rows: list[dict[str, Any]], study: str) -> dict[str, Any]:
    """Whether ``study``'s ``study``-variant rows pass the bar: every seed NE <= 0.97, spread < 0.01."""
    mine = [r for r in rows if r["study"] == study and r["variant"] == "study" and r.get("twin") is None]
    ne = [r.get("eval_ne") for r in mine]
    if not mine or any(r.get("status") != "ok" or ne_ is None or not math.isfinite(ne_) for r, ne_ in zip(mine, ne)):
        why = "; ".join(f"seed {r['seed']}: {r.get('status')} {r.get('error', '')[:120]}".strip() for r in mine)
        return {"study": study, "passed": False, "reason": f"not every seed ran: {why or 'no runs'}"}
    spread = max(ne) - min(ne)
    passed = max(ne) <= NE_BAR and spread < SPREAD_BAR and len(ne) >= 2
    reason = (f"NE {', '.join(f'{x:.4f}' for x in ne)} (bar <= {NE_BAR}), spread {spread:.4f} (bar < {SPREAD_BAR})"
              + ("" if len(ne) >= 2 else "; needs two seeds"))
    return {"study": study, "passed": passed, "reason": reason, "ne": ne, "spread": spread}


def noise_floors(rows: list[dict[str, Any]], budgets: dict[str, float]) -> list[dict[str, Any]]:
    """Each (study, variant) with twin rows: its twins' relative log loss seed by seed, the floor
    (the largest |rel_logloss_pct|, as the study's ``paired_noise_floor``) and whether it is below
    the study's budget (``budgets``: study -> objective.budget_pct). A twin that did not run makes
    the floor unknown (``None``): not below the budget."""
    from loka_tune.tuner.baseline import paired_noise_floor

    out: list[dict[str, Any]] = []
    keys = dict.fromkeys((r["study"], r["variant"]) for r in rows if r.get("twin") is not None)
    for study, variant in keys:
        twins = [r for r in rows if r["study"] == study and r["variant"] == variant and r.get("twin") is not None]
        pct = [r.get("rel_logloss_pct") for r in twins]
        known = [float(x) for x in pct if x is not None and math.isfinite(x)]
        floor = paired_noise_floor(known) if known and len(known) == len(pct) else None
        budget = budgets.get(study)
        by_seed: dict[str, list[float | None]] = {}
        for r in twins:
            by_seed.setdefault(str(r["seed"]), []).append(r.get("rel_logloss_pct"))
        out.append({"study": study, "variant": variant, "twins_pct": by_seed, "floor_pct": floor,
                    "budget_pct": budget, "n_twins": len(twins), "n_ran": len(known),
                    "below_budget": floor is not None and budget is not None and floor < budget})
    return out


def floor_line(f: dict[str, Any]) -> str:
    """One floor in words: ``"FLOOR s lr2e-4: 0.965% (seed 0: +0.062% +0.965%) vs budget 0.5%: not below"``."""
    seeds = "; ".join(f"seed {s}: " + " ".join("-" if x is None else f"{x:+.3g}%" for x in xs)
                      for s, xs in f["twins_pct"].items())
    floor = "unknown" if f["floor_pct"] is None else f"{f['floor_pct']:.3g}%"
    verdict = "below" if f["below_budget"] else "not below"
    return f"FLOOR {f['study']} {f['variant']}: {floor} ({seeds}) vs budget {f['budget_pct']}%: {verdict}"


def _is_compile_error(tb: str) -> bool:
    """A failure inside torch.compile (dynamo, inductor, a fake kernel), not in the model or the data."""
    return any(k in tb for k in ("torch/_dynamo", "torch/_inductor", "CompileHealthError", "BackendCompilerFailed"))


def bar_passed_note(rows: list[dict[str, Any]], study: str) -> str:
    """" (eager: ...)" when the study's bar rows ran eagerly after a compile failure, else ""."""
    eager = [r for r in rows if r["study"] == study and r["variant"] == "study" and r.get("compiled_error")]
    return f" (ran eagerly: the compiled run failed with {eager[0]['compiled_error'][:120]})" if eager else ""


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    head = (f"{'study':<20} {'variant':<12} {'seed':>4} {'eval NE':>8} {'AUC':>7} {'train':>7} {'max@20':>7}"
            f" {'lr_d':>7} {'warm':>4} {'comp':>4} {'sec':>6} {'twin':>4} {'rel%':>8}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        status = r.get("status", "?") + (f": {r['error'][:90]}" if r.get("error") else "")
        lines.append(f"{r['study']:<20} {r['variant']:<12} {r['seed']:>4} {f(r.get('eval_ne'), '.4f'):>8}"
                     f" {f(r.get('eval_auc'), '.4f'):>7} {f(r.get('train_logloss'), '.4f'):>7}"
                     f" {f(r.get('max_loss_first20'), '.3f'):>7} {f(r.get('lr_dense'), '.0e'):>7}"
                     f" {f(r.get('lr_warmup_steps'), 'd'):>4} {('yes' if r.get('compiled') else 'no'):>4}"
                     f" {f(r.get('seconds'), '.1f'):>6} {f(r.get('twin'), 'd'):>4}"
                     f" {f(r.get('rel_logloss_pct'), '+.3f'):>8}  {status}")
    return "\n".join(lines)


def run_one(cfg: Any, source: Any, seed: int, changes: dict[str, Any], device: str, *, steps: int | None,
            batch: int | None, compile_: bool | None, twin: int | None = None) -> tuple[dict[str, Any], Any]:
    """One bf16 baseline run of the study, as the tuner's run_baseline makes it, with ``changes``;
    with ``twin`` (0-based) its noise twin of that number, as the tuner's noise twins are made."""
    from loka_tune.applier import apply
    from loka_tune.config import PrecisionConfig
    from loka_tune.tuner.baseline import perturb_weights
    from loka_tune.tuner.build import make_model, run_train, train_config

    tcfg = train_config(cfg, seed, device=device)  # [training] in the study's [regime]
    over = dict(changes)
    if steps is not None:
        over["steps"] = steps
    if batch is not None:
        over["batch_size"] = batch
    if compile_ is not None:
        over["compile"] = compile_
    if over:
        n = over.get("steps", tcfg.steps)
        tcfg = replace(tcfg, **over, window=min(tcfg.window, n), warmup_steps=min(tcfg.warmup_steps, n - 1),
                       log_every=min(tcfg.log_every, n))
    model = make_model(cfg, source, seed=seed)
    if twin is not None:
        model = perturb_weights(model, seed, twin=twin)
    apply(model, PrecisionConfig())  # bf16 (the baseline's config: no Mods, no FP8)
    res = run_train(model, source, tcfg)
    del model
    return {"lr_dense": tcfg.lr_dense, "lr_sparse": tcfg.lr_sparse, "lr_warmup_steps": tcfg.lr_warmup_steps,
            "lr_cooldown_steps": tcfg.lr_cooldown_steps,
            "steps": tcfg.steps, "batch_size": tcfg.batch_size, "compiled": tcfg.compile,
            "autocast": tcfg.autocast}, res


def _run_row(row: dict[str, Any], cfg: Any, source: Any, seed: int, changes: dict[str, Any], args: Any,
             attempts: list[bool | None], twin: int | None, compile_broken: dict[str, str], label: str) -> None:
    """One run into ``row``: compiled first, then eagerly when ``attempts`` allows (--eager-fallback);
    a failure is recorded in the row (and a compile failure in ``compile_broken``), never raised."""
    for compile_ in attempts:
        t0 = time.perf_counter()
        try:
            info, res = run_one(cfg, source, seed, changes, args.device, steps=args.steps,
                                batch=args.batch, compile_=compile_, twin=twin)
            losses = list(res.step_losses)
            row.update(info, status=res.status, eval_ne=res.eval_ne, eval_auc=res.eval_auc,
                       eval_logloss=res.eval_logloss, train_logloss=res.train_logloss,
                       max_loss_first20=max(losses[:20]) if losses else None,
                       loss_curve=list(res.loss_curve), curve_steps=list(res.curve_steps),
                       step_time_s=res.step_time_s, seconds=time.perf_counter() - t0,
                       base_rate=getattr(source, "base_rate", None), eval_count=res.eval_count)
            row.pop("error", None)
            break
        except Exception as e:  # e.g. a compile failure: recorded, the grid goes on
            row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                       if str(e) else type(e).__name__, seconds=time.perf_counter() - t0,
                       traceback=traceback.format_exc()[-3000:])
            if compile_ is None and _is_compile_error(traceback.format_exc()):
                compile_broken[label] = row["error"]
                row["compiled_error"] = row["error"]
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--studies", default=",".join(STUDIES), help="comma list of study files")
    ap.add_argument("--variants", default="study,warmup_only,lr3e-5,old", help=f"comma list of {', '.join(VARIANTS)}"
                    " and the --add names (\"study\" always runs first)")
    ap.add_argument("--add", action="append", default=[], metavar="NAME:key=value,...",
                    help="another variant, e.g. lr1e-4:lr_dense=1e-4 (keys: lr_dense, lr_sparse, lr_warmup_steps,"
                         " lr_cooldown_steps, steps)")
    ap.add_argument("--seeds", default="", help="comma list (default: the study's training.seeds)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=None, help="override the model preset (e.g. tiny, to check the code path)")
    ap.add_argument("--steps", type=int, default=None, help="override the study's steps (code-path checks)")
    ap.add_argument("--batch", type=int, default=None, help="override the study's batch (code-path checks)")
    ap.add_argument("--eval-examples", type=int, default=None, help="override the data's eval_examples")
    ap.add_argument("--eager-fallback", action="store_true",
                    help="retry a failed compiled run eagerly (recorded with compiled: false)")
    ap.add_argument("--twins", type=int, default=0, help="noise twins after each baseline run (the study's"
                    " perturbation); each (study, variant) then gets a noise floor against the study's budget_pct")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no new run after this many seconds")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    if args.twins < 0:
        raise SystemExit(f"--twins {args.twins}: give 0 (no twins) or more")

    from loka_tune.objectives.metrics import relative_log_loss
    from loka_tune.tuner.build import make_source
    from loka_tune.tuner.study import load_study

    variants = dict(VARIANTS)
    for spec in args.add:
        name, changes = parse_add(spec)
        variants[name] = changes
    names = ["study"] + [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() != "study"]
    bad = [v for v in names if v not in variants]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {', '.join(variants)} or define one with --add")
    t_start = time.perf_counter()
    meta = {"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available()
            else platform.processor() or "cpu", "bar": {"ne_max": NE_BAR, "spread_lt": SPREAD_BAR},
            "variants": {n: variants[n] for n in names}, "twins": args.twins}
    rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    budgets: dict[str, float] = {}  # study -> its objective.budget_pct

    def dump(verdicts: list[dict[str, Any]] | None = None) -> None:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "verdicts": verdicts or [],
                                        "floors": noise_floors(rows, budgets)}, indent=1))

    studies: dict[str, tuple[Any, Any] | str] = {}
    compile_broken: dict[str, str] = {}  # study -> the error of its failed compiled run
    for path in [s.strip() for s in args.studies.split(",") if s.strip()]:
        try:
            cfg = load_study(path)
            if args.preset:
                cfg = replace(cfg, model=replace(cfg.model, preset=args.preset))
            if args.eval_examples:
                cfg = replace(cfg, data=replace(cfg.data, params={**dict(cfg.data.params),
                                                                  "eval_examples": args.eval_examples}))
            studies[path] = (cfg, None)  # the data source is made when the study's first run starts
            budgets[Path(path).stem] = float(cfg.objective.budget_pct)
        except Exception as e:  # a study that cannot load: its rows say why, the others go on
            studies[path] = f"{type(e).__name__}: {e}"

    for name in names:
        for path, entry in studies.items():
            label = Path(path).stem
            if isinstance(entry, str):
                rows.append({"study": label, "variant": name, "seed": -1, "status": "error", "error": entry})
                continue
            cfg, source = entry
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or list(cfg.training.seeds)
            for seed in seeds:
                base: dict[str, Any] | None = None  # this seed's baseline row, which its twins pair with
                for twin in [None, *range(args.twins)]:
                    row: dict[str, Any] = {"study": label, "variant": name, "seed": seed, "model": cfg.model.name,
                                           "preset": cfg.model.preset}
                    if twin is not None:
                        row["twin"] = twin + 1
                    rows.append(row)
                    if base is not None and base.get("status") != "ok":
                        row.update(status="skipped", error="its baseline did not run")
                        continue
                    if time.perf_counter() - t_start > args.budget_s:
                        row.update(status="skipped", error=f"over --budget-s {args.budget_s:g}")
                        continue
                    attempts: list[bool | None] = [None, False] if args.eager_fallback else [None]
                    if label in compile_broken:  # its compile failed once: do not pay for failing again
                        if not args.eager_fallback:
                            row.update(status="skipped",
                                       error=f"its compiled run failed before: {compile_broken[label]}")
                            continue
                        attempts = [False]
                        row["compiled_error"] = compile_broken[label]
                    if source is None:  # once per study, outside the runs' seconds
                        try:
                            t_src = time.perf_counter()
                            source = make_source(cfg)
                            studies[path] = (cfg, source)
                            meta.setdefault("source_s", {})[label] = time.perf_counter() - t_src
                        except Exception as e:
                            row.update(status="error", error=f"data source: {type(e).__name__}: {e}"[:300])
                            studies[path] = row["error"]
                            break
                    _run_row(row, cfg, source, seed, variants[name], args, attempts, twin, compile_broken, label)
                    if twin is None:
                        base = row
                    elif row.get("status") == "ok" and base is not None:
                        row["rel_logloss_pct"] = relative_log_loss(row["eval_logloss"], base["eval_logloss"]) * 100
                    print(table([row]).splitlines()[-1], flush=True)
                    dump()
                if isinstance(studies[path], str):  # its data source failed: no more seeds
                    break

    verdicts = [bar_verdict(rows, Path(p).stem) for p in studies]
    floors = noise_floors(rows, budgets)
    for v in verdicts:  # with twins, the study's own rates must also keep its floor below its budget
        mine = [f for f in floors if f["study"] == v["study"] and f["variant"] == "study"]
        if args.twins and mine:
            v["floor_pct"], v["below_budget"] = mine[0]["floor_pct"], mine[0]["below_budget"]
            v["passed"] = bool(v["passed"] and mine[0]["below_budget"])
            v["reason"] += f"; noise floor {floor_line(mine[0]).split(': ', 1)[1]}"
    dump(verdicts)
    print("\n" + table(rows))
    for f in floors:
        print(floor_line(f))
    for v in verdicts:
        print(f"{'PASS' if v['passed'] else 'MISS'} {v['study']}: {v['reason']}{bar_passed_note(rows, v['study'])}")
    print(f"wall {time.perf_counter() - t_start:.0f}s; results in {args.out}")
    return 0 if verdicts and all(v["passed"] for v in verdicts) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
