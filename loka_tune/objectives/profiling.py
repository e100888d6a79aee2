"""Where a training step's time goes: GPU kernel time per step from ``torch.profiler``.

A step is GPU-bound when its wall time (CUDA events, :class:`~loka_tune.objectives.trainer.
TrainResult.step_time_s`) is close to the time its kernels keep the GPU busy; the gap is host
time the GPU waits for (Python, launches, host syncs). :class:`StepProfiler` records a few
steps with the CPU and CUDA activities and :func:`kernel_summary` reduces them to the GPU's
busy time per step, the GEMM share of it (by kernel name) and the largest kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from loka_tune.kernels.timing import GEMM_KERNEL_RE, is_gpu_activity, kernel_kind, kernel_summary

__all__ = ["StepProfiler", "kernel_summary", "kernel_kind", "is_gpu_activity", "GEMM_KERNEL_RE"]


class StepProfiler:
    """``torch.profiler`` (CPU + CUDA activities) around ``steps`` training steps.

    ``start()`` before the first profiled step, ``stop()`` after the last: returns
    :func:`kernel_summary` plus ``host_ms`` (CPU time of the profiled steps' top-level
    operators per step), ``top`` its 30 longest kernels (``top=``). On a CPU-only run ``gpu_ms``
    is None.
    """

    def __init__(self, steps: int, device: torch.device, *, top: int = 30) -> None:
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
                                                           "kinds": None, "kernels_per_step": 0, "top": [],
                                                           "fp8_casts": None, "amax": None}
        roots = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
        out["host_ms"] = sum(e.time_range.elapsed_us() for e in roots) / 1e3 / self.steps
        out["steps"] = self.steps
        return out
