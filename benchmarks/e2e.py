"""End-to-end evaluation (issue 8): a tuned config against bf16 and uniform FP8 policies.

For one study's model and data (``--study``, e.g. ``studies/wukong_h200.toml``; ``--preset``
and ``--batch`` override it), trains each variant from the same initial weights on the same
data order (paired: seed ``s`` of every variant sees the same batches) with the product's
trainer (:func:`loka_tune.objectives.trainer.train`: CUDA-event step times, median after
``--warmup`` steps; quantization and optimizers included; ``--compile`` wraps the model in
``torch.compile``), and reports per variant:

- the train step time (median over seeds), speed-up vs bf16 and vs bf16 with the config's Mods;
- the eval log loss, and the relative log loss vs bf16 + Mods and vs bf16 of the same seed
  (mean and standard deviation over ``--seeds``);
- with ``--infer-batches``, the eval-mode forward latency (``torch.no_grad``; compiled with
  ``--compile``) of the trained model at those serving batch sizes, vs bf16 + Mods.

Variants (``--variants``, comma list, in this order by default; each name is one of):

- ``bf16``: no Mods, bf16 autocast; ``bf16_mods``: the config's Mods (``--config``), bf16;
- ``config``: the exported loka-tune config (``--config``: Mods and per-site precision);
- ``torchao_tensorwise`` / ``torchao_rowwise``: torchao's own float8 training
  (``convert_to_float8_training``, ``Float8LinearConfig.from_recipe_name``) on every linear it
  accepts (dims divisible by 16), after the same Mods; ``torchao_tensorwise_filter`` /
  ``torchao_rowwise_filter``: with torchao's size filter (``_auto_filter_for_recipe``);
- ``fbgemm_rowwise``, ``scaled_mm_rowwise``, ``triton_rowwise``: one loka-tune backend
  (``e4m3.row.fa.<backend>``) on every GEMM it runs at the GEMM's real shape (bf16 where the
  backend declares the shape unsupported, counted as fallbacks), through ``loka_tune.apply``,
  after the same Mods: the best of these is "our best single backend everywhere";
  ``scaled_mm_rowwise_filter``: the same on the Linears that torchao's rowwise size filter
  accepts (like for like with ``torchao_rowwise_filter``: the unfiltered policy also runs the
  Wukong feature-axis Linears, whose wgrad is a 16-32 wide output over B x 256 rows, where a
  rowwise FP8 GEMM has no split-K and loses badly). ``scaled_mm_tensorwise_filter`` /
  ``scaled_mm_tensorwise_fa_filter``: e4m3 tensorwise on torchao's tensorwise sites, without /
  with fast accumulation (in all three GEMMs: the ``tensorwise_fa`` recipe). These take the
  process's dual-cast mode (:mod:`loka_tune.kernels.dualcast`; default ``off``: inductor's casts);
  ``scaled_mm_tensorwise_dualcast_filter`` is ``scaled_mm_tensorwise_filter`` with the mode
  ``auto``: each shared operand cast into both FP8 layouts by ``torch.ops.loka.cast_dual`` (the
  A/B of the op); ``config_dualcast`` is ``config`` with the mode ``auto``.
- ``static_tensorwise_filter``: e4m3 tensorwise on the Linears torchao's tensorwise size filter
  accepts, each one's input cast with a scale calibrated before training (4 batches, margin 2)
  instead of its own amax per call (``benchmarks/static_scales.py``): does a fixed activation
  scale pay in the compiled training step, as it does in serving, and what does it cost in loss?
- ``delayed_tensorwise_filter``: the same sites, ``x`` and ``dy`` cast by *delayed* scales (the
  amax of the step before, times a margin of 2, filled by one calibration pass of forward and
  backward before training: ``benchmarks/delayed_scales.py``), so that inductor can fuse each cast
  into the operand's producer and the wgrad's transposed copy is read from the FP8 one: does it
  pay, and what does it cost in loss? ``delayed_dualcast_tensorwise_filter``: the weight's scale
  delayed too, and every operand cast by one Triton kernel that writes both FP8 layouts and takes
  the next step's amax in the same pass (no amax pass over the fp32 weights).
- ``chain_tensorwise_filter``: the same sites, each MLP among them (``linear -> BlockNorm(256) ->
  Hard Swish`` blocks, and a Wukong FMB's ``out`` after it) one FP8 chain whose norms write the
  next GEMM's FP8 operands, and the previous GEMM's FP8 gradients, themselves (delayed scales; no
  bf16 copy of either: ``benchmarks/fp8_chain.py``); any other site as in
  ``delayed_dualcast_tensorwise_filter``.
- ``scaled_mm_tensorwise_chain_filter`` / ``scaled_mm_tensorwise_dualcast_chain_filter``: the
  product's form of the chains: ``scaled_mm_tensorwise_filter`` / ``..._dualcast_filter`` with
  the ``fp8_chain`` Mod on (``loka_tune.apply`` makes the chains; every other site a LokaLinear
  with dynamic scales; the trainer fills the chains' delayed amaxes from its first batch).
- ``dualcast_tensorwise_filter``: the same sites, dynamic scales, each operand (``x``, ``w``,
  ``dy``) cast by one kernel that writes both of its FP8 layouts (``benchmarks/cast_dual.py``):
  do inductor's separate transposing casts cost more than the fusion an opaque cast gives up?

Compiled runs are held to account (:func:`loka_tune.objectives.compiled.strict_compile`):
each variant starts from a reset dynamo (its own compiles, as in a fresh process), a
recompile-limit hit raises instead of running eagerly, and a graph break or a run that
compiled nothing fails the variant loudly (its row says why; the exit status is 1). Each
record keeps dynamo's counters, the GPU kernel time per step of ``--profile-steps`` profiled
steps beside the step's wall time (``wall/GPU`` near 1: the step is GPU-bound), the GEMM
share, the GPU time per kind of kernel (FP8 GEMM, GEMM, embedding, optimizer, reduction,
pointwise, copy, other: ``kernel_kind``; a second table in table.md, against bf16 + Mods), every
kernel that writes an FP8 operand or takes an amax (``fp8_casts``, ``amax``: uncapped, the last two
columns of that table) and the 30 largest kernels. ``--cuda-graphs`` captures each whole training step in a
CUDA graph (the trainer's ``cuda_graphs``).

Inference of the ``config`` variant runs the *serving plan* of the config at each serving
batch: a site keeps its FP8 forward only where the H200 cost model prices it faster than bf16
at that batch's rows (``--no-serving-plan``: the training config as it is).

GPU-only variants are recorded as skipped on a CPU. Results are written to ``--out`` after
every run (a run that dies keeps what finished); ``--budget`` seconds of wall time stop
starting new variants. Example (the BENCHMARKS.md table):

    python benchmarks/e2e.py --study studies/wukong_h200.toml --batch 8192 --steps 150 --seeds 0 \\
        --config best.json --compile --infer-batches 512,2048,8192 --out $OUT/e2e
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_tune.applier import apply  # noqa: E402
from loka_tune.config import BF16, ModsConfig, PrecisionConfig, SitePrecision  # noqa: E402
from loka_tune.data.base import model_inputs  # noqa: E402
from loka_tune.kernels.dualcast import dual_cast_mode  # noqa: E402
from loka_tune.objectives.compiled import CompileHealthError, strict_compile  # noqa: E402
from loka_tune.objectives.trainer import TrainConfig, train  # noqa: E402

VARIANTS = ("bf16", "bf16_mods", "config", "torchao_tensorwise", "torchao_rowwise", "torchao_tensorwise_filter",
            "torchao_rowwise_filter", "fbgemm_rowwise", "scaled_mm_rowwise", "triton_rowwise",
            "scaled_mm_rowwise_filter", "scaled_mm_tensorwise_filter", "scaled_mm_tensorwise_fa_filter",
            "static_tensorwise_filter", "dualcast_tensorwise_filter", "scaled_mm_tensorwise_dualcast_filter",
            "config_dualcast", "delayed_tensorwise_filter", "delayed_dualcast_tensorwise_filter",
            "chain_tensorwise_filter", "scaled_mm_tensorwise_chain_filter", "scaled_mm_tensorwise_dualcast_chain_filter")
_DUAL = {"scaled_mm_tensorwise_dualcast_filter", "config_dualcast", "scaled_mm_tensorwise_dualcast_chain_filter"}  # run with the dual-cast mode "auto"
_UNIFORM = {"fbgemm_rowwise": "e4m3.row.fa.fbgemm", "scaled_mm_rowwise": "e4m3.row.fa.torch_scaled_mm",
            "triton_rowwise": "e4m3.row.fa.triton", "scaled_mm_rowwise_filter": "e4m3.row.fa.torch_scaled_mm",
            # LokaLinear's tensorwise path (operands quantized once when compiled) on torchao's tensorwise sites
            "scaled_mm_tensorwise_filter": "e4m3.tensor.torch_scaled_mm",
            # the same with loka::cast_dual instead of inductor's casts (dual-cast mode "auto": the A/B)
            "scaled_mm_tensorwise_dualcast_filter": "e4m3.tensor.torch_scaled_mm",
            # the same with fast accumulation in all three GEMMs (the tensorwise_fa recipe)
            "scaled_mm_tensorwise_fa_filter": "e4m3.tensor.fa.torch_scaled_mm",
            # the product's FP8 chains (the fp8_chain Mod) on those sites, the other sites as
            # scaled_mm_tensorwise_filter's / _dualcast_filter's
            "scaled_mm_tensorwise_chain_filter": "e4m3.tensor.torch_scaled_mm",
            "scaled_mm_tensorwise_dualcast_chain_filter": "e4m3.tensor.torch_scaled_mm"}
_GPU_ONLY = {"torchao_tensorwise", "torchao_rowwise", "torchao_tensorwise_filter", "torchao_rowwise_filter",
             "static_tensorwise_filter", "dualcast_tensorwise_filter", "delayed_tensorwise_filter",
             "delayed_dualcast_tensorwise_filter", "chain_tensorwise_filter", *_UNIFORM}  # (CPU torch._scaled_mm: a reference loop, ~1 GFLOP/s)


def _torchao(model: nn.Module, recipe: str, size_filter: bool) -> dict[str, Any]:
    """torchao's float8 training on ``model`` (in place); returns what it converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    if size_filter:
        keep: Callable[[nn.Module, str], bool] = _auto_filter_for_recipe(recipe, filter_fqns=[])
    else:
        def keep(mod: nn.Module, fqn: str) -> bool:  # torchao's hardware requirement only
            return isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
    seen: list[str] = []

    def filt(mod: nn.Module, fqn: str) -> bool:
        ok = keep(mod, fqn)
        if ok and isinstance(mod, nn.Linear):
            seen.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=filt, config=Float8LinearConfig.from_recipe_name(recipe))
    return {"fp8_sites": len(seen), "sites": seen}


def prepare(name: str, model: nn.Module, config: PrecisionConfig, *, source: Any = None, batch_size: int = 0,
            device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Turn a fresh bf16 ``model`` into variant ``name`` in place; returns what was done.

    Every variant takes the config's Mods but the ``fp8_chain`` Mod, which only ``config`` (as
    exported) and the ``*_chain_filter`` variants run: ``scaled_mm_tensorwise_filter`` is the
    plain recipe on our backend whatever the export chose (the reference issue 21's bar compares
    the export with), and bf16 + Mods has nothing to chain."""
    mods = replace(config.mods, fp8_chain=False)
    if name == "bf16":
        return {"fp8_sites": 0}
    if name == "bf16_mods":
        apply(model, PrecisionConfig(mods=mods))
        return {"fp8_sites": 0, "mods": mods.short_str()}
    if name in ("config", "config_dualcast"):
        s = apply(model, config, strict=False)
        return {"fp8_sites": len(s.replaced) + len(s.chained), "fallbacks": len(s.fallbacks),
                "mods": config.mods.short_str(),
                **({"chains": s.chains, "chain_skipped": s.chain_skipped} if s.fp8_chain else {})}
    if name.startswith("torchao_"):
        if mods.any:
            apply(model, PrecisionConfig(mods=mods))
        recipe = name.split("_")[1]
        return {**_torchao(model, recipe, name.endswith("_filter")), "mods": mods.short_str()}
    if name in _UNIFORM:
        if mods.any:
            apply(model, PrecisionConfig(mods=mods))
        recipe = "tensorwise" if "tensorwise" in name else "rowwise"
        only = _torchao_filtered(model, recipe) if name.endswith("_filter") else None
        cfg, kept_bf16 = uniform_config(model, _UNIFORM[name], source, batch_size, device, only=only)
        run_mods = replace(mods, fp8_chain=True) if name.endswith("_chain_filter") else mods
        s = apply(model, replace(cfg, mods=run_mods), strict=False)
        return {"fp8_sites": len(s.replaced) + len(s.chained), "fallbacks": len(s.fallbacks) + kept_bf16,
                "mods": run_mods.short_str(), **({"chains": s.chains, "chain_skipped": s.chain_skipped}
                                                 if run_mods.fp8_chain else {})}
    if name == "static_tensorwise_filter":
        return _static_tensorwise(model, mods, source, batch_size, device)
    if name == "dualcast_tensorwise_filter":
        return _dualcast_tensorwise(model, mods)
    if name == "chain_tensorwise_filter":
        return _chain_tensorwise(model, mods, source, batch_size, device)
    if name in ("delayed_tensorwise_filter", "delayed_dualcast_tensorwise_filter"):
        return _delayed_tensorwise(model, mods, source, batch_size, device, dual=name.startswith("delayed_dual"))
    raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


#: calibration of ``static_tensorwise_filter``: batches (of the run's batch size, seed 1000: not a
#: training seed's order) and the headroom over the largest input seen
STATIC_CALIBRATION_BATCHES = 4
STATIC_MARGIN = 2.0


def _filter_sites_after_mods(model: nn.Module, mods: ModsConfig) -> list[str]:
    """Apply ``mods``, then name the plain ``nn.Linear`` modules that torchao's tensorwise size
    filter keeps (``loka_tune.recipes.SIZE_FILTERS``, its filter restated); puts this folder on
    ``sys.path`` for the benchmark modules the variants swap in (when this file is imported)."""
    from loka_tune.recipes import SIZE_FILTERS

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)  # benchmarks/static_scales.py, cast_dual.py (tests, serve.py)
    if mods.any:
        apply(model, PrecisionConfig(mods=mods))
    keep = SIZE_FILTERS["tensorwise"]
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and keep.keeps(m.in_features, m.out_features)]


def _static_tensorwise(model: nn.Module, mods: ModsConfig, source: Any, batch_size: int,
                       device: torch.device) -> dict[str, Any]:
    """e4m3 tensorwise on torchao's tensorwise filter sites (``loka_tune.recipes.SIZE_FILTERS``,
    its size filter restated) with each site's input cast by a calibrated scale instead of its
    own amax (``benchmarks/static_scales.py``); the weight and the output gradient stay per call."""
    names = _filter_sites_after_mods(model, mods)
    from static_scales import calibrate, swap_static

    swapped = swap_static(model, names, margin=STATIC_MARGIN)
    it = iter(source.batches("train", batch_size, seed=1000, device=device))
    batches = [model_inputs(model, next(it)) for _ in range(STATIC_CALIBRATION_BATCHES)]
    amax = calibrate(model, batches, autocast=torch.bfloat16)
    return {"fp8_sites": len(swapped), "sites": swapped, "mods": mods.short_str(), "calibration_amax": amax,
            "calibration": {"batches": STATIC_CALIBRATION_BATCHES, "margin": STATIC_MARGIN}}


def _dualcast_tensorwise(model: nn.Module, mods: ModsConfig) -> dict[str, Any]:
    """e4m3 tensorwise on torchao's tensorwise filter sites with each operand cast once into both
    FP8 layouts by one kernel (``benchmarks/cast_dual.py``), dynamic scales as torchao's."""
    names = _filter_sites_after_mods(model, mods)
    from cast_dual import swap_dual

    swapped = swap_dual(model, names)
    return {"fp8_sites": len(swapped), "sites": swapped, "mods": mods.short_str()}


#: calibration of ``delayed_tensorwise_filter``: forward + backward passes (of the run's batch size,
#: seed 1000) that fill the amax buffers before training
DELAYED_CALIBRATION_BATCHES = 1


def _delayed_tensorwise(model: nn.Module, mods: ModsConfig, source: Any, batch_size: int,
                        device: torch.device, *, dual: bool = False) -> dict[str, Any]:
    """e4m3 tensorwise on torchao's tensorwise filter sites with ``x`` and ``dy`` cast by delayed
    scales (the last step's amax times a margin: ``benchmarks/delayed_scales.py``), so that the
    casts fuse into the operands' producers; the weight keeps its own amax per call. ``dual``:
    the weight's scale is delayed too, and each operand is cast by one kernel that writes both
    FP8 layouts and takes the next step's amax in the same pass."""
    names = _filter_sites_after_mods(model, mods)
    import torch.nn.functional as F
    from delayed_scales import MARGIN, calibrate, swap_delayed

    swapped = swap_delayed(model, names, dual=dual)
    it = iter(source.batches("train", batch_size, seed=1000, device=device))
    raw = [next(it) for _ in range(DELAYED_CALIBRATION_BATCHES)]

    def loss(out: torch.Tensor, i: int) -> torch.Tensor:  # the trainer's loss (objectives/step.py)
        return F.binary_cross_entropy_with_logits(out.float().reshape(-1), raw[i].labels.float().reshape(-1))

    amax = calibrate(model, [model_inputs(model, b) for b in raw], loss, autocast=torch.bfloat16)
    return {"fp8_sites": len(swapped), "sites": swapped, "mods": mods.short_str(), "calibration_amax": amax,
            "calibration": {"batches": DELAYED_CALIBRATION_BATCHES, "margin": MARGIN}, "dual": dual}


def chain_sites(model: nn.Module, names: list[str]) -> tuple[list[str], list[str]]:
    """Swap the MLPs (``linear -> BlockNorm(256) -> Hard Swish`` blocks) whose linears are among
    ``names`` for FP8 chains (``benchmarks/fp8_chain.py``), each Wukong FMB's MLP with its ``out``
    as the chain's tail when ``out`` is among them too, and the rest of ``names`` for
    ``DelayedScaleLinear(dual=True)``; returns (the linears in chains, the rest)."""
    from delayed_scales import swap_delayed
    from fp8_chain import swap_chain

    wanted, covered = set(names), []
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ != "MLP" or not any(f"{name}.{j}.linear" in wanted for j in range(len(mod))):
            continue
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        tail = f"{parent_name}.out" if type(parent).__name__ == "FactorizationMachineBlock" else None
        try:
            covered += swap_chain(model, name, tail if tail in wanted else None)
        except ValueError:  # no block of it can join a chain: its sites stay for the per-layer swap
            continue
    rest = [n for n in names if n not in set(covered)]
    if rest:
        swap_delayed(model, rest, dual=True)
    return sorted(covered), rest


def _chain_tensorwise(model: nn.Module, mods: ModsConfig, source: Any, batch_size: int,
                      device: torch.device) -> dict[str, Any]:
    """e4m3 tensorwise on torchao's tensorwise filter sites, the MLPs among them as FP8 chains whose
    norms write the FP8 operands with delayed scales (``benchmarks/fp8_chain.py``), any other site a
    ``DelayedScaleLinear(dual=True)``; one calibration pass fills every delayed amax."""
    names = _filter_sites_after_mods(model, mods)
    import delayed_scales
    import fp8_chain
    import torch.nn.functional as F

    chained, rest = chain_sites(model, names)
    it = iter(source.batches("train", batch_size, seed=1000, device=device))
    raw = [next(it) for _ in range(DELAYED_CALIBRATION_BATCHES)]
    batches = [model_inputs(model, b) for b in raw]

    def loss(out: torch.Tensor, i: int) -> torch.Tensor:  # the trainer's loss (objectives/step.py)
        return F.binary_cross_entropy_with_logits(out.float().reshape(-1), raw[i].labels.float().reshape(-1))

    layers = [m for m in model.modules() if isinstance(m, delayed_scales.DelayedScaleLinear)]
    for m in layers:  # the chains' pass with the other layers on their own amaxes
        m.own_scales = True
    try:
        chain_amax = fp8_chain.calibrate(model, batches, loss, autocast=torch.bfloat16)
    finally:
        for m in layers:
            m.own_scales = False
    layer_amax = delayed_scales.calibrate(model, batches, loss, autocast=torch.bfloat16)
    return {"fp8_sites": len(chained) + len(rest), "sites": sorted(chained + rest), "chained": chained, "rest": rest,
            "mods": mods.short_str(), "calibration_amax": {**chain_amax, **layer_amax},
            "calibration": {"batches": DELAYED_CALIBRATION_BATCHES, "margin": delayed_scales.MARGIN}}


def _torchao_filtered(model: nn.Module, recipe: str) -> set[str]:
    """Names of the Linears that torchao's size filter for ``recipe`` converts."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe(recipe, filter_fqns=[])
    return {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)}


def uniform_config(model: nn.Module, choice_id: str, source: Any, batch_size: int,
                   device: torch.device, *, only: set[str] | None = None) -> tuple[PrecisionConfig, int]:
    """``choice_id`` on every GEMM of every linear that its backend runs at the GEMM's real shape
    (the batch's rows, 3-D inputs included: e.g. FBGEMM's rowwise GEMM is declared unsupported
    above 32768 reduction rows, which a wgrad over batch x 256 rows exceeds); bf16 for the rest.
    Returns the config and the number of GEMMs left in bf16 that way."""
    from loka_tune.config import BF16, ROLES, GemmChoice
    from loka_tune.kernels.registry import get_backend
    from loka_tune.space.sites import discover_sites

    choice = GemmChoice.parse(choice_id)
    backend = get_backend(choice.backend)
    b = next(iter(source.batches("train", 64, seed=0, device=device)))
    sites = discover_sites(model, *model_inputs(model, b))
    rules, kept = {}, 0
    for site in sites:
        if only is not None and site.name not in only:
            continue
        per_role = []
        for role in ROLES:
            ok = backend.supports(choice, role, device=str(device), shape=site.shape(role, batch_size)) is None
            per_role.append(choice if ok else BF16)
            kept += not ok
        rules[site.name] = SitePrecision(*per_role)
    return PrecisionConfig(sites=rules), kept


def serving_plan(model: nn.Module, batch: int, *, device: str = "h200", min_speedup: float = 1.0) -> dict[str, str]:
    """Switch each LokaLinear's forward to bf16 where the cost model prices its FP8 forward at
    ``batch`` serving rows no faster than bf16 (x ``min_speedup``); returns {site: old fwd}
    so that :func:`restore_plan` can undo it. Sites' rows per example come from the layer's
    last input (3-D inputs: rows = batch x middle dims), recorded by a forward hook."""
    from loka_tune.kernels import costmodel
    from loka_tune.kernels.linear import LokaLinear

    changed: dict[str, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, LokaLinear) or m.precision.fwd.is_bf16 or not getattr(m, "_rows_per_example", None):
            continue
        rows = batch * m._rows_per_example
        try:
            sp = costmodel.modeled_speedup(m.precision.fwd, rows, m.in_features, m.out_features, "fwd", device)
        except Exception:  # a choice the cost model does not price: keep it
            continue
        if sp < min_speedup:
            changed[name] = m.precision.fwd.short_str()
            m.precision = SitePrecision(BF16, m.precision.dgrad, m.precision.wgrad)
    return changed


def restore_plan(model: nn.Module, changed: dict[str, str]) -> None:
    from loka_tune.kernels.linear import LokaLinear

    for name, m in model.named_modules():
        if name in changed and isinstance(m, LokaLinear):
            m.precision = SitePrecision(changed[name], m.precision.dgrad, m.precision.wgrad)


def record_rows_per_example(model: nn.Module, source: Any, dev: torch.device) -> None:
    """One eval forward of 2 rows: each LokaLinear learns its rows per example."""
    from loka_tune.kernels.linear import LokaLinear

    hooks = []
    for m in model.modules():
        if isinstance(m, LokaLinear):
            def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
                mod._rows_per_example = args[0].numel() // (args[0].shape[-1] * 2)  # type: ignore[assignment]
            hooks.append(m.register_forward_pre_hook(hook))
    b = next(iter(source.batches("eval", 2, seed=0, device=dev)))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(*model_inputs(model, b))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def inference_latency(model: nn.Module, source: Any, batch: int, dev: torch.device, *, compile_: bool,
                      reps: int, autocast: bool) -> float:
    """Median seconds of one eval-mode forward at ``batch`` rows (no_grad)."""
    model.eval()
    fwd = torch.compile(model, dynamic=False) if compile_ else model  # one static graph per serving batch
    b = next(iter(source.batches("eval", batch, seed=0, device=dev)))
    inputs = model_inputs(model, b)
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else torch.autocast(dev.type, enabled=False)
    times = []
    with torch.no_grad(), ctx:
        for i in range(reps + 5):
            if dev.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fwd(*inputs)
                e1.record()
                e1.synchronize()
                dt = e0.elapsed_time(e1) / 1e3
            else:
                t0 = time.perf_counter()
                fwd(*inputs)
                dt = time.perf_counter() - t0
            if i >= 5:
                times.append(dt)
    return statistics.median(times)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-variant medians/means over seeds, speed-ups and paired relative log losses."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)

    def step(v: str) -> float | None:
        ok = [r["step_time_s"] for r in by.get(v, []) if r.get("status") == "ok"]
        return statistics.median(ok) if ok else None

    def ll(v: str) -> dict[int, float]:
        return {r["seed"]: r["eval_logloss"] for r in by.get(v, []) if r.get("status") == "ok"}

    rows = []
    for v, rs in by.items():
        row: dict[str, Any] = {"variant": v, "seeds": [r["seed"] for r in rs]}
        first = rs[0]
        for k in ("fp8_sites", "fallbacks", "mods", "skipped", "error"):
            if k in first:
                row[k] = first[k]
        st = step(v)
        row["step_ms"] = None if st is None else st * 1e3
        for ref in ("bf16", "bf16_mods"):
            base = step(ref)
            row[f"speedup_vs_{ref}"] = None if st is None or base is None else base / st
            a, b = ll(v), ll(ref)
            rel = [100.0 * (a[s] / b[s] - 1.0) for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
            row[f"rel_ll_pct_vs_{ref}"] = statistics.fmean(rel) if rel else None
            row[f"rel_ll_pct_vs_{ref}_sd"] = statistics.stdev(rel) if len(rel) > 1 else None
        lls = list(ll(v).values())
        row["eval_logloss"] = statistics.fmean(lls) if lls else None
        gpu = [r["gpu_time_s"] for r in rs if r.get("gpu_time_s")]
        row["gpu_ms"] = 1e3 * statistics.median(gpu) if gpu else None
        row["wall_over_gpu"] = None if not gpu or st is None else st / statistics.median(gpu)
        prof = next((r["profile"] for r in rs if r.get("profile")), None)
        if prof:
            row["gemm_share"] = prof.get("gemm_share")
            row["kernels_per_step"] = prof.get("kernels_per_step")
        kinds = [r["profile"]["kinds"] for r in rs if isinstance((r.get("profile") or {}).get("kinds"), dict)]
        if kinds:  # GPU ms per kind of kernel (kernel_summary), seeds averaged
            row["kinds_ms"] = {k: statistics.fmean(d.get(k, 0.0) for d in kinds) for k in kinds[0]}
        for key in ("fp8_casts", "amax"):  # every cast / amax kernel (kernel_summary, uncapped), seeds averaged
            ms = [r["profile"][key]["ms"] for r in rs if isinstance((r.get("profile") or {}).get(key), dict)]
            if ms:
                row[f"{key}_ms"] = statistics.fmean(ms)
        if "serving_plan" in first:
            row["serving_plan"] = first["serving_plan"]
        inf = [r["infer_s"] for r in rs if "infer_s" in r]
        if inf:
            row["infer_ms"] = {str(k): 1e3 * statistics.median([d[k] for d in inf if k in d]) for k in inf[0]}
        rows.append(row)
    base_inf = next((r.get("infer_ms") for r in rows if r["variant"] == "bf16_mods"), None)
    for r in rows:
        if base_inf and r.get("infer_ms"):
            r["infer_speedup_vs_bf16_mods"] = {k: base_inf[k] / r["infer_ms"][k] for k in r["infer_ms"] if k in base_inf}
    return {"rows": rows}


def table(summary: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| variant | Mods | FP8 sites | step ms | GPU ms | wall/GPU | GEMM share | vs bf16 | vs bf16+Mods |"
             " rel. LL vs bf16+Mods (sd) | rel. LL vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        note = r.get("skipped") or r.get("error")
        if note:
            lines.append(f"| {r['variant']} | | | {note[:120]} | | | | | | | |")
            continue
        sd = r.get("rel_ll_pct_vs_bf16_mods_sd")
        lines.append(
            f"| {r['variant']} | {r.get('mods', 'none')} | {r.get('fp8_sites', 0)} | {f(r['step_ms'], '.2f')} |"
            f" {f(r.get('gpu_ms'), '.2f')} | {f(r.get('wall_over_gpu'), '.3f')} | {f(r.get('gemm_share'), '.2f')} |"
            f" {f(r['speedup_vs_bf16'], '.3f')}x | {f(r['speedup_vs_bf16_mods'], '.3f')}x |"
            f" {f(r['rel_ll_pct_vs_bf16_mods'], '+.3f')}%" + ("" if sd is None else f" ({sd:.3f})") + " |"
            f" {f(r['rel_ll_pct_vs_bf16'], '+.3f')}% |")
    kinds = [r for r in summary["rows"] if r.get("kinds_ms")]
    if kinds:  # where the GPU time goes, by kind of kernel, and against bf16 + Mods where it ran
        names = list(kinds[0]["kinds_ms"])
        ref = next((r["kinds_ms"] for r in kinds if r["variant"] == "bf16_mods"), None)
        lines += ["", "GPU ms per step by kind of kernel (profiled steps" + (", change vs bf16_mods" if ref else "")
                  + "; the last two columns are parts of pointwise + reduction: inductor's kernels that write an"
                  " FP8 operand, and its reductions that take an amax, mostly fused into a norm's own reductions):", "",
                  "| variant | " + " | ".join(names) + " | FP8 casts | amax reductions |",
                  "|---|" + "---|" * (len(names) + 2)]
        for r in kinds:
            lines.append(f"| {r['variant']} | " + " | ".join(
                f"{r['kinds_ms'].get(k, 0.0):.2f}" + ("" if ref is None else f" ({r['kinds_ms'].get(k, 0.0) - ref.get(k, 0.0):+.2f})")
                for k in names) + f" | {f(r.get('fp8_casts_ms'), '.2f')} | {f(r.get('amax_ms'), '.2f')} |")
    inf = [r for r in summary["rows"] if r.get("infer_ms")]
    if inf:
        sizes = list(inf[0]["infer_ms"])
        lines += ["", "| variant | " + " | ".join(f"fwd ms @ {b}" for b in sizes) + " | speed-up vs bf16+Mods |",
                  "|---|" + "---|" * (len(sizes) + 1)]
        for r in inf:
            sp = r.get("infer_speedup_vs_bf16_mods", {})
            lines.append(f"| {r['variant']} | " + " | ".join(f"{r['infer_ms'][b]:.3f}" for b in sizes)
                         + " | " + ", ".join(f"{sp[b]:.2f}x" for b in sizes if b in sp) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, required=True, help="study file: model, preset, data, learning rates")
    ap.add_argument("--model", default=None, help="override the study's model (a registered name, e.g. interformer)")
    ap.add_argument("--preset", default=None, help="override the study's model preset")
    ap.add_argument("--batch", type=int, default=None, help="override the study's batch size")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=30, help="steps left out of the step-time median")
    ap.add_argument("--seeds", default="0", help="comma list: paired runs per variant")
    ap.add_argument("--config", type=Path, default=None, help="the exported loka-tune config (JSON)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (training and inference); "
                    "every variant is checked: no graph break, no eager fallback, no recompile-limit hit")
    ap.add_argument("--cuda-graphs", action="store_true", help="capture each whole training step in a CUDA graph")
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="profile the last N training steps: GPU kernel time per step, GEMM share (0: off)")
    ap.add_argument("--no-serving-plan", action="store_true",
                    help="time the config's inference with its training precision everywhere")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--infer-batches", default="", help="comma list of serving batch sizes (empty: skip)")
    ap.add_argument("--infer-variants", default="bf16,bf16_mods,config")
    ap.add_argument("--infer-reps", type=int, default=30)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds: start no new run after this")
    ap.add_argument("--chain-margin", type=float, default=None,
                    help="the FP8 chains' delayed-scale margin for this run (an A/B; default: the product's, 2)")
    ap.add_argument("--chain-grad", choices=("e4m3", "e5m2"), default=None,
                    help="the FP8 chains' gradient format for this run (an A/B; default: the product's, "
                         "loka_tune.kernels.chain.GRAD_FORMAT, e5m2 as torchao's tensorwise recipe)")
    ap.add_argument("--chain-trace", action="store_true",
                    help="record the FP8 chains' amaxes each step (one on-device copy a chain a step, outside the "
                         "compiled step) and report, per chain, the largest step-to-step growth of its operands and "
                         "the steps where one outgrew its margin, i.e. saturated: key chain_amax. A diagnosis, off "
                         "by default so that timed rows carry no extra work")
    ap.add_argument("--nproc", type=int, default=1,
                    help="data-parallel training over N processes, one GPU each (torchrun, DDP; --batch stays the"
                         " global batch); inference is then skipped. Scaling: benchmarks/scaling.py")
    ap.add_argument("--out", type=Path, required=True, help="output folder (results.json, table.md)")
    args = ap.parse_args(argv)

    from loka_tune.objectives.distributed import dist_env, launch, process_group, rank_device, strip_nproc

    env = dist_env()
    if args.nproc > 1 and env is None:  # launch this script under torchrun and wait
        return launch(args.nproc, [__file__, *strip_nproc(sys.argv[1:] if argv is None else argv)])
    if env is not None and args.infer_batches:
        args.infer_batches = ""  # serving is one GPU: measure it in a one-process run
    main_rank = env is None or env.is_main

    from loka_tune.tuner.build import make_model, make_source, resolve_device
    from loka_tune.tuner.study import load_study

    t_start = time.perf_counter()
    cfg = load_study(args.study)
    if args.model:
        cfg = replace(cfg, model=replace(cfg.model, name=args.model, overrides={}))
    if args.preset:
        cfg = replace(cfg, model=replace(cfg.model, preset=args.preset))
    dev = torch.device(resolve_device(args.device))
    if env is not None:
        dev = rank_device(env, dev)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    source = make_source(cfg)
    config = PrecisionConfig.load(args.config) if args.config else PrecisionConfig(
        mods=ModsConfig(no_bias=True, blocknorm=256, hardswish=True))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if {"config", "config_dualcast"} & set(names) and args.config is None:
        raise SystemExit("the 'config' variants need --config best.json (loka-tune export STUDY --out best.json)")
    infer_sizes = [int(b) for b in args.infer_batches.split(",") if b.strip()]
    infer_variants = {v.strip() for v in args.infer_variants.split(",")}
    t = cfg.training
    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch or t.batch_size, lr_dense=t.lr_dense,
                       lr_sparse=t.lr_sparse, lr_warmup_steps=t.lr_warmup_steps,
                       lr_cooldown_steps=min(t.lr_cooldown_steps, args.steps),
                       warmup_steps=min(args.warmup, args.steps - 1), window=min(25, args.steps),
                       eval_batches=args.eval_batches, device=str(dev), compile=args.compile,
                       log_every=max(args.steps, 10), cuda_graphs=args.cuda_graphs,
                       profile_steps=min(args.profile_steps, max(args.steps - args.warmup - 1, 0)))
    meta = {"study": str(args.study), "model": cfg.model.name, "preset": cfg.model.preset, "batch": tcfg.batch_size,
            "steps": args.steps, "warmup": tcfg.warmup_steps, "seeds": seeds, "compile": args.compile,
            "compile_mode": "default" if args.compile else None, "cuda_graphs": args.cuda_graphs,
            "profile_steps": tcfg.profile_steps, "serving_plan": not args.no_serving_plan,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "config": str(args.config) if args.config else None, "config_mods": config.mods.short_str(),
            "argv": sys.argv[1:] if argv is None else argv, "nproc": env.world_size if env is not None else 1,
            "chain_margin": args.chain_margin, "chain_grad": args.chain_grad, "chain_trace": args.chain_trace}
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    failed: list[str] = []

    def run_variant(name: str, seed: int, rec: dict[str, Any]) -> None:
        torch.manual_seed(seed)
        model = make_model(cfg, source, seed=seed)
        model.to(dev)
        rec.update(prepare(name, model, config, source=source, batch_size=tcfg.batch_size, device=dev))
        trace = None
        if any(type(m).__name__ == "ChainMLP" for m in model.modules()):
            here = str(Path(__file__).resolve().parent)
            if here not in sys.path:
                sys.path.insert(0, here)  # benchmarks/fp8_chain.py (when this file is imported)
            import fp8_chain

            if args.chain_margin is not None:
                rec["chain_margin"] = args.chain_margin
                fp8_chain.set_margin(model, args.chain_margin)
            if args.chain_grad is not None:
                rec["chain_grad"] = args.chain_grad
                fp8_chain.set_grad_format(model, args.chain_grad)
            trace = fp8_chain.AmaxTrace(model) if args.chain_trace else None
        res = train(model, source, replace(tcfg, seed=seed), progress=False, after_step=trace)
        if trace is not None:
            rec["chain_amax"] = trace.summary()
        rec.update(status=res.status, step_time_s=res.step_time_s, eval_logloss=res.eval_logloss,
                   eval_ne=res.eval_ne, eval_auc=res.eval_auc, wall_s=res.wall_s, gpu_time_s=res.gpu_time_s,
                   profile=res.profile)
        if infer_sizes and name in infer_variants and res.status == "ok":
            rec["infer_s"], plans = {}, {}
            if name == "config" and not args.no_serving_plan:
                record_rows_per_example(model, source, dev)
            for b in infer_sizes:
                changed = serving_plan(model, b) if name == "config" and not args.no_serving_plan else {}
                plans[str(b)] = sorted(changed)
                rec["infer_s"][str(b)] = inference_latency(model, source, b, dev, compile_=args.compile,
                                                           reps=args.infer_reps, autocast=dev.type == "cuda")
                restore_plan(model, changed)
            if name == "config" and not args.no_serving_plan:
                rec["serving_plan"] = {"bf16_fwd_sites": plans}
        del model

    def dump() -> None:
        if not main_rank:
            return
        summary = summarize(runs)
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs, **summary}, indent=1))
        (args.out / "table.md").write_text(table(summary) + "\n")

    group = process_group(env, dev) if env is not None else contextlib.nullcontext()
    with group:  # one process group for every variant's run (train() joins it)
        for name in names:
            for seed in seeds:
                rec: dict[str, Any] = {"variant": name, "seed": seed}
                if time.perf_counter() - t_start > args.budget:
                    rec["skipped"] = "over the --budget"
                elif name in _GPU_ONLY and dev.type != "cuda":
                    rec["skipped"] = "needs a CUDA GPU"
                else:
                    guard = strict_compile() if args.compile else contextlib.nullcontext({})
                    cast_mode = dual_cast_mode("auto") if name in _DUAL else contextlib.nullcontext()
                    try:
                        with guard as dynamo, cast_mode:
                            run_variant(name, seed, rec)
                        if args.compile:
                            rec["dynamo"] = dynamo
                    except Exception as e:  # record it and go on: one broken variant must not hide the rest
                        rec["error"] = f"{type(e).__name__}: {e}"[:400]
                        if isinstance(e, CompileHealthError):
                            print(f"!! {name} seed {seed}: {e}", flush=True)
                        failed.append(name)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                runs.append(rec)
                dump()
                shown = {k: rec[k] for k in ("status", "step_time_s", "eval_logloss", "fp8_sites", "skipped", "error")
                         if k in rec}
                if main_rank:
                    print(f"[e2e {time.perf_counter() - t_start:6.0f}s] {name} seed {seed}: {shown}", flush=True)
    dump()
    if not main_rank:
        return 1 if failed else 0
    print()
    print(table(summarize(runs)))
    if failed:
        print(f"\n{len(failed)} run(s) failed: {', '.join(sorted(set(failed)))} (their rows say why)")
    return 1 if failed else 0


if __name__ == "__main__":
    _code = main()
    from loka_tune.objectives.distributed import exit_rank

    exit_rank(_code)  # a torchrun rank ends without interpreter finalization (see exit_rank)
    raise SystemExit(_code)
