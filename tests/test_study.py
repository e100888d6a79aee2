"""Study files: valid ones load into a frozen StudyConfig; malformed ones name the bad key."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from loka_tune.errors import ConfigError
from loka_tune.tuner.study import StudyConfig, load_study, parse_study

REPO = Path(__file__).resolve().parents[1]

MINIMAL = """
[model]
name = "dlrm"
[data]
source = "synthetic"
"""


def _write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_minimal_study_gets_defaults(tmp_path: Path) -> None:
    cfg = load_study(_write(tmp_path, MINIMAL, "mystudy.toml"), cwd=tmp_path)
    assert isinstance(cfg, StudyConfig)
    assert cfg.name == "mystudy"  # the file's stem
    assert cfg.output_dir == (tmp_path / "runs" / "mystudy").resolve()
    assert cfg.storage.url == f"sqlite:///{cfg.output_dir / 'optuna.db'}"
    assert cfg.tracking.uri == f"sqlite:///{cfg.output_dir / 'mlflow.db'}"
    assert cfg.training.seeds == (0, 1, 2) and cfg.training.seed == 0
    assert cfg.model.preset == "tiny" and not cfg.model.is_function
    assert cfg.cost_batch_size == cfg.training.batch_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.steps = 3  # type: ignore[misc]


def test_full_study_round_trip(tmp_path: Path) -> None:
    text = MINIMAL.replace('name = "dlrm"', 'name = "wukong"\npreset = "paper"\n[model.overrides]\nnum_layers = 2') + """
[study]
name = "x1"
output_dir = "out/x1"
[training]
steps = 20
window = 5
seeds = [3, 4]
device = "cpu"
[objective]
kind = "inference"
budget_pct = 0.02
cost_batch_size = 65536
[space]
formats = ["e4m3"]
granularities = ["row", "tensor"]
mods = ["no_bias", "blocknorm"]
per_role = false
[trials]
timeout_s = 60
pruner = "median"
[storage]
url = "postgresql://u@127.0.0.1:5432/db"
[tracking]
enabled = false
uri = "http://127.0.0.1:5000"
"""
    cfg = load_study(_write(tmp_path, text), cwd=tmp_path)
    assert cfg.model.name == "wukong" and cfg.model.overrides == {"num_layers": 2}
    assert cfg.output_dir == (tmp_path / "out" / "x1").resolve()
    assert cfg.training.seeds == (3, 4) and cfg.training.seed == 3
    assert cfg.objective.kind == "inference" and cfg.objective.budget_pct == 0.02
    assert cfg.cost_batch_size == 65536
    assert cfg.space.per_role is False and cfg.space.mods == ("no_bias", "blocknorm")
    assert cfg.trials.n_trials is None and cfg.trials.timeout_s == 60.0
    assert cfg.storage.url.startswith("postgresql://")
    assert cfg.tracking.enabled is False
    assert cfg.to_dict()["study"]["name"] == "x1"


def test_data_paths_resolve_against_the_study_file(tmp_path: Path) -> None:
    sub = tmp_path / "studies"
    sub.mkdir()
    p = _write(sub, MINIMAL.replace('"synthetic"', '"criteo:../data/train.tsv"'))
    cfg = load_study(p, cwd=tmp_path)
    assert cfg.data.source == f"criteo:{(tmp_path / 'data' / 'train.tsv').resolve()}"
    assert cfg.data.kind == "criteo"


def test_user_function_model_and_data(tmp_path: Path) -> None:
    text = """
    [model]
    name = "mypkg.models:build"
    [model.overrides]
    width = 64
    [data]
    source = "mypkg.data:source"
    """
    cfg = load_study(_write(tmp_path, text), cwd=tmp_path)
    assert cfg.model.is_function and cfg.model.overrides == {"width": 64}
    assert cfg.data.kind == "function"


@pytest.mark.parametrize("studies_file", sorted((REPO / "studies").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_studies_load(studies_file: Path, tmp_path: Path) -> None:
    cfg = load_study(studies_file, cwd=tmp_path)
    assert cfg.name == studies_file.stem


# (snippet appended to / replacing the minimal study, dotted key the error must name, text in the message)
MALFORMED = [
    ("[training]\nstpes = 10\n", "training.stpes", "did you mean 'steps'"),
    ("[trainig]\nsteps = 10\n", "trainig", "did you mean [training]"),
    ("[training]\nsteps = 0\n", "training.steps", ">= 1"),
    ("[training]\nsteps = \"ten\"\n", "training.steps", "'ten'"),
    ("[training]\nseeds = []\n", "training.seeds", "[]"),
    ("[training]\nseeds = [1, 1]\n", "training.seeds", "distinct"),
    ("[training]\nlr_dense = -0.1\n", "training.lr_dense", "-0.1"),
    ("[training]\ndevice = \"tpu\"\n", "training.device", "'tpu'"),
    ("[training]\nsparse_optimizer = \"sgd\"\n", "training.sparse_optimizer", "'sgd'"),  # TrainConfig's check
    ("[training]\ndeterministic = 1\n", "training.deterministic", "true, false or a string"),
    ("[training]\ndeterministic = \"always\"\n", "training.deterministic", "'always'"),
    ("[training]\ncpu_threads = 0\n", "training.cpu_threads", "0"),
    ("[training]\nseed = 3\n", "training.seed", "did you mean 'seeds'"),
    ("[training]\nsteps = 10\nwindow = 20\n", "training.window", "window=20"),
    ("[training]\nsteps = 10\nwindow = 5\nlr_warmup_steps = 20\n", "training.lr_warmup_steps", "lr_warmup_steps=20"),
    ("[training]\nlr_warmup_steps = -5\n", "training.lr_warmup_steps", "-5"),
    ("[training]\nsteps = 10\nwindow = 5\nlr_cooldown_steps = 11\n", "training.lr_cooldown_steps", "11 > steps=10"),
    ("[training]\nlr_cooldown_steps = -1\n", "training.lr_cooldown_steps", "-1"),
    ("[objective]\nbudget_pct = 0\n", "objective.budget_pct", "> 0"),
    ("[objective]\nkind = \"latency\"\n", "objective.kind", "'latency'"),
    ("[objective]\ncost_device = \"a100\"\n", "objective.cost_device", "'a100'"),
    ("[objective]\nnon_gemm_fraction = 1.5\n", "objective.non_gemm_fraction", "1.5"),
    ("[space]\nformats = [\"e4m3\", \"fp4\"]\n", "space.formats", "fp4"),
    ("[space]\ngranularities = [\"rowwise\"]\n", "space.granularities", "rowwise"),
    ("[space]\nformats = \"e4m3\"\n", "space.formats", "list of strings"),
    ("[space]\nmods = [\"nobias\"]\n", "space.mods", "nobias"),
    ("[space]\nbackends = [\"Fancy Backend\"]\n", "space.backends", "Fancy Backend"),
    ("[space]\nbackends = [\"emulated\", \"trtion\"]\n", "space.backends", "'trtion': not a backend; did you mean 'triton'?"),
    ("[space]\nbackends = [\"cublas\"]\n", "space.backends", "did you mean 'torch_scaled_mm'? Known backends: bf16, emulated"),
    ("[space]\nformats = [\"mxfp8\"]\ngranularities = [\"row\"]\n", "space.granularities", "mx"),
    ("[probe]\nmax_error = -1\n", "probe.max_error", "-1"),
    ("[trials]\nn_trials = 0\n", "trials.n_trials", ">= 1"),
    ("[trials]\npruner = \"asha\"\n", "trials.pruner", "'asha'"),
    ("[trials]\nenqueue_starts = \"no\"\n", "trials.enqueue_starts", "'no'"),
    ("[trials]\nenqueue_start = false\n", "trials.enqueue_start", "did you mean 'enqueue_starts'"),
    ("[probe]\nenabled = 0\n", "probe.enabled", "true or false"),
    ("[storage]\nurl = \"sqlite:///:memory:\"\n", "storage.url", "in-memory"),
    ("[storage]\nurl = \"redis://localhost\"\n", "storage.url", "redis://"),
    ("[storage]\nheartbeat_s = 10\ngrace_s = 5\n", "storage.grace_s", "grace_s=5"),
    ("[tracking]\nenabled = \"yes\"\n", "tracking.enabled", "'yes'"),
    ("[tracking]\nuri = \"ftp://x\"\n", "tracking.uri", "ftp://x"),
    ("[study]\nname = \"has space\"\n", "study.name", "has space"),
]


@pytest.mark.parametrize("snippet,key,text", MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_study_names_the_key(tmp_path: Path, snippet: str, key: str, text: str) -> None:
    p = _write(tmp_path, MINIMAL + snippet)
    with pytest.raises(ConfigError) as ei:
        load_study(p, cwd=tmp_path)
    assert ei.value.key == key, str(ei.value)
    assert key in str(ei.value) and text in str(ei.value)


@pytest.mark.parametrize("text,key,needle", [
    ("[data]\nsource = \"synthetic\"\n", "model", "[model]"),
    ("[model]\nname = \"dlrm\"\n", "data", "[data]"),
    ("[model]\nname = \"transformer\"\n[data]\nsource = \"synthetic\"\n", "model.name", "'transformer'"),
    ("[model]\nname = \"dlrm\"\npreset = \"huge\"\n[data]\nsource = \"synthetic\"\n", "model.preset", "'huge'"),
    ("[model]\nname = \"pkg.mod:fn\"\npreset = \"tiny\"\n[data]\nsource = \"synthetic\"\n", "model.preset",
     "overrides"),
    ("[model]\nname = \"dlrm\"\n[data]\nsource = \"csv:x.csv\"\n", "data.source", "'csv:x.csv'"),
    ("[model]\nname = \"dlrm\"\n[data]\nsource = \"criteo:\"\n", "data.source", "path"),
    ("[model]\nname = \"dlrm\"\n[data]\nsrc = \"synthetic\"\n", "data.src", "did you mean 'source'"),
])
def test_malformed_model_and_data(tmp_path: Path, text: str, key: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_study(_write(tmp_path, text), cwd=tmp_path)
    assert ei.value.key == key and needle in str(ei.value), str(ei.value)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_study(_write(tmp_path, "[model\nname="), cwd=tmp_path)
    with pytest.raises(ConfigError, match="no such study file"):
        load_study(tmp_path / "nope.toml")


def test_errors_in_a_study_file_name_the_file_and_the_key(tmp_path: Path) -> None:
    p = _write(tmp_path, MINIMAL + "[training]\nsteps = 0\n", "mine.toml")
    with pytest.raises(ConfigError) as ei:
        load_study(p, cwd=tmp_path)
    assert ei.value.key == "training.steps" and ei.value.path == str(p)
    assert str(ei.value).startswith(f"{p}: training.steps: ")


def test_parse_study_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError):
        parse_study(["not", "a", "table"])  # type: ignore[arg-type]


def test_enqueue_starts_and_probe_enabled(tmp_path: Path) -> None:
    cfg = load_study(_write(tmp_path, MINIMAL), cwd=tmp_path)
    assert cfg.trials.enqueue_starts is True and cfg.probe.enabled is True  # defaults: what tune does today
    off = load_study(_write(tmp_path, MINIMAL + "[probe]\nenabled = false\n[trials]\nenqueue_starts = false\n"),
                     cwd=tmp_path)
    assert off.trials.enqueue_starts is False and off.probe.enabled is False
    assert off.to_dict()["trials"]["enqueue_starts"] is False


# ------------------------------------------------------------------ [training] is the trainer's TrainConfig
_VALID_STR = {"device": "cpu", "autocast": "off", "sparse_optimizer": "sparse_adam"}


def _another_value(name: str, kinds: tuple[type, ...], default: object) -> object:
    """A valid value of a TrainConfig knob other than its default (where this test knows one)."""
    if name in _VALID_STR:
        return _VALID_STR[name]
    if bool in kinds:
        return not default if isinstance(default, bool) else True
    if int in kinds:
        return (default or 1) + 1  # type: ignore[operator]
    if float in kinds:
        return (default or 1.0) * 2  # type: ignore[operator]
    return default  # a string knob without a known other value: it is settable all the same


def _trainer_knobs() -> dict[str, tuple[type, ...]]:
    from loka_tune._toml import plain_fields
    from loka_tune.objectives.trainer import TrainConfig

    return plain_fields(TrainConfig, exclude=("seed",))


@pytest.mark.parametrize("name", sorted(_trainer_knobs()))
def test_every_plain_trainer_knob_is_a_training_key(tmp_path: Path, name: str) -> None:
    from loka_tune.tuner.build import train_config

    doc = {"study": {"name": "s"}, "model": {"name": "dlrm"}, "data": {"source": "synthetic"}}
    base = parse_study(doc, cwd=tmp_path)
    value = _another_value(name, _trainer_knobs()[name], getattr(base.training, name))
    cfg = parse_study({**doc, "training": {name: value}}, cwd=tmp_path)
    assert getattr(cfg.training, name) == value and getattr(cfg.training.trainer, name) == value
    assert getattr(train_config(cfg), name) == value
    assert cfg.to_dict()["training"][name] == value


def test_training_defaults_are_the_trainers_but_the_run_length(tmp_path: Path) -> None:
    import dataclasses

    from loka_tune.objectives.trainer import TrainConfig
    from loka_tune.tuner.sections import SHORT_RUN, TrainingSection

    cfg = load_study(_write(tmp_path, MINIMAL), cwd=tmp_path)
    assert cfg.training == TrainingSection() and cfg.training.trainer == TrainConfig(**SHORT_RUN)
    assert (cfg.training.steps, cfg.training.eval_batches, cfg.training.window) == (60, 8, 10)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in SHORT_RUN:
            assert getattr(cfg.training, f.name) == f.default, f.name
    with pytest.raises(AttributeError, match="no attribute 'stpes'"):
        cfg.training.stpes  # noqa: B018


@pytest.mark.parametrize("studies_file", sorted((REPO / "studies").glob("*.toml")), ids=lambda p: p.name)
def test_train_config_is_the_one_built_before_the_training_section_held_it(studies_file: Path,
                                                                          tmp_path: Path) -> None:
    from loka_tune.objectives.trainer import TrainConfig
    from loka_tune.tuner.build import train_config

    cfg = load_study(studies_file, cwd=tmp_path)
    t = cfg.training
    for seed, device in ((None, None), (7, "cpu")):
        before = TrainConfig(steps=t.steps, batch_size=t.batch_size, lr_dense=t.lr_dense, lr_sparse=t.lr_sparse,
                             seed=t.seed if seed is None else seed, eval_batches=t.eval_batches,
                             eval_batch_size=t.eval_batch_size, window=t.window, warmup_steps=t.warmup_steps,
                             device=device or t.device, autocast=t.autocast, compile=t.compile,
                             cpu_threads=t.cpu_threads,  # newer than that builder; quickstart.toml sets it
                             lr_warmup_steps=t.lr_warmup_steps,  # issue 20: the H200 studies set it
                             lr_cooldown_steps=t.lr_cooldown_steps)  # wukong_h200_b32768 sets it
        # ... then put in the study's production [regime] (issue 13): on a CPU, without a
        # [regime] table, that changes nothing
        from loka_tune.tuner.build import resolve_device

        assert train_config(cfg, seed, device=device) == cfg.regime.apply(before, resolve_device(before.device))
        if device == "cpu" and cfg.regime == type(cfg.regime)():
            assert train_config(cfg, seed, device=device) == before


def test_with_output_dir_moves_the_default_databases_only(tmp_path: Path) -> None:
    cfg = load_study(_write(tmp_path, MINIMAL, "mystudy.toml"), cwd=tmp_path)
    moved = cfg.with_output_dir(tmp_path / "elsewhere")
    out = (tmp_path / "elsewhere").resolve()
    assert moved.output_dir == out and moved.name == cfg.name
    assert moved.storage.url == f"sqlite:///{out / 'optuna.db'}"
    assert moved.tracking.uri == f"sqlite:///{out / 'mlflow.db'}"
    text = MINIMAL + '[storage]\nurl = "postgresql://u@h:5432/db"\n[tracking]\nuri = "http://h:5000"\n'
    custom = load_study(_write(tmp_path, text, "custom.toml"), cwd=tmp_path)
    kept = custom.with_output_dir(tmp_path / "elsewhere")
    assert (kept.storage.url, kept.tracking.uri) == (custom.storage.url, custom.tracking.uri)
    assert kept.output_dir == out
