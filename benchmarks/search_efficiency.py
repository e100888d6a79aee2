"""Search efficiency where the loss budget binds (issue 21, point 5): the model-based search in the
recipe space vs plain TPE over the per-GEMM space vs random search, with the same trial count.

Measure: the trials (distinct configurations evaluated; a configuration asked again is a cache
copy and does not count, as in ``loka-tune tune``) until a feasible one reaches 99% of the best
speed-up any run found; a run that never gets there enters at its trial count (censored, and
marked so). ``trials_ratio`` = the model arm's mean over seeds / plain TPE's (with TPE censored it
is an upper bound of the true ratio).

Composition is *modeled* (:class:`World`): a configuration's step time and loss are sums over its
sites, so thousands of trials cost seconds, and every arm sees the same numbers:

- sites and per-GEMM probe errors (MERE) come from a real probe report (default
  ``benchmarks/results/study_prepare_h200.json``: the H200 preparation of
  ``studies/wukong_h200.toml``, Wukong large at B = 8192, 27 sites); the per-GEMM space is the
  report's candidates pruned as a study prunes them (alignment; the report's "unsupported"
  skips; unsafe: MERE > its max_error; slow: the cost model's speed-up at B < ``--min-speedup``,
  default 1.0 as ``[probe] min_speedup``; the report's own 1.05 would drop the feature-axis sites);
- speed, "modeled": the step time is ``base_s - sum of the sites' savings``, a site's saving the sum
  of its GEMMs' cost-model savings (H200, ``t_bf16 - t_choice`` at B), ``base_s`` the bf16 GEMMs
  over (1 - NON_GEMM_FRACTION). With ``--prices FILE`` ("measured per-site prices, modeled
  composition"): ``{"site_prices": {site: {recipe value: saved seconds}}, "base_s": s, ...}``
  (``loka_tune.kernels.site_timing.price_sites``' answer on a GPU; ``--write-precs`` writes the
  shapes and values to price): a site precision that is a priced value saves its price; any other
  its GEMMs' modeled savings times the site's measured / modeled ratio (mean over its priced values);
- loss: ``relLL% = kappa * sum over FP8 GEMMs g of w_s * e_g + noise``. ``e_g`` is the probe's MERE
  where the report measured it, else the median MERE of that role; except on the feature-axis
  Linears (``rows_per_example > 1``: ``layers.*.fmb.proj`` / ``lcb.proj``, (B x 256) x 64 -> 32),
  whose FP8 wgrad reduces over B x 256 rows: ``e_g = --feature-axis-error`` (default 1.0, 8x a
  typical MERE; the probe did not measure them, so the model starts them at ``[probe]
  max_error``). That is the binding part: on those sites FP8 saves little and costs much.
  ``w_s`` ~ lognormal(0, 0.25) per site (the probe ranks sites right on average, not each one);
  noise ~ N(0, ``--noise-pct``) per configuration (seeded by its key: a configuration has one loss
  in every arm, as paired short runs do); ``kappa`` makes the configuration of every GEMM's largest
  saving cost ``--overshoot`` x the budget.

Arms (each an in-memory Optuna study with ``loka-tune tune``'s sampler, the constrained TPE of
``tuner.optuna_setup.make_sampler`` with ``n_startup_trials`` 8, unless said otherwise):

- ``model``: the recipe space (:mod:`loka_tune.space.recipe_space`, priced by the world), the
  enqueued starts (all-bf16, tensorwise@filter, rowwise@filter, dispatch), the model's proposals
  (:mod:`loka_tune.tuner.proposals`), then TPE;
- ``tpe``: plain TPE over the pruned per-GEMM space (``[space] per_gemm = true``, no starts);
- ``random``: Optuna's RandomSampler over the pruned per-GEMM space;
- ablations: ``recipe_tpe`` (recipe space + starts, no proposals), ``model_gp`` (the model arm with
  Optuna's GPSampler instead of TPE after the proposals), ``recipe_random``.

    python benchmarks/search_efficiency.py --n-trials 30 --seeds 0,1,2,3,4 --out benchmarks/results
    python benchmarks/search_efficiency.py --prices loka_tune/kernels/data/site_prices_h200.json \\
        --name search_efficiency_h200 --out benchmarks/results      # measured per-site prices
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["ARMS", "World", "build_world", "run_arm", "summarize", "run_benchmark", "to_markdown", "main"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REPORT = REPO / "benchmarks" / "results" / "study_prepare_h200.json"
BACKENDS = ("torch_scaled_mm", "fbgemm", "triton")  # studies/wukong_h200.toml's [space] backends
NON_GEMM_FRACTION = 0.3  # share of the bf16 step that is not GEMMs (the studies' objective.non_gemm_fraction)
N_STARTUP = 8  # TPE's random trials first (studies/wukong_h200.toml's [trials] n_startup_trials)
TARGET = 0.99  # "reached": a feasible speed-up of at least this fraction of the best found
MAX_COPIES = 20  # as tuner.loop.MAX_COPIES_IN_A_ROW: a sampler proposing only evaluated configs stops

#: arm -> (space, starts, proposals, sampler)
ARMS: dict[str, tuple[str, bool, bool, str]] = {
    "model": ("recipe", True, True, "tpe"),
    "tpe": ("per_gemm", False, False, "tpe"),
    "random": ("per_gemm", False, False, "random"),
    "recipe_tpe": ("recipe", True, False, "tpe"),
    "model_gp": ("recipe", True, True, "gp"),
    "recipe_random": ("recipe", False, False, "random"),
}
ARM_LABELS = {
    "model": "model-based: recipe space + starts + model proposals + TPE",
    "tpe": "plain TPE over the per-GEMM space",
    "random": "random search over the per-GEMM space",
    "recipe_tpe": "recipe space + starts + TPE (no model)",
    "model_gp": "recipe space + starts + model proposals + GPSampler",
    "recipe_random": "random search over the recipe space",
}


@dataclass
class World:
    """The modeled composition (see the module): spaces, per-GEMM savings and errors, loss scale."""

    per_gemm: Any  # SearchSpace, pruned per GEMM
    recipe: Any  # SearchSpace, recipe values priced
    report: Any  # the probe report's dict (its records: the Dispatch start)
    base_s: float
    budget_pct: float
    noise_pct: float
    kappa: float
    gemm_saving: dict[tuple[str, str, str], float]  # (site, role, choice) -> seconds saved (cost model)
    true_error: dict[tuple[str, str, str], float]  # (site, role, choice) -> e_g
    weight: dict[str, float]  # w_s
    site_prices: dict[str, dict[str, float]] | None  # measured, per site value
    ratio: dict[str, float]  # measured / modeled per site (1 when modeled)
    label: str
    max_error: float
    seed: int
    meta: dict[str, Any] = field(default_factory=dict)

    def site_saving(self, site: str, prec: Any) -> float:
        v = prec.short_str()
        if v == "bf16":
            return 0.0
        if self.site_prices is not None and v in self.site_prices.get(site, {}):
            return float(self.site_prices[site][v])
        modeled = sum(self.gemm_saving.get((site, r, prec[r].short_str()), 0.0) for r in ("fwd", "dgrad", "wgrad")
                      if not prec[r].is_bf16)
        return modeled * self.ratio.get(site, 1.0)

    def true_loss(self, config: Any) -> float:
        """relLL% without the noise."""
        total = 0.0
        for sc in self.per_gemm.sites:
            prec = config.resolve(sc.name)
            for r in ("fwd", "dgrad", "wgrad"):
                c = prec[r].short_str()
                if c != "bf16":
                    total += self.weight[sc.name] * self.true_error[(sc.name, r, c)]
        return self.kappa * total

    def evaluate(self, config: Any) -> tuple[float, float]:
        """(step seconds, measured relLL%) of a PrecisionConfig."""
        import numpy as np

        step = self.base_s - sum(self.site_saving(sc.name, config.resolve(sc.name)) for sc in self.per_gemm.sites)
        h = int.from_bytes(hashlib.sha256(f"{self.seed}:{config.key()}".encode()).digest()[:8], "little")
        noise = float(np.random.default_rng(h).normal(0.0, self.noise_pct))
        return step, self.true_loss(config) + noise


def _load_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _candidates(report: Mapping[str, Any]) -> dict[str, list[Any]]:
    from loka_tune.config import ROLES, Format, GemmChoice

    cands = [GemmChoice.parse(c) for c in report["meta"]["candidates"] if c != "bf16"]
    return {r.value: [c for c in cands if r.value != "fwd" or c.a_format != Format.E5M2] for r in ROLES}


def _per_gemm_space(report: Mapping[str, Any], batch: int, min_speedup: float) -> Any:
    """The report's candidates pruned as a study prunes them (see the module)."""
    from loka_tune.config import GemmRole
    from loka_tune.errors import UnsupportedChoiceError
    from loka_tune.kernels.costmodel import modeled_speedup
    from loka_tune.space.candidates import build_space, prune_by_probe
    from loka_tune.space.sites import Site

    sites = [Site(n, int(d["K"]), int(d["N"]), float(d["M"]) / batch) for n, d in report["meta"]["sites"].items()]
    unsupported = {(s["site"], s["role"], s["choice"]): s["reason"] for s in report.get("skipped", ())
                   if not str(s["reason"]).startswith("slow:")}

    def supports(choice: Any, role: GemmRole, device: str, shape: Any) -> str | None:
        return None  # alignment is build_space's; the backends' own limits are the report's (below)

    space = build_space(sites, _candidates(report), batch_size=batch, supports=supports)
    space = replace(space, sites=tuple(replace(sc, choices={r: tuple(c for c in ch if (sc.name, r, c) not in unsupported)
                                                            for r, ch in sc.choices.items()}) for sc in space.sites))
    dev = report["meta"].get("cost_device", "h200")

    def speedup(site: Any, role: str, cid: str) -> float:
        m, k, n = site.shape(role, batch)
        try:
            return modeled_speedup(cid, m, k, n, role, dev)
        except UnsupportedChoiceError:
            return 0.0

    return prune_by_probe(space, report["results"], max_error=float(report["max_error"]),
                          min_speedup=min_speedup, speedup=speedup)


def _gemm_savings(space: Any, batch: int, device: str) -> dict[tuple[str, str, str], float]:
    from loka_tune.errors import UnsupportedChoiceError
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    out = {}
    for sc in space.sites:
        for r, ch in sc.choices.items():
            m, k, n = sc.site.shape(r, batch)
            t0 = estimate_gemm_seconds("bf16", m, k, n, r, device)
            for c in ch[1:]:
                try:
                    out[(sc.name, r, c)] = t0 - estimate_gemm_seconds(c, m, k, n, r, device)
                except UnsupportedChoiceError:
                    out[(sc.name, r, c)] = -math.inf
    return out


def shapes_and_precs(world: World, batch: int) -> dict[str, Any]:
    """What ``price_sites`` must time for ``--prices``: per site its (M, K, N) and candidate values."""
    from loka_tune.space.recipe_space import recipe_candidates

    cands = recipe_candidates(world.per_gemm, BACKENDS, _plan(world.report))
    return {"batch_size": batch,
            "shapes": {sc.name: [sc.site.rows(batch), sc.site.in_features, sc.site.out_features]
                       for sc in cands.sites if len(sc.values) > 1},
            "precs": {sc.name: list(sc.values[1:]) for sc in cands.sites if len(sc.values) > 1}}


def _plan(report: Mapping[str, Any]) -> Any:
    from loka_tune.dispatch import build_plan

    return build_plan(dict(report), max_error=float(report["max_error"]),
                      min_speedup=max(float(report["min_speedup"]), 1.0), resolve_emulated=False)


def build_world(*, report_path: Path = DEFAULT_REPORT, prices_path: Path | None = None, batch: int = 8192,
                budget_pct: float = 0.5, overshoot: float = 3.0, noise_pct: float = 0.015,
                feature_axis_error: float = 1.0, min_speedup: float = 1.0, seed: int = 0) -> World:
    """The modeled world of the module docstring."""
    import numpy as np

    from loka_tune.config import ROLES
    from loka_tune.space.recipe_space import recipe_candidates, select_recipes

    report = _load_report(report_path)
    device = report["meta"].get("cost_device", "h200")
    space = _per_gemm_space(report, batch, min_speedup)
    gemm = _gemm_savings(space, batch, device)
    measured = {(r["site"], r["role"], r["choice"]): float(r["mere"]) for r in report["results"]
                if r.get("dist", "learned") == report["meta"]["dists"][0] and math.isfinite(float(r["mere"]))}
    median = {r.value: statistics.median(v for (_, role, _), v in measured.items() if role == r.value) for r in ROLES}
    true_error = {}
    for sc in space.sites:
        for r, ch in sc.choices.items():
            for c in ch[1:]:
                if sc.site.rows_per_example > 1:
                    true_error[(sc.name, r, c)] = feature_axis_error
                else:
                    true_error[(sc.name, r, c)] = measured.get((sc.name, r, c), median[r])
    rng = np.random.default_rng(seed)
    weight = {sc.name: float(rng.lognormal(0.0, 0.25)) for sc in space.sites}
    bf16_total = 0.0
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    for sc in space.sites:
        for r in ROLES:
            m, k, n = sc.site.shape(r, batch)
            bf16_total += estimate_gemm_seconds("bf16", m, k, n, r, device)
    base_s = bf16_total / (1.0 - NON_GEMM_FRACTION)
    site_prices = ratio = None
    label = "modeled"
    if prices_path is not None:
        data = json.loads(Path(prices_path).read_text())
        site_prices = {s: {v: float(x) for v, x in d.items()} for s, d in data["site_prices"].items()}
        base_s = float(data.get("base_s", base_s))
        label = "measured per-site prices, modeled composition"
    cands = recipe_candidates(space, BACKENDS, _plan(report))
    modeled_prices: dict[str, dict[str, float]] = {}
    from loka_tune.config import SitePrecision

    for sc in cands.sites:
        for v in sc.values[1:]:
            p = SitePrecision.parse(v)
            modeled_prices.setdefault(sc.name, {})[v] = sum(gemm.get((sc.name, r.value, p[r].short_str()), 0.0)
                                                            for r in ROLES if not p[r].is_bf16)
    ratio = {}
    if site_prices is not None:
        for s, d in site_prices.items():
            pairs = [(x, modeled_prices.get(s, {}).get(v)) for v, x in d.items()]
            rs = [x / m for x, m in pairs if m is not None and m > 0 and math.isfinite(m)]
            ratio[s] = statistics.fmean(rs) if rs else 1.0
    prices = site_prices if site_prices is not None else modeled_prices
    recipe = select_recipes(cands, prices, source="measured" if site_prices is not None else "modeled")
    world = World(space, recipe, report, base_s, budget_pct, noise_pct, 1.0, gemm, true_error, weight, site_prices,
                  ratio, label, float(report["max_error"]), seed)
    # kappa: the configuration of every GEMM's largest saving costs `overshoot` x the budget
    from loka_tune.config import PrecisionConfig

    greedy = {}
    for sc in space.sites:
        ids = []
        for r in ROLES:
            ch = [c for c in sc.choices[r.value][1:] if gemm.get((sc.name, r.value, c), -1.0) > 0]
            ids.append(max(ch, key=lambda c: gemm[(sc.name, r.value, c)]) if ch else "bf16")
        if any(i != "bf16" for i in ids):
            greedy[sc.name] = "|".join(ids)
    unit = world.true_loss(PrecisionConfig.from_sites(greedy))
    world.kappa = overshoot * budget_pct / unit
    world.meta = {"report": str(report_path), "batch_size": batch, "cost_device": device, "overshoot": overshoot,
                  "min_speedup": min_speedup,
                  "feature_axis_error": feature_axis_error, "world_seed": seed,
                  "prices": None if prices_path is None else str(prices_path),
                  "greedy_speedup": base_s / (base_s - sum(world.site_saving(s, SitePrecision.parse(v))
                                                           for s, v in greedy.items()))}
    return world


def _sampler(kind: str, seed: int) -> Any:
    import optuna

    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "gp":
        from loka_tune.tuner._sampler import TrialSeededSampler

        return TrialSeededSampler(seed, lambda s: optuna.samplers.GPSampler(seed=s, n_startup_trials=N_STARTUP))
    from loka_tune.tuner.optuna_setup import make_sampler
    from loka_tune.tuner.study import parse_study

    cfg = parse_study({"study": {"name": "search-efficiency", "seed": seed}, "model": {"name": "dlrm"},
                       "data": {"source": "synthetic"}, "trials": {"n_startup_trials": N_STARTUP}})
    return make_sampler(cfg)  # loka-tune tune's: constrained TPE, seeded per trial position


def run_arm(world: World, arm: str, seed: int, n_trials: int) -> dict[str, Any]:
    """One in-memory study of ``arm`` (sampler ``seed``) until ``n_trials`` distinct configs."""
    import optuna

    from loka_tune.space.encode import config_from_params, distributions
    from loka_tune.tuner.optuna_setup import set_constraint
    from loka_tune.tuner.proposals import enqueue_proposals
    from loka_tune.tuner.results import within_budget
    from loka_tune.tuner.starts import enqueue_mods_starts, enqueue_recipe_starts, recipe_starts

    space_kind, starts, proposals, sampler = ARMS[arm]
    space = world.recipe if space_kind == "recipe" else world.per_gemm
    dists = distributions(space)
    n_configs = math.prod(len(d.choices) for d in dists.values())
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=_sampler(sampler, seed))
    if starts:
        enqueue_mods_starts(study, space, recipe_starts(space, BACKENDS, world.report))
    seen: dict[str, tuple[float, float]] = {}
    records = []
    n_eval = copies = 0
    t0 = time.perf_counter()
    while n_eval < min(n_trials, n_configs) and copies < MAX_COPIES:
        if starts:
            enqueue_recipe_starts(study)
        if proposals:
            enqueue_proposals(study, space, budget_pct=world.budget_pct, base_s=world.base_s,
                              unmeasured_error=world.max_error, noise_pct=2 * world.noise_pct)
        trial = study.ask(fixed_distributions=dists)
        config = config_from_params(space, trial.params)
        key = config.key()
        cached = key in seen
        step, rel = seen[key] if cached else world.evaluate(config)
        seen[key] = (step, rel)
        n_eval += int(not cached)
        copies = copies + 1 if cached else 0
        feasible = within_budget(rel, world.budget_pct)
        for k, v in {"config_key": key, "rel_logloss_pct": rel, "budget_pct": world.budget_pct, "step_time_s": step,
                     "mods_step_time_s": world.base_s, "feasible": feasible, "cache_hit": cached}.items():
            trial.set_user_attr(k, v)
        set_constraint(trial, rel, world.budget_pct)
        study.tell(trial, step)
        records.append({"trial": trial.number, "evaluated": not cached, "n_evaluated": n_eval,
                        "seeded": trial.user_attrs.get("seeded"), "feasible": feasible,
                        "speedup": world.base_s / step, "rel_logloss_pct": rel,
                        "true_rel_logloss_pct": world.true_loss(config)})
    return {"arm": arm, "seed": seed, "n_trials": n_trials, "wall_s": time.perf_counter() - t0, "records": records,
            "parameters": len(dists), "configs": float(n_configs)}


def _mean(xs: Sequence[float | None]) -> float | None:
    """The mean of the runs that found one (None: none did)."""
    got = [x for x in xs if x is not None]
    return statistics.fmean(got) if got else None


def _x(v: float | None) -> str:
    return "none" if v is None else f"{v:.4f}x"


def _first(records: Sequence[Mapping[str, Any]], target: float) -> Mapping[str, Any] | None:
    return next((r for r in records if r["feasible"] and r["speedup"] >= target), None)


def summarize(runs: Sequence[Mapping[str, Any]], *, target: float = TARGET,
              budget_pct: float | None = None) -> dict[str, Any]:
    """Per run the trials to ``target`` x the best feasible speed-up of all runs; per arm the mean.
    ``budget_pct``: also each run's best speed-up whose noise-free loss is within it (a measured
    loss can pass the budget by noise alone)."""
    from loka_tune.tuner.results import within_budget

    best = max((r["speedup"] for run in runs for r in run["records"] if r["feasible"]), default=None)
    per_run = []
    for run in runs:
        recs = run["records"]
        n = max((r["n_evaluated"] for r in recs), default=0)
        feas = [r for r in recs if r["feasible"]]
        own = max(feas, key=lambda r: r["speedup"], default=None)
        hit = _first(recs, target * best) if best is not None else None
        truly = [r for r in recs if within_budget(r["true_rel_logloss_pct"], budget_pct)] if budget_pct is not None else []
        per_run.append({"arm": run["arm"], "seed": run["seed"], "n_evaluated": n,
                        "best_speedup": None if own is None else own["speedup"],
                        "best_truly_feasible_speedup": max((r["speedup"] for r in truly), default=None),
                        "best_true_rel_logloss_pct": None if own is None else own["true_rel_logloss_pct"],
                        "best_seeded": None if own is None else own["seeded"],
                        "reached": hit is not None, "trials_to_target": hit["n_evaluated"] if hit else n,
                        "reached_by": None if hit is None else hit["seeded"], "wall_s": run["wall_s"]})
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in per_run):
        rows = [r for r in per_run if r["arm"] == arm]
        ts = [r["trials_to_target"] for r in rows]
        arms[arm] = {"runs": len(rows), "reached": sum(r["reached"] for r in rows),
                     "trials_to_target_mean": statistics.fmean(ts), "trials_to_target": ts,
                     "censored": any(not r["reached"] for r in rows),
                     "best_speedup_mean": _mean([r["best_speedup"] for r in rows]),
                     "best_truly_feasible_speedup_mean": _mean([r["best_truly_feasible_speedup"] for r in rows]),
                     "wall_s_mean": statistics.fmean(r["wall_s"] for r in rows)}
    out: dict[str, Any] = {"target": target, "best_speedup": best, "per_run": per_run, "arms": arms}
    if "model" in arms and "tpe" in arms:
        m, t = arms["model"], arms["tpe"]
        out["trials_ratio"] = m["trials_to_target_mean"] / t["trials_to_target_mean"]
        out["trials_ratio_is_upper_bound"] = t["censored"] and not m["censored"]
        out["trials_ratio_note"] = ("tpe censored: its mean is a lower bound, so the ratio an upper bound"
                                    if t["censored"] else "")
    return out


def run_benchmark(world: World, *, n_trials: int, seeds: Sequence[int], arms: Sequence[str],
                  log: bool = True) -> dict[str, Any]:
    import optuna

    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        for arm in arms:
            run = run_arm(world, arm, seed, n_trials)
            if log:
                s = summarize([run])["per_run"][0]
                best = "none feasible" if s["best_speedup"] is None else f"{s['best_speedup']:.4f}x ({s['best_seeded']})"
                print(f"[search-efficiency] {arm} seed {seed}: best {best}, {s['n_evaluated']} trials,"
                      f" {run['wall_s']:.1f}s", file=sys.stderr, flush=True)
            runs.append(run)
    summary = summarize(runs, budget_pct=world.budget_pct)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.node(), "python": platform.python_version(),
            "optuna": optuna.__version__, "n_trials": n_trials, "seeds": list(seeds), "arms": list(arms),
            "composition": world.label, "base_s": world.base_s, "budget_pct": world.budget_pct,
            "noise_pct": world.noise_pct, "kappa": world.kappa, "total_wall_s": time.perf_counter() - t0,
            "per_gemm_parameters": len(_dists(world.per_gemm)), "per_gemm_configs": world.per_gemm.size(),
            "recipe_parameters": len(_dists(world.recipe)), "recipe_configs": world.recipe.size(),
            "recipe_optimum_speedup": recipe_optimum(world), **world.meta}
    return {"meta": meta, "runs": runs, "summary": summary, "trials_ratio": summary.get("trials_ratio")}


def _dists(space: Any) -> dict[str, Any]:
    from loka_tune.space.encode import distributions

    return distributions(space)


def recipe_optimum(world: World) -> float:
    """The recipe space's best speed-up within the budget by the noise-free truth (a knapsack over
    its values with the true costs: :meth:`AdditiveModel.frontier` on the world's numbers)."""
    from loka_tune.config import SitePrecision
    from loka_tune.space.model import AdditiveModel

    sites = []
    for sc in world.recipe.sites:
        err = {r: {c: world.weight[sc.name] * e for (s, rr, c), e in world.true_error.items() if s == sc.name and rr == r}
               for r in ("fwd", "dgrad", "wgrad")}
        prices = {v: world.site_saving(sc.name, SitePrecision.parse(v)) for v in sc.values}
        sites.append(replace(sc, error=err, prices=prices))
    truth = AdditiveModel(replace(world.recipe, sites=tuple(sites)), alpha=world.kappa, unmeasured_error=0.0)
    point = truth.frontier(world.budget_pct)
    return world.base_s / (world.base_s - truth.saving(point))


def to_markdown(result: Mapping[str, Any], command: str | None = None) -> str:
    m, s = result["meta"], result["summary"]
    lines = [f"## Search efficiency where the budget binds (issue 21, point 5): {m['composition']}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"Date {m['date']}; {m['machine']}; Python {m['python']}, optuna {m['optuna']}; {m['total_wall_s']:.0f} s.",
              "",
              f"World: {m['report']} (B = {m['batch_size']}, cost model {m['cost_device']}); budget {m['budget_pct']}%,"
              f" noise sd {m['noise_pct']}% per config, kappa {m['kappa']:.4g}%/MERE (every GEMM's largest saving costs"
              f" {m['overshoot']} x the budget, speed-up {m['greedy_speedup']:.4f}x); feature-axis FP8 error"
              f" {m['feature_axis_error']}; base step {m['base_s'] * 1e3:.4g} ms. Per-GEMM space: {m['per_gemm_parameters']}"
              f" parameters, {m['per_gemm_configs']:.3g} configs; recipe space: {m['recipe_parameters']} parameters,"
              f" {m['recipe_configs']:.3g} configs, its optimum within the budget (noise-free)"
              f" {m['recipe_optimum_speedup']:.4f}x.", "",
              f"{m['n_trials']} trials per run (distinct configs), sampler seeds {m['seeds']}. Best feasible speed-up of"
              f" any run: **{s['best_speedup']:.4f}x**; target {s['target']:.0%} of it.", "",
              "| arm | reached target | trials to target (mean; per seed) | mean best speed-up (feasible as"
              " measured; runs that found one) | ... within the budget by the noise-free loss |", "|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        lb = ">= " if a["censored"] else ""
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | {a['reached']}/{a['runs']} | {lb}{a['trials_to_target_mean']:.1f};"
                     f" {a['trials_to_target']} | {_x(a['best_speedup_mean'])} | {_x(a['best_truly_feasible_speedup_mean'])} |")
    if s.get("trials_ratio") is not None:
        lines += ["", f"**trials_ratio** (model / plain TPE) = {s['trials_ratio']:.3f}"
                  + (f" ({s['trials_ratio_note']})" if s.get("trials_ratio_note") else "")
                  + f"; target <= 1/3: {'MET' if s['trials_ratio'] <= 1 / 3 else 'NOT MET'}."]
    lines += ["", "Per run:", "", "| arm | seed | trials | best speed-up (its true relLL%) | found by | trials to target |"
              " reached by |", "|---|---|---|---|---|---|---|"]
    for r in s["per_run"]:
        tt = r["trials_to_target"] if r["reached"] else f"> {r['trials_to_target']} (censored)"
        best = "-" if r["best_speedup"] is None else f"{r['best_speedup']:.4f}x ({r['best_true_rel_logloss_pct']:+.3f})"
        lines.append(f"| {r['arm']} | {r['seed']} | {r['n_evaluated']} | {best} | {r['best_seeded'] or 'sampler'} | {tt} |"
                     f" {r['reached_by'] or ('sampler' if r['reached'] else '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, default=DEFAULT_REPORT, help="the probe report (sites, errors)")
    ap.add_argument("--prices", type=Path, default=None, help="measured per-site prices (JSON, see above)")
    ap.add_argument("--write-precs", type=Path, default=None,
                    help="write the shapes and values --prices must price (for price_sites on a GPU) and exit")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--n-trials", type=int, default=30)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--arms", default="model,tpe,random", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--budget-pct", type=float, default=0.5)
    ap.add_argument("--overshoot", type=float, default=3.0)
    ap.add_argument("--noise-pct", type=float, default=0.015)
    ap.add_argument("--feature-axis-error", type=float, default=1.0)
    ap.add_argument("--min-speedup", type=float, default=1.0,
                    help="the pruning's [probe] min_speedup (default 1.0, the study default; the report used 1.05)")
    ap.add_argument("--world-seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder for NAME.json and NAME.md")
    ap.add_argument("--name", default="search_efficiency")
    args = ap.parse_args(argv)
    world = build_world(report_path=args.report, prices_path=args.prices, batch=args.batch, budget_pct=args.budget_pct,
                        overshoot=args.overshoot, noise_pct=args.noise_pct, feature_axis_error=args.feature_axis_error,
                        min_speedup=args.min_speedup, seed=args.world_seed)
    if args.write_precs is not None:
        args.write_precs.write_text(json.dumps(shapes_and_precs(world, args.batch), indent=1) + "\n")
        print(f"wrote {args.write_precs}")
        return 0
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    result = run_benchmark(world, n_trials=args.n_trials, seeds=seeds, arms=arms)
    command = "python benchmarks/search_efficiency.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["meta"]["command"] = command
    md = to_markdown(result, command)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
