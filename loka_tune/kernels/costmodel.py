"""A CPU cost model of every GEMM choice: how long it would take on a named GPU.

Used where no GPU is present (CI, laptops, the probe's ``cost_device``): every number it
gives is *modeled*, never measured, and callers label it so (``time_source="modeled"``).

What a GEMM choice costs (canonical ``A (m, k) @ B (n, k)^T``, see :mod:`loka_tune.config`):

1. **Quantization** of each FP8 operand, as the backend really does it: the number of passes
   over the bf16 input (an amax pass for dynamic tensorwise scaling, a column-amax pass for a
   transposed rowwise operand), the bytes written (1 B per element + fp32 scales), whether the
   transposition that dgrad / wgrad need is fused into the quantization kernel (our Triton
   kernels) or costs a separate copy (libraries that need contiguous inputs), the number of
   kernel launches, and an achieved fraction of the memory bandwidth fitted per kernel family.
2. **The GEMM**: a wave-quantization model. Output tiles (128 x 128 by default) are spread over
   the streaming multiprocessors; time = number of waves x (a fixed per-tile cost + the tile's
   FLOPs at the format's per-SM rate x an achieved fraction), or the bytes of the operands and
   the output at memory bandwidth if larger, plus a fixed per-kernel cost. Small GEMMs fill
   one partial wave and pay mostly fixed costs: this is why FP8 loses on them. Libraries that
   do split-K (cuBLAS) may split the reduction when the tiles leave SMs idle.
3. **Fixed costs**: one ``launch_s`` per kernel (in back-to-back replay this is the kernel's
   ramp-up and tail, not the CPU launch).

``static_b=True`` prices a GEMM whose B operand is quantized once, ahead of time: the serving
forward (``apply(..., serving=True)``), whose weight is a static FP8 tensor with its scales, so
only the activation's quantization (and its transposition, if any) runs per call.

Device data (``DEVICES``) are datasheet numbers (dense tensor-core rates, HBM bandwidth, SM
count). The achieved fractions and fixed costs are calibration constants fitted to our own
H200 measurements (``benchmarks/gemm_suite.py``) and shipped as JSON in
``loka_tune/kernels/data/costmodel_h200.json``; other devices reuse the H200's fractions with
their own datasheet rates (a transfer, not a measurement).

Backends modeled: ``bf16`` (cuBLAS), ``torch_scaled_mm`` (our fused Triton quantization +
cuBLASLt/CUTLASS through ``torch._scaled_mm``), ``fbgemm`` (FBGEMM GenAI quantize ops +
CUTLASS GEMMs; blockwise quantized by our Triton kernels), ``triton`` (our fused quantization
+ our Triton FP8 GEMMs), ``torchao`` (torchao's eager float8 casts + ``torch._scaled_mm``) and
``emulated``, which stands for "the fastest real backend that implements these numerics".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from loka_tune.config import (
    ROLES,
    Format,
    GemmChoice,
    GemmRole,
    Granularity,
    SitePrecision,
)
from loka_tune.errors import ConfigError, UnsupportedChoiceError

__all__ = [
    "DeviceSpec",
    "DEVICES",
    "Step",
    "device_key",
    "load_calibration",
    "set_calibration",
    "modeled_backends",
    "gemm_breakdown",
    "estimate_gemm_seconds",
    "estimate_site_seconds",
    "modeled_speedup",
    "best_modeled_choice",
    "MODELED_BACKENDS",
]

_BF16_BYTES = 2  # inputs arrive in bf16 (autocast); fp32 inputs are not modeled
_FP8_BYTES = 1
_OUT_BYTES = 2  # every backend writes a bf16 output


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet numbers of one GPU (dense tensor-core rates, no sparsity)."""

    name: str
    sms: int  # streaming multiprocessors
    bf16_tflops: float  # dense bf16 tensor-core peak
    fp8_tflops: float  # dense fp8 (e4m3/e5m2) peak
    mxfp8_tflops: float | None  # block-scaled mxfp8 peak; None: not in hardware
    hbm_tbps: float  # memory bandwidth, TB/s
    l2_mb: float
    compute_capability: tuple[int, int]


# Datasheet values (SXM parts). Sources: NVIDIA H100 / H200 / B200 datasheets.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 132, 989.4, 1978.9, None, 3.35, 50.0, (9, 0)),
    "h200": DeviceSpec("h200", 132, 989.4, 1978.9, None, 4.8, 60.0, (9, 0)),
    "b200": DeviceSpec("b200", 148, 2250.0, 4500.0, 4500.0, 8.0, 126.0, (10, 0)),
}

_ALIASES = {
    "nvidia h100": "h100",
    "nvidia h100 80gb hbm3": "h100",
    "h100-sxm": "h100",
    "h100_sxm": "h100",
    "nvidia h200": "h200",
    "h200-sxm": "h200",
    "nvidia b200": "b200",
    "gb200": "b200",
}

MODELED_BACKENDS = ("bf16", "torch_scaled_mm", "fbgemm", "triton", "torchao", "emulated")
_REAL_FP8_BACKENDS = ("torch_scaled_mm", "fbgemm", "triton", "torchao")


def device_key(device: str) -> str:
    """Normalise a device name ("H200", "NVIDIA H200", "h200-sxm") to a key of :data:`DEVICES`.

    Raises :class:`ConfigError` listing the modeled devices for an unknown name.
    """
    if not isinstance(device, str):
        raise ConfigError(f"got {device!r}; expected a device name such as 'h200'", key="device")
    key = device.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        for name in DEVICES:  # "NVIDIA H200 NVL", "h100 pcie" ... -> nearest family
            if name in key.replace("nvidia", "").split() or key.startswith(name):
                return name
        raise ConfigError(
            f"got {device!r}; the cost model knows {', '.join(sorted(DEVICES))}"
            " (pass one of these, e.g. cost_device='h200')",
            key="device",
        )
    return key


# --------------------------------------------------------------------------- calibration
_DATA_FILE = "costmodel_h200.json"

# Defaults: a first fit to the table of ../shared/docs/gpu.md (do_bench medians); the
# shipped JSON overrides them (fitted to benchmarks/gemm_suite.py on the H200).
_DEFAULT_CAL: dict[str, Any] = {
    "schema_version": 1,
    "fitted_on": "defaults (docs/gpu.md table)",
    "launch_s": 5.0e-6,  # fixed cost of one kernel in back-to-back replay
    "mem_frac": 0.9,  # achieved fraction of datasheet HBM bandwidth for plain streaming
    "fast_accum_gain": 1.10,  # fp8 main-loop speed-up without periodic fp32 promotion
    "gemm": {
        # per GEMM kernel family: tile, K alignment, achieved fraction of the per-SM peak,
        # fixed per-tile cost (prologue / epilogue not hidden by the pipeline), split-K
        "cublas_bf16": {"tile_m": 128, "tile_n": 128, "k_align": 64, "rate_frac": 0.75,
                        "tile_fixed_s": 3.0e-7, "split_k": True},
        "cublaslt_fp8_tensor": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.68,
                                "tile_fixed_s": 6.0e-7, "split_k": True},
        "cutlass_fp8_row": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.68,
                            "tile_fixed_s": 6.0e-7, "split_k": False},
        "fbgemm_fp8_row": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.68,
                           "tile_fixed_s": 6.0e-7, "split_k": False},
        "fbgemm_fp8_tensor": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.66,
                              "tile_fixed_s": 6.0e-7, "split_k": False},
        "fbgemm_fp8_block": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.55,
                             "tile_fixed_s": 8.0e-7, "split_k": False},
        "triton_fp8_tensor": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.55,
                              "tile_fixed_s": 8.0e-7, "split_k": False},
        "triton_fp8_row": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.55,
                           "tile_fixed_s": 8.0e-7, "split_k": False},
        "triton_fp8_block": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.45,
                             "tile_fixed_s": 1.0e-6, "split_k": False},
        "cublaslt_mxfp8": {"tile_m": 128, "tile_n": 128, "k_align": 128, "rate_frac": 0.68,
                           "tile_fixed_s": 6.0e-7, "split_k": False},
    },
    "quant": {
        # per quantization kernel family: achieved fraction of HBM bandwidth on the bytes
        # the design must move (passes x 2 B read + 1 B written per element)
        "triton_tensor": {"bw_frac": 0.80},
        "triton_row": {"bw_frac": 0.85},
        "triton_row_t": {"bw_frac": 0.75},
        "triton_block": {"bw_frac": 0.85},
        "triton_block_t": {"bw_frac": 0.80},
        "triton_mx": {"bw_frac": 0.80},
        "fbgemm_row": {"bw_frac": 0.80},
        "fbgemm_tensor": {"bw_frac": 0.80},
        "torch_ops_tensor": {"bw_frac": 0.80},
        "torch_ops_row": {"bw_frac": 0.80},
        "transpose_copy": {"bw_frac": 0.80},
    },
}

# Design facts of each quantization kernel family (not fitted): full reads of the bf16
# input, kernel launches, extra bf16-sized intermediate writes+reads (unfused torch ops).
_QUANT_DESIGN: dict[str, dict[str, float]] = {
    # two-stage: per-block partial amax, then cast (reads the partials, reduces, casts)
    "triton_tensor": {"reads": 2, "kernels": 2, "temp": 0},
    "triton_row": {"reads": 1, "kernels": 1, "temp": 0},  # one program per row strip
    "triton_row_t": {"reads": 2, "kernels": 2, "temp": 0},  # column amax, then cast+transpose
    "triton_block": {"reads": 1, "kernels": 1, "temp": 0},
    "triton_block_t": {"reads": 1, "kernels": 1, "temp": 0},  # tile in registers, written transposed
    "triton_mx": {"reads": 1, "kernels": 1, "temp": 0},
    "fbgemm_row": {"reads": 2, "kernels": 1, "temp": 0},  # amax and cast passes in one kernel
    "fbgemm_tensor": {"reads": 2, "kernels": 3, "temp": 0},
    # eager torchao: abs, amax, scale math, mul, clamp, cast: ~2 temporaries of input size
    "torch_ops_tensor": {"reads": 3, "kernels": 6, "temp": 2},
    "torch_ops_row": {"reads": 3, "kernels": 6, "temp": 2},
    "transpose_copy": {"reads": 1, "kernels": 1, "temp": 0},  # bytes set by the caller
}

_CAL_OVERRIDE: dict[str, Any] | None = None


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


@lru_cache(maxsize=1)
def _shipped_calibration() -> dict[str, Any]:
    try:
        text = resources.files("loka_tune.kernels").joinpath("data", _DATA_FILE).read_text()
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return dict(_DEFAULT_CAL)
    return _merge(_DEFAULT_CAL, json.loads(text))


def load_calibration(path: str | Path | None = None) -> dict[str, Any]:
    """The calibration constants in use: ``path`` if given, else the override set by
    :func:`set_calibration`, else the JSON shipped in ``loka_tune/kernels/data``."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no calibration file at {str(p)!r}", key="calibration")
        return _merge(_DEFAULT_CAL, json.loads(p.read_text()))
    if _CAL_OVERRIDE is not None:
        return _CAL_OVERRIDE
    return _shipped_calibration()


def set_calibration(cal: Mapping[str, Any] | str | Path | None) -> None:
    """Use other calibration constants (a mapping or a JSON path) from now on; ``None``
    restores the shipped ones."""
    global _CAL_OVERRIDE
    if cal is None:
        _CAL_OVERRIDE = None
    elif isinstance(cal, (str, Path)):
        _CAL_OVERRIDE = load_calibration(cal)
    else:
        _CAL_OVERRIDE = _merge(_DEFAULT_CAL, cal)


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Step:
    """One kernel (or group of identical kernels) of a modeled GEMM choice."""

    name: str  # e.g. "quant A triton_row", "gemm cublas_bf16"
    seconds: float
    bytes: float = 0.0
    flops: float = 0.0
    kernels: int = 1


@dataclass(frozen=True)
class _Operand:
    rows: int  # rows of the canonical operand
    red: int  # reduction length
    transposed: bool  # the caller hands a transposed view (needs a transpose somewhere)
    is_weight: bool  # 128x128 blocks for blockwise scaling


def _operands(role: GemmRole, m: int, k: int, n: int) -> tuple[_Operand, _Operand]:
    # which canonical operands arrive as transposed views (see config.py's table):
    # fwd X, W contiguous; dgrad dY contiguous, W^T a view; wgrad dY^T and X^T both views.
    if role == GemmRole.FWD:
        return _Operand(m, k, False, False), _Operand(n, k, False, True)
    if role == GemmRole.DGRAD:
        return _Operand(m, k, False, False), _Operand(n, k, True, True)
    return _Operand(m, k, True, False), _Operand(n, k, True, False)


def _quant_step(label: str, family: str, op: _Operand, gran: Granularity, dev: DeviceSpec,
                cal: Mapping[str, Any]) -> Step:
    design = _QUANT_DESIGN[family]
    frac = float(cal["quant"][family]["bw_frac"])
    elems = op.rows * op.red
    if gran == Granularity.TENSOR:
        n_scales = 1
    elif gran == Granularity.ROW:
        n_scales = op.rows
    elif gran == Granularity.BLOCK:
        n_scales = (math.ceil(op.rows / 128) if op.is_weight else op.rows) * math.ceil(op.red / 128)
    else:  # mx
        n_scales = op.rows * math.ceil(op.red / 32)
    nbytes = elems * (design["reads"] * _BF16_BYTES + _FP8_BYTES + 2 * design["temp"] * _BF16_BYTES)
    nbytes += n_scales * 4
    kernels = int(design["kernels"])
    sec = kernels * float(cal["launch_s"]) + nbytes / (dev.hbm_tbps * 1e12 * frac)
    return Step(f"quant {label} {family}", sec, nbytes, 0.0, kernels)


def _transpose_step(label: str, op: _Operand, dev: DeviceSpec, cal: Mapping[str, Any]) -> Step:
    nbytes = op.rows * op.red * 2 * _BF16_BYTES  # read + write bf16
    frac = float(cal["quant"]["transpose_copy"]["bw_frac"])
    return Step(f"transpose {label}", float(cal["launch_s"]) + nbytes / (dev.hbm_tbps * 1e12 * frac), nbytes)


def _gemm_step(family: str, m: int, k: int, n: int, rate_tflops: float, a_bytes: float,
               fast_accum: bool, dev: DeviceSpec, cal: Mapping[str, Any]) -> Step:
    g = cal["gemm"][family]
    tm, tn, ka = int(g["tile_m"]), int(g["tile_n"]), int(g["k_align"])
    kp = math.ceil(k / ka) * ka
    frac = float(g["rate_frac"])
    if fast_accum:  # per family: promotion costs little in cuBLAS, 3x in FBGEMM's CUTLASS rowwise
        frac = float(g["fa_rate_frac"]) if "fa_rate_frac" in g else frac * float(cal.get("fast_accum_gain", 1.0))
    rate = rate_tflops * 1e12 * min(frac, 1.0) / dev.sms  # FLOP/s of one SM, never above peak
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    bw = dev.hbm_tbps * 1e12 * float(cal["mem_frac"])
    io_bytes = (m + n) * k * a_bytes + m * n * _OUT_BYTES
    launch = float(cal["launch_s"])
    best = math.inf
    splits = (1, 2, 4, 8, 16) if g.get("split_k") else (1,)
    for s in splits:
        if s > 1 and (tiles * s > 2 * dev.sms or kp // s < 256):
            break
        waves = math.ceil(tiles * s / dev.sms)
        per_tile = float(g["tile_fixed_s"]) + 2.0 * tm * tn * (kp / s) / rate
        extra = 0.0 if s == 1 else m * n * 4 * 2 * s / bw + launch  # fp32 partials + reduce
        t = launch + max(waves * per_tile, io_bytes / bw) + extra
        best = min(best, t)
    return Step(f"gemm {family}", best, io_bytes, 2.0 * m * n * k)


def _check_fp8(choice: GemmChoice, role: GemmRole, dev: DeviceSpec) -> None:
    """Device-level support (what the hardware can do at all)."""
    if choice.granularity == Granularity.MX and dev.mxfp8_tflops is None:
        raise UnsupportedChoiceError(
            f"{choice.short_str()}: mxfp8 block-scaled GEMMs need Blackwell tensor cores;"
            f" {dev.name} has none (use 'block' or 'row' granularity, or cost_device='b200')"
        )


def _backend_steps(choice: GemmChoice, role: GemmRole, m: int, k: int, n: int,
                   dev: DeviceSpec, cal: Mapping[str, Any]) -> list[Step]:
    """The kernels a real backend runs for ``choice`` (raises UnsupportedChoiceError)."""
    be = choice.backend
    if choice.is_bf16:
        return [_gemm_step("cublas_bf16", m, k, n, dev.bf16_tflops, _BF16_BYTES, False, dev, cal)]
    _check_fp8(choice, role, dev)
    gran = choice.granularity
    fa = choice.fast_accum and gran in (Granularity.TENSOR, Granularity.ROW)
    a_op, b_op = _operands(role, m, k, n)
    fmts = (choice.a_format, choice.b_format)
    steps: list[Step] = []

    def unsupported(why: str) -> UnsupportedChoiceError:
        return UnsupportedChoiceError(f"{choice.short_str()} ({role.value}) on backend {be!r}: {why}")

    def triton_quant(label: str, op: _Operand) -> Step:
        if gran == Granularity.TENSOR:
            fam = "triton_tensor"
        elif gran == Granularity.ROW:
            fam = "triton_row_t" if op.transposed else "triton_row"
        elif gran == Granularity.BLOCK:
            fam = "triton_block_t" if op.transposed else "triton_block"
        else:
            fam = "triton_mx"
        return _quant_step(label, fam, op, gran, dev, cal)

    if be == "torch_scaled_mm":
        if gran == Granularity.BLOCK:
            raise unsupported("torch._scaled_mm has no 1x128/128x128 blockwise scaling on sm90 here")
        if gran == Granularity.MX:
            steps += [triton_quant("A", a_op), triton_quant("B", b_op)]
            steps.append(_gemm_step("cublaslt_mxfp8", m, k, n, dev.mxfp8_tflops or dev.fp8_tflops,
                                    _FP8_BYTES, False, dev, cal))
            return steps
        if fmts == (Format.E5M2, Format.E5M2):
            raise unsupported("cuBLASLt has no e5m2 x e5m2 GEMM; use e5m2+e4m3 or e4m3")
        steps += [triton_quant("A", a_op), triton_quant("B", b_op)]
        fam = "cublaslt_fp8_tensor" if gran == Granularity.TENSOR else "cutlass_fp8_row"
        steps.append(_gemm_step(fam, m, k, n, dev.fp8_tflops, _FP8_BYTES, fa, dev, cal))
        return steps
    if be == "fbgemm":
        if dev.compute_capability[0] != 9:
            raise unsupported("the FBGEMM GenAI FP8 kernels modeled here are the sm90 CUTLASS ones")
        if fmts != (Format.E4M3, Format.E4M3):
            raise unsupported("FBGEMM FP8 GEMMs take e4m3 operands only")
        if gran == Granularity.MX:
            raise unsupported("no mxfp8 GEMM on sm90")
        if gran == Granularity.BLOCK:
            if role == GemmRole.WGRAD:
                raise unsupported("f8f8bf16_groupwise wants 128x128 weight blocks for B; wgrad's"
                                  " B is an activation (1x128): use the triton backend")
            steps += [triton_quant("A", a_op), triton_quant("B", b_op)]
            steps.append(_gemm_step("fbgemm_fp8_block", m, k, n, dev.fp8_tflops, _FP8_BYTES, False, dev, cal))
            return steps
        if choice.rounding.value == "pow2":
            raise unsupported("FBGEMM's quantize ops compute exact scales (no power-of-two rounding)")
        fam_q = "fbgemm_tensor" if gran == Granularity.TENSOR else "fbgemm_row"
        for label, op in (("A", a_op), ("B", b_op)):
            if op.transposed:
                steps.append(_transpose_step(label, op, dev, cal))
            steps.append(_quant_step(label, fam_q, op, gran, dev, cal))
        fam = "fbgemm_fp8_tensor" if gran == Granularity.TENSOR else "fbgemm_fp8_row"
        steps.append(_gemm_step(fam, m, k, n, dev.fp8_tflops, _FP8_BYTES, fa, dev, cal))
        return steps
    if be == "triton":
        if gran == Granularity.MX:
            raise unsupported("our Triton GEMMs implement tensor, row and block scaling")
        steps += [triton_quant("A", a_op), triton_quant("B", b_op)]
        fam = {"tensor": "triton_fp8_tensor", "row": "triton_fp8_row", "block": "triton_fp8_block"}[gran.value]
        steps.append(_gemm_step(fam, m, k, n, dev.fp8_tflops, _FP8_BYTES, fa, dev, cal))
        return steps
    if be == "torchao":
        if gran not in (Granularity.TENSOR, Granularity.ROW):
            raise unsupported("torchao's float8 training recipes are tensorwise and rowwise")
        if fmts == (Format.E5M2, Format.E5M2):
            raise unsupported("cuBLASLt has no e5m2 x e5m2 GEMM")
        fam_q = "torch_ops_tensor" if gran == Granularity.TENSOR else "torch_ops_row"
        for label, op in (("A", a_op), ("B", b_op)):
            steps.append(_quant_step(label, fam_q, op, gran, dev, cal))
        fam = "cublaslt_fp8_tensor" if gran == Granularity.TENSOR else "cutlass_fp8_row"
        steps.append(_gemm_step(fam, m, k, n, dev.fp8_tflops, _FP8_BYTES, fa, dev, cal))
        return steps
    raise UnsupportedChoiceError(
        f"the cost model does not know backend {be!r}; modeled backends: {', '.join(MODELED_BACKENDS)}"
    )


def modeled_backends() -> tuple[str, ...]:
    """Backends the cost model can price."""
    return MODELED_BACKENDS


def _norm_args(choice: GemmChoice | str, role: GemmRole | str, m: int, k: int, n: int) -> tuple[GemmChoice, GemmRole]:
    if isinstance(choice, str):
        choice = GemmChoice.parse(choice)
    try:
        role = GemmRole(role)
    except ValueError:
        raise ConfigError(f"got {role!r}; expected one of 'fwd', 'dgrad', 'wgrad'", key="role") from None
    for name, v in (("m", m), ("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"got {name}={v!r}; GEMM dimensions are positive integers", key=name)
    return choice, role


def _without_b_quant(steps: list[Step]) -> list[Step]:
    """``steps`` less B's quantization and transposition (a static B: quantized ahead of time)."""
    return [st for st in steps if not (st.name.startswith("quant B ") or st.name == "transpose B")]


def gemm_breakdown(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str,
                   device: str = "h200", *, static_b: bool = False) -> list[Step]:
    """The modeled kernels of one GEMM choice, each with its modeled seconds.

    ``emulated`` choices are priced as the fastest real backend implementing the same
    numerics on ``device``. ``static_b``: B (the weight, in fwd) is quantized once ahead of
    time, so its quantization kernels are left out (the serving forward). Raises
    :class:`UnsupportedChoiceError` when no modeled backend can run the choice there,
    :class:`ConfigError` for an unknown device.
    """
    choice, role = _norm_args(choice, role, m, k, n)
    dev = DEVICES[device_key(device)]
    cal = load_calibration()

    def steps_of(c: GemmChoice) -> list[Step]:
        st = _backend_steps(c, role, m, k, n, dev, cal)
        return _without_b_quant(st) if static_b else st

    if choice.backend == "emulated" or (choice.is_bf16 and choice.backend != "bf16"):
        if choice.is_bf16:
            return steps_of(GemmChoice.bf16())
        best: list[Step] | None = None
        reasons = []
        for be in _REAL_FP8_BACKENDS:
            try:
                steps = steps_of(choice.with_backend(be))
            except UnsupportedChoiceError as e:
                reasons.append(str(e))
                continue
            if best is None or sum(s.seconds for s in steps) < sum(s.seconds for s in best):
                best = steps
        if best is None:
            raise UnsupportedChoiceError(
                f"no modeled backend runs {choice.short_str()} ({role.value}) on {dev.name}: "
                + "; ".join(reasons)
            )
        return best
    return steps_of(choice)


def estimate_gemm_seconds(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str,
                          device: str = "h200", *, static_b: bool = False) -> float:
    """Modeled seconds of ``A (m, k) @ B (n, k)^T`` under ``choice`` in ``role``, quantization
    of both operands and every launch included (``static_b=True``: B's quantization left out,
    as when serving a weight quantized once). See the module docstring for the model."""
    return float(sum(s.seconds for s in gemm_breakdown(choice, m, k, n, role, device, static_b=static_b)))


def estimate_site_seconds(precision: SitePrecision | str, M: int, K: int, N: int,
                          device: str = "h200", *, compiled: bool = False) -> dict[str, float]:
    """Modeled seconds of the three GEMMs of a linear layer (M rows, K -> N) under
    ``precision``: ``{"fwd": s, "dgrad": s, "wgrad": s}``.

    ``compiled=True`` models the layer as it runs under ``torch.compile``: an operand that two
    of its GEMMs take tensorwise on ``torch_scaled_mm`` in one format is quantized once
    (:func:`loka_tune.kernels.scaled.share_plan`: ``X`` for fwd and wgrad, ``W`` for fwd and
    dgrad, ``dY`` for dgrad and wgrad; an ``emulated`` choice counts as ``torch_scaled_mm``, the
    fastest real backend of tensorwise numerics); the second GEMM pays a 1-byte transposed copy of the
    FP8 tensor instead of its own quantization. The per-GEMM model (``False``) is the one the
    GEMM suite was fitted on (each GEMM alone, as eager mode runs it). The copy's bandwidth
    (calibration ``compiled.transpose_fp8_bw_frac``) is fitted to the H200's compiled per-site
    prices (``kernels/data/site_prices_h200.json``): over their 36 ``torch_scaled_mm`` cells the
    modeled saving per site is off by 39 us on average (per-GEMM: 59 us); e.g. tensorwise on
    8192 x 2048 x 8192 saves 0.205 ms modeled, 0.228 measured (per-GEMM: 0.133).
    """
    if isinstance(precision, str):
        precision = SitePrecision.parse(precision)
    out: dict[str, float] = {}
    steps: dict[str, list[Step]] = {}
    for r in ROLES:
        m, k, n = r.shape(M, K, N)
        steps[r.value] = gemm_breakdown(precision[r], m, k, n, r, device)
    if compiled:
        from loka_tune.kernels.scaled import share_plan

        def real(c: GemmChoice) -> GemmChoice:  # emulated: the fastest real backend, torch_scaled_mm for tensorwise
            return c.with_backend("torch_scaled_mm") if c.backend == "emulated" and not c.is_bf16 else c

        plan = share_plan(real(precision.fwd), real(precision.dgrad), real(precision.wgrad))
        dev, cal = DEVICES[device_key(device)], load_calibration()
        # (the GEMM whose quantization of the shared operand is dropped, its label, the operand's elements)
        for shared, role, label, elems in ((plan.x, "wgrad", "B", M * K), (plan.w, "dgrad", "B", K * N),
                                           (plan.dy, "wgrad", "A", M * N)):
            if not shared:
                continue
            kept = [st for st in steps[role] if not st.name.startswith(f"quant {label} ")]
            nbytes = elems * 2 * _FP8_BYTES  # read + write the FP8 copy, transposed (inductor's kernel)
            frac = float(cal.get("compiled", {}).get("transpose_fp8_bw_frac", 0.4))
            kept.append(Step(f"transpose {label} fp8", float(cal["launch_s"]) + nbytes / (dev.hbm_tbps * 1e12 * frac),
                             nbytes))
            steps[role] = kept
    for r in ROLES:
        out[r.value] = float(sum(st.seconds for st in steps[r.value]))
    return out


def modeled_speedup(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str,
                    device: str = "h200", *, static_b: bool = False) -> float:
    """Modeled bf16 time over the choice's time (> 1: faster than bf16); ``static_b``: as
    :func:`estimate_gemm_seconds`."""
    t = estimate_gemm_seconds(choice, m, k, n, role, device, static_b=static_b)
    return estimate_gemm_seconds(GemmChoice.bf16(), m, k, n, role, device) / t


def best_modeled_choice(candidates: Iterable[GemmChoice | str], m: int, k: int, n: int,
                        role: GemmRole | str, device: str = "h200", *,
                        min_speedup: float = 1.05) -> tuple[GemmChoice, float]:
    """The fastest modeled candidate whose modeled speed-up over bf16 exceeds ``min_speedup``
    (bf16 if none), with its modeled seconds. Unsupported candidates are skipped."""
    bf16 = GemmChoice.bf16()
    t_bf16 = estimate_gemm_seconds(bf16, m, k, n, role, device)
    best, best_t = bf16, t_bf16
    for c in candidates:
        c = GemmChoice.parse(c) if isinstance(c, str) else c
        try:
            t = estimate_gemm_seconds(c, m, k, n, role, device)
        except UnsupportedChoiceError:
            continue
        if t_bf16 / t > min_speedup and t < best_t:
            best, best_t = c, t
    return best, best_t
