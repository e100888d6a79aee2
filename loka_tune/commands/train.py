"""``loka-tune train``: one deterministic short training run of a reference model.

Builds the data source (for the input spec), then the model, optionally applies a precision
config, trains, evaluates on the held-out split and prints the metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HELP = "train a reference model for a short deterministic run and report held-out metrics"

DESCRIPTION = """\
Train a reference model (DLRM, DCNv2, Wukong) for a short, seeded run and report the windowed
training log loss, held-out log loss / normalized entropy (NE) / AUC, and the step time.

The run is deterministic: the data order comes only from the source and --seed, and the model
is initialized from --seed, so two runs that differ only in --config (the precision) are a
paired comparison. Embedding tables train with row-wise Adagrad (--lr-sparse), everything
else with Adam (--lr-dense); bf16 autocast on CUDA, fp32 on CPU. --lr-warmup-steps N ramps both
rates up linearly over the first N steps: wide models (the large presets) need it and a lower
--lr-dense (e.g. 1e-4), or Adam's first full-rate steps can collapse them to the base rate.
--lr-cooldown-steps N brings them down linearly over the last N steps, so that the final weights
(what the eval reads) carry less of the last steps' noise.

--data takes:
  synthetic[:k=v,...]  a synthetic CTR stream with realistic distributions
                       (e.g. synthetic:base_rate=0.1,num_sparse=8,cardinality=1000)
  criteo:PATH[?k=v]    Criteo (Kaggle / Terabyte) TSV, plain or .gz: label, 13 integer,
                       26 categorical (e.g. criteo:train.txt?eval_fraction=0.1)
  avazu:PATH[?k=v]     Avazu CSV with its header, plain or .gz
  pkg.module:function  your own: function() returns a DataSource

--config with a config exported by `loka-tune export` and no --model rebuilds the tuned model
from the config's provenance (model, preset, overrides, data spec and parameters) and trains it
with the study's schedule and rates (--steps, --batch-size, --lr-dense, --lr-sparse,
--lr-warmup-steps, --lr-cooldown-steps, --sparse-optimizer as its [training] had them); any of those options, and
--model-arg, --preset and --data, still override what it recorded.

Exit status: 0 ok, 1 the loss went non-finite, 2 a usage or input error.

examples:
  loka-tune train --model dlrm --preset tiny --data synthetic --steps 300
  loka-tune train --config best.json          # the model and data the study tuned
  loka-tune train --model interformer --preset tiny --data synthetic:seq_len=32
  loka-tune train --model wukong --preset tiny --data criteo:day_0.gz \\
      --steps 2000 --batch-size 1024 --config best.json --json metrics.json --no-progress

On a small sample, train about one epoch or it overfits (held-out NE > 1): without --steps
and --batch-size that is what happens (e.g. 1,605 Criteo training rows: batch 16, 101 steps);
a --steps of more than 1.5 epochs of a file's training rows gets a warning on stderr.
The prediction head's bias starts at logit(the data's base rate): the model starts out
predicting the click rate of the training rows.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loka_tune.commands._args import integer, model_arg, number
    from loka_tune.models.registry import MODEL_NAMES, PRESETS

    g = parser.add_argument_group("model and data")
    g.add_argument("--model", choices=MODEL_NAMES,
                   help="reference model (default: the one recorded in --config's provenance)")
    g.add_argument("--preset", default=None, choices=PRESETS,
                   help="model size (default: tiny, or the preset recorded in --config)")
    g.add_argument(
        "--model-arg", action="append", default=[], type=model_arg, metavar="KEY=VALUE",
        help="override a preset hyperparameter, JSON value (e.g. embedding_dim=16, "
        "top_mlp=[64,32], norm=layernorm); repeatable",
    )
    g.add_argument("--data", default=None, metavar="SPEC",
                   help="synthetic | synthetic:seq_len=32 (with behaviour sequences) | criteo:PATH | avazu:PATH |"
                        " amazon:PATH (with sequences) | module:function (default: synthetic, or the data recorded"
                        " in --config when it also gives the model)")
    g.add_argument("--config", type=Path, metavar="PRECISION.json",
                   help="apply this precision config (loka-tune export) to the model before training;"
                        " without --model, build the model it was tuned on")

    t = parser.add_argument_group("training")
    t.add_argument("--steps", type=integer("a number of steps", minimum=1), default=None,
                   help="optimizer steps (default: 300; on a file with fewer rows than that needs,"
                        " one epoch: a short run must not overfit a small sample)")
    t.add_argument("--batch-size", type=integer("a batch size", minimum=1), default=None,
                   help="training batch size (default: 256; on a file of under 25,600 training rows,"
                        " rows/100 but at least 16, so one epoch is about 100 steps)")
    t.add_argument("--lr-dense", type=number("a learning rate", minimum=0.0, strict=True), default=None,
                   help="Adam learning rate (default: 1e-3)")
    t.add_argument("--lr-sparse", type=number("a learning rate", minimum=0.0, strict=True), default=None,
                   help="embedding-table learning rate (default: 1e-2)")
    t.add_argument("--lr-warmup-steps", type=integer("a number of steps", minimum=0), default=None,
                   help="ramp both learning rates linearly over the first N steps (default: 0, none)")
    t.add_argument("--lr-cooldown-steps", type=integer("a number of steps", minimum=0), default=None,
                   help="bring both learning rates down linearly over the last N steps, the last step at"
                        " 1/(N+1) of them (default: 0, none)")
    t.add_argument("--sparse-optimizer", default=None,
                   choices=("rowwise_adagrad", "sparse_adam"),
                   help="optimizer of the embedding tables (default: rowwise_adagrad)")
    t.add_argument("--seed", type=integer("a seed", minimum=0), default=0, help="model init and data order seed (default: 0)")
    t.add_argument("--window", type=integer("a number of steps", minimum=1), default=50,
                   help="steps per point of the training loss curve (default: 50)")
    t.add_argument("--eval-batches", type=integer("a number of batches", minimum=1), default=None,
                   help="evaluate on at most this many batches (default: the whole eval split)")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    t.add_argument("--autocast", default="auto", choices=("auto", "bf16", "off"),
                   help="auto = bf16 on CUDA, fp32 on CPU (default: auto)")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--cuda-graphs", action="store_true",
                   help="capture the whole training step in one CUDA graph and replay it (CUDA only)")
    t.add_argument("--nproc", type=integer("a number of processes", minimum=1), default=1, metavar="N",
                   help="data-parallel over N processes on this host (torchrun; gloo on the CPU, NCCL with one"
                        " GPU per process); --batch-size stays the global batch, so the run takes the same"
                        " steps on the same examples as one process (default: 1)")
    t.add_argument("--cpu-threads", type=integer("a number of threads", minimum=1), default=None, metavar="N",
                   help="torch CPU threads for the run (default: torch's; 1 is fastest for tiny "
                   "models on a busy machine)")

    o = parser.add_argument_group("output")
    o.add_argument("--json", type=Path, metavar="OUT", help="write the metrics as JSON to OUT")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def format_table(d: dict[str, Any]) -> str:
    """The human summary of a run (``d`` as written by ``--json``)."""
    rows = [
        ("model", f"{d['model']}/{d['preset']}  ({d['num_params']:,} params, "
                  f"{d['num_sparse_params']:,} in embeddings)"),
        ("data", str(d["data"])),
        ("status", f"{d['status']}  ({d['steps_run']} steps"
                   + (f", non-finite at step {d['nonfinite_step']}" if d["nonfinite_step"] is not None else "")
                   + ")"),
        ("train loss", f"{_fmt(d['train_logloss'], '.4f')}  (mean of the last"
                       f" {min(d['config']['window'], d['steps_run'])} steps)"),
        ("eval logloss", f"{_fmt(d['eval_logloss'], '.4f')}  ({d['eval_count']:,} examples, "
                         f"ctr {_fmt(d['eval_ctr'], '.3f')})"),
        ("eval NE", _fmt(d["eval_ne"], ".4f")),
        ("eval AUC", _fmt(d["eval_auc"], ".4f")),
        ("step time", f"{_fmt(None if d['step_time_s'] is None else d['step_time_s'] * 1e3, '.3f')} ms"
                      f"  (median, {d['device']} {d['precision']})"),
        ("examples/s", _fmt(d["examples_per_s"], ",.0f")),
    ]
    if d.get("precision_config"):
        n = len(d.get("precision_replaced") or {})
        rows.insert(2, ("precision", f"{d['precision_config']}  ({n} linear layers replaced)"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


DEFAULT_STEPS = 300  # a short run: enough for the tiny presets to learn synthetic data
DEFAULT_BATCH = 256


def default_schedule(source: Any, batch_size: int | None, steps: int | None) -> tuple[int, int]:
    """Batch size and steps when not given: 256 x 300 steps, except on a file source too small
    for that (fewer training rows than 300 batches need), where one epoch at a batch of about
    rows/100 (at least 16) is the default, since more epochs overfit a small sample."""
    rows = getattr(source, "num_train_rows", None)
    if batch_size is None:
        batch_size = DEFAULT_BATCH
        if rows is not None and rows < 100 * DEFAULT_BATCH:
            batch_size = max(16, rows // 100)
    if steps is None:
        steps = DEFAULT_STEPS
        if rows is not None:
            steps = max(1, min(DEFAULT_STEPS, math.ceil(rows / batch_size)))
    return batch_size, steps


def _recorded_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The model and data to build: the command line's, or (no --model) those recorded in the
    provenance of --config, with --preset / --model-arg / --data on top."""
    from loka_tune.errors import ConfigError

    overrides = dict(args.model_arg)
    if args.model is not None:
        return {"model": args.model, "preset": args.preset or "tiny", "overrides": overrides,
                "data": args.data or "synthetic", "data_params": {}, "from": None, "training": {}}
    if args.config is None:
        raise ConfigError("give --model (dlrm, dcnv2, wukong), or --config with a config exported by"
                          " `loka-tune export` to train the model it was tuned on", key="--model")
    from loka_tune.applier import load_config

    prov = load_config(args.config).provenance
    rec = prov.get("model")
    if not isinstance(rec, dict) or not isinstance(rec.get("name"), str):
        raise ConfigError(f"{str(args.config)!r} records no model in its provenance (it was not written by"
                          " `loka-tune export`, or by an older version); give --model (and --model-arg, --data)",
                          key="--model")
    data, params = prov.get("data"), prov.get("data_params")
    if args.data is not None:  # the user's data: the recorded parameters were for the recorded source
        data, params = args.data, {}
    elif not isinstance(data, str):
        raise ConfigError(f"{str(args.config)!r} records no data spec (exported by an older version?);"
                          " give --data", key="--data")
    training = prov.get("training")
    return {"model": rec["name"], "preset": args.preset or rec.get("preset") or "tiny",
            "overrides": {**dict(rec.get("overrides") or {}), **overrides}, "data": data,
            "data_params": dict(params) if isinstance(params, dict) else {}, "from": str(args.config),
            "training": {k: v for k, v in training.items() if k in _SCHEDULE} if isinstance(training, dict) else {}}


# the rates' defaults (the command line's, where neither it nor --config's provenance gives one)
TRAINING_DEFAULTS: dict[str, Any] = {"lr_dense": 1e-3, "lr_sparse": 1e-2, "lr_warmup_steps": 0, "lr_cooldown_steps": 0,
                                     "sparse_optimizer": "rowwise_adagrad"}
_SCHEDULE = ("steps", "batch_size", *TRAINING_DEFAULTS)  # what an export's provenance.training may set


def _schedule_args(args: argparse.Namespace, recorded: dict[str, Any]) -> dict[str, Any]:
    """The training options: each given one, else the one recorded by the study (``recorded``,
    from --config's provenance), else the default."""
    return {k: getattr(args, k) if getattr(args, k) is not None else recorded.get(k, TRAINING_DEFAULTS.get(k))
            for k in _SCHEDULE}


def _build(spec: dict[str, Any], source: Any) -> Any:
    from loka_tune.models import build_model

    num_dense, cards = int(source.num_dense), list(source.cardinalities)
    if ":" in spec["model"]:  # a user's factory, recorded by a study of it
        from loka_tune.tuner.build import call_model_factory

        return call_model_factory(spec["model"], num_dense, cards, spec["overrides"], key="--config")
    overrides: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["overrides"].items()}
    return build_model(spec["model"], spec["preset"], num_dense=num_dense, cardinalities=cards,
                       base_rate=getattr(source, "base_rate", None),  # the head's bias starts at logit(base rate)
                       **overrides)


def epochs_warning(source: Any, batch_size: int, steps: int) -> str | None:
    """A warning when ``steps`` batches make more than one pass over a file source's training rows."""
    rows = getattr(source, "num_train_rows", None)
    if not rows:
        return None
    epochs = steps * batch_size / rows
    if epochs <= 1.5:
        return None
    one = max(1, math.ceil(rows / batch_size))
    return (f"warning: --steps {steps} at batch {batch_size} is {epochs:.1f} epochs over the {rows:,} training"
            f" rows: a short run on a small sample overfits (held-out NE goes up); one epoch is {one} steps")


def run(args: argparse.Namespace) -> int:
    import torch

    from loka_tune.commands._output import check_output, write_error
    from loka_tune.data import parse_data_spec
    from loka_tune.errors import ConfigError
    from loka_tune.objectives.distributed import dist_env, launch, strip_nproc
    from loka_tune.objectives.trainer import TrainConfig, resolve_device, train

    env = dist_env()
    main_rank = env is None or env.is_main
    if args.json is not None and main_rank:
        check_output(args.json, "--json")
    if args.config is not None and not args.config.is_file():
        raise ConfigError(f"precision config {str(args.config)!r} not found: pass the JSON written by "
                          "'loka-tune export'", key="--config")
    spec = _recorded_spec(args)
    opts = _schedule_args(args, spec["training"])
    if spec["from"] is not None and not args.no_progress and main_rank and not (args.nproc > 1 and env is None):
        used = {k: v for k, v in spec["training"].items() if getattr(args, k, None) is None}
        print(f"model from {spec['from']}: {spec['model']}/{spec['preset']} {spec['overrides'] or ''},"
              f" data {spec['data']} {spec['data_params'] or ''}"
              + (f"; the study's training: {', '.join(f'{k} {v}' for k, v in used.items())}" if used else ""),
              file=sys.stderr)
    source = parse_data_spec(spec["data"], **spec["data_params"])
    batch_size, steps = default_schedule(source, opts["batch_size"], opts["steps"])
    if args.nproc > 1 and env is None:  # this process launches the job and waits for it
        if batch_size % args.nproc:
            raise ConfigError(f"got a global batch of {batch_size} for {args.nproc} processes; it must split evenly:"
                              f" pass --batch-size as a multiple of {args.nproc}", key="--batch-size")
        return launch(args.nproc, ["-m", "loka_tune", *strip_nproc(args._argv)])
    warning = epochs_warning(source, batch_size, steps)
    if warning is not None and main_rank:
        print(f"loka-tune train: {warning}", file=sys.stderr)
    cfg = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        lr_dense=opts["lr_dense"],
        lr_sparse=opts["lr_sparse"],
        lr_warmup_steps=opts["lr_warmup_steps"],
        lr_cooldown_steps=opts["lr_cooldown_steps"],
        seed=args.seed,
        eval_batches=args.eval_batches,
        window=args.window,
        device=args.device,
        autocast=args.autocast,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        sparse_optimizer=opts["sparse_optimizer"],
        cpu_threads=args.cpu_threads,
    )

    torch.manual_seed(args.seed)  # deterministic model init
    replaced: dict[str, str] = {}
    model = _build(spec, source)
    if args.config is not None:
        from loka_tune.applier import apply

        # apply on the run's device: GPU backends (and the fused Triton epilogue) check it
        model.to(resolve_device(cfg.device))
        summary = apply(model, args.config)
        replaced = dict(getattr(summary, "replaced", {}))
        if not args.no_progress and main_rank:
            print(summary, file=sys.stderr)

    result = train(model, source, cfg, progress=not args.no_progress)
    if not main_rank:  # rank 0 reports
        return 0 if result.status == "ok" else 1
    d = {
        "nproc": env.world_size if env is not None else 1,
        "model": spec["model"],
        "preset": spec["preset"],
        "model_args": {k: list(v) if isinstance(v, tuple) else v for k, v in spec["overrides"].items()},
        "data": spec["data"],
        "precision_config": str(args.config) if args.config is not None else None,
        "precision_replaced": replaced,  # site -> precision id of every LokaLinear
        "training": {"steps": steps, "batch_size": batch_size, **{k: opts[k] for k in TRAINING_DEFAULTS}},
        **result.to_dict(),
    }
    print(format_table(d))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(d, indent=2) + "\n")
        except OSError as e:
            raise write_error(args.json, "--json", e, "the metrics are printed above") from None
    return 0 if result.status == "ok" else 1
