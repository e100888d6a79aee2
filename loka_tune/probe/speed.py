"""The speed side of the probe: seconds of one GEMM choice at one shape, and where they came from.

A :class:`SpeedModel` answers ``seconds(choice, m, k, n, role) -> (seconds, source)`` with
``source`` ``"measured"`` (a GPU timed it) or ``"modeled"`` (estimated). The default
(:func:`default_speed_model`) is, in order of preference:

1. a :class:`TimedSpeed` over a timing cache (``loka_tune.kernels.timing``) when one is given
   and holds a GPU measurement of that choice and shape;
2. :class:`CostModelSpeed`, ``loka_tune.kernels.costmodel.estimate_gemm_seconds`` for the
   named device (modeled);
3. :class:`RooflineSpeed`, a small roofline stub for when the cost model is unavailable
   (modeled; H200: 790 TFLOP/s bf16, twice that for FP8, 4.8 TB/s HBM, quantization as
   memory traffic, 5 us per kernel launch).

A choice no backend can run on the device gets ``nan`` seconds (and so is never "fast").
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from loka_tune.config import GemmChoice, GemmRole, Granularity
from loka_tune.errors import LokaError

__all__ = ["SpeedModel", "RooflineSpeed", "CostModelSpeed", "TimedSpeed", "default_speed_model"]

MEASURED, MODELED = "measured", "modeled"


@runtime_checkable
class SpeedModel(Protocol):
    """Seconds of one GEMM ``A (m, k) @ B (n, k)^T`` under ``choice`` in ``role``."""

    def seconds(self, choice: GemmChoice, m: int, k: int, n: int, role: GemmRole | str) -> tuple[float, str]: ...


class RooflineSpeed:
    """A roofline with quantization passes as memory traffic (a stub; see the module docstring).

    GEMM: ``max(2 m k n / peak, bytes / bw)`` with 2 B bf16 or 1 B FP8 operands and a bf16
    output; each FP8 operand adds a quantization kernel that reads bf16 and writes FP8 (3 B
    per element; tensorwise adds an amax pass reading 2 B more and a second launch); each
    kernel costs ``launch_s``.
    """

    def __init__(
        self,
        bf16_flops: float = 790e12,  # achievable dense bf16 rate of an H200 (datasheet 989)
        fp8_speedup: float = 2.0,  # FP8 tensor cores: twice the bf16 rate
        bandwidth: float = 4.8e12,  # H200 HBM3e bytes/s
        launch_s: float = 5e-6,  # per kernel
    ) -> None:
        self.bf16_flops, self.fp8_speedup, self.bandwidth, self.launch_s = bf16_flops, fp8_speedup, bandwidth, launch_s

    def seconds(self, choice: GemmChoice, m: int, k: int, n: int, role: GemmRole | str) -> tuple[float, str]:
        flops = 2.0 * m * k * n
        if choice.is_bf16:
            t = max(flops / self.bf16_flops, (2 * (m * k + n * k) + 2 * m * n) / self.bandwidth)
            return t + self.launch_s, MODELED
        t = max(flops / (self.bf16_flops * self.fp8_speedup), ((m * k + n * k) + 2 * m * n) / self.bandwidth)
        t += self.launch_s
        for elems in (m * k, n * k):  # quantize both operands
            per = 5.0 if choice.granularity == Granularity.TENSOR else 3.0
            launches = 2 if choice.granularity == Granularity.TENSOR else 1
            t += per * elems / self.bandwidth + launches * self.launch_s
        return t, MODELED


class CostModelSpeed:
    """:func:`loka_tune.kernels.costmodel.estimate_gemm_seconds` on ``device`` (modeled)."""

    def __init__(self, device: str = "h200") -> None:
        from loka_tune.kernels import costmodel

        costmodel.device_key(device)  # unknown device -> ConfigError now, not per call
        self._est = costmodel.estimate_gemm_seconds
        self.device = device

    def seconds(self, choice: GemmChoice, m: int, k: int, n: int, role: GemmRole | str) -> tuple[float, str]:
        try:
            return float(self._est(choice, m, k, n, role, self.device)), MODELED
        except LokaError:  # no modeled backend runs it on this device (e.g. mxfp8 on Hopper)
            return math.nan, MODELED


class TimedSpeed:
    """Measured seconds from a GPU timing cache when it has them, else ``fallback``.

    ``cache``: a :class:`loka_tune.kernels.timing.TimingCache` (or anything with
    ``lookup(choice, m, k, n, role, device=...) -> float | None``). A TimingCache keys its
    entries by GPU name and library versions; read on another machine (the CPU host that
    runs the probe), its own key does not match, so entries recorded on a GPU whose name
    contains ``device`` (``"h200"`` matches ``"NVIDIA H200"``) are used, the most recent
    first. An ``emulated`` choice stands for "the fastest real backend with these numerics"
    (as in the cost model): the fastest measured of those backends is taken.
    """

    REAL_BACKENDS = ("torch_scaled_mm", "fbgemm", "triton", "torchao")

    def __init__(self, cache: Any, fallback: SpeedModel, device: str = "h200") -> None:
        self.cache, self.fallback, self.device = cache, fallback, device
        if not (hasattr(cache, "lookup") or hasattr(cache, "get")):
            raise TypeError(f"{type(cache).__name__} is not a timing cache (no lookup() or get())")
        self._index: dict[str, tuple[str, float]] | None = None

    def _by_device(self, key_tail: str) -> float | None:
        if self._index is None:
            self._index = {}
            entries = self.cache.entries() if hasattr(self.cache, "entries") else {}
            want = self.device.lower()
            for key, rec in entries.items():
                parts = key.split("|")  # device|versions|role|mxkxn|choice
                if len(parts) != 5 or want not in parts[0].lower():
                    continue
                tail = "|".join(parts[2:])
                when = str(rec.get("when", ""))
                if tail not in self._index or when > self._index[tail][0]:
                    self._index[tail] = (when, float(rec["seconds"]))
        hit = self._index.get(key_tail)
        return None if hit is None else hit[1]

    def _one(self, choice: GemmChoice, m: int, k: int, n: int, role: str) -> float | None:
        if hasattr(self.cache, "lookup"):
            return self.cache.lookup(choice, m, k, n, role, device=self.device)
        t = self.cache.get(choice, m, k, n, role)
        if t is None:
            t = self._by_device(f"{role}|{m}x{k}x{n}|{choice.short_str()}")
        return t

    def seconds(self, choice: GemmChoice, m: int, k: int, n: int, role: GemmRole | str) -> tuple[float, str]:
        role = str(getattr(role, "value", role))
        if choice.is_bf16:
            ids = [GemmChoice.bf16()]
        elif choice.backend == "emulated":
            ids = [choice.with_backend(b) for b in self.REAL_BACKENDS]
        else:
            ids = [choice]
        times = []
        for c in ids:
            try:
                t = self._one(c, m, k, n, role)
            except (KeyError, LokaError):
                t = None
            if t is not None and math.isfinite(float(t)) and float(t) > 0:
                times.append(float(t))
        if times:
            return min(times), MEASURED
        return self.fallback.seconds(choice, m, k, n, role)


def default_speed_model(device: str = "h200", timing_cache: Any = None) -> SpeedModel:
    """The speed model of :func:`loka_tune.probe.measure` (see the module docstring)."""
    try:
        base: SpeedModel = CostModelSpeed(device)
    except ImportError:
        base = RooflineSpeed()
    if timing_cache is not None:
        return TimedSpeed(timing_cache, base, device)
    return base
