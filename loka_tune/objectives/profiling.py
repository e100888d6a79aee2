"""Where a training step's time goes: GPU kernel time per step from ``torch.profiler``.

A step is GPU-bound when its wall time (CUDA events, :class:`~loka_tune.objectives.trainer.
TrainResult.step_time_s`) is close to the time its kernels keep the GPU busy; the gap is host
time the GPU waits for (Python, launches, host syncs). :class:`StepProfiler` records a few
steps with the CPU and CUDA activities and :func:`kernel_summary` reduces them to the GPU's
busy time per step, the GEMM share of it (by kernel name) and the largest kernels.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import torch

from loka_tune.kernels.timing import is_gpu_activity

__all__ = ["StepProfiler", "kernel_summary", "is_gpu_activity", "GEMM_KERNEL_RE"]

#: kernel names of matrix products: cuBLAS / cuBLASLt (gemm, nvjet, sm90_xmma), CUTLASS
#: (FBGEMM's f8f8bf16*), torch._scaled_mm, our Triton GEMMs and inductor's mm templates
GEMM_KERNEL_RE = re.compile(r"gemm|nvjet|xmma|cutlass|f8f8bf16|scaled_mm|_mm_|mm_kernel|matmul|wgmma", re.I)


def kernel_summary(kernels: Iterable[tuple[str, float]], steps: int, *, top: int = 15) -> dict[str, Any]:
    """``kernels``: ``(name, microseconds)`` of every GPU activity (kernels, copies, sets) over
    ``steps`` steps. Returns per-step milliseconds: ``gpu_ms`` (all activities), ``gemm_ms``,
    ``gemm_share``, ``kernels_per_step`` and ``top`` (name, ms per step, calls per step)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps=}")
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    total = sum(sum(v) for v in by_name.values()) / 1e3 / steps
    gemm = sum(sum(v) for n, v in by_name.items() if GEMM_KERNEL_RE.search(n)) / 1e3 / steps
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "gpu_ms": total,
        "gemm_ms": gemm,
        "gemm_share": gemm / total if total > 0 else math.nan,
        "kernels_per_step": sum(len(v) for v in by_name.values()) / steps,
        "top": [{"name": n[:160], "ms": sum(v) / 1e3 / steps, "calls": len(v) / steps} for n, v in ranked],
    }


class StepProfiler:
    """``torch.profiler`` (CPU + CUDA activities) around ``steps`` training steps.

    ``start()`` before the first profiled step, ``stop()`` after the last: returns
    :func:`kernel_summary` plus ``host_ms`` (CPU time of the profiled steps' top-level
    operators per step). On a CPU-only run ``gpu_ms`` is None.
    """

    def __init__(self, steps: int, device: torch.device, *, top: int = 15) -> None:
        self.steps, self.device, self.top = steps, device, top
        self._prof: Any = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()

    def stop(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        events = prof.events()
        gpu = [(e.name, e.time_range.elapsed_us()) for e in events if is_gpu_activity(e)]
        out = kernel_summary(gpu, self.steps, top=self.top) if gpu else {"gpu_ms": None, "gemm_ms": None, "gemm_share": None,
                                                           "kernels_per_step": 0, "top": []}
        roots = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
        out["host_ms"] = sum(e.time_range.elapsed_us() for e in roots) / 1e3 / self.steps
        out["steps"] = self.steps
        return out
