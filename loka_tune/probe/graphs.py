"""A side collection's statistics as one CUDA graph (issue 22).

On the compiled large-Wukong step (37 ms on an H200, ~24 ms of it host time to launch) a side
collection's statistics are ~2,000 small eager launches: ~30 ms of host time, more than the
step leaves idle, so the collection's cost was its launches. Captured once, they replay as one
graph launch. What the capture needs, and what this module gives:

- **Static inputs**: the graph reads fixed addresses. :func:`capture` clones the collection's
  activations and output gradients into buffers the graph owns; :meth:`SideGraph.run` copies
  each new collection's into them (one copy kernel each) and replays.
- **State in place**: the statistics' merge is functional (each accumulator attribute is
  replaced by a new tensor). :class:`Pinned` records the attributes before the captured code
  runs and, after it, copies every new value back into the tensor that was there (the copy is
  part of the graph) and puts that tensor back: the graph reads and writes the same state at
  every replay. An attribute that was ``None`` before (the real rows of a first collection) is
  an output only: it stays the graph's own tensor, rewritten by each replay.
- **Host scalars**: a plain value the captured code sets on a state object (an accumulator's
  ``rows``, a Python int) is not replayed by the graph. A layout fixes them (a collection of
  the same layout sets the same values), so :func:`capture` records the state objects' plain
  values after the capture and :meth:`SideGraph.run` sets them again after every replay (an
  eager collection of another layout in between may have set its own).
- **Random draws**: the probe's CUDA generator is registered with the graph, so each replay
  draws new rows and elements (its offset advances as in eager mode).
- **No host traffic** in the captured code: the small index and constant tensors a collection
  builds from Python lists come from a cache (:func:`loka_tune.probe.moments.on_device`) filled
  by an eager collection of the same layout first (the probe's warm-up).

A layout the graph was not captured for (another batch size, say) runs eagerly on the same
state (:class:`Pinned` again, so the graph stays valid). Memory: the graph keeps its inputs and
its working set (the float32 copies of the collection's rows) reserved between collections.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["Pinned", "SideGraph", "capture", "graphs_supported"]

Ref = tuple[Any, str]  # (object, attribute) of one state tensor


def graphs_supported(device: torch.device) -> bool:
    """Whether a side collection on ``device`` can be captured: CUDA, and a torch whose graphs
    take a non-default generator (``CUDAGraph.register_generator_state``)."""
    return device.type == "cuda" and hasattr(torch.cuda, "CUDAGraph") and hasattr(
        torch.cuda.CUDAGraph, "register_generator_state")


class Pinned:
    """The state attributes ``refs`` kept in their tensors across a functional update: made
    before the update, :meth:`restore` after it (see the module docstring)."""

    def __init__(self, refs: Sequence[Ref]) -> None:
        self.refs = list(refs)
        self.old = [getattr(o, a) for o, a in self.refs]

    def restore(self, copy: bool = True) -> list[tuple[Any, str, torch.Tensor]]:
        """``copy``: each replaced tensor's new value copied into the old one, which is put back
        (returns the output-only attributes: ``None`` before, a tensor now). ``copy=False``:
        the old tensors put back as they were (an update that failed half-way)."""
        outputs = []
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for (o, a), old in zip(self.refs, self.old):
            new = getattr(o, a)
            if new is old:
                continue
            if not copy or not isinstance(new, torch.Tensor):
                setattr(o, a, old)
            elif not isinstance(old, torch.Tensor):
                outputs.append((o, a, new))
            elif new.shape != old.shape or new.dtype != old.dtype:
                pass  # an output of another shape (the real rows of a smaller batch): the new one stays
            else:
                if not (new.data_ptr() == old.data_ptr() and new.stride() == old.stride()):  # not updated in place
                    dst.append(old)
                    src.append(new)
                setattr(o, a, old)
        if dst:
            _copy_all(dst, src)
        return outputs

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.restore(copy=kind is None)


class SideGraph:
    """One captured collection layout: ``key`` (what :meth:`run` must be given the same of),
    the graph, its static input buffers (``None`` where a collection has no tensor) and the
    output-only attributes it rewrites."""

    def __init__(self, key: Any, graph: Any, inputs: list[torch.Tensor | None],
                 outputs: list[tuple[Any, str, torch.Tensor]],
                 host: Sequence[tuple[Any, str, Any]] = ()) -> None:
        self.key, self.graph, self.inputs, self.outputs = key, graph, inputs, outputs
        self.host = list(host)  # (object, attribute, value): the plain values the captured code set
        self.replays = 0

    def run(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy ``tensors`` into the static inputs and replay (no host sync)."""
        pairs = [(d, t) for d, t in zip(self.inputs, tensors) if d is not None and t is not None]
        _copy_all([d for d, _ in pairs], [t for _, t in pairs])
        self.graph.replay()
        for o, a, t in self.outputs:
            setattr(o, a, t)
        for o, a, v in self.host:
            setattr(o, a, v)
        self.replays += 1


_SCALARS = (bool, int, float, str, type(None))


def _host_values(objs: Sequence[Any]) -> dict[tuple[int, str], Any]:
    """The plain scalar attributes of ``objs`` (keyed by object id and name)."""
    return {(id(o), k): v for o in objs for k, v in vars(o).items() if isinstance(v, _SCALARS)}


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair: one multi-tensor kernel per dtype (a graph of ~600 small
    copies spent ~2 ms on their launches alone on an H200), one copy each where that is refused."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        g = groups.setdefault((d.dtype, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    for ds, ss in groups.values():
        try:
            torch._foreach_copy_(ds, ss)
        except (RuntimeError, AttributeError):
            for d, s in zip(ds, ss):
                d.copy_(s)


def capture(fn: Callable[[list[torch.Tensor | None]], None], key: Any, inputs: Sequence[torch.Tensor | None],
            refs: Sequence[Ref], generator: torch.Generator) -> SideGraph:
    """Capture ``fn(static_inputs)`` (the statistics of one collection layout) as a CUDA graph
    on a side stream, the state ``refs`` pinned (:class:`Pinned`), ``generator`` registered.
    Nothing runs: the state is as it was until the first :meth:`SideGraph.run`. Raises what the
    capture raised (the state attributes are put back first)."""
    dev = next(t.device for t in inputs if t is not None)
    static = [None if t is None else t.clone() for t in inputs]
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)
    pin = Pinned(refs)
    objs = list({id(o): o for o, _ in refs}.values())
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    outputs: list[tuple[Any, str, torch.Tensor]] | None = None
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn(static)
                outputs = pin.restore(copy=True)  # recorded: the copies back are part of the graph
            finally:
                graph.capture_end()
    except BaseException:
        if outputs is None:
            pin.restore(copy=False)
        else:
            for o, a, _ in outputs:
                setattr(o, a, None)
        raise
    finally:
        torch.cuda.current_stream(dev).wait_stream(stream)
    by_id = {id(o): o for o in objs}
    host = [(by_id[i], k, v) for (i, k), v in _host_values(objs).items()]
    return SideGraph(key, graph, static, outputs, host)
