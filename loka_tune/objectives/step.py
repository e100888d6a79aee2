"""One training step of a CTR model, the way the product trains it.

:class:`TrainStep` runs forward (under the run's autocast; the model wrapped in
``torch.compile`` when asked), the binary cross-entropy loss, backward and every optimizer,
and returns the loss as a device tensor: nothing in it reads a value back to the host, so the
host queues step after step ahead of the GPU.

With ``cuda_graphs=True`` the whole step (forward, backward, optimizers) is captured in one
CUDA graph after ``graph_warmup`` eager steps (run on a side stream, as PyTorch's whole-network
capture recipe does; compilation and lazy optimizer state happen there), and every later step
is three copies into static input buffers and one graph replay: no Python, no kernel launches
per op. Each step runs exactly once, so training is the same as without graphs. Batches must
keep one shape (the trainer's fixed batch size does). The optimizers must be capturable:
:func:`~loka_tune.objectives.optim.build_optimizers` builds them so when the config asks for
CUDA graphs.

``lr_warmup_steps = W`` (W > 0) ramps every optimizer's learning rate linearly: step ``i``
(0-based) runs at ``min(1, (i + 1) / W)`` times each parameter group's own rate
(:func:`warmup_factor`), so step ``W - 1`` and every later one run at the full rate.
``lr_cooldown_steps = C`` (C > 0, with the run's length ``total_steps = S``) brings every rate
down linearly over the run's last C steps: step ``i >= S - C`` runs at ``(S - i) / (C + 1)`` of
it, the last step at ``1 / (C + 1)`` (:func:`lr_factor` takes the smaller of the two factors).
A short run is judged by its final weights; at a constant rate they carry the last steps' noise,
and so does a paired comparison of two runs' eval losses. The rates are set before each step on
the host; in a CUDA-graph step they are 0-d device tensors that the captured optimizers read,
filled before each replay, so the schedule survives capture.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.data.base import model_inputs
from loka_tune.errors import ConfigError, DataError

__all__ = ["TrainStep", "autocast_for", "cooldown_factor", "lr_factor", "warmup_factor"]


def autocast_for(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a run: None (fp32) for ``"off"`` and for ``"auto"`` off CUDA, else bf16."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> Any:
    """``torch.autocast`` for ``dtype`` on ``device`` (disabled when ``dtype`` is None)."""
    if dtype is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=dtype)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The learning-rate multiplier of 0-based ``step`` under a linear warm-up of ``warmup_steps``:
    ``min(1, (step + 1) / warmup_steps)``; 1 for every step when ``warmup_steps`` is 0."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def cooldown_factor(step: int, total_steps: int, cooldown_steps: int) -> float:
    """The learning-rate multiplier of 0-based ``step`` of a ``total_steps`` run under a linear
    cool-down over its last ``cooldown_steps``: ``(total_steps - step) / (cooldown_steps + 1)``
    there, else 1; 1 for every step when ``cooldown_steps`` is 0."""
    left = total_steps - step  # this step and the ones after it
    if cooldown_steps <= 0 or left > cooldown_steps:
        return 1.0
    return max(left, 1) / (cooldown_steps + 1)


def lr_factor(step: int, *, warmup_steps: int = 0, total_steps: int = 0, cooldown_steps: int = 0) -> float:
    """The schedule's multiplier of 0-based ``step``: the warm-up's and the cool-down's, the smaller."""
    return min(warmup_factor(step, warmup_steps), cooldown_factor(step, total_steps, cooldown_steps))


class TrainStep:
    """``step(batch) -> loss`` (a 0-d float32 device tensor); see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        compile: bool = False,
        cuda_graphs: bool = False,
        graph_warmup: int = 3,
        lr_warmup_steps: int = 0,
        lr_cooldown_steps: int = 0,
        total_steps: int | None = None,
    ) -> None:
        if cuda_graphs and device.type != "cuda":
            raise ConfigError(
                f"cuda_graphs needs a CUDA device, this run is on {str(device)!r}: turn cuda_graphs off",
                key="cuda_graphs",
            )
        self.model, self.optimizers, self.device, self.dtype = model, optimizers, device, dtype
        if compile:  # sparse embedding gradients in the compiled backward: see allow_sparse_gradients
            from loka_tune.objectives.compiled import allow_sparse_gradients

            allow_sparse_gradients()
        self.fwd: Callable[..., torch.Tensor] = torch.compile(model) if compile else model
        self.cuda_graphs, self.graph_warmup = cuda_graphs, graph_warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static: tuple[torch.Tensor, ...] = ()
        self._static_loss: torch.Tensor | None = None
        self._warm = 0
        self._stream: torch.cuda.Stream | None = None
        self.lr_warmup_steps, self.steps_done = int(lr_warmup_steps), 0
        self.lr_cooldown_steps = int(lr_cooldown_steps)
        if self.lr_cooldown_steps > 0 and (total_steps is None or total_steps < 1):
            raise ValueError(f"lr_cooldown_steps={lr_cooldown_steps} needs the run's length: pass total_steps"
                             f" (the number of steps the run takes), got {total_steps!r}")
        self.total_steps = int(total_steps or 0)
        self._factor = 1.0  # the multiplier the groups' rates hold now
        # each parameter group's own rate: the schedule scales it (the groups' "lr" is what the step reads)
        self._base_lrs = [[float(g["lr"]) for g in opt.param_groups] for opt in optimizers]
        if self._scheduled and cuda_graphs:  # a captured optimizer reads its rate from device memory
            for opt in optimizers:
                for g in opt.param_groups:
                    g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)

    def _tensors(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """The model's inputs (:func:`~loka_tune.data.base.model_inputs`), then the labels."""
        return (*model_inputs(self.model, batch), batch.labels)

    def _run(self, *tensors: torch.Tensor) -> torch.Tensor:
        *inputs, labels = tensors  # the model's inputs, then the labels
        with autocast_context(self.device, self.dtype):
            logits = self.fwd(*inputs)  # (B,)
        loss = F.binary_cross_entropy_with_logits(logits.float().reshape(-1), labels.float().reshape(-1))
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss.detach()

    @property
    def _scheduled(self) -> bool:
        """Whether the rates change during the run (a warm-up or a cool-down)."""
        return self.lr_warmup_steps > 0 or self.lr_cooldown_steps > 0

    def _set_lrs(self) -> None:
        """The schedule's rates for the step about to run (nothing to do while they stay put)."""
        f = lr_factor(self.steps_done, warmup_steps=self.lr_warmup_steps, total_steps=self.total_steps,
                      cooldown_steps=self.lr_cooldown_steps)
        if f == self._factor and self.steps_done > 0:
            return
        self._factor = f
        for opt, bases in zip(self.optimizers, self._base_lrs):
            for g, base in zip(opt.param_groups, bases):
                if isinstance(g["lr"], torch.Tensor):
                    g["lr"].fill_(base * f)  # queued before the replay that reads it
                else:
                    g["lr"] = base * f

    def _calibrate_chains(self, batch: Any) -> None:
        """Before the first step: the FP8 chains that have no delayed amaxes yet (the ``fp8_chain``
        Mod) take them from one eager forward and backward of this batch, each operand cast with
        its own amax; no weight moves. Left to their own first call, a compiled model would
        compile twice (that call's graph, then the delayed one)."""
        from loka_tune.kernels.chain import ChainMLP, calibrate

        if not any(isinstance(m, ChainMLP) and not m.calibrated for m in self.model.modules()):
            return
        *inputs, labels = self._tensors(batch)

        def loss(logits: torch.Tensor, i: int) -> torch.Tensor:
            return F.binary_cross_entropy_with_logits(logits.float().reshape(-1), labels.float().reshape(-1))

        calibrate(self.model, [tuple(inputs)], loss, autocast=self.dtype)

    def __call__(self, batch: Any) -> torch.Tensor:
        if self._scheduled:
            self._set_lrs()
        if self.steps_done == 0:
            self._calibrate_chains(batch)
        self.steps_done += 1
        if not self.cuda_graphs:
            return self._run(*self._tensors(batch))
        if self.graph is None:
            if self._warm < self.graph_warmup:
                self._warm += 1
                return self._side_stream(batch)
            self._capture(batch)
        self._copy_in(batch)
        assert self.graph is not None and self._static_loss is not None
        self.graph.replay()
        return self._static_loss

    # ------------------------------------------------------------------ CUDA graphs
    def _side_stream(self, batch: Any) -> torch.Tensor:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            loss = self._run(*self._tensors(batch))
        torch.cuda.current_stream(self.device).wait_stream(s)
        return loss

    def _capture(self, batch: Any) -> None:
        self._static = tuple(t.clone() for t in self._tensors(batch))
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)  # the captured backward allocates the grads in the graph's pool
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._static_loss = self._run(*self._static)
        self.graph = graph  # capture recorded the step without running it: the caller replays it

    def _copy_in(self, batch: Any) -> None:
        tensors = self._tensors(batch)
        if len(tensors) != len(self._static):
            raise DataError(
                f"a batch with {len(tensors)} tensors reached a CUDA-graph step captured for "
                f"{len(self._static)}: every batch must carry sequences, or none (turn cuda_graphs off)"
            )
        for dst, src in zip(self._static, tensors):
            if dst.shape != src.shape:
                raise DataError(
                    f"a batch of shape {tuple(src.shape)} reached a CUDA-graph step captured for "
                    f"{tuple(dst.shape)}: CUDA graphs need one batch shape (turn cuda_graphs off)"
                )
            dst.copy_(src, non_blocking=True)
