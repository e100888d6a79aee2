"""Serving prices on the GPU: one site's forward with a static weight, compiled with CUDA graphs.

:func:`time_serving_site` times the block ``Hard Swish -> Linear`` forward at one shape
``(M, K, N)`` (rows, in, out) and one fwd choice: ``bf16`` (a plain ``nn.Linear``) or an FP8
choice served with a static weight (:class:`~loka_tune.kernels.serving.ServingLinear`, weight
quantized once, the activation per call), under ``torch.compile(mode="reduce-overhead",
fullgraph=True, dynamic=False)`` (CUDA graphs, static shapes) and ``torch.no_grad``, in bf16, as a
served model's Linear runs: its input comes from an elementwise producer into which inductor
fuses the activation's quantization. The input is a buffer of the compiled module, as an
activation made inside a served model's graph is (an input argument would be copied into the
CUDA graph's static buffer on every replay, a copy no served Linear pays). The price is the
GPU's busy time per call from
``torch.profiler`` (kernels, copies and sets; the pattern of
:func:`loka_tune.kernels.site_timing.time_site`), the median over ``reps`` windows of ``iters``
calls, with the host time per call beside it. If the profiler sees no GPU activity inside the
graph replays (a CUPTI that does not trace graphs), the window's CUDA-event time is used and
``timing`` says ``"events"``.

:func:`loka_tune.serving.plan_serving` calls it per (bucket rows, site shape, choice); its cells
can be cached in a :class:`~loka_tune.kernels.site_timing.SitePriceCache` under ``serve:<choice>``.
It resets dynamo before each cell (every cell compiles the same
``forward``, which would otherwise reach the recompile limit and run eagerly).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from loka_tune.config import GemmChoice
from loka_tune.kernels.timing import gpu_activity_us, is_gpu_activity, require_cuda

__all__ = ["time_serving_site"]


class _Cell(torch.nn.Module):
    """``block(x)`` with ``x`` a buffer: a compiled call with no input to copy."""

    def __init__(self, block: torch.nn.Module, x: torch.Tensor) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("x", x)

    def forward(self) -> torch.Tensor:
        return self.block(self.x)


def time_serving_site(m: int, k: int, n: int, choice: GemmChoice | str, *, device: str = "cuda", iters: int = 20,
                      reps: int = 3, warmup: int = 3) -> dict[str, Any]:
    """Time one serving cell (module docstring): ``{gpu_s, host_s, spread, iters, kernels, timing}``.

    ``device="cpu"`` runs the same code on the CPU (no CUDA graphs, no profiler: ``gpu_s`` is
    then the wall time per call, ``timing="wall"``), which is what the CPU tests check; a price
    is a GPU's. Raises what the compile raises on a graph break (``fullgraph=True``) or the
    choice's backend on an unsupported shape.
    """
    from loka_tune.kernels.serving import ServingLinear

    c = GemmChoice.parse(choice)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        require_cuda("serving site timing")
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    served: torch.nn.Module = lin if c.is_bf16 else ServingLinear.from_linear(lin, c, name=f"{m}x{k}x{n}")
    block = torch.nn.Sequential(torch.nn.Hardswish(), served)
    g = torch.Generator(device=dev).manual_seed(1)
    cell = _Cell(block, torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(cell, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=False)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    gpu, host, kernels, timing = [], [], [], "profiler" if cuda else "wall"
    with torch.no_grad():
        for _ in range(warmup):  # compile, record the CUDA graph, replay once
            compiled()
        sync()
        for _ in range(reps):
            prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if cuda
                    else contextlib.nullcontext(None))
            with prof as p:
                sync()
                h0 = time.perf_counter()
                if cuda:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                for _ in range(iters):
                    compiled()
                if cuda:
                    e1.record()
                host.append((time.perf_counter() - h0) / iters)
                sync()
                wall = (time.perf_counter() - h0) / iters
            events = [e for e in p.events() if is_gpu_activity(e)] if p is not None else []
            busy = gpu_activity_us(events) / 1e6 / iters
            if busy <= 0:  # the profiler saw nothing inside the graph replays (or the CPU: no profiler)
                busy = e0.elapsed_time(e1) / 1e3 / iters if cuda else wall
                timing = "events" if cuda else "wall"
            gpu.append(busy)
            kernels.append(len(events) / iters)
    med = statistics.median(gpu)
    return {"gpu_s": med, "host_s": statistics.median(host), "spread": (max(gpu) - min(gpu)) / med,
            "iters": iters * reps, "kernels": statistics.median(kernels), "timing": timing}
