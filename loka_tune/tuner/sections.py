"""The sections of a study file: one frozen dataclass per TOML table, each reading and checking
its own table (``from_table``), next to its fields and their defaults.

Each field is a key and carries its doc as data (:func:`_doc`: ``doc``; ``default`` in words
where there is none or it is computed; ``choices``, or ``"module:name"`` of them in a lower
layer; ``keys_of`` on ``TrainingSection.trainer``: its config's plain fields are the keys).
:mod:`loka_tune.tuner.schema` renders them (``docs/study-schema.md``). ``[regime]``: regime.py.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loka_tune._toml import Table, json_scalar_tree, plain_fields, read_plain, rekeyed
from loka_tune.config import Format, Granularity
from loka_tune.errors import ConfigError
from loka_tune.mods_config import check_chain_space
from loka_tune.tuner.storage import check_url_form

if TYPE_CHECKING:
    from loka_tune.objectives.trainer import TrainConfig

__all__ = ["StudySection", "ModelSection", "DataSection", "TrainingSection", "ObjectiveSection", "SpaceSection",
           "ProbeSection", "TrialsSection", "StorageSection", "TrackingSection", "ConfirmSection",
           "MOD_NAMES", "SHORT_RUN"]

MOD_NAMES = ("no_bias", "blocknorm", "hardswish", "pad", "fuse_epilogue", "fp8_chain")  # the Mods the sampler may switch on
OBJECTIVES = ("train_step", "inference")
SPEED_SOURCES = ("auto", "measured", "modeled")
PRUNERS = ("hopeless", "median", "none")
FORMATS = tuple(f.value for f in Format if f != Format.BF16)  # [space] formats: the FP8 ones
GRANULARITIES = tuple(g.value for g in Granularity if g != Granularity.NONE)
ROUNDINGS = ("exact", "pow2")
TRAINER_EXCLUDED = ("seed",)  # TrainConfig fields that are not [training] keys (seed is seeds[0])
# a study's short paired runs are shorter than TrainConfig's default run; every other trainer
# default is TrainConfig's own
SHORT_RUN: dict[str, Any] = {"steps": 60, "eval_batches": 8, "window": 10}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FUNC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function
_DEVICE_RE = re.compile(r"^cuda:\d+$")


@dataclass(frozen=True)
class Where:
    """What a section may need besides its table: the working directory (anchors a relative
    ``study.output_dir``), the study file and its folder (anchors relative data paths) and,
    once ``[study]`` is read, the output dir (the default storage and tracking URLs)."""

    cwd: Path
    base_dir: Path | None = None
    source_path: Path | None = None
    output_dir: Path | None = None


def _default(cls: type, name: str) -> Any:
    """A section field's default, as its dataclass states it."""
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _doc(text: str, **more: Any) -> dict[str, Any]:
    """A section field's metadata: its doc, and optionally ``default`` (in words) and ``choices``."""
    return {"doc": text, **more}


# ---------------------------------------------------------------------------------------------
# the sections


@dataclass(frozen=True)
class StudySection:
    """Identity of the study and where its files go."""

    name: str = field(metadata=_doc("the Optuna study's name and the MLflow run's name: letters, digits, `_`, `-` and"
        " `.`", default="the study file's name without `.toml`"))
    output_dir: Path = field(metadata=_doc("the folder of the study's files (`optuna.db`, `mlflow.db`, plots,"
        " `inductor_cache`), relative to the working directory", default="`runs/<name>`"))
    seed: int = field(default=0, metadata=_doc("the sampler's seed (each trial position draws from a seed derived from"
        " it and the position)"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> StudySection:
        default_name = where.source_path.stem if where.source_path is not None else None
        name = t.string("name", default_name, required=True)
        if not _NAME_RE.match(name):
            raise ConfigError(f"got {name!r}; use letters, digits, '_', '-' and '.' (e.g. 'dlrm_fp8')",
                              key="study.name")
        out = t.string("output_dir", f"runs/{name}")
        if not out:
            raise ConfigError("got an empty string; give a folder such as 'runs/my_study'", key="study.output_dir")
        out_path = Path(os.path.expanduser(out))
        out_path = (out_path if out_path.is_absolute() else where.cwd / out_path).resolve()
        seed = t.integer("seed", _default(cls, "seed"), minimum=0)
        t.done()
        return cls(name, out_path, seed)


@dataclass(frozen=True)
class ModelSection:
    """A built-in model (``name`` + ``preset`` + ``overrides``) or a user's ``module:function``.

    A user function is called as ``function(num_dense=..., cardinalities=..., **overrides)`` and
    returns an ``nn.Module`` with ``forward(dense, sparse) -> (B,) logits``
    (:func:`loka_tune.tuner.build.call_model_factory`, :func:`loka_tune.data.base.model_inputs`).
    """

    name: str = field(metadata=_doc("a built-in model (`\"dlrm\"`, `\"dcnv2\"`, `\"wukong\"`, `\"interformer\"`) or"
        " your own factory `\"package.module:function\"`", default="required"))
    preset: str = field(default="tiny", metadata=_doc("the built-in model's size (built-in models only)",
        choices="loka_tune.models:PRESETS"))
    overrides: Mapping[str, Any] = field(default_factory=dict, metadata=_doc("the table `[model.overrides]`: preset"
        " entries to replace (e.g. `top_mlp = [256, 256]`), or the keyword arguments of your factory"))

    @property
    def is_function(self) -> bool:
        return ":" in self.name

    @classmethod
    def from_table(cls, t: Table, where: Where) -> ModelSection:
        mname = t.string("name", required=True)
        preset = t.string("preset", _default(cls, "preset"))
        overrides = json_scalar_tree(t.table("overrides"), "model.overrides")
        t.done()
        if ":" in mname:
            if not _FUNC_RE.match(mname):
                raise ConfigError(f"got {mname!r}; a user model is 'package.module:function'", key="model.name")
            if t.has("preset"):
                raise ConfigError(f"got preset={preset!r} with a user function {mname!r}: presets are for built-in"
                                  " models; pass settings in [model.overrides] instead", key="model.preset")
        else:
            from loka_tune.models import PRESETS, model_names

            if mname not in model_names():
                raise ConfigError(f"got {mname!r}; choose a built-in model ({', '.join(model_names())}) or give"
                                  " 'package.module:function'", key="model.name")
            if preset not in PRESETS:
                raise ConfigError(f"got {preset!r}; choose one of {', '.join(PRESETS)}", key="model.preset")
        return cls(mname, preset, overrides)


@dataclass(frozen=True)
class DataSection:
    """The data source spec (``synthetic``, ``criteo:PATH``, ``avazu:PATH``, ``module:function``)
    and its keyword parameters. Relative paths are resolved against the study file's folder."""

    source: str = field(metadata=_doc("`\"synthetic\"`, `\"criteo:PATH\"` (the raw Kaggle / 1TB layout),"
        " `\"avazu:PATH\"` (the CSV with header) or `\"package.module:function\"` returning a DataSource; a relative"
        " PATH is relative to the study file's folder", default="required"))
    params: Mapping[str, Any] = field(default_factory=dict, metadata=_doc("the table `[data.params]`: keyword arguments"
        " of the source (synthetic: `num_dense`, `cardinalities`, `eval_examples`, `seq_len`, ...)"))

    @property
    def kind(self) -> str:
        if self.source == "synthetic" or self.source.startswith("synthetic:"):
            return "synthetic"
        if self.source.startswith(("criteo:", "avazu:")):
            return self.source.split(":", 1)[0]
        return "function"

    @classmethod
    def from_table(cls, t: Table, where: Where) -> DataSection:
        src = t.string("source", required=True)
        params = json_scalar_tree(t.table("params"), "data.params")
        t.done()
        if src.startswith(("criteo:", "avazu:")):
            kind, _, path = src.partition(":")
            if not path:
                raise ConfigError(f"got {src!r}; give a path, e.g. '{kind}:data/train.tsv'", key="data.source")
            src = f"{kind}:{_resolve_path(path, where.base_dir)}"
        elif src == "synthetic" or (":" in src and _FUNC_RE.match(src)):
            pass
        else:
            raise ConfigError(f"got {src!r}; use 'synthetic', 'criteo:PATH', 'avazu:PATH' or"
                              " 'package.module:function'", key="data.source")
        return cls(src, params)


def _short_run() -> TrainConfig:
    from loka_tune.objectives.trainer import TrainConfig

    return TrainConfig(**SHORT_RUN)


@dataclass(frozen=True)
class TrainingSection:
    """The short paired runs: the baseline seeds and the trainer's settings.

    ``trainer`` is the :class:`~loka_tune.objectives.trainer.TrainConfig` of every run, and its
    fields read through: ``training.steps`` is ``training.trainer.steps``. Every plain field of
    TrainConfig (bool, int, float, str, or a union of them) can be set in ``[training]``, checked
    by ``TrainConfig`` itself; the defaults are TrainConfig's, except the length of the run
    (:data:`SHORT_RUN`). ``seeds[0]`` is the seed every trial pairs with.
    """

    seeds: tuple[int, ...] = field(default=(0, 1, 2), metadata=_doc("the bf16 baseline seeds, 1 to 5 distinct (2-3 are"
        " usual): every trial pairs with `seeds[0]`, the confirmation runs each"))
    trainer: TrainConfig = field(default_factory=_short_run, metadata=_doc("not a key: every plain field of TrainConfig"
        " but `seed` is a key of [training], with TrainConfig's default except the run's length (`steps`,"
        " `eval_batches`, `window`)", keys_of=TRAINER_EXCLUDED))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "trainer":  # copy/pickle probe these before __init__
            raise AttributeError(name)
        try:
            return getattr(self.trainer, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    @property
    def seed(self) -> int:
        """The seed every trial pairs with."""
        return self.seeds[0]

    def to_train_config(self, seed: int | None = None, *, device: str | None = None) -> TrainConfig:
        """The trainer's config for one run: under ``seed`` (default: the pairing seed), on ``device``."""
        return replace(self.trainer, seed=self.seed if seed is None else seed, device=device or self.trainer.device)

    def to_dict(self) -> dict[str, Any]:
        """The seeds and the trainer's settings, flat (``seed`` is ``seeds[0]``)."""
        return {"seeds": self.seeds, **{k: v for k, v in asdict(self.trainer).items() if k != "seed"}}

    @classmethod
    def from_table(cls, t: Table, where: Where) -> TrainingSection:
        from loka_tune.objectives.trainer import TrainConfig

        seeds = _read_seeds(t, _default(cls, "seeds"))
        base = _short_run()  # every plain TrainConfig field but seed (seeds[0]) is a key, with its default
        values = {name: read_plain(t, name, kinds, getattr(base, name))
                  for name, kinds in plain_fields(TrainConfig, exclude=TRAINER_EXCLUDED).items()}
        device = values["device"]
        if device not in ("auto", "cpu", "cuda") and not _DEVICE_RE.match(device):
            raise ConfigError(f"got {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'", key="training.device")
        try:
            trainer = TrainConfig(**values, seed=seeds[0])
        except ConfigError as e:  # TrainConfig names its own field: name it in the study's terms
            raise rekeyed(e, "training") from None
        t.done()
        if trainer.window > trainer.steps:
            raise ConfigError(f"got window={trainer.window} > steps={trainer.steps}; the loss window must fit"
                              " in the run", key="training.window")
        if trainer.lr_warmup_steps > trainer.steps:
            raise ConfigError(f"got lr_warmup_steps={trainer.lr_warmup_steps} > steps={trainer.steps}; the"
                              " learning rate would never reach lr_dense / lr_sparse: give a warm-up shorter"
                              " than the run (e.g. a tenth of it), or 0 for none", key="training.lr_warmup_steps")
        return cls(seeds, trainer)


def _read_seeds(t: Table, default: tuple[int, ...]) -> tuple[int, ...]:
    seeds = t.get("seeds", list(default))
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise ConfigError(f"got {seeds!r}; expected a list of 1-5 integer seeds >= 0, e.g. [0, 1, 2]",
                          key="training.seeds")
    if not 1 <= len(seeds) <= 5 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"got {seeds!r}; give 1 to 5 distinct seeds (2-3 are usual)",
                          key="training.seeds")
    return tuple(seeds)


@dataclass(frozen=True)
class ObjectiveSection:
    """What is minimized (step time) and the constraint (relative log loss <= budget)."""

    kind: str = field(default="train_step", metadata=_doc("what is timed: the training step (forward, backward,"
        " optimizers) or inference (the forward only)", choices=OBJECTIVES))
    budget_pct: float = field(default=0.5, metadata=_doc("the loss budget: the largest relative log loss vs the paired"
        " bf16 baseline, in percent (> 0); it must exceed the baseline's noise floor"))
    speed: str = field(default="auto", metadata=_doc("`\"measured\"` (timed on CUDA), `\"modeled\"` (the cost model) or"
        " `\"auto\"` (measured on CUDA, modeled on a CPU)", choices=SPEED_SOURCES))
    cost_device: str = field(default="h200", metadata=_doc("the cost model's target device",
        choices="loka_tune.kernels.costmodel:DEVICES"))
    cost_batch_size: int | None = field(default=None, metadata=_doc("the batch size the modeled step time is computed"
        " at", default="`[regime] batch_size`, else `training.batch_size`"))
    non_gemm_fraction: float = field(default=0.3, metadata=_doc("the modeled share of non-GEMM work in the bf16 step (0"
        " to 0.95)"))
    noise_twins: int = field(default=1, metadata=_doc("noise twins per baseline seed: bf16 runs from perturbed initial"
        " weights (`loka_tune.tuner.baseline`), whose paired relative log loss is the noise floor the budget must"
        " exceed; more give a steadier floor, each costs one baseline run"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> ObjectiveSection:
        d = cls()
        objective = cls(
            kind=t.string("kind", d.kind, choices=OBJECTIVES),
            budget_pct=t.number("budget_pct", d.budget_pct, minimum=0.0, strict_min=True),
            speed=t.string("speed", d.speed, choices=SPEED_SOURCES),
            cost_device=t.string("cost_device", d.cost_device),
            cost_batch_size=t.integer("cost_batch_size", d.cost_batch_size, minimum=1, allow_none=True),
            non_gemm_fraction=t.number("non_gemm_fraction", d.non_gemm_fraction, minimum=0.0, maximum=0.95),
            noise_twins=t.integer("noise_twins", d.noise_twins, minimum=1),
        )
        t.done()
        from loka_tune.kernels.costmodel import DEVICES

        if objective.cost_device not in DEVICES:
            raise ConfigError(f"got {objective.cost_device!r}; the cost model knows {', '.join(sorted(DEVICES))}",
                              key="objective.cost_device")
        return objective


@dataclass(frozen=True)
class SpaceSection:
    """The allowed search space: the FP8 choices per layer ("site") and the Mods.

    By default (``per_gemm = false``) the recipe space (:mod:`loka_tune.space.recipe_space`),
    else the per-GEMM space.
    """

    formats: tuple[str, ...] = field(default=("e4m3", "e5m2"), metadata=_doc("the FP8 formats (`\"mxfp8\"` needs the"
        " granularity `\"mx\"`)", choices=FORMATS))
    granularities: tuple[str, ...] = field(default=("tensor", "row", "block"), metadata=_doc("the scaling"
        " granularities: tensorwise, rowwise (along each operand's reduction dim), blockwise, mx (mxfp8 only)",
        choices=GRANULARITIES))
    backends: tuple[str, ...] = field(default=("emulated",), metadata=_doc("the GEMM backends, by their registry names"
        " (an unknown one's error lists those this install knows): `\"emulated\"` (FP8 emulated, any device), on a GPU"
        " e.g. `\"torch_scaled_mm\"`, `\"triton\"`, `\"fbgemm\"`, `\"torchao\"`; one whose package is missing here is"
        " left out of the space, with a warning"))
    roundings: tuple[str, ...] = field(default=("exact",), metadata=_doc("scale rounding: exact and/or to a power of 2",
        choices=ROUNDINGS))
    mods: tuple[str, ...] = field(default=(), metadata=_doc("the Mods the sampler may switch on (`\"fuse_epilogue\"`"
        " needs `\"blocknorm\"` and `\"hardswish\"`; `\"fp8_chain\"` needs `\"no_bias\"`, `\"blocknorm\"` with 256"
        " among `blocknorm_sizes`, and `\"hardswish\"`, and excludes `\"fuse_epilogue\"`)", choices=MOD_NAMES))
    per_role: bool = field(default=True, metadata=_doc("`per_gemm = true` only: choose fwd / dgrad / wgrad separately"
        " (true) or tie them (false); a file that sets `per_role` but not `per_gemm` (written before the recipe space)"
        " gets the per-GEMM space it had, and `per_gemm = false` with `per_role` set is an error"))
    per_gemm: bool = field(default=False, metadata=_doc("false: per site one of a few whole-site recipes (bf16,"
        " tensorwise, tensorwise with fast accumulation everywhere, rowwise, rowwise with a bf16 wgrad, Dispatch's"
        " per-GEMM choice), priced per site; true: per site"
        " x GEMM every choice the probe kept (for experts)", default="`false` (`true` where `per_role` is set)"))
    align: int = field(default=16, metadata=_doc("FP8 only where K and N are multiples of this"))
    min_dim: int = field(default=16, metadata=_doc("FP8 only where K and N are at least this"))
    blocknorm_sizes: tuple[int, ...] = field(default=(128,), metadata=_doc("the BlockNorm Mod's block sizes the sampler"
        " chooses from"))
    pad_multiples: tuple[int, ...] = field(default=(16,), metadata=_doc("the padding Mod's multiples the sampler"
        " chooses from"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> SpaceSection:
        d = cls()
        fmts = t.str_list("formats", d.formats, choices=FORMATS)
        grans = t.str_list("granularities", d.granularities, choices=GRANULARITIES)
        backends = t.str_list("backends", d.backends)
        for b in backends:
            _check_backend_name(b)
        mods = t.str_list("mods", d.mods, choices=MOD_NAMES, allow_empty=True)
        if "fuse_epilogue" in mods and not {"blocknorm", "hardswish"} <= set(mods):
            raise ConfigError(f"got {list(mods)!r}: 'fuse_epilogue' fuses Linear -> BlockNorm -> Hard Swish chains,"
                              " which exist only with the blocknorm and hardswish Mods on; add 'blocknorm' and"
                              " 'hardswish' to space.mods (or drop 'fuse_epilogue')", key="space.mods")
        bn = t.get("blocknorm_sizes", list(d.blocknorm_sizes))
        pm = t.get("pad_multiples", list(d.pad_multiples))
        for k, v in (("blocknorm_sizes", bn), ("pad_multiples", pm)):
            if (not isinstance(v, list) or not v
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
                raise ConfigError(f"got {v!r}; expected a non-empty list of positive integers", key=f"space.{k}")
        check_chain_space(mods, bn)
        per_role = t.boolean("per_role", d.per_role)
        if t.has("per_role") and t.has("per_gemm") and not t.boolean("per_gemm", d.per_gemm):
            raise ConfigError(f"got per_gemm = false with per_role = {str(per_role).lower()}: per_role chooses how"
                              " the per-GEMM space ties a site's three GEMMs, and per_gemm = false searches whole-site"
                              " recipes instead; drop per_role, or set per_gemm = true", key="space.per_role")
        # a study file from before the recipe space that sets per_role keeps its per-GEMM space
        per_gemm = t.boolean("per_gemm", t.has("per_role"))
        space = cls(
            formats=fmts, granularities=grans, backends=backends, mods=mods,
            roundings=t.str_list("roundings", d.roundings, choices=ROUNDINGS),
            per_role=per_role, per_gemm=per_gemm,
            align=t.integer("align", d.align, minimum=1),
            min_dim=t.integer("min_dim", d.min_dim, minimum=1),
            blocknorm_sizes=tuple(bn), pad_multiples=tuple(pm),
        )
        t.done()
        if fmts == ("mxfp8",) and "mx" not in grans:
            raise ConfigError(f"got formats=['mxfp8'] with granularities {list(grans)!r}; mxfp8 needs 'mx':"
                              " add it to space.granularities", key="space.granularities")
        if grans == ("mx",) and "mxfp8" not in fmts:
            raise ConfigError(f"got granularities=['mx'] with formats {list(fmts)!r}; 'mx' needs 'mxfp8':"
                              " add it to space.formats", key="space.formats")
        return space


@dataclass(frozen=True)
class ProbeSection:
    """The probe during the first baseline run, and its thresholds: which candidates survive pruning."""

    enabled: bool = field(default=True, metadata=_doc("false: no probe run, no pruning, no Dispatch plan (the unpruned"
        " space)"))
    max_error: float = field(default=0.2, metadata=_doc("a candidate whose MERE (mean relative error of its GEMM"
        " outputs) is above this is unsafe and dropped"))
    min_speedup: float = field(default=1.0, metadata=_doc("candidates not faster than bf16 by this factor are dropped"
        " (0: keep every speed)"))
    samples: int = field(default=32, metadata=_doc("synthetic draws `(X, dY, W)` per site from the collected"
        " statistics, on which each candidate's error is measured"))
    every: int = field(default=10, metadata=_doc("collect the probe's statistics every this many steps"))
    price_first: bool = field(default=False, metadata=_doc("true: price every candidate's speed first, measure the"
        " error of the fast ones only"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> ProbeSection:
        d = cls()
        probe = cls(
            enabled=t.boolean("enabled", d.enabled),
            max_error=t.number("max_error", d.max_error, minimum=0.0, strict_min=True),
            min_speedup=t.number("min_speedup", d.min_speedup, minimum=0.0),  # 0: keep every speed
            samples=t.integer("samples", d.samples, minimum=1),
            every=t.integer("every", d.every, minimum=1),
            price_first=t.boolean("price_first", d.price_first),
        )
        t.done()
        return probe


@dataclass(frozen=True)
class TrialsSection:
    """The trial budget and the pruner. ``n_trials`` counts distinct configurations evaluated: a
    trial the sampler gives an already evaluated configuration copies its result (a cache copy,
    recorded) and does not spend the budget; so does one that trains as an evaluated one (under
    the ``fp8_chain`` Mod, a chained site's tensorwise variants)."""

    n_trials: int | None = field(default=20, metadata=_doc("distinct configurations evaluated (a cache copy of an"
        " evaluated one is not counted); and/or `timeout_s`", default="`20` (none when `timeout_s` is set)"))
    timeout_s: float | None = field(default=None, metadata=_doc("stop starting trials after this many seconds",
        default="none (no time limit)"))
    pruner: str = field(default="hopeless", metadata=_doc("`\"hopeless\"`: prune a trial whose windowed training loss"
        " is `hopeless_factor` x the budget above the baseline's at the same step; `\"median\"`: Optuna's median"
        " pruner; `\"none\"`", choices=PRUNERS))
    hopeless_factor: float = field(default=10.0, metadata=_doc("the hopeless pruner's threshold, in budgets (>= 1)"))
    prune_warmup_steps: int = field(default=0, metadata=_doc(
        "training steps of a trial before the pruner may prune it"))
    n_startup_trials: int = field(default=8, metadata=_doc("random trials before TPE models the results"))
    enqueue_starts: bool = field(default=True, metadata=_doc("first trials: bf16 with no Mods and with all of `[space]"
        " mods`, then under the faster feasible of the two the recipes tensorwise / rowwise on torchao's size-filter"
        " Linears (per GEMM also torchao's own with the torchao backend) and the Dispatch plan, then (recipe space) the"
        " additive model's proposals; false leaves every trial to the sampler"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> TrialsSection:
        d = cls()
        n_trials = t.integer("n_trials", d.n_trials if not t.has("timeout_s") else None, minimum=1,
                             allow_none=True)
        timeout = t.number("timeout_s", d.timeout_s, minimum=0.0, strict_min=True)
        trials = cls(
            n_trials=n_trials, timeout_s=timeout,
            pruner=t.string("pruner", d.pruner, choices=PRUNERS),
            hopeless_factor=t.number("hopeless_factor", d.hopeless_factor, minimum=1.0),
            prune_warmup_steps=t.integer("prune_warmup_steps", d.prune_warmup_steps, minimum=0),
            n_startup_trials=t.integer("n_startup_trials", d.n_startup_trials, minimum=0),
            enqueue_starts=t.boolean("enqueue_starts", d.enqueue_starts),
        )
        t.done()
        if trials.n_trials is None and trials.timeout_s is None:
            raise ConfigError("neither n_trials nor timeout_s is set; give at least one (e.g. n_trials = 20)",
                              key="trials.n_trials")
        return trials


@dataclass(frozen=True)
class StorageSection:
    """Optuna storage (``url``: ``sqlite:///...`` or ``postgresql://...``) and worker heartbeats."""

    url: str = field(metadata=_doc("the Optuna storage: `sqlite:///PATH`, or `postgresql://USER:PW@HOST:PORT/DB` for"
        " workers on many machines", default="`sqlite:///<output_dir>/optuna.db`"))
    heartbeat_s: int = field(default=10, metadata=_doc("seconds between a running trial's heartbeats"))
    grace_s: int = field(default=30, metadata=_doc("a trial without a heartbeat for this many seconds is marked failed"
        " and re-queued (more than `heartbeat_s`, e.g. 3x)"))
    max_retry: int = field(default=2, metadata=_doc("how many times a failed trial is re-queued"))

    @staticmethod
    def default_url(output_dir: Path) -> str:
        return f"sqlite:///{output_dir / 'optuna.db'}"

    @classmethod
    def from_table(cls, t: Table, where: Where) -> StorageSection:
        assert where.output_dir is not None, "[study] is read first"
        url = t.string("url", "") or cls.default_url(where.output_dir)
        check_url_form(url, "storage.url")
        storage = cls(
            url=url,
            heartbeat_s=t.integer("heartbeat_s", _default(cls, "heartbeat_s"), minimum=1),
            grace_s=t.integer("grace_s", _default(cls, "grace_s"), minimum=1),
            max_retry=t.integer("max_retry", _default(cls, "max_retry"), minimum=0),
        )
        t.done()
        if storage.grace_s <= storage.heartbeat_s:
            raise ConfigError(f"got grace_s={storage.grace_s} <= heartbeat_s={storage.heartbeat_s}; a trial is"
                              " declared dead after grace_s without a heartbeat, so make it larger (e.g. 3x)",
                              key="storage.grace_s")
        return storage


@dataclass(frozen=True)
class TrackingSection:
    """MLflow tracking: one run per study, a nested run per trial, the plots."""

    enabled: bool | str = field(default="auto", metadata=_doc("true, false or `\"auto\"` (on when mlflow can be"
        " imported)"))
    uri: str = field(default="", metadata=_doc("the MLflow tracking URI: `sqlite:///PATH`, `http(s)://HOST:PORT`,"
        " `postgresql://...` or `file:///PATH`", default="`sqlite:///<output_dir>/mlflow.db`"))
    experiment: str = field(default="loka-tune", metadata=_doc("the MLflow experiment's name"))
    plots: bool = field(default=True, metadata=_doc("write the study's plots (speed vs loss, the choice map) and log"
        " them to MLflow"))

    @staticmethod
    def default_uri(output_dir: Path) -> str:
        return f"sqlite:///{output_dir / 'mlflow.db'}"

    @classmethod
    def from_table(cls, t: Table, where: Where) -> TrackingSection:
        assert where.output_dir is not None, "[study] is read first"
        d = cls()
        enabled = t.get("enabled", d.enabled)
        if enabled not in (True, False, "auto"):
            raise ConfigError(f"got {enabled!r}; use true, false or \"auto\"", key="tracking.enabled")
        uri = t.string("uri", d.uri) or cls.default_uri(where.output_dir)
        if not re.match(r"^(sqlite|postgresql|mysql|mssql|https?|file|databricks)(\+\w+)?:", uri):
            raise ConfigError(f"got {uri!r}; use sqlite:///PATH, http(s)://HOST:PORT, postgresql://... or"
                              " file:///PATH", key="tracking.uri")
        experiment = t.string("experiment", d.experiment)
        if not experiment:
            raise ConfigError("got an empty string; name the MLflow experiment", key="tracking.experiment")
        tracking = cls(enabled=enabled, uri=uri, experiment=experiment, plots=t.boolean("plots", d.plots))
        t.done()
        return tracking


@dataclass(frozen=True)
class ConfirmSection:
    """The confirmation stage: after the search, the best ``n_best`` feasible configs are run
    again in the ``[regime]`` on ``seeds`` (at least two), each paired against bf16 with the same
    Mods, and the export takes the fastest one whose mean relative log loss is within the budget
    (:mod:`loka_tune.tuner.confirm`)."""

    enabled: bool = field(default=True, metadata=_doc("false: no confirmation stage (the export takes the search's best"
        " feasible trial)"))
    n_best: int = field(default=3, metadata=_doc("how many of the best feasible configs are confirmed"))
    seeds: tuple[int, ...] = field(default=(), metadata=_doc("the confirmation's seeds, at least two distinct (`[]`:"
        " `training.seeds`; one training seed `s` gives `[s, s + 1]`)"))

    @classmethod
    def from_table(cls, t: Table, where: Where) -> ConfirmSection:
        d = cls()
        seeds = t.get("seeds", list(d.seeds))
        if (not isinstance(seeds, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
            raise ConfigError(f"got {seeds!r}; expected a list of integer seeds >= 0, e.g. [0, 1]", key="confirm.seeds")
        if len(seeds) == 1 or len(set(seeds)) != len(seeds):
            raise ConfigError(f"got {seeds!r}; give at least two distinct seeds (or [] for training.seeds)",
                              key="confirm.seeds")
        confirm = cls(enabled=t.boolean("enabled", d.enabled), n_best=t.integer("n_best", d.n_best, minimum=1),
                      seeds=tuple(seeds))
        t.done()
        return confirm

    def seeds_for(self, training_seeds: tuple[int, ...]) -> tuple[int, ...]:
        """The confirmation's seeds: its own, else the training seeds (one seed s: s and s + 1)."""
        if self.seeds:
            return self.seeds
        if len(training_seeds) >= 2:
            return tuple(training_seeds)
        return (training_seeds[0], training_seeds[0] + 1)


# names users reach for that are not backend names: the backend that runs that library's kernels
_BACKEND_ALIASES = {"cublas": "torch_scaled_mm", "cublaslt": "torch_scaled_mm", "scaled_mm": "torch_scaled_mm",
                    "cutlass": "torch_scaled_mm", "emulate": "emulated", "emulation": "emulated",
                    "fbgemm_gpu": "fbgemm", "ao": "torchao"}


def _check_backend_name(name: str) -> None:
    """A backend name of ``[space] backends`` that the registry knows (installed or not: a backend
    whose package is missing here is left out of the space later, with a warning)."""
    from loka_tune.kernels.registry import list_backends

    known = list_backends()
    if name in known:
        return
    if not re.match(r"^[a-z][a-z0-9_]*$", name):
        raise ConfigError(f"got {name!r}; a backend name is lower-case letters, digits and '_'"
                          f" (known backends: {', '.join(known)})", key="space.backends")
    guess = _BACKEND_ALIASES.get(name) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)
    hint = f"; did you mean {guess!r}?" if guess else ""
    raise ConfigError(f"got {name!r}: not a backend{hint} Known backends: {', '.join(known)}",
                      key="space.backends")


def _resolve_path(p: str, base: Path | None) -> str:
    p = os.path.expanduser(os.path.expandvars(p))
    if base is not None and not os.path.isabs(p):
        p = str((base / p).resolve())
    return p
