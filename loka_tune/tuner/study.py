"""Study files: a TOML description of one tuning study, validated into a frozen :class:`StudyConfig`.

A study says what to tune (model + data), how to measure quality (short paired training runs)
and speed (measured on a GPU, modeled on a CPU), under which loss budget, over which space
(formats, granularities, backends, Mods), with which trial budget, and where results go
(Optuna storage, MLflow tracking). Every key is checked: an unknown key (a typo) or a bad
value raises :class:`~loka_tune.errors.ConfigError` whose ``key`` is the dotted path
(``"training.steps"``) and whose message quotes the value and names the fix.

Layout (every section but ``[model]`` and ``[data]`` is optional)::

    [study]
    name = "quickstart"          # the Optuna study name and the MLflow experiment's run name
    output_dir = "runs/quickstart"  # default runs/<name>, relative to the working directory
    seed = 0                     # the sampler's seed

    [model]
    name = "dlrm"                # a built-in model, or "package.module:function"
    preset = "tiny"              # built-in models only
    [model.overrides]            # preset entries to replace (or keyword arguments of the function)
    top_mlp = [256, 256]

    [data]
    source = "synthetic"         # "synthetic", "criteo:PATH", "avazu:PATH" or "package.module:function"
    [data.params]                # keyword arguments of the source (synthetic: num_dense, cardinalities, ...)

    [training]                   # the short paired runs: any plain field of
                                 # loka_tune.objectives.trainer.TrainConfig, with its default
    steps = 60                   # ... except the run's length: steps, eval_batches, window
    batch_size = 256
    lr_dense = 1e-3
    lr_sparse = 1e-2
    seeds = [0, 1, 2]            # baseline seeds (2-3); trials pair with seeds[0], confirmation with each
    eval_batches = 8
    window = 10
    device = "auto"              # "auto", "cpu", "cuda" or "cuda:N"

    [objective]
    kind = "train_step"          # or "inference" (forward only)
    budget_pct = 0.5             # max relative log loss vs the bf16 baseline, in percent
    speed = "auto"               # "measured" (CUDA), "modeled" (cost model) or "auto"
    cost_device = "h200"         # target device of the cost model
    cost_batch_size = 65536      # batch size the modeled step time is computed at (default: training's)
    non_gemm_fraction = 0.3      # modeled share of non-GEMM work in the bf16 step
    noise_twins = 1              # per baseline seed: bf16 runs from perturbed init, the paired noise floor

    [space]
    formats = ["e4m3", "e5m2"]
    granularities = ["tensor", "row", "block"]
    backends = ["emulated"]
    roundings = ["exact"]        # scale rounding: "exact" and/or "pow2"
    mods = ["no_bias", "blocknorm", "hardswish"]
    per_gemm = false             # false: per site one of a few whole-site recipes (bf16, tensorwise, rowwise,
                                 # rowwise with a bf16 wgrad, Dispatch's per-GEMM choice), priced per site;
                                 # true: per site x GEMM every choice the probe kept (for experts)
    per_role = true              # per_gemm = true only: choose fwd / dgrad / wgrad separately (false: tied);
                                 # a file that sets per_role without per_gemm gets the per-GEMM space
    align = 16                   # FP8 only where K and N are multiples of this
    min_dim = 16                 # ... and at least this big

    [probe]
    enabled = true               # false: no probe run, no pruning, no Dispatch plan (the unpruned space)
    max_error = 0.2              # MERE above this = unsafe
    min_speedup = 1.0            # candidates not faster than bf16 by this factor are dropped
    samples = 32
    every = 10
    price_first = false          # true: price every candidate's speed first, measure the error of the fast only

    [trials]
    n_trials = 20                # distinct configurations evaluated (cache copies are not counted); and/or
    timeout_s = 600
    pruner = "hopeless"          # "hopeless", "median" or "none"
    n_startup_trials = 8         # random trials before TPE models the results
    enqueue_starts = true        # first trials: bf16 with no Mods and with all of [space] mods, then under
                                 # the faster feasible of the two the recipes tensorwise / rowwise on
                                 # torchao's size-filter Linears (per GEMM also torchao's own with the
                                 # torchao backend) and the Dispatch plan, then (recipe space) the additive
                                 # model's proposals; false leaves every trial to the sampler

    [storage]
    url = ""                     # default sqlite:///<output_dir>/optuna.db; postgresql://... for many machines

    [tracking]
    enabled = "auto"             # true, false or "auto" (on when mlflow imports)
    uri = ""                     # default sqlite:///<output_dir>/mlflow.db; or http://server:5000
    experiment = "loka-tune"

    [regime]                     # how the config will train in production: every timed run uses it
    compile = "auto"             # "auto" (compiled on CUDA, eager on a CPU), true or false
    cuda_graphs = false          # one CUDA graph per step (CUDA only)
    batch_size = 0               # the production batch (0: training.batch_size)
    autocast = ""                # "" = training.autocast
    nproc = 1                    # processes (GPUs) per training run, data-parallel at the same global batch

    [confirm]                    # after the search: the best n_best feasible configs re-run on 2+ seeds
    enabled = true
    n_best = 3
    seeds = []                   # default: training.seeds
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loka_tune._toml import Table
from loka_tune.errors import ConfigError
from loka_tune.tuner.regime import RegimeSection
from loka_tune.tuner.sections import (
    MOD_NAMES,
    ConfirmSection,
    DataSection,
    ModelSection,
    ObjectiveSection,
    ProbeSection,
    SpaceSection,
    StorageSection,
    StudySection,
    TrackingSection,
    TrainingSection,
    TrialsSection,
    Where,
)

__all__ = [
    "StudyConfig",
    "StudySection",
    "ModelSection",
    "DataSection",
    "TrainingSection",
    "ObjectiveSection",
    "SpaceSection",
    "ProbeSection",
    "TrialsSection",
    "StorageSection",
    "TrackingSection",
    "load_study",
    "parse_study",
    "settings_of",
    "settings_changes",
    "MOD_NAMES",
]


@dataclass(frozen=True)
class StudyConfig:
    """A whole study, validated. Build it with :func:`load_study` or :func:`parse_study`."""

    study: StudySection
    model: ModelSection
    data: DataSection
    training: TrainingSection
    objective: ObjectiveSection
    space: SpaceSection
    probe: ProbeSection
    trials: TrialsSection
    storage: StorageSection
    tracking: TrackingSection
    regime: RegimeSection = RegimeSection()
    confirm: ConfirmSection = ConfirmSection()
    source_path: Path | None = None

    @property
    def name(self) -> str:
        return self.study.name

    @property
    def output_dir(self) -> Path:
        return self.study.output_dir

    @property
    def batch_size(self) -> int:
        """The production batch size the study's runs use (``[regime]``, else ``[training]``)."""
        return self.regime.batch_size or self.training.batch_size

    @property
    def cost_batch_size(self) -> int:
        return self.objective.cost_batch_size or self.batch_size

    def with_overrides(self, **sections: Any) -> StudyConfig:
        """A copy with whole sections replaced (``with_overrides(trials=TrialsSection(...))``)."""
        return replace(self, **sections)

    def with_output_dir(self, path: str | Path) -> StudyConfig:
        """A copy whose files go to ``path`` (resolved against the working directory): the storage
        and tracking URLs move with it where they are the defaults (databases in the output dir)."""
        out, old = Path(path).resolve(), self.output_dir
        storage, tracking = self.storage, self.tracking
        if storage.url == StorageSection.default_url(old):
            storage = replace(storage, url=StorageSection.default_url(out))
        if tracking.uri == TrackingSection.default_uri(old):
            tracking = replace(tracking, uri=TrackingSection.default_uri(out))
        return replace(self, study=replace(self.study, output_dir=out), storage=storage, tracking=tracking)

    def settings(self) -> dict[str, Any]:
        """The settings a study's baseline, space and trials depend on, flat (``"training.steps"``:
        value), JSON values: what a resumed study must still have (:func:`settings_of`)."""
        return settings_of(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (for MLflow params and provenance)."""
        d = asdict(self)
        d["study"]["output_dir"] = str(self.study.output_dir)
        d["training"] = self.training.to_dict()
        if d["regime"]["nproc"] == 1:  # one process, the default: summaries (and exports) as before the key
            del d["regime"]["nproc"]
        d["source_path"] = None if self.source_path is None else str(self.source_path)
        return d


#: the sections whose settings a study's stored baseline, space and trials depend on ([regime]:
#: the trials' and baselines' step times were taken compiled or not, at its batch and process
#: count); [study] (name, output dir, sampler seed), [trials] (budget, pruner), [confirm],
#: [storage] and [tracking] may change between runs of one study
SETTINGS_SECTIONS = ("model", "data", "training", "objective", "space", "probe", "regime")
#: settings a summary leaves out at their default (so older summaries read the same)
_SUMMARY_DEFAULTS = {"regime": {"nproc": 1}}


def settings_of(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The settings (see :meth:`StudyConfig.settings`) of a study summary (``StudyConfig.to_dict()``,
    as stored in a study's attributes), flat and JSON-normalized (tuples as lists)."""
    import json

    flat = {f"{sec}.{k}": v for sec in SETTINGS_SECTIONS
            for k, v in {**(_SUMMARY_DEFAULTS.get(sec, {}) if sec in summary else {}), **(summary.get(sec) or {})}.items()}
    return json.loads(json.dumps(flat, sort_keys=True, default=str))


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for each setting present in both with another value (a key only one
    side has is a field another loka-tune version added or removed, at its default: not a change)."""
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]


# ---------------------------------------------------------------------------------------------
# parsing

_SECTIONS: dict[str, Any] = {
    "study": StudySection, "model": ModelSection, "data": DataSection, "training": TrainingSection,
    "objective": ObjectiveSection, "space": SpaceSection, "probe": ProbeSection, "trials": TrialsSection,
    "storage": StorageSection, "tracking": TrackingSection, "regime": RegimeSection, "confirm": ConfirmSection,
}
_REQUIRED = {  # sections without defaults: what the message says to add
    "model": "missing section; add [model] with name = \"dlrm\" (or \"package.module:function\")",
    "data": "missing section; add [data] with source = \"synthetic\" (or \"criteo:PATH\")",
}


def parse_study(doc: Mapping[str, Any], *, base_dir: Path | None = None, source_path: Path | None = None,
                cwd: Path | None = None) -> StudyConfig:
    """Validate a parsed TOML document into a :class:`StudyConfig`.

    ``base_dir`` (the study file's folder) anchors relative data paths; ``cwd`` (default: the
    working directory) anchors a relative ``study.output_dir``. Each section reads and checks
    its own table (``*Section.from_table``), in the order of :data:`_SECTIONS`.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"got {type(doc).__name__}; a study is a TOML document", key="(top level)")
    unknown = [k for k in doc if k not in _SECTIONS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(_SECTIONS), n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        raise ConfigError(f"unknown section [{k}]{hint} (valid sections: {', '.join(_SECTIONS)})", key=k)
    where = Where(cwd=Path.cwd() if cwd is None else Path(cwd), base_dir=base_dir, source_path=source_path)
    sections: dict[str, Any] = {}
    for name, section in _SECTIONS.items():
        if name in _REQUIRED and name not in doc:
            raise ConfigError(_REQUIRED[name], key=name)
        sections[name] = section.from_table(Table(doc.get(name, {}), name), where)
        if name == "study":
            where = replace(where, output_dir=sections[name].output_dir)
    cfg = StudyConfig(**sections, source_path=source_path)
    n = cfg.regime.nproc
    if cfg.batch_size % n:
        key = "regime.batch_size" if cfg.regime.batch_size else "training.batch_size"
        raise ConfigError(f"got a global batch of {cfg.batch_size} with [regime] nproc = {n}; the batch must split"
                          f" evenly over the processes: use a multiple of {n}", key=key)
    return cfg


def load_study(path: str | Path, *, cwd: Path | None = None) -> StudyConfig:
    """Read and validate a study TOML file (errors name the file and the dotted key)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such study file {str(path)!r}; see studies/quickstart.toml for an example")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", path=str(path)) from None
    try:
        return parse_study(doc, base_dir=path.resolve().parent, source_path=path.resolve(), cwd=cwd)
    except ConfigError as e:
        raise e.in_file(path) from None
