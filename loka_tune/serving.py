"""Serving a config: static FP8 weights, a plan per batch bucket, padded static shapes.

The serving form of a config is one call::

    summary = loka_tune.apply(model, "best.json", serving=True, batch=2048)   # in place
    fast = torch.compile(model, mode="reduce-overhead", dynamic=False)        # CUDA graphs
    with torch.no_grad():
        logits = fast(*inputs)                                               # 2048 rows

``apply(..., serving=True)`` (rather than a separate verb: it is the same config, the same Mods,
the same site resolution and the same all-or-nothing swap, read for another use) puts a
:class:`~loka_tune.kernels.serving.ServingLinear` in place of every site whose fwd choice is
FP8: its weight is quantized once (tensor-, row- or blockwise as the choice says, on its
backend), only the activation is quantized per call, and there is no dgrad / wgrad (a backward
raises :class:`~loka_tune.errors.ServingError`). Sites whose fwd choice is bf16 stay plain
``nn.Linear``: a config whose FP8 choices are all in dgrad / wgrad serves in bf16 (its
summary says so). With ``mods.fuse_epilogue``, each Linear -> BlockNorm -> Hard Swish chain
whose served choice the fused kernel runs becomes a
:class:`~loka_tune.kernels.serving.ServingFusedBlock`.

``batch=B`` reads the config's serving plan (:class:`~loka_tune.config.ServingPlan`, the
``serving`` section): the smallest bucket holding ``B`` rows gives each site's fwd choice
(``bf16`` where FP8 does not pay at that size). The plan is priced by :func:`plan_serving`:
per bucket and site, the fwd GEMM with a static weight against bf16, from the cost model on a
CPU (``estimate_gemm_seconds(..., static_b=True)``, labelled "modeled") or timed on the GPU
(:func:`loka_tune.kernels.serve_timing.time_serving_site`: compiled with CUDA graphs, GPU
kernel time from the profiler, "measured"). :func:`serve_buckets` builds one served copy of a
model per bucket (every tensor but the served weights shared) behind :class:`ServingBuckets`,
which pads a batch up to its bucket so that shapes stay static for CUDA graphs.

:func:`serving_form` is the serving copy of a model already applied for *training* (its
LokaLinear sites served with their fwd choices, tensors shared): what the inference objective
times. ``apply(serving=True)`` itself refuses such a model (and an already served one).

Errors name the bad value and the fix: a fwd choice whose backend has no static-weight path
or cannot run here -> :class:`UnsupportedChoiceError` (``strict=False``: that site serves in
bf16, listed in ``summary.fallbacks``); ``batch`` above every bucket -> :class:`ServingError`;
``batch`` without a plan, or a plan naming no layer of the model -> :class:`ConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, cast

import torch
from torch import nn

from loka_tune.config import BF16, GemmChoice, GemmRole, PrecisionConfig, ServingPlan
from loka_tune.errors import BackendError, ConfigError, ServingError, UnsupportedChoiceError

if TYPE_CHECKING:
    from loka_tune.applying import ApplySummary

__all__ = ["serving_form", "ServingBuckets", "CapturedBuckets", "serve_buckets", "plan_serving", "site_rows",
           "verify_serving_plan", "time_served_model", "calibrate", "Calibration", "DEFAULT_BUCKETS",
           "WHOLE_MODEL_ALTERNATIVES", "ALL_ALTERNATIVES"]

DEFAULT_BUCKETS = (512, 2048, 8192)  # the serving batch sizes of issue 23 (small, medium, production)

#: ``timer(served_model, rows, inputs) -> seconds`` of :func:`verify_serving_plan`
ModelTimer = Callable[[nn.Module, int, Sequence[Any]], float]
#: the whole-model alternatives :func:`verify_serving_plan` times per bucket, by default
WHOLE_MODEL_ALTERNATIVES = ("sites", "tensor", "tensor_all", "bf16")
#: every alternative verify_serving_plan knows
ALL_ALTERNATIVES = ("sites", "tensor", "row", "tensor_all", "row_all", "bf16")


# ----------------------------------------------------------------------------- helpers
def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``'s module tree that shares every parameter and buffer tensor."""
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def _applied_sites(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the modules that a training ``apply`` made (LokaLinear, fused chains) and of the
    served ones (ServingLinear)."""
    from loka_tune.kernels.chain import ChainMLP
    from loka_tune.kernels.fused import FusedLinearBlockNormHardswish
    from loka_tune.kernels.linear import LokaLinear
    from loka_tune.kernels.serving import ServingLinear

    trained = [n for n, m in model.named_modules()
               if isinstance(m, (LokaLinear, FusedLinearBlockNormHardswish, ChainMLP))]
    served = [n for n, m in model.named_modules() if isinstance(m, ServingLinear)]
    return trained, served


def refuse_served(model: nn.Module, *, serving: bool) -> None:
    """Raise :class:`ServingError` when ``model`` cannot take an ``apply`` (``serving`` or not)."""
    trained, served = _applied_sites(model)
    if served:
        raise ServingError(
            f"the model is served already ({len(served)} ServingLinear site(s), e.g. {served[0]!r}): its high-precision"
            " weights are gone, so it can be neither applied again nor trained. Build the model again, load its"
            " checkpoint (model.load_state_dict) and apply to that")
    if serving and trained:
        raise ServingError(
            f"the model was applied for training ({len(trained)} LokaLinear / fused / FP8 chain site(s), e.g. {trained[0]!r});"
            " apply(serving=True) takes a model whose linears are still plain nn.Linear. Apply it to a fresh model"
            " (the same model class, with its checkpoint loaded), or take loka_tune.serving.serving_form(model)"
            " for a serving copy of this one")


def _fwd_reason(site: str, lin: nn.Linear, choice: GemmChoice) -> str | None:
    """Why ``choice`` cannot serve ``lin``'s fwd GEMM with a static weight here (None: it can).
    An unknown backend name raises :class:`BackendError` (a typo, not a missing install)."""
    from loka_tune.kernels.registry import check_supported, get_backend, list_backends
    from loka_tune.kernels.serving import static_support_reason

    if choice.backend not in list_backends():
        raise BackendError(f"site {site!r}, fwd GEMM {choice.short_str()!r}: unknown backend {choice.backend!r};"
                           f" known backends: {', '.join(list_backends())}")
    try:
        backend = get_backend(choice.backend)
    except BackendError as e:
        return str(e)
    static = static_support_reason(choice)
    if static is not None:
        return static
    dev = lin.weight.device
    devices = sorted(backend.devices) if dev.type == "meta" else [dev]
    last = None
    for d in devices:
        try:
            check_supported(choice, GemmRole.FWD, d, GemmRole.FWD.shape(None, lin.in_features, lin.out_features),
                            site=site)
            return None
        except UnsupportedChoiceError as e:
            last = str(e)
    return last


def _to_serving(site: str, lin: nn.Linear, choice: GemmChoice) -> nn.Module:
    """The serving module of one site: ``ServingLinear`` for an FP8 choice, else a plain ``nn.Linear``."""
    from loka_tune.applying import to_plain_linear
    from loka_tune.kernels.linear import LokaLinear
    from loka_tune.kernels.serving import ServingLinear

    if choice.is_bf16:
        return to_plain_linear(lin) if isinstance(lin, LokaLinear) else lin
    return ServingLinear.from_linear(lin, choice, name=site)


def _swap(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    from loka_tune.applying import module_parents

    if new is old:
        return
    for parent, key in module_parents(model).get(id(old), []):
        parent._modules[key] = new


# ----------------------------------------------------------------------------- apply(serving=True)
def apply_serving(model: nn.Module, cfg: PrecisionConfig, *, strict: bool, batch: int | None) -> "ApplySummary":
    """The body of ``apply(model, cfg, serving=True, batch=...)`` (the caller restores the model
    on error; see the module docstring)."""
    from loka_tune.applying import NO_CHAIN_NOTE, ApplySummary, check_rules, run_mods
    from loka_tune.kernels.linear import find_linears
    from loka_tune.mods.fuse import fuse_serving_epilogues

    refuse_served(model, serving=True)
    bucket: int | None = None
    plan: dict[str, GemmChoice] = {}
    if batch is not None:
        if cfg.serving is None:
            raise ConfigError(
                f"batch={batch!r} picks a bucket of the config's serving plan, but this config has none: price one"
                " with loka_tune.serving.plan_serving(model, config, inputs) (or benchmarks/serve.py), or apply"
                " with serving=True and no batch to serve every site's own fwd choice", key="serving")
        bucket = cfg.serving.bucket_for(batch)
        plan = cfg.serving.choices(bucket)
    summary = ApplySummary(config_key=cfg.key(), fuse_epilogue=cfg.mods.fuse_epilogue, serving=True, bucket=bucket)
    summary.mods, summary.mods_note = run_mods(model, cfg)
    linears = find_linears(model)
    check_rules(cfg, list(linears), strict, summary)
    missing = [s for s in plan if s not in linears]
    if missing and strict:
        raise ConfigError(
            f"the serving plan's bucket {bucket} names {missing[0]!r}, which is no linear layer of this model"
            + (f" ({len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
            + f"; the model's sites are e.g. {list(linears)[:4]}. Price the plan for this model"
            " (loka_tune.serving.plan_serving) or apply with strict=False to skip them",
            key=f"serving.buckets.{bucket}")
    summary.unmatched += missing
    counts: Counter[str] = Counter()
    for site, lin in linears.items():
        summary.shapes[site] = (lin.in_features, lin.out_features)
        choice = plan.get(site, cfg.resolve(site).fwd)
        if not choice.is_bf16:
            reason = _fwd_reason(site, lin, choice)
            if reason is not None:
                if strict:
                    raise UnsupportedChoiceError(
                        f"site {site!r}: the fwd choice {choice.short_str()!r} cannot serve here: {reason}."
                        " Choose another backend for it, or apply with strict=False to serve this site in bf16")
                summary.fallbacks[site] = {"fwd": reason}
                choice = BF16
        new = _to_serving(site, lin, choice)
        counts["bf16" if choice.is_bf16 else choice.short_str()] += 1
        if choice.is_bf16:
            summary.unchanged.append(site)
        else:
            summary.replaced[site] = choice.short_str()
        _swap(model, lin, new)
    summary.counts = dict(counts)
    if cfg.mods.fuse_epilogue:
        rep = fuse_serving_epilogues(model)
        summary.fused = list(rep.fused)
        summary.fuse_skipped = dict(rep.skipped)
        if not rep.fused and not rep.skipped:
            summary.fuse_note = NO_CHAIN_NOTE
    return summary


def serving_form(model: nn.Module, *, strict: bool = True) -> nn.Module:
    """A serving copy of ``model``, a model applied for training: every tensor shared, each
    LokaLinear site served with its own fwd choice (a static weight; bf16 fwd: a plain
    ``nn.Linear``), fused epilogues kept where their choice serves fused. ``model`` itself is
    not changed. ``strict=False`` serves in bf16 the sites whose fwd choice cannot serve here.
    """
    from loka_tune.kernels.fused import FusedLinearBlockNormHardswish
    from loka_tune.kernels.linear import LokaLinear
    from loka_tune.mods.fuse import fuse_serving_epilogues, unfuse_epilogues

    refuse_served(model, serving=False)
    out = shared_copy(model)
    fused = any(isinstance(m, FusedLinearBlockNormHardswish) for m in out.modules())
    if fused:
        unfuse_epilogues(out)
    for site, lin in [(n, m) for n, m in out.named_modules() if isinstance(m, LokaLinear)]:
        choice = lin.precision.fwd
        if not choice.is_bf16:
            reason = _fwd_reason(site, lin, choice)
            if reason is not None:
                if strict:
                    raise UnsupportedChoiceError(f"site {site!r}: the fwd choice {choice.short_str()!r} cannot serve"
                                                 f" here: {reason}. Pass strict=False to serve it in bf16")
                choice = BF16
        _swap(out, lin, _to_serving(site, lin, choice))
    if fused:
        fuse_serving_epilogues(out)
    out.eval()
    return out


# ----------------------------------------------------------------------------- calibrated activation scales
@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` did: per calibrated site the amax seen (before ``margin``), per
    served site left dynamic why, over how many batches."""

    amax: Mapping[str, float]
    skipped: Mapping[str, str]
    batches: int
    margin: float


def calibrate(model: nn.Module, batches: Iterable[Sequence[Any]], *, margin: float = 1.0,
              strict: bool = True) -> Calibration:
    """Fix the activation scale of every served site that can take one (tensorwise on
    ``emulated`` or ``torch_scaled_mm``: :meth:`~loka_tune.kernels.serving.ServingLinear.calibrate_`)
    from the largest ``|x|`` each sees over ``batches`` (each a tuple of the model's inputs, e.g.
    a few real requests), run through ``model`` in eval under ``torch.no_grad`` (eagerly: call it
    before ``torch.compile`` or :meth:`ServingBuckets.captured`). Rowwise and blockwise sites stay
    dynamic (a row's scale follows its request); ``skipped`` says why per site. ``margin`` (>= 1)
    widens each scale's range. Calibrating again replaces the scales (they are dropped first, so
    the batches run the dynamic path). Raises :class:`ServingError` on no batches, a model with
    no served site, or no site that can be calibrated, and for a site whose activations were
    never reached or were all zero or non-finite. ``strict=False``: a model with no site to
    calibrate is returned as it is (an empty ``amax``) instead.
    """
    from loka_tune.kernels.serving import ServingLinear

    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
        raise ServingError(f"got margin={margin!r}; a calibration margin is a factor >= 1.0 (1.0: the largest"
                           " activation seen maps to the format's max)")
    served = {name: m for name, m in model.named_modules() if isinstance(m, ServingLinear)}
    if not strict and not any(m.calibration_reason() is None for m in served.values()):
        return Calibration(amax={}, skipped={n: m.calibration_reason() or "" for n, m in served.items()}, batches=0,
                           margin=float(margin))
    if not served:
        raise ServingError("calibrate found no served site in this model: apply the config first with"
                           " loka_tune.apply(model, config, serving=True, batch=B)")
    skipped = {name: why for name, m in served.items() if (why := m.calibration_reason()) is not None}
    sites = {name: m for name, m in served.items() if name not in skipped}
    if not sites:
        first = next(iter(skipped.items()))
        raise ServingError(f"no served site can take a calibrated activation scale ({len(skipped)} served, e.g."
                           f" {first[0]!r}: {first[1]}); serve tensorwise choices such as"
                           " e4m3.tensor.fa.torch_scaled_mm to calibrate them")
    for m in sites.values():
        m.clear_calibration_()
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in sites.items():
        def hook(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            a = args[0].detach().abs().amax().to(torch.float32)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        hooks.append(m.register_forward_pre_hook(hook))
    n = 0
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                model(*batch)
                n += 1
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    if n == 0:
        raise ServingError("calibrate got no batches; pass a few real batches of the model's inputs,"
                           " e.g. [(dense, sparse), ...]")
    missing = [name for name in sites if name not in amax]
    if missing:
        raise ServingError(f"site {missing[0]!r} saw no activation in {n} calibration batch(es)"
                           f"{f' ({len(missing) - 1} more)' if len(missing) > 1 else ''}: its forward was never"
                           " reached; calibrate with batches that run the whole model")
    seen = {name: float(a) for name, a in amax.items()}  # one host sync per site, after every batch
    for name, m in sites.items():
        m.calibrate_(seen[name], margin=margin)
    return Calibration(amax=seen, skipped=skipped, batches=n, margin=float(margin))


# ----------------------------------------------------------------------------- buckets
def _pad_rows(t: Any, rows: int, batch: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch or rows == batch:
        return t
    return torch.cat([t, t.new_zeros((rows - batch, *t.shape[1:]))])  # zeros: a valid id for embedding inputs


def _cut_rows(out: Any, batch: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:batch]
    if isinstance(out, (tuple, list)):
        return type(out)(_cut_rows(o, batch) for o in out)
    return out


class ServingBuckets(nn.Module):
    """One served model per batch bucket; a call pads its batch up to the smallest bucket that
    holds it (zero rows), runs that bucket's model and returns the real rows' outputs.

    ``models``: ``{bucket rows: served model}`` (e.g. from :func:`serve_buckets`). Every tensor
    argument whose first dimension is the batch is padded. A batch above every bucket raises
    :class:`ServingError`. :meth:`compiled` wraps each bucket's model in ``torch.compile``
    (CUDA graphs by default): shapes then never change, so each bucket records its graph once.
    Under CUDA graphs an output is overwritten by the next call of the same bucket: clone what
    you keep. Rows are independent in eval for row- and blockwise activation scaling (the pad
    rows change nothing); a tensorwise site's activation scale is the amax of the whole padded
    batch, so pad rows may move the real rows' rounding slightly.
    """

    def __init__(self, models: Mapping[int, nn.Module]) -> None:
        super().__init__()
        if not models:
            raise ServingError("ServingBuckets needs at least one bucket: {rows: model}")
        self.sizes = tuple(sorted(int(b) for b in models))
        self.models = nn.ModuleDict({str(b): models[b] for b in sorted(models)})

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows."""
        return ServingPlan(buckets=tuple((b, {}) for b in self.sizes)).bucket_for(batch)

    def forward(self, *inputs: Any) -> Any:
        first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if first is None:
            raise ServingError("ServingBuckets takes the model's inputs with the batch as their first dimension")
        batch = int(first.shape[0])
        rows = self.bucket_for(batch)
        padded = [_pad_rows(t, rows, batch) for t in inputs]
        return _cut_rows(self.models[str(rows)](*padded), batch)

    def compiled(self, **compile_kwargs: Any) -> "ServingBuckets":
        """These buckets, each model wrapped in ``torch.compile(model, **compile_kwargs)``
        (default ``mode="reduce-overhead", dynamic=False``: CUDA graphs, static shapes)."""
        kw = {"mode": "reduce-overhead", "dynamic": False, **compile_kwargs}
        return ServingBuckets({b: torch.compile(self.models[str(b)], **kw) for b in self.sizes})  # type: ignore[misc]

    def captured(self, *example_inputs: Any, compile: bool = True, warmup: int = 3,
                 autotune: bool = False) -> "CapturedBuckets":
        """These buckets as :class:`CapturedBuckets`: each bucket's model (compiled with
        ``torch.compile(mode="default", dynamic=False)`` unless ``compile=False``; ``autotune``:
        with inductor's coordinate-descent tuning of every Triton kernel instead, minutes of
        compile for faster kernels) captured as one CUDA graph on static inputs shaped like
        ``example_inputs`` at the bucket's rows."""
        return CapturedBuckets(self, example_inputs, compile=compile, warmup=warmup, autotune=autotune)


#: inductor options of ``autotune``: coordinate-descent tuning of every Triton kernel (what
#: torchao's float8 inference turns on process-wide, ``recommended_inductor_config_setter``)
_AUTOTUNE = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True}


class _Bucket:
    """One bucket of :class:`CapturedBuckets`: its static inputs, the callable, its graph and output."""

    def __init__(self, rows: int, fn: Callable[..., Any], inputs: tuple[Any, ...], batch_args: tuple[bool, ...]) -> None:
        self.rows, self.fn, self.inputs, self.batch_args = rows, fn, inputs, batch_args
        self.graph: Any = None
        self.out: Any = None
        self.last = rows  # real rows of the previous call (the pad rows past them are zero)


class CapturedBuckets:
    """Serving with one captured CUDA graph per batch bucket (issue 23): a call copies the
    request into its bucket's static inputs (the rows past the batch zero, as
    :class:`ServingBuckets` pads), replays the graph and returns the real rows of the graph's
    output, with no per-call Python between the request and the kernels but those copies and
    one ``cudaGraphLaunch`` (``torch.compile``'s ``reduce-overhead`` mode runs cudagraph trees'
    Python on every call; on an H200 at large Wukong's 8192 rows a call's latency sat 0.26 ms
    (bf16), 0.40 ms (our FP8 serving) and 1.5 ms (torchao's float8 model) above the back-to-back
    time per call).

    Built by :meth:`ServingBuckets.captured` from example inputs: every tensor whose first
    dimension is the example's batch is a batch input (padded per bucket); any other argument
    is fixed at the capture (a call must pass an equal one, else :class:`ServingError`). On a
    CPU nothing is captured: the same static buffers feed the (compiled) model, so the padding
    and copying are what the GPU path does. The returned tensors are views of the graph's
    output: the next call of that bucket overwrites them (clone what you keep). Inference only
    (run under ``torch.no_grad``); calls from one thread at a time.
    """

    def __init__(self, buckets: ServingBuckets, example_inputs: Sequence[Any], *, compile: bool = True,
                 warmup: int = 3, autotune: bool = False) -> None:
        first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if first is None:
            raise ServingError("CapturedBuckets needs example inputs with the batch as their first dimension"
                               " (the model's inputs for one batch)")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ServingError(f"got warmup={warmup!r}; warm each bucket up with at least 1 call before its capture")
        self.sizes = buckets.sizes
        example_batch = int(first.shape[0])
        self._example = tuple(example_inputs)
        batch_args = tuple(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == example_batch
                           for t in example_inputs)
        self._buckets: dict[int, _Bucket] = {}
        for rows in self.sizes:
            model = buckets.models[str(rows)]
            fn: Callable[..., Any]
            if not compile:
                fn = model
            elif autotune:  # torch.compile takes a mode or inductor options, not both
                fn = torch.compile(model, dynamic=False, options=dict(_AUTOTUNE))
            else:
                fn = torch.compile(model, mode="default", dynamic=False)
            static = tuple(t.new_zeros((rows, *t.shape[1:])) if is_batch
                           else (t.clone() if isinstance(t, torch.Tensor) else t)
                           for t, is_batch in zip(example_inputs, batch_args))
            self._buckets[rows] = self._capture(_Bucket(rows, fn, static, batch_args), warmup)

    @staticmethod
    def _capture(b: _Bucket, warmup: int) -> _Bucket:
        dev = next(t.device for t in b.inputs if isinstance(t, torch.Tensor))
        with torch.no_grad():
            if dev.type != "cuda":
                b.out = b.fn(*b.inputs)  # compiles here, not at the first request
                return b
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):  # compiles, autotunes and allocates outside the capture
                    b.fn(*b.inputs)
            torch.cuda.current_stream(dev).wait_stream(side)
            b.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b.graph):
                b.out = b.fn(*b.inputs)
        return b

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows."""
        return ServingPlan(buckets=tuple((s, {}) for s in self.sizes)).bucket_for(batch)

    def __call__(self, *inputs: Any) -> Any:
        if len(inputs) != len(self._example):
            raise ServingError(f"got {len(inputs)} input(s); these buckets were captured for {len(self._example)}"
                               " (the example inputs of ServingBuckets.captured)")
        first = next((t for t, is_b in zip(inputs, self._buckets[self.sizes[0]].batch_args) if is_b), None)
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise ServingError("CapturedBuckets takes the model's inputs with the batch as their first dimension")
        batch = int(first.shape[0])
        b = self._buckets[self.bucket_for(batch)]
        with torch.no_grad():
            for i, (dst, src, is_batch) in enumerate(zip(b.inputs, inputs, b.batch_args)):
                if is_batch:
                    if not isinstance(src, torch.Tensor) or src.shape[1:] != dst.shape[1:] or int(src.shape[0]) != batch:
                        got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                        raise ServingError(f"input {i}: got {got}; the capture's batch input {i} is (rows,"
                                           f" {', '.join(map(str, dst.shape[1:]))}) with {batch} rows in this call")
                    dst[:batch].copy_(src)
                    if b.last > batch:  # the previous call's real rows past this batch: back to zero pad
                        dst[batch:b.last].zero_()
                elif isinstance(dst, torch.Tensor):
                    if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
                        raise ServingError(f"input {i}: got {src!r:.60}; the capture fixed it as a tensor of shape"
                                           f" {tuple(dst.shape)}")
                    dst.copy_(src)
                elif src != dst:
                    raise ServingError(f"input {i}: got {src!r:.60}; the capture fixed it as {dst!r:.60}"
                                       " (capture again with ServingBuckets.captured to serve another value)")
            b.last = batch
            if b.graph is not None:
                b.graph.replay()
                out = b.out
            else:
                out = b.fn(*b.inputs)
        return _cut_rows(out, batch)


def serve_buckets(model: nn.Module, config: PrecisionConfig | Mapping[str, Any] | str, *,
                  strict: bool = True) -> ServingBuckets:
    """A :class:`ServingBuckets` of ``model`` under ``config``'s serving plan: the config's
    Mods run on ``model`` in place (once), then each bucket gets a copy sharing every tensor,
    applied with ``serving=True, batch=<bucket>`` (its own static weights)."""
    from loka_tune.applying import as_config, run_mods

    cfg = as_config(config)
    if cfg.serving is None or not cfg.serving.buckets:
        raise ConfigError("the config has no serving plan with buckets: price one with"
                          " loka_tune.serving.plan_serving(model, config, inputs)", key="serving")
    refuse_served(model, serving=True)
    run_mods(model, cfg)
    models: dict[int, nn.Module] = {}
    for rows in cfg.serving.sizes:
        served = shared_copy(model)
        apply_serving(served, cfg, strict=strict, batch=rows)  # apply(..., serving=True)'s body: a fresh copy
        models[rows] = served.eval()
    return ServingBuckets(models)


# ----------------------------------------------------------------------------- pricing the plan
def site_rows(model: nn.Module, inputs: Sequence[Any]) -> dict[str, tuple[float, int, int]]:
    """``{site: (rows per example, in_features, out_features)}`` of every linear site that one
    eval forward of ``model(*inputs)`` reaches (3-D inputs count their middle dimensions as
    rows: Wukong's feature-axis Linears see ``batch x d`` rows)."""
    from loka_tune.kernels.linear import find_linears

    first = next(t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0)
    batch = int(first.shape[0])
    rows: dict[str, tuple[float, int, int]] = {}
    hooks = []
    for name, lin in find_linears(model).items():
        def hook(mod: nn.Module, args: tuple[Any, ...], name: str = name, kn: tuple[int, int] = (
                lin.in_features, lin.out_features)) -> None:
            x = args[0]
            rows.setdefault(name, (x.numel() / x.shape[-1] / batch, *kn))
        hooks.append(lin.register_forward_pre_hook(hook))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return rows


Timer = Callable[..., Mapping[str, Any]]


def _fast_accum_twin(choice: GemmChoice) -> GemmChoice | None:
    """``choice`` with fast accumulation, where its backend has a fast-accumulation kernel that
    ``choice`` does not use (not bf16, not an emulation, whose ``fa`` changes nothing); else None."""
    from loka_tune.kernels.registry import get_backend

    if choice.is_bf16 or choice.fast_accum:
        return None
    try:
        backend = get_backend(choice.backend)
    except Exception:  # noqa: BLE001 - an unknown backend is the price's error to report
        return None
    modes = backend.enumerated_fast_accum if backend.enumerated_fast_accum is not None else backend.fast_accum_modes
    return dataclasses.replace(choice, fast_accum=True) if True in modes else None


def _shape_refusal(choice: GemmChoice, m: int, k: int, n: int) -> str | None:
    """Why ``choice``'s backend cannot run the fwd GEMM ``(m, k, n)`` (its alignment of ``k`` and
    ``n``, its per-shape limits), or None: asked before a serving price is timed, so that a shape
    no kernel takes is skipped in one line instead of failing inside a compile."""
    from loka_tune.kernels.registry import get_backend

    try:
        backend = get_backend(choice.backend)
    except Exception:  # noqa: BLE001 - an unknown backend is the price's error to report
        return None
    return (backend.shape_reason(GemmRole.FWD, (m, k, n))
            or backend.runtime_reason(choice, GemmRole.FWD, (m, k, n)))


def plan_serving(model: nn.Module, config: PrecisionConfig | Mapping[str, Any] | str, inputs: Sequence[Any], *,
                 buckets: Iterable[int] = DEFAULT_BUCKETS, candidates: Iterable[GemmChoice | str] = (),
                 min_speedup: float = 1.0, cost_device: str = "h200", measure: bool = False,
                 device: str = "cuda", timer: Timer | None = None, cache: Any = None,
                 budget_s: float | None = None, progress: Callable[[str], None] | None = None,
                 fast_accum: bool = True, verify: bool = False, model_timer: ModelTimer | None = None,
                 alternatives: Iterable[str] = WHOLE_MODEL_ALTERNATIVES,
                 verify_budget_s: float | None = None,
                 calibration: Sequence[Sequence[Any]] | None = None) -> PrecisionConfig:
    """``config`` with a serving plan (:class:`ServingPlan`) priced for ``model``'s sites.

    Each site's shape comes from one eval forward of ``model(*inputs)`` (a copy with the config's
    Mods; ``model`` is not changed); its rows at a bucket are the bucket's batch x its rows per
    example. Per bucket and site, the fwd GEMM of the site's own fwd choice (and of each of
    ``candidates``) with a static weight is priced against bf16 at those rows, and the fastest
    is kept if it beats bf16 by more than ``min_speedup`` (else ``bf16``). Sites whose every
    option is bf16 are not priced (they serve bf16). An option whose kernel cannot take the
    site's shape (``torch._scaled_mm``: ``k`` and ``n`` multiples of 16) is not priced there
    (``source`` says why): the site serves another option, or bf16. ``fast_accum`` (default):
    each FP8 option without fast accumulation on a backend that has it is priced beside its
    ``.fa`` twin (serving runs only the forward GEMM, which torchao's float8 inference runs with
    fast accumulation by default; the logits' SQNR is ``benchmarks/serve.py``'s to check).

    Prices: the cost model for ``cost_device`` (``estimate_gemm_seconds(..., static_b=True)``,
    time source "modeled"), or with ``measure=True`` GPU timings on ``device`` of the compiled,
    CUDA-graphed fwd (``timer``, default :func:`loka_tune.kernels.serve_timing.time_serving_site`;
    ``cache``: a :class:`~loka_tune.kernels.site_timing.SitePriceCache`, cells keyed
    ``serve:<choice>``), "measured". ``budget_s``: after that many seconds of timing the
    remaining cells are modeled (the plan is then "mixed"; ``prices`` says per cell); buckets are
    priced from the largest down, so a short budget times the largest batches.
    A choice the cost model cannot price is kept (recorded as unpriced).

    ``verify=True``: each bucket's per-site plan is then checked against whole-model
    alternatives (:func:`verify_serving_plan`: ``model_timer``, ``alternatives``,
    ``verify_budget_s``; ``calibration``: batches that calibrate each alternative's tensorwise
    activation scales before it is timed), because sites priced one at a time do not add up to the model (on an
    H200 at large Wukong's 8192 rows, the per-site plan of 16 rowwise sites served 7.49 ms, every
    torchao site tensorwise 7.41 ms, although each site alone priced rowwise faster).
    """
    from loka_tune.applying import as_config, run_mods
    from loka_tune.kernels.costmodel import estimate_gemm_seconds

    cfg = as_config(config)
    sizes = sorted({int(b) for b in buckets})
    if not sizes or sizes[0] <= 0:
        raise ConfigError(f"got buckets={list(buckets)!r}; give positive batch sizes such as [512, 2048, 8192]",
                          key="buckets")
    if not (isinstance(min_speedup, (int, float)) and min_speedup > 0):
        raise ConfigError(f"got min_speedup={min_speedup!r}; a positive factor (1.0: FP8 must beat bf16)",
                          key="min_speedup")
    extra = [GemmChoice.parse(c, key="candidates") for c in candidates]
    probe = shared_copy(model)
    run_mods(probe, cfg)
    shapes = site_rows(probe, inputs)
    del probe
    say = progress or (lambda _msg: None)
    if measure:
        from loka_tune.kernels.serve_timing import time_serving_site

        timer = timer or time_serving_site
    t0 = time.perf_counter()
    measured: dict[tuple[int, int, int, str], float | None] = {}
    n_measured = n_modeled = 0

    def price(c: GemmChoice, m: int, k: int, n: int) -> tuple[float | None, str]:
        nonlocal n_measured, n_modeled
        cid = c.short_str()
        if measure and (budget_s is None or time.perf_counter() - t0 < budget_s):
            key = (m, k, n, cid)
            if key not in measured:
                hit = cache.get(m, k, n, "serve:" + cid) if cache is not None else None
                if hit is None:
                    try:
                        assert timer is not None
                        hit = dict(timer(m, k, n, cid, device=device))
                    except Exception as e:  # noqa: BLE001 - one bad cell must not stop the plan
                        say(f"serving price {m}x{k}x{n} {cid}: failed ({type(e).__name__}: {str(e)[:160]})")
                        hit = None
                    if hit is not None and cache is not None:
                        cache.put(m, k, n, "serve:" + cid, hit)
                    if hit is not None:
                        say(f"serving price {m}x{k}x{n} {cid}: {hit['gpu_s'] * 1e6:.1f} us")
                measured[key] = None if hit is None else float(hit["gpu_s"])
            sec = measured[key]
            if sec is not None:
                n_measured += 1
                return sec, "measured"
        try:
            sec = estimate_gemm_seconds(c, m, k, n, "fwd", cost_device, static_b=not c.is_bf16)
        except UnsupportedChoiceError:
            return None, "unpriced"
        n_modeled += 1
        return sec, "modeled"

    plan: dict[int, dict[str, GemmChoice]] = {}
    prices: dict[str, dict[str, Any]] = {}
    refused: set[tuple[int, int, GemmChoice]] = set()
    for rows in sorted(sizes, reverse=True):  # the largest bucket first: timed first when the budget is short
        plan[rows], prices[str(rows)] = {}, {}
        for site, (per_example, k, n) in shapes.items():
            options = [cfg.resolve(site).fwd, *extra]
            if fast_accum:
                options += [t for t in map(_fast_accum_twin, options) if t is not None]
            options = [c for i, c in enumerate(options) if not c.is_bf16 and c not in options[:i]]
            if not options:
                continue
            m = max(1, int(round(rows * per_example)))
            t_bf16, src = price(BF16, m, k, n)
            cell: dict[str, Any] = {"m": m, "k": k, "n": n, "bf16_us": None if t_bf16 is None else t_bf16 * 1e6,
                                    "source": {"bf16": src}}
            best, best_t = BF16, t_bf16
            for c in options:
                why = _shape_refusal(c, m, k, n)
                if why is not None:  # the kernel cannot take this shape: the site cannot serve it
                    cell[f"{c.short_str()}_us"] = None
                    cell["source"][c.short_str()] = f"unsupported: {why}"
                    if (k, n, c) not in refused:
                        refused.add((k, n, c))
                        say(f"serving price {m}x{k}x{n} {c.short_str()}: not priced ({why})")
                    continue
                t, src = price(c, m, k, n)
                cell[f"{c.short_str()}_us"] = None if t is None else t * 1e6
                cell["source"][c.short_str()] = src
                if t is None or t_bf16 is None:  # unpriced: keep the config's own choice
                    if best.is_bf16 and c == options[0]:
                        best, best_t = c, math.inf
                    continue
                if t_bf16 / t > min_speedup and (best_t is None or t < best_t):
                    best, best_t = c, t
            plan[rows][site] = best
            cell["choice"] = best.short_str()
            prices[str(rows)][site] = cell
    if n_measured and n_modeled:
        source = "mixed"
    else:
        source = "measured" if n_measured else "modeled"
    dev_name = cost_device  # modeled: the cost model's device; measured: where the cells were timed
    if n_measured:
        d = torch.device(device)
        dev_name = torch.cuda.get_device_name(d) if d.type == "cuda" and torch.cuda.is_available() else d.type
    cells = {str(b): prices[str(b)] for b in sizes}
    planned = cfg.with_serving(ServingPlan(buckets=tuple(plan.items()), time_source=source, device=dev_name,
                                           prices={"min_speedup": min_speedup, "cells": cells}))
    if not verify:
        return planned
    return verify_serving_plan(model, planned, inputs, alternatives=alternatives, timer=model_timer,
                               budget_s=verify_budget_s, progress=progress, calibration=calibration)


# ----------------------------------------------------------------------------- the plan, checked whole


def _tile_rows(inputs: Sequence[Any], rows: int) -> tuple[Any, ...]:
    """``inputs`` (one batch of a model's inputs) repeated along the batch to ``rows`` rows."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None:
        raise ServingError("the plan's check needs example inputs with the batch as their first dimension")
    batch = int(first.shape[0])

    def tile(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        reps = -(-rows // batch)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:rows].contiguous()

    return tuple(tile(t) for t in inputs)


def time_served_model(model: nn.Module, rows: int, inputs: Sequence[Any], *, iters: int = 20, reps: int = 3,
                      warmup: int = 3) -> float:
    """Seconds per call of a served ``model`` at ``rows`` rows (``inputs``: that many rows), as
    serving runs it: on a GPU compiled and captured as one CUDA graph
    (:meth:`ServingBuckets.captured`), each call copying the request in and replaying, timed
    between CUDA events (the median of ``reps`` windows of ``iters`` calls; ``fullgraph=True``: a
    graph break raises); on a CPU the eager model's wall time. Resets dynamo first (each
    alternative compiles the same ``forward``)."""
    dev = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cuda = dev.type == "cuda"
    torch._dynamo.reset()
    with torch.no_grad():
        if cuda:  # fullgraph: a graph break fails the alternative instead of timing glue code
            fn = cast(nn.Module, torch.compile(model, mode="default", dynamic=False, fullgraph=True))  # an OptimizedModule
            server: Callable[..., Any] = ServingBuckets({rows: fn}).captured(*inputs, compile=False, warmup=warmup)
        else:
            server = model
        for _ in range(warmup):
            server(*inputs)
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(dev)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(iters):
                    server(*inputs)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3 / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    server(*inputs)
                times.append((time.perf_counter() - t0) / iters)
    times.sort()
    return times[len(times) // 2]


def _regranular(c: GemmChoice, gran: str) -> GemmChoice | None:
    """``c`` with granularity ``gran`` (format, backend, rounding and fast accumulation kept),
    where its backend serves that with a static weight; else None."""
    from loka_tune.config import Granularity
    from loka_tune.kernels.serving import static_support_reason

    if c.is_bf16:
        return None
    if c.granularity == Granularity(gran):
        return c
    try:
        alt = dataclasses.replace(c, granularity=Granularity(gran))
    except (ValueError, ConfigError):
        return None
    return alt if static_support_reason(alt) is None else None


def _alternative(name: str, cells: Mapping[str, Mapping[str, Any]], sites: Mapping[str, GemmChoice],
                 options: Mapping[str, list[GemmChoice]]) -> dict[str, GemmChoice]:
    """One whole-model alternative of a bucket's per-site plan ``sites`` (see :func:`verify_serving_plan`)."""
    if name == "sites":
        return dict(sites)
    if name == "bf16":
        return {s: BF16 for s in sites}
    gran, _, scope = name.partition("_")
    out: dict[str, GemmChoice] = {}
    for site, chosen in sites.items():
        if scope != "all" and chosen.is_bf16:
            out[site] = BF16
            continue
        cell = cells.get(site, {})
        pick: GemmChoice | None = None
        best = math.inf
        for c in options.get(site, []):
            alt = _regranular(c, gran)
            if alt is None:
                continue
            src = str(cell.get("source", {}).get(alt.short_str(), ""))
            if src.startswith("unsupported"):
                continue
            t = cell.get(f"{alt.short_str()}_us")
            t = math.inf if t is None else float(t)
            if pick is None or t < best:
                pick, best = alt, t
        out[site] = pick if pick is not None else BF16
    return out


def verify_serving_plan(model: nn.Module, config: PrecisionConfig | Mapping[str, Any] | str,
                        inputs: Sequence[Any], *, alternatives: Iterable[str] = WHOLE_MODEL_ALTERNATIVES,
                        timer: ModelTimer | None = None, budget_s: float | None = None,
                        progress: Callable[[str], None] | None = None,
                        calibration: Sequence[Sequence[Any]] | None = None, margin: float = 1.0) -> PrecisionConfig:
    """``config``'s serving plan (priced per site by :func:`plan_serving`) with each bucket's
    choices replaced by the fastest of whole-model alternatives, each served and timed as a
    whole (``timer(model, rows, inputs)`` -> seconds; default :func:`time_served_model`: the
    captured CUDA graph on a GPU).

    Alternatives per bucket (``alternatives``, in this order of preference on a tie):
    ``sites`` (the per-site plan as priced), ``tensor`` / ``row`` (each site the plan puts in
    FP8 at that granularity: the option of it priced fastest there, on the same backend),
    ``tensor_all`` / ``row_all`` (every priced site whose kernel takes its shape at that
    granularity, FP8 or not in the per-site plan: torchao's inference takes every Linear it can)
    and ``bf16`` (no FP8 site: the bucket is never slower than bf16 + Mods). Alternatives equal
    to an earlier one are not timed again. The inputs are ``inputs`` repeated to each bucket's
    rows (on ``inputs``' device). ``budget_s``: no alternative starts after that many seconds
    (the bucket keeps the fastest timed so far; ``sites`` is always timed first). The record
    goes into the plan's ``prices["whole_model"]``: per bucket the seconds of each alternative,
    its FP8 sites and the one chosen. ``model`` is not changed. ``calibration`` (batches of the
    model's inputs): each alternative is served with calibrated activation scales on its
    tensorwise sites (:func:`calibrate`, ``margin``), as it will then be served; the record says
    ``calibrated``.
    """
    from loka_tune.applying import as_config

    cfg = as_config(config)
    if cfg.serving is None or not cfg.serving.buckets:
        raise ConfigError("verify_serving_plan checks a serving plan; price one first with"
                          " loka_tune.serving.plan_serving(model, config, inputs)", key="serving")
    names = list(dict.fromkeys(alternatives))
    bad = [a for a in names if a not in ALL_ALTERNATIVES]
    if bad or not names:
        raise ConfigError(f"got alternatives={list(alternatives)!r}; choose from {', '.join(ALL_ALTERNATIVES)}"
                          " (e.g. sites,tensor,tensor_all,bf16)", key="alternatives")
    if "sites" in names:
        names.remove("sites")
    names.insert(0, "sites")
    say = progress or (lambda _msg: None)
    timer = timer or (lambda m, rows, inp: time_served_model(m, rows, inp))
    plan = cfg.serving
    cells_all = plan.prices.get("cells", {}) if isinstance(plan.prices, Mapping) else {}
    extra_opts: dict[str, list[GemmChoice]] = {}
    for _b, by_site in cells_all.items():
        for site, cell in by_site.items():
            for key in cell:
                if key.endswith("_us") and key != "bf16_us":
                    c = GemmChoice.parse(key[:-3])
                    if c not in extra_opts.setdefault(site, []):
                        extra_opts[site].append(c)
    t0 = time.perf_counter()
    new_buckets: list[tuple[int, dict[str, GemmChoice]]] = []
    record: dict[str, Any] = {}
    for rows, sites in sorted(plan.buckets, reverse=True):
        cells = cells_all.get(str(rows), {})
        tiled = _tile_rows(inputs, rows)
        tried: list[tuple[str, dict[str, GemmChoice]]] = []
        timed: dict[str, Any] = {}
        best_name, best_t = "sites", math.inf
        for name in names:
            alt = _alternative(name, cells, sites, extra_opts)
            same = next((n for n, a in tried if a == alt), None)
            if same is not None:
                timed[name] = {"same_as": same}
                continue
            tried.append((name, alt))
            if name != "sites" and budget_s is not None and time.perf_counter() - t0 > budget_s:
                timed[name] = {"skipped": "over the budget"}
                continue
            served = shared_copy(model)
            one = cfg.with_serving(dataclasses.replace(plan, buckets=((rows, alt),)))
            try:
                apply_serving(served, one, strict=False, batch=rows)
                n_cal = 0
                if calibration is not None:
                    n_cal = len(calibrate(served, calibration, margin=margin, strict=False).amax)
                sec = float(timer(served.eval(), rows, tiled))
            except Exception as e:  # noqa: BLE001 - one alternative that fails must not stop the plan
                timed[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                say(f"whole model @ {rows} {name}: failed ({type(e).__name__}: {str(e)[:120]})")
                continue
            finally:
                del served
            n_fp8 = sum(not c.is_bf16 for c in alt.values())
            timed[name] = {"ms": sec * 1e3, "fp8_sites": n_fp8, **({"calibrated": n_cal} if calibration else {})}
            say(f"whole model @ {rows} {name}: {sec * 1e3:.3f} ms ({n_fp8} FP8 sites)")
            if sec < best_t:
                best_name, best_t = name, sec
        chosen = dict(next(a for n, a in tried if n == best_name))
        new_buckets.append((rows, chosen))
        record[str(rows)] = {"alternatives": timed, "chosen": best_name}
        say(f"whole model @ {rows}: {best_name}")
    prices = {**dict(plan.prices), "whole_model": record, **({"calibrated": True} if calibration else {})}
    return cfg.with_serving(dataclasses.replace(plan, buckets=tuple(sorted(new_buckets)), prices=prices))
