"""``loka-tune probe``: train with the probe attached, then measure every candidate GEMM choice.

Writes DIR/probe_stats.npz (the statistics), DIR/probe_report.json, DIR/probe_table.txt and
DIR/probe_heatmap.png, and prints the table. With ``--stats FILE`` it skips training and
re-analyses saved statistics (the model is still built, to check that they belong to it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

HELP = "probe where FP8 is safe and fast: per-layer error and speed of candidate GEMM choices"

DESCRIPTION = """\
Train a reference model for a short run with the LoKA probe attached (statistics of every
linear layer's inputs, output gradients and weight, collected every --every steps), then draw
synthetic GEMM operands from those statistics and measure, per layer x GEMM (fwd, dgrad,
wgrad) x candidate choice, the error against a float64 reference (MERE and SQNR) and the
speed-up over bf16 (measured on a GPU when a timing cache has it, else modeled for
--cost-device). Cells are "safe" when MERE <= --max-error and "fast" when the speed-up is
>= --min-speedup.

Outputs in --out DIR: probe_stats.npz, probe_report.json, probe_table.txt, probe_heatmap.png.

examples:
  loka-tune probe --model wukong --preset tiny --data synthetic --steps 200 --every 20 --out probe/
  loka-tune probe --model wukong --preset tiny --stats probe/probe_stats.npz --out probe2/ \\
      --candidates e4m3.row.emulated,e4m3.block.emulated --samples 64
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loka_tune.commands._args import integer, model_arg, number
    from loka_tune.models.registry import MODEL_NAMES, PRESETS

    g = parser.add_argument_group("model and data")
    g.add_argument("--model", required=True, choices=MODEL_NAMES, help="reference model")
    g.add_argument("--preset", default="tiny", choices=PRESETS, help="model size (default: tiny)")
    g.add_argument("--model-arg", action="append", default=[], type=model_arg, metavar="KEY=VALUE",
                   help="override a preset hyperparameter (JSON value); repeatable")
    g.add_argument("--data", default="synthetic", metavar="SPEC",
                   help="synthetic | synthetic:seq_len=32 (with behaviour sequences) | criteo:PATH | "
                        "avazu:PATH | amazon:PATH (with sequences) | module:function (default: synthetic)")
    g.add_argument("--stats", type=Path, metavar="FILE",
                   help="re-analyse saved probe stats (.npz) instead of training")

    t = parser.add_argument_group("training (with the probe attached)")
    t.add_argument("--steps", type=integer("a number of steps", minimum=1), default=200, help="training steps (default: 200)")
    t.add_argument("--every", type=integer("a number of steps", minimum=1), default=20, help="collect statistics every N steps (default: 20)")
    t.add_argument("--batch-size", type=integer("a batch size", minimum=1), default=256, help="training batch size (default: 256)")
    t.add_argument("--lr-dense", type=number("a learning rate", minimum=0.0, strict=True), default=1e-3, help="dense learning rate (default: 1e-3)")
    t.add_argument("--lr-sparse", type=number("a learning rate", minimum=0.0, strict=True), default=1e-2, help="embedding learning rate (default: 1e-2)")
    t.add_argument("--seed", type=integer("a seed", minimum=0), default=0, help="model init, data order and draw seed (default: 0)")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")

    m = parser.add_argument_group("measurement")
    m.add_argument("--candidates", default=None, metavar="LIST",
                   help="comma-separated GEMM choices (default: bf16, e4m3 tensor/row/block, mxfp8,"
                        " e5m2+e4m3 tensor/row, all on the emulated backend)")
    m.add_argument("--samples", type=integer("a number of draws", minimum=1), default=64, help="draws per layer (default: 64)")
    m.add_argument("--dists", default="learned,normal",
                   help="distributions: learned, normal, real (default: learned,normal)")
    m.add_argument("--max-rows", type=integer("a number of rows", minimum=1), default=None,
                   help="cap on the rows M of sampled GEMMs (default: 4096)")
    m.add_argument("--weights", default="model", choices=("model", "current"),
                   help="learned weights: matrix-normal draws or the current weight (default: model)")
    m.add_argument("--max-error", type=number("an error bound", minimum=0.0, strict=True), default=None, help="safe if MERE <= this (default: 0.2)")
    m.add_argument("--min-speedup", type=number("a speed-up", minimum=0.0), default=None, help="fast if speed-up >= this (default: 1.05)")
    m.add_argument("--cost-device", default="h200", help="GPU priced by the cost model (default: h200)")
    m.add_argument("--timing-cache", type=Path, default=None, metavar="FILE",
                   help="GPU timing cache (loka_tune.kernels.timing) for measured speeds")

    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    o.add_argument("--no-heatmap", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _train_fn(args: argparse.Namespace) -> Callable[[Any, Any], Any]:
    """The trainer of :mod:`loka_tune.objectives` (the probe layer itself never imports it)."""
    from loka_tune.objectives.trainer import TrainConfig, train

    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr_dense=args.lr_dense,
                      lr_sparse=args.lr_sparse, seed=args.seed, device=args.device,
                      window=min(50, args.steps), eval_batches=4)

    def fn(model: Any, source: Any) -> Any:
        result = train(model, source, cfg, progress=not args.no_progress)
        if result.status != "ok":
            print(f"loka-tune probe: warning: training ended with status {result.status!r}"
                  f" (step {result.nonfinite_step})", file=sys.stderr)
        return result

    return fn


def run(args: argparse.Namespace) -> int:
    import torch

    from loka_tune.commands._output import check_output, write_error
    from loka_tune.data import parse_data_spec
    from loka_tune.models import build_model
    from loka_tune.probe import DEFAULT_MAX_ERROR, ProbeStats, measure
    from loka_tune.probe.measure import DEFAULT_MIN_SPEEDUP
    from loka_tune.probe.run import collect
    from loka_tune.probe.synth import MAX_ROWS

    check_output(args.out, "--out", is_dir=True)  # before training, not after
    cands = None if args.candidates is None else [c for c in args.candidates.split(",") if c.strip()]
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]

    source = parse_data_spec(args.data)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.preset, num_dense=source.num_dense,
                        cardinalities=list(source.cardinalities), base_rate=getattr(source, "base_rate", None),
                        **dict(args.model_arg))
    try:
        args.out.mkdir(exist_ok=True)  # its parent exists: check_output said so
    except OSError as e:
        raise write_error(args.out, "--out", e) from None
    if args.stats is not None:
        stats = ProbeStats.load(args.stats, model=model)
    else:
        stats = collect(model, source, _train_fn(args), every=args.every, seed=args.seed)
        stats.meta.update(model=args.model, preset=args.preset, data=args.data, steps=args.steps,
                          batch_size=args.batch_size, seed=args.seed)
        path = stats.save(args.out / "probe_stats.npz")
        print(f"probe stats: {path}", file=sys.stderr)
    timing_cache = None
    if args.timing_cache is not None:
        from loka_tune.kernels.timing import TimingCache

        timing_cache = TimingCache(args.timing_cache)
    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    report = measure(
        stats, cands, samples=args.samples, dists=dists, cost_device=args.cost_device,
        device="cuda" if on_cuda and args.device == "auto" else (args.device if on_cuda else "cpu"),
        timing_cache=timing_cache, max_rows=args.max_rows or MAX_ROWS, weights=args.weights,
        max_error=DEFAULT_MAX_ERROR if args.max_error is None else args.max_error,
        min_speedup=DEFAULT_MIN_SPEEDUP if args.min_speedup is None else args.min_speedup,
        seed=args.seed, progress=not args.no_progress,
    )
    report.save(args.out / "probe_report.json")
    table = report.table()
    (args.out / "probe_table.txt").write_text(table + "\n")
    if not args.no_heatmap:
        report.heatmap(args.out / "probe_heatmap.png")
    print(table)
    print(f"\nwrote {args.out}/probe_report.json, probe_table.txt"
          + ("" if args.no_heatmap else ", probe_heatmap.png"), file=sys.stderr)
    return 0
