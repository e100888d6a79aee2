"""The enqueued starts (issue 21, point 1): bf16 under each Mods set first, then the named recipes
(tensorwise / rowwise on torchao's size-filter Linears, torchao's own, the Dispatch plan) under
the fastest feasible of those; queued once, also across a resume; none with
``enqueue_starts = false``; and a study's export never worse than its best start."""

from __future__ import annotations

from pathlib import Path

import pytest

from loka_tune.recipes import SIZE_FILTERS
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices
from loka_tune.space.encode import config_from_params
from loka_tune.space.sites import Site
from loka_tune.tuner.results import ATTR_SPACE
from loka_tune.tuner.starts import ATTR_STARTS, enqueue_mods_starts, enqueue_recipe_starts, mods_sets, recipe_starts

ROLES = ("fwd", "dgrad", "wgrad")


# ------------------------------------------------------------------ torchao's size filter, as data
@pytest.mark.parametrize("recipe,in_f,out_f,keep", [
    # tensorwise skips a Linear only when in <= 4096 and out <= 1024 at once
    ("tensorwise", 4096, 1024, False), ("tensorwise", 4112, 1024, True), ("tensorwise", 4096, 1040, True),
    ("tensorwise", 16, 4096, True), ("tensorwise", 4100, 1024, False), ("tensorwise", 1024, 4100, False),
    ("tensorwise", 2048, 1024, False),  # the large Wukong's dense_proj: torchao 0.17 leaves it in bf16
    # rowwise needs out > 2048, in > 1024 and not (in <= 2048 and out <= 4096)
    ("rowwise", 8192, 2048, False), ("rowwise", 1024, 8192, False), ("rowwise", 2048, 4096, False),
    ("rowwise", 2048, 4112, True), ("rowwise", 2064, 4096, True), ("rowwise", 2048, 2064, False), ("rowwise", 2064, 2064, True),
    ("rowwise", 8192, 8200, False),
    ("rowwise", 2048, 8192, True), ("rowwise", 16384, 4096, True), ("rowwise", 4096, 2048, False),  # Wukong's 5
])
def test_size_filter_is_torchaos_rule(recipe: str, in_f: int, out_f: int, keep: bool) -> None:
    assert SIZE_FILTERS[recipe].keeps(in_f, out_f) is keep


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_size_filter_agrees_with_the_installed_torchao(recipe: str) -> None:
    """Where torchao is installed (the GPU machine), its own ``_auto_filter_for_recipe`` keeps
    exactly the Linears our restated filter keeps, over a grid of shapes around every bound."""
    from torch import nn

    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    keep = utils._auto_filter_for_recipe(recipe, filter_fqns=[])
    dims = (16, 1008, 1024, 1040, 1408, 2032, 2048, 2064, 4080, 4096, 4112, 8192, 16384, 1000)
    wrong = [(i, o) for i in dims for o in dims
             if bool(keep(nn.Linear(i, o, bias=False, device="meta"), "x")) != SIZE_FILTERS[recipe].keeps(i, o)]
    assert not wrong, f"(in, out) where torchao's {recipe} filter differs from ours: {wrong}"


# ------------------------------------------------------------------ starts in a hand-made space
def _site(name: str, in_f: int, out_f: int, choices: tuple[str, ...]) -> SiteChoices:
    return SiteChoices(Site(name, in_f, out_f, 1.0), {r: (BF16_ID, *choices) for r in ROLES})


FP8 = ("e4m3.tensor.torch_scaled_mm", "e4m3.tensor.fbgemm", "e4m3.row.torch_scaled_mm", "e4m3.row.pow2.torch_scaled_mm",
       "e4m3.row.pow2.fa.torch_scaled_mm", "e5m2+e4m3.tensor.fbgemm", "e4m3.tensor.torchao", "e4m3.row.pow2.torchao")
SPACE = SearchSpace(sites=(
    _site("big", 8192, 8192, FP8),                      # both filters keep it
    _site("wide", 8192, 2048, FP8),                     # tensorwise keeps it, rowwise does not (out <= 2048)
    _site("small", 512, 512, FP8),                      # neither
    _site("pruned", 8192, 8192, ("e4m3.row.torch_scaled_mm",)),  # the probe left rowwise only
), mods={"mods.no_bias": (False, True), "mods.blocknorm": (None, 256, 128)})


def test_bf16_starts_are_no_mods_then_every_mod_on() -> None:
    assert mods_sets(SPACE) == [{"mods.no_bias": False, "mods.blocknorm": None},
                                {"mods.no_bias": True, "mods.blocknorm": 256}]
    assert mods_sets(SearchSpace(sites=SPACE.sites)) == [{}]  # no Mods dimension: one bf16 start


def test_recipe_starts_pick_the_filtered_sites_through_the_spaces_backends() -> None:
    starts = dict(recipe_starts(SPACE, ["fbgemm", "torch_scaled_mm", "torchao"]))
    assert list(starts) == ["tensorwise@filter", "rowwise@filter", "torchao:tensorwise@filter",
                            "torchao:rowwise@filter"]  # no probe report: no dispatch
    tw = starts["tensorwise@filter"]
    # the first backend of [space] backends that has the choice; e4m3 only (not e5m2 gradients)
    assert [tw[f"big@{r}"] for r in ROLES] == ["e4m3.tensor.fbgemm"] * 3
    assert tw["wide@fwd"] == "e4m3.tensor.fbgemm" and tw["small@fwd"] == BF16_ID
    assert [tw[f"pruned@{r}"] for r in ROLES] == [BF16_ID] * 3  # the pruned space lacks it: bf16
    rw = starts["rowwise@filter"]
    # torchao's rowwise: power-of-two scales, fast accumulation in fwd only
    assert [rw[f"big@{r}"] for r in ROLES] == ["e4m3.row.pow2.fa.torch_scaled_mm", "e4m3.row.pow2.torch_scaled_mm",
                                              "e4m3.row.pow2.torch_scaled_mm"]
    assert rw["wide@fwd"] == BF16_ID and rw["small@fwd"] == BF16_ID
    assert rw["pruned@fwd"] == "e4m3.row.torch_scaled_mm"  # the nearest the space offers
    assert starts["torchao:tensorwise@filter"]["big@wgrad"] == "e4m3.tensor.torchao"
    assert starts["torchao:rowwise@filter"]["big@dgrad"] == "e4m3.row.pow2.torchao"
    for params in starts.values():  # every Mod off: the loop sets the best bf16 + Mods start's
        assert (params["mods.no_bias"], params["mods.blocknorm"]) == (False, None)
    assert "torchao:tensorwise@filter" not in dict(recipe_starts(SPACE, ["torch_scaled_mm"]))


def test_tensorwise_fa_start_runs_fast_accumulation_in_every_gemm_where_the_space_has_it() -> None:
    fa = "e4m3.tensor.fa.torch_scaled_mm"
    space = SearchSpace(sites=(_site("big", 8192, 8192, (*FP8, fa)), _site("small", 512, 512, (*FP8, fa))),
                        mods=SPACE.mods)
    starts = dict(recipe_starts(space, ["torch_scaled_mm"]))
    assert list(starts) == ["tensorwise@filter", "tensorwise_fa@filter", "rowwise@filter"]
    assert [starts["tensorwise_fa@filter"][f"big@{r}"] for r in ROLES] == [fa] * 3
    assert [starts["tensorwise@filter"][f"big@{r}"] for r in ROLES] == [fa, *["e4m3.tensor.torch_scaled_mm"] * 2]
    assert starts["tensorwise_fa@filter"]["small@fwd"] == BF16_ID  # torchao's tensorwise filter
    # without fast accumulation in the space (SPACE) it would repeat tensorwise@filter: not a start
    assert "tensorwise_fa@filter" not in dict(recipe_starts(SPACE, ["torch_scaled_mm"]))


def test_dispatch_start_is_the_plan_in_the_space() -> None:
    rep = []  # candidate records as Dispatch reads them: the row choice is safe and fast on 'big' only
    for site, speedup in (("big", 1.5), ("wide", 0.8)):
        for role in ROLES:
            rep.append({"site": site, "role": role, "choice": "e4m3.row.torch_scaled_mm", "m": 8192, "k": 8192,
                        "n": 8192, "mere": 0.01, "speedup": speedup, "time_source": "modeled"})
    starts = dict(recipe_starts(SPACE, ["torch_scaled_mm"], rep, max_error=0.2, min_speedup=1.0))
    d = starts["dispatch"]
    assert [d[f"big@{r}"] for r in ROLES] == ["e4m3.row.torch_scaled_mm"] * 3
    assert d["wide@fwd"] == BF16_ID


def _finish(study, trial, step_s: float, feasible: bool) -> None:  # noqa: ANN001
    trial.set_user_attr("feasible", feasible)
    trial.set_user_attr("rel_logloss_pct", 0.0 if feasible else 9.0)
    trial.set_user_attr("budget_pct", 1.0)
    study.tell(trial, step_s)


def test_recipes_wait_for_the_mods_starts_then_run_once_under_the_fastest_feasible() -> None:
    import optuna

    from loka_tune.space.encode import distributions

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    dists = distributions(SPACE)
    enqueue_mods_starts(study, SPACE, recipe_starts(SPACE, ["torch_scaled_mm"]))
    assert study.user_attrs[ATTR_STARTS]["state"] == "pending"
    a = study.ask(fixed_distributions=dists)
    assert a.user_attrs["seeded"] == "all-bf16"
    assert not enqueue_recipe_starts(study)  # the other bf16 start waits in the queue: ask it
    b = study.ask(fixed_distributions=dists)
    assert b.user_attrs["seeded"] == "bf16+mods:nobias+bn256"
    assert enqueue_recipe_starts(study)  # both run (another worker's): wait rather than sample
    _finish(study, a, 1.0, True)
    assert enqueue_recipe_starts(study)
    _finish(study, b, 0.8, True)  # the faster, and feasible: its Mods
    assert not enqueue_recipe_starts(study)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["seeded"] for t in waiting] == ["tensorwise@filter", "rowwise@filter"]
    for t in waiting:
        fixed = t.system_attrs["fixed_params"]
        assert (fixed["mods.no_bias"], fixed["mods.blocknorm"]) == (True, 256)
        assert config_from_params(SPACE, fixed).mods.short_str() == "nobias+bn256"
    info = study.user_attrs[ATTR_STARTS]
    assert (info["state"], info["under"], info["under_trial"]) == ("done", "nobias+bn256", b.number)
    assert not enqueue_recipe_starts(study)  # done: a resumed run queues nothing more
    assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == 2


def test_recipes_run_without_mods_when_no_mods_start_is_feasible() -> None:
    import optuna

    from loka_tune.space.encode import distributions

    study = optuna.create_study()
    dists = distributions(SPACE)
    enqueue_mods_starts(study, SPACE, recipe_starts(SPACE, ["torch_scaled_mm"]))
    a, b = study.ask(fixed_distributions=dists), study.ask(fixed_distributions=dists)
    _finish(study, a, 1.0, True)
    _finish(study, b, 0.5, False)  # faster, but over the budget
    enqueue_recipe_starts(study)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert all(t.system_attrs["fixed_params"]["mods.no_bias"] is False for t in waiting) and waiting
    assert study.user_attrs[ATTR_STARTS]["under"] == "none"


# ------------------------------------------------------------------ a real study on the CPU
STUDY = """
[study]
name = "starts"
output_dir = "{out}"
[model]
name = "dlrm"
preset = "tiny"
[model.overrides]
embedding_dim = 8
bottom_mlp = [32]
top_mlp = [2048, 2048]       # 2048 -> 2048: torchao's tensorwise filter converts it (in > 1024), FP8 gains there
[data]
source = "synthetic"
[data.params]
num_dense = 7
cardinalities = [40, 30, 20]
eval_examples = 320
[training]
steps = 6
batch_size = 32
seeds = [0, 1]
eval_batches = 2
window = 3
device = "cpu"
[objective]
budget_pct = 50.0
speed = "modeled"
cost_batch_size = 65536
non_gemm_fraction = 0.3    # as the quickstart: the GEMMs are most of the modeled step
[space]
formats = ["e4m3"]
granularities = ["row", "tensor"]
mods = ["no_bias"]
[probe]
samples = 2
every = 3
min_speedup = 0.0
[trials]
n_trials = {n_trials}
n_startup_trials = 1
enqueue_starts = {enqueue}
[confirm]
enabled = false              # the export is the search's best (confirmation re-runs seeds: another test's)
"""


def _study_file(d: Path, *, n_trials: int, enqueue: bool = True) -> Path:
    p = d / "starts.toml"
    p.write_text(STUDY.format(out=d / "runs", n_trials=n_trials, enqueue=str(enqueue).lower()))
    return p


def _run(path: Path, **kw):  # noqa: ANN003, ANN202
    from loka_tune.tuner.loop import run_study
    from loka_tune.tuner.study import load_study

    return run_study(load_study(path), tracking=False, progress=False, **kw)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("starts")
    path = _study_file(d, n_trials=6)
    _run(path)
    return path


def _seeded(study) -> list[tuple[int, str, str]]:  # noqa: ANN001
    return [(t.number, t.state.name, t.user_attrs.get("seeded")) for t in study.get_trials(deepcopy=False)]


def test_study_runs_bf16_mods_starts_then_recipes_under_the_best_mods(tuned: Path) -> None:
    from loka_tune.tuner.results import TrialRecord

    study = _run(tuned, n_trials=0)  # reopen (0 trials: prepared already, nothing runs)
    trials = study.get_trials(deepcopy=False)
    labels = [t.user_attrs.get("seeded") for t in trials]
    assert labels[:2] == ["all-bf16", "bf16+mods:nobias"]
    info = study.user_attrs[ATTR_STARTS]
    assert info["state"] == "done"
    recipes = [label for label, _ in info["recipes"]]
    assert recipes == ["tensorwise@filter", "rowwise@filter", "dispatch"]
    # every start runs before any sampled trial; a start repeating an earlier trial's parameters
    # is not queued (here rowwise@filter: no Linear passes its filter, so it is bf16 under the Mods)
    first_sampled = next(i for i, s in enumerate(labels) if s is None)
    assert all(s is not None for s in labels[:first_sampled]) and not any(labels[first_sampled:])
    assert set(labels[2:first_sampled]) <= set(recipes) and "tensorwise@filter" in labels
    best = min((t for t in trials[:2] if TrialRecord.of(t).feasible), key=lambda t: t.value)
    best_mods = {k: v for k, v in best.params.items() if k.startswith("mods.")}
    assert info["under_trial"] == best.number
    for t in trials[2:first_sampled]:
        assert {k: v for k, v in t.params.items() if k.startswith("mods.")} == best_mods
    space = SearchSpace.from_dict(study.user_attrs[ATTR_SPACE])
    kept = {sc.name for sc in space.sites if SIZE_FILTERS["tensorwise"].keeps(sc.site.in_features, sc.site.out_features)}
    tw = next(t for t in trials if t.user_attrs.get("seeded") == "tensorwise@filter")
    fp8 = set(TrialRecord.of(tw).config["sites"])
    assert fp8 and fp8 <= kept, (fp8, kept)  # FP8 on torchao's tensorwise sites only


def test_export_is_never_worse_than_the_best_start(tuned: Path) -> None:
    from loka_tune.tuner.results import TrialRecord, export_best

    study = _run(tuned, n_trials=0)
    exported = export_best(study)
    starts = [TrialRecord.of(t) for t in study.get_trials(deepcopy=False)
              if t.user_attrs.get("seeded") and t.state.name == "COMPLETE"]
    feasible = [r.speedup for r in starts if r.feasible]
    assert len(feasible) >= 2  # bf16 with and without the Mods at least: a comparison, not a tautology of one
    assert exported.provenance["speedup"] >= max(feasible)
    assert any(r.feasible and r.speedup > 1.0 for r in starts)  # a start beats bf16: the bar is above 1.0


def test_the_leaderboard_shows_every_starts_label(tuned: Path) -> None:
    """Also a start that is a cache copy of an earlier trial (the note: "<label>, cache of N").
    MLflow: each trial run's tag ``seeded`` (tuner/tracking.py)."""
    from loka_tune.commands.report import format_leaderboard
    from loka_tune.tuner.results import leaderboard

    study = _run(tuned, n_trials=0)
    rows = leaderboard(study)
    lines = {int(x.split()[0].lstrip("*")): x for x in format_leaderboard(rows, limit=None).splitlines()[2:]
             if x.strip()[:1].isdigit()}
    for t in study.get_trials(deepcopy=False):
        label = t.user_attrs.get("seeded")
        if label and t.number in lines:
            assert label in lines[t.number], lines[t.number]
            assert {r["trial"]: r["seeded"] for r in rows}[t.number] == label
    assert any(r["seeded"] == "tensorwise@filter" for r in rows)


def test_enqueue_starts_false_queues_nothing(tmp_path: Path) -> None:
    study = _run(_study_file(tmp_path, n_trials=3, enqueue=False), n_trials=0)  # prepare only
    assert study.get_trials(deepcopy=False) == [] and ATTR_STARTS not in study.user_attrs


def test_a_resumed_study_queues_no_start_twice(tuned: Path) -> None:
    """(Last of the tests on ``tuned``: it adds trials to it.)"""
    path = tuned
    before = _seeded(_run(path, n_trials=0))
    study = _run(path, n_trials=8)  # resume: 2 more trials
    after = _seeded(study)
    assert after[:len(before)] == before
    labels = [s for _, _, s in after if s]
    assert len(labels) == len(set(labels))  # every start once
    assert not [s for _, _, s in after[len(before):] if s]  # the new trials are the sampler's
