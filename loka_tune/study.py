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

    [training]                   # the short paired runs (see loka_tune.objectives.trainer.TrainConfig)
    steps = 60
    batch_size = 256
    lr_dense = 1e-3
    lr_sparse = 1e-2
    seeds = [0, 1, 2]            # baseline seeds (2-3): the noise floor; trials pair with seeds[0]
    eval_batches = 8
    window = 10
    device = "auto"

    [objective]
    kind = "train_step"          # or "inference" (forward only)
    budget_pct = 0.5             # max relative log loss vs the bf16 baseline, in percent
    speed = "auto"               # "measured" (CUDA), "modeled" (cost model) or "auto"
    cost_device = "h200"         # target device of the cost model
    cost_batch_size = 65536      # batch size the modeled step time is computed at (default: training's)
    non_gemm_fraction = 0.3      # modeled share of non-GEMM work in the bf16 step

    [space]
    formats = ["e4m3", "e5m2"]
    granularities = ["tensor", "row", "block"]
    backends = ["emulated"]
    roundings = ["exact"]        # scale rounding: "exact" and/or "pow2"
    mods = ["no_bias", "blocknorm", "hardswish"]
    per_role = true              # choose fwd / dgrad / wgrad separately
    align = 16                   # FP8 only where K and N are multiples of this
    min_dim = 16                 # ... and at least this big

    [probe]
    enabled = true               # false: no probe run, no pruning, no Dispatch plan (the unpruned space)
    max_error = 0.2              # MERE above this = unsafe
    min_speedup = 1.0            # candidates not faster than bf16 by this factor are dropped
    samples = 32
    every = 10

    [trials]
    n_trials = 20                # and/or
    timeout_s = 600
    pruner = "hopeless"          # "hopeless", "median" or "none"
    n_startup_trials = 8         # random trials before TPE models the results
    enqueue_starts = true        # first trials: all-bf16, the Dispatch plan, all-FP8 at the fastest safe
                                 # choices; false leaves every trial to the sampler

    [storage]
    url = ""                     # default sqlite:///<output_dir>/optuna.db; postgresql://... for many machines

    [tracking]
    enabled = "auto"             # true, false or "auto" (on when mlflow imports)
    uri = ""                     # default sqlite:///<output_dir>/mlflow.db; or http://server:5000
    experiment = "loka-tune"
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from loka_tune.config import Format, Granularity
from loka_tune.errors import ConfigError

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
    "MOD_NAMES",
]

MOD_NAMES = ("no_bias", "blocknorm", "hardswish", "pad", "fuse_epilogue")  # the Mods the sampler may switch on
OBJECTIVES = ("train_step", "inference")
SPEED_SOURCES = ("auto", "measured", "modeled")
PRUNERS = ("hopeless", "median", "none")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FUNC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function


# ---------------------------------------------------------------------------------------------
# a tiny validating reader of one TOML table


class _Table:
    """Reads typed keys of one TOML table, remembering which were read; ``done()`` rejects the rest."""

    def __init__(self, data: Any, prefix: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"got {data!r}; expected a table [{prefix}]", key=prefix)
        self.data = dict(data)
        self.prefix = prefix
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def string(self, name: str, default: str | None = None, *, choices: tuple[str, ...] | None = None,
               required: bool = False) -> str | None:
        v = self.get(name, default)
        if v is None:
            if required:
                typo = difflib.get_close_matches(name, [k for k in self.data if k not in self.seen], n=1)
                if typo:
                    raise ConfigError(f"unknown key {typo[0]!r} in [{self.prefix}]; did you mean {name!r}?",
                                      key=self.key(typo[0]))
                raise ConfigError(f"missing; add {name} = \"...\" to [{self.prefix}]", key=self.key(name))
            return None
        if not isinstance(v, str):
            raise ConfigError(f"got {v!r}; expected a string", key=self.key(name))
        if choices is not None and v not in choices:
            raise ConfigError(f"got {v!r}; choose one of {', '.join(map(repr, choices))}", key=self.key(name))
        return v

    def integer(self, name: str, default: int | None, *, minimum: int | None = None,
                allow_none: bool = False) -> int | None:
        v = self.get(name, default)
        if v is None and (allow_none or default is None):
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"got {v!r}; expected an integer", key=self.key(name))
        if minimum is not None and v < minimum:
            raise ConfigError(f"got {v!r}; expected an integer >= {minimum}", key=self.key(name))
        return v

    def number(self, name: str, default: float | None, *, minimum: float | None = None,
               maximum: float | None = None, strict_min: bool = False) -> float | None:
        v = self.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"got {v!r}; expected a finite number", key=self.key(name))
        if minimum is not None and (v < minimum or (strict_min and v == minimum)):
            op = ">" if strict_min else ">="
            raise ConfigError(f"got {v!r}; expected a number {op} {minimum}", key=self.key(name))
        if maximum is not None and v > maximum:
            raise ConfigError(f"got {v!r}; expected a number <= {maximum}", key=self.key(name))
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise ConfigError(f"got {v!r}; expected true or false", key=self.key(name))
        return v

    def str_list(self, name: str, default: tuple[str, ...], *, choices: tuple[str, ...] | None = None,
                 allow_empty: bool = False) -> tuple[str, ...]:
        v = self.get(name, list(default))
        if isinstance(v, str) or not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"got {v!r}; expected a list of strings such as {list(default)!r}",
                              key=self.key(name))
        if not v and not allow_empty:
            raise ConfigError("got an empty list; give at least one entry", key=self.key(name))
        if choices is not None:
            bad = [x for x in v if x not in choices]
            if bad:
                raise ConfigError(f"got {bad!r}; each entry must be one of {', '.join(map(repr, choices))}",
                                  key=self.key(name))
        if len(set(v)) != len(v):
            raise ConfigError(f"got {v!r}; an entry is repeated", key=self.key(name))
        return tuple(v)

    def table(self, name: str) -> dict[str, Any]:
        v = self.get(name, {})
        if not isinstance(v, Mapping):
            raise ConfigError(f"got {v!r}; expected a table [{self.prefix}.{name}]", key=self.key(name))
        return dict(v)

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.seen]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, sorted(self.seen), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown key {k!r} in [{self.prefix}]{hint} (valid keys: {', '.join(sorted(self.seen))})",
                key=self.key(k),
            )


# ---------------------------------------------------------------------------------------------
# the sections


@dataclass(frozen=True)
class StudySection:
    """Identity of the study and where its files go."""

    name: str
    output_dir: Path
    seed: int = 0


@dataclass(frozen=True)
class ModelSection:
    """A built-in model (``name`` + ``preset`` + ``overrides``) or a user's ``module:function``.

    A user function is called as ``function(num_dense=..., cardinalities=..., **overrides)``
    and returns an ``nn.Module`` with ``forward(dense, sparse) -> (B,) logits``.
    """

    name: str
    preset: str = "tiny"
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_function(self) -> bool:
        return ":" in self.name


@dataclass(frozen=True)
class DataSection:
    """The data source spec (``synthetic``, ``criteo:PATH``, ``avazu:PATH``, ``module:function``)
    and its keyword parameters. Relative paths are resolved against the study file's folder."""

    source: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        if self.source == "synthetic" or self.source.startswith("synthetic:"):
            return "synthetic"
        if self.source.startswith(("criteo:", "avazu:")):
            return self.source.split(":", 1)[0]
        return "function"


@dataclass(frozen=True)
class TrainingSection:
    """The short paired runs: baseline seeds and the trainer's settings."""

    steps: int = 60
    batch_size: int = 256
    lr_dense: float = 1e-3
    lr_sparse: float = 1e-2
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_batches: int | None = 8
    eval_batch_size: int | None = None
    window: int = 10
    warmup_steps: int = 5
    device: str = "auto"
    autocast: str = "auto"
    compile: bool = False

    @property
    def seed(self) -> int:
        """The seed every trial pairs with."""
        return self.seeds[0]


@dataclass(frozen=True)
class ObjectiveSection:
    """What is minimized (step time) and the constraint (relative log loss <= budget)."""

    kind: str = "train_step"
    budget_pct: float = 0.5
    speed: str = "auto"
    cost_device: str = "h200"
    cost_batch_size: int | None = None
    non_gemm_fraction: float = 0.3


@dataclass(frozen=True)
class SpaceSection:
    """The allowed search space."""

    formats: tuple[str, ...] = ("e4m3", "e5m2")
    granularities: tuple[str, ...] = ("tensor", "row", "block")
    backends: tuple[str, ...] = ("emulated",)
    roundings: tuple[str, ...] = ("exact",)
    mods: tuple[str, ...] = ()
    per_role: bool = True
    align: int = 16
    min_dim: int = 16
    blocknorm_sizes: tuple[int, ...] = (128,)
    pad_multiples: tuple[int, ...] = (16,)


@dataclass(frozen=True)
class ProbeSection:
    """Probe thresholds: which candidates survive pruning."""

    enabled: bool = True
    max_error: float = 0.2
    min_speedup: float = 1.0
    samples: int = 32
    every: int = 10


@dataclass(frozen=True)
class TrialsSection:
    """The trial budget and the pruner."""

    n_trials: int | None = 20
    timeout_s: float | None = None
    pruner: str = "hopeless"
    hopeless_factor: float = 10.0
    prune_warmup_steps: int = 0
    n_startup_trials: int = 8
    enqueue_starts: bool = True


@dataclass(frozen=True)
class StorageSection:
    """Optuna storage (``url``: ``sqlite:///...`` or ``postgresql://...``) and worker heartbeats."""

    url: str
    heartbeat_s: int = 10
    grace_s: int = 30
    max_retry: int = 2


@dataclass(frozen=True)
class TrackingSection:
    """MLflow tracking: ``enabled`` is True, False or "auto" (on when mlflow can be imported)."""

    enabled: bool | str = "auto"
    uri: str = ""
    experiment: str = "loka-tune"
    plots: bool = True


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
    source_path: Path | None = None

    @property
    def name(self) -> str:
        return self.study.name

    @property
    def output_dir(self) -> Path:
        return self.study.output_dir

    @property
    def cost_batch_size(self) -> int:
        return self.objective.cost_batch_size or self.training.batch_size

    def with_overrides(self, **sections: Any) -> "StudyConfig":
        """A copy with whole sections replaced (``with_overrides(trials=TrialsSection(...))``)."""
        return replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (for MLflow params and provenance)."""
        from dataclasses import asdict

        d = asdict(self)
        d["study"]["output_dir"] = str(self.study.output_dir)
        d["source_path"] = None if self.source_path is None else str(self.source_path)
        return d


# ---------------------------------------------------------------------------------------------
# parsing

_SECTIONS = ("study", "model", "data", "training", "objective", "space", "probe", "trials",
             "storage", "tracking")


def _json_scalar_tree(v: Any, key: str) -> Any:
    """Overrides and params must be plain TOML values (no dates: they do not serialize)."""
    if isinstance(v, Mapping):
        return {str(k): _json_scalar_tree(x, f"{key}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_json_scalar_tree(x, f"{key}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, (str, int, float, bool)):
        return v
    raise ConfigError(f"got {v!r} ({type(v).__name__}); use strings, numbers, booleans, lists or tables",
                      key=key)


def _resolve_path(p: str, base: Path | None) -> str:
    p = os.path.expanduser(os.path.expandvars(p))
    if base is not None and not os.path.isabs(p):
        p = str((base / p).resolve())
    return p


def parse_study(doc: Mapping[str, Any], *, base_dir: Path | None = None, source_path: Path | None = None,
                cwd: Path | None = None) -> StudyConfig:
    """Validate a parsed TOML document into a :class:`StudyConfig`.

    ``base_dir`` (the study file's folder) anchors relative data paths; ``cwd`` (default: the
    working directory) anchors a relative ``study.output_dir``.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"got {type(doc).__name__}; a study is a TOML document", key="(top level)")
    unknown = [k for k in doc if k not in _SECTIONS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, _SECTIONS, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        raise ConfigError(f"unknown section [{k}]{hint} (valid sections: {', '.join(_SECTIONS)})", key=k)
    cwd = Path.cwd() if cwd is None else Path(cwd)

    # [study]
    t = _Table(doc.get("study", {}), "study")
    default_name = source_path.stem if source_path is not None else None
    name = t.string("name", default_name, required=True)
    if not _NAME_RE.match(name):
        raise ConfigError(f"got {name!r}; use letters, digits, '_', '-' and '.' (e.g. 'dlrm_fp8')",
                          key="study.name")
    out = t.string("output_dir", f"runs/{name}")
    if not out:
        raise ConfigError("got an empty string; give a folder such as 'runs/my_study'", key="study.output_dir")
    out_path = Path(os.path.expanduser(out))
    out_path = (out_path if out_path.is_absolute() else cwd / out_path).resolve()
    seed = t.integer("seed", 0, minimum=0)
    t.done()
    study = StudySection(name, out_path, seed)

    # [model]
    if "model" not in doc:
        raise ConfigError("missing section; add [model] with name = \"dlrm\" (or \"package.module:function\")",
                          key="model")
    t = _Table(doc["model"], "model")
    mname = t.string("name", required=True)
    preset = t.string("preset", "tiny")
    overrides = _json_scalar_tree(t.table("overrides"), "model.overrides")
    t.done()
    if ":" in mname:
        if not _FUNC_RE.match(mname):
            raise ConfigError(f"got {mname!r}; a user model is 'package.module:function'", key="model.name")
        if t.has("preset"):
            raise ConfigError(f"got preset={preset!r} with a user function {mname!r}: presets are for built-in"
                              " models; pass settings in [model.overrides] instead", key="model.preset")
    else:
        from loka_tune.models import model_names, PRESETS

        if mname not in model_names():
            raise ConfigError(f"got {mname!r}; choose a built-in model ({', '.join(model_names())}) or give"
                              " 'package.module:function'", key="model.name")
        if preset not in PRESETS:
            raise ConfigError(f"got {preset!r}; choose one of {', '.join(PRESETS)}", key="model.preset")
    model = ModelSection(mname, preset, overrides)

    # [data]
    if "data" not in doc:
        raise ConfigError("missing section; add [data] with source = \"synthetic\" (or \"criteo:PATH\")",
                          key="data")
    t = _Table(doc["data"], "data")
    src = t.string("source", required=True)
    params = _json_scalar_tree(t.table("params"), "data.params")
    t.done()
    if src.startswith(("criteo:", "avazu:")):
        kind, _, path = src.partition(":")
        if not path:
            raise ConfigError(f"got {src!r}; give a path, e.g. '{kind}:data/train.tsv'", key="data.source")
        src = f"{kind}:{_resolve_path(path, base_dir)}"
    elif src == "synthetic":
        pass
    elif ":" in src and _FUNC_RE.match(src):
        pass
    else:
        raise ConfigError(f"got {src!r}; use 'synthetic', 'criteo:PATH', 'avazu:PATH' or"
                          " 'package.module:function'", key="data.source")
    data = DataSection(src, params)

    # [training]
    t = _Table(doc.get("training", {}), "training")
    d = TrainingSection()
    seeds_v = t.get("seeds", list(d.seeds))
    if (not isinstance(seeds_v, list) or not seeds_v
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds_v)):
        raise ConfigError(f"got {seeds_v!r}; expected a list of 1-5 integer seeds >= 0, e.g. [0, 1, 2]",
                          key="training.seeds")
    if not 1 <= len(seeds_v) <= 5 or len(set(seeds_v)) != len(seeds_v):
        raise ConfigError(f"got {seeds_v!r}; give 1 to 5 distinct seeds (2-3 measure the noise floor)",
                          key="training.seeds")
    device = t.string("device", d.device)
    if device not in ("auto", "cpu", "cuda") and not re.match(r"^cuda:\d+$", device):
        raise ConfigError(f"got {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'", key="training.device")
    training = TrainingSection(
        steps=t.integer("steps", d.steps, minimum=1),
        batch_size=t.integer("batch_size", d.batch_size, minimum=1),
        lr_dense=t.number("lr_dense", d.lr_dense, minimum=0.0, strict_min=True),
        lr_sparse=t.number("lr_sparse", d.lr_sparse, minimum=0.0, strict_min=True),
        seeds=tuple(seeds_v),
        eval_batches=t.integer("eval_batches", d.eval_batches, minimum=1, allow_none=True),
        eval_batch_size=t.integer("eval_batch_size", None, minimum=1, allow_none=True),
        window=t.integer("window", d.window, minimum=1),
        warmup_steps=t.integer("warmup_steps", d.warmup_steps, minimum=0),
        device=device,
        autocast=t.string("autocast", d.autocast, choices=("auto", "bf16", "off")),
        compile=t.boolean("compile", d.compile),
    )
    t.done()
    if training.window > training.steps:
        raise ConfigError(f"got window={training.window} > steps={training.steps}; the loss window must fit"
                          " in the run", key="training.window")

    # [objective]
    t = _Table(doc.get("objective", {}), "objective")
    d2 = ObjectiveSection()
    objective = ObjectiveSection(
        kind=t.string("kind", d2.kind, choices=OBJECTIVES),
        budget_pct=t.number("budget_pct", d2.budget_pct, minimum=0.0, strict_min=True),
        speed=t.string("speed", d2.speed, choices=SPEED_SOURCES),
        cost_device=t.string("cost_device", d2.cost_device),
        cost_batch_size=t.integer("cost_batch_size", None, minimum=1, allow_none=True),
        non_gemm_fraction=t.number("non_gemm_fraction", d2.non_gemm_fraction, minimum=0.0, maximum=0.95),
    )
    t.done()
    _check_cost_device(objective.cost_device)

    # [space]
    t = _Table(doc.get("space", {}), "space")
    d3 = SpaceSection()
    fmts = t.str_list("formats", d3.formats, choices=tuple(f.value for f in Format if f != Format.BF16))
    grans = t.str_list("granularities", d3.granularities,
                       choices=tuple(g.value for g in Granularity if g != Granularity.NONE))
    backends = t.str_list("backends", d3.backends)
    for b in backends:
        if not re.match(r"^[a-z][a-z0-9_]*$", b):
            raise ConfigError(f"got {b!r}; a backend name is lower-case letters, digits and '_'",
                              key="space.backends")
    mods = t.str_list("mods", d3.mods, choices=MOD_NAMES, allow_empty=True)
    if "fuse_epilogue" in mods and not {"blocknorm", "hardswish"} <= set(mods):
        raise ConfigError(f"got {list(mods)!r}: 'fuse_epilogue' fuses Linear -> BlockNorm -> Hard Swish chains,"
                          " which exist only with the blocknorm and hardswish Mods on; add 'blocknorm' and"
                          " 'hardswish' to space.mods (or drop 'fuse_epilogue')", key="space.mods")
    bn = t.get("blocknorm_sizes", list(d3.blocknorm_sizes))
    pm = t.get("pad_multiples", list(d3.pad_multiples))
    for k, v in (("blocknorm_sizes", bn), ("pad_multiples", pm)):
        if (not isinstance(v, list) or not v
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
            raise ConfigError(f"got {v!r}; expected a non-empty list of positive integers", key=f"space.{k}")
    space = SpaceSection(
        formats=fmts, granularities=grans, backends=backends, mods=mods,
        roundings=t.str_list("roundings", d3.roundings, choices=("exact", "pow2")),
        per_role=t.boolean("per_role", d3.per_role),
        align=t.integer("align", d3.align, minimum=1),
        min_dim=t.integer("min_dim", d3.min_dim, minimum=1),
        blocknorm_sizes=tuple(bn), pad_multiples=tuple(pm),
    )
    t.done()
    if fmts == ("mxfp8",) and "mx" not in grans:
        raise ConfigError(f"got formats=['mxfp8'] with granularities {list(grans)!r}; mxfp8 needs 'mx':"
                          " add it to space.granularities", key="space.granularities")
    if grans == ("mx",) and "mxfp8" not in fmts:
        raise ConfigError(f"got granularities=['mx'] with formats {list(fmts)!r}; 'mx' needs 'mxfp8':"
                          " add it to space.formats", key="space.formats")

    # [probe]
    t = _Table(doc.get("probe", {}), "probe")
    d4 = ProbeSection()
    probe = ProbeSection(
        enabled=t.boolean("enabled", d4.enabled),
        max_error=t.number("max_error", d4.max_error, minimum=0.0, strict_min=True),
        min_speedup=t.number("min_speedup", d4.min_speedup, minimum=0.0),  # 0: keep every speed
        samples=t.integer("samples", d4.samples, minimum=1),
        every=t.integer("every", d4.every, minimum=1),
    )
    t.done()

    # [trials]
    t = _Table(doc.get("trials", {}), "trials")
    d5 = TrialsSection()
    n_trials = t.integer("n_trials", d5.n_trials if not t.has("timeout_s") else None, minimum=1,
                         allow_none=True)
    timeout = t.number("timeout_s", None, minimum=0.0, strict_min=True)
    trials = TrialsSection(
        n_trials=n_trials, timeout_s=timeout,
        pruner=t.string("pruner", d5.pruner, choices=PRUNERS),
        hopeless_factor=t.number("hopeless_factor", d5.hopeless_factor, minimum=1.0),
        prune_warmup_steps=t.integer("prune_warmup_steps", d5.prune_warmup_steps, minimum=0),
        n_startup_trials=t.integer("n_startup_trials", d5.n_startup_trials, minimum=0),
        enqueue_starts=t.boolean("enqueue_starts", d5.enqueue_starts),
    )
    t.done()
    if trials.n_trials is None and trials.timeout_s is None:
        raise ConfigError("neither n_trials nor timeout_s is set; give at least one (e.g. n_trials = 20)",
                          key="trials.n_trials")

    # [storage]
    t = _Table(doc.get("storage", {}), "storage")
    d6 = StorageSection(url="")
    url = t.string("url", "") or f"sqlite:///{out_path / 'optuna.db'}"
    _check_db_url(url, "storage.url")
    storage = StorageSection(
        url=url,
        heartbeat_s=t.integer("heartbeat_s", d6.heartbeat_s, minimum=1),
        grace_s=t.integer("grace_s", d6.grace_s, minimum=1),
        max_retry=t.integer("max_retry", d6.max_retry, minimum=0),
    )
    t.done()
    if storage.grace_s <= storage.heartbeat_s:
        raise ConfigError(f"got grace_s={storage.grace_s} <= heartbeat_s={storage.heartbeat_s}; a trial is"
                          " declared dead after grace_s without a heartbeat, so make it larger (e.g. 3x)",
                          key="storage.grace_s")

    # [tracking]
    t = _Table(doc.get("tracking", {}), "tracking")
    enabled = t.get("enabled", "auto")
    if enabled not in (True, False, "auto"):
        raise ConfigError(f"got {enabled!r}; use true, false or \"auto\"", key="tracking.enabled")
    turi = t.string("uri", "") or f"sqlite:///{out_path / 'mlflow.db'}"
    if not re.match(r"^(sqlite|postgresql|mysql|mssql|https?|file|databricks)(\+\w+)?:", turi):
        raise ConfigError(f"got {turi!r}; use sqlite:///PATH, http(s)://HOST:PORT, postgresql://... or"
                          " file:///PATH", key="tracking.uri")
    experiment = t.string("experiment", "loka-tune")
    if not experiment:
        raise ConfigError("got an empty string; name the MLflow experiment", key="tracking.experiment")
    tracking = TrackingSection(enabled=enabled, uri=turi, experiment=experiment,
                               plots=t.boolean("plots", True))
    t.done()

    return StudyConfig(study, model, data, training, objective, space, probe, trials, storage, tracking,
                       source_path)


def _check_db_url(url: str, key: str) -> None:
    if url.startswith("sqlite:///"):
        if url == "sqlite:///" or url.startswith("sqlite:///:memory:"):
            raise ConfigError(f"got {url!r}; an in-memory database cannot be shared or resumed; give a file"
                              " such as sqlite:///runs/study/optuna.db", key=key)
        return
    if re.match(r"^(postgresql|mysql)(\+\w+)?://", url):
        return
    raise ConfigError(f"got {url!r}; use sqlite:///PATH (one machine) or postgresql://USER@HOST:PORT/DB"
                      " (several machines)", key=key)


def _check_cost_device(name: str) -> None:
    """The cost model's device names, when the cost model is installed in this checkout."""
    try:
        from loka_tune.kernels.costmodel import DEVICES
    except ImportError:  # the cost model is checked again when used
        return
    if name not in DEVICES:
        raise ConfigError(f"got {name!r}; the cost model knows {', '.join(sorted(DEVICES))}",
                          key="objective.cost_device")


def load_study(path: str | Path, *, cwd: Path | None = None) -> StudyConfig:
    """Read and validate a study TOML file (errors name the file and the dotted key)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such study file {str(path)!r}; see studies/quickstart.toml for an example",
                          key="(file)")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}", key="(file)") from None
    return parse_study(doc, base_dir=path.resolve().parent, source_path=path.resolve(), cwd=cwd)
