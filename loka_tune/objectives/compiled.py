"""Compiled runs that fail loudly: no silent eager fallback, graph break or recompile storm.

``torch.compile`` degrades quietly: after ``recompile_limit`` recompilations of one code object
(every reference model's ``forward`` is one code object, so a benchmark that compiles several
models reaches it fast) dynamo runs the function *eagerly* and only logs a warning; a graph
break splits the model into several graphs with Python between them. Either can turn a
speed-up into a slow-down without an error (an e2e table once reported 0.57x that way).

:func:`strict_compile` wraps one compiled run: it resets dynamo's caches and counters first
(every run compiles afresh, as a new process would), makes a recompile-limit hit raise
instead of falling back, and afterwards checks dynamo's counters: a graph break, or nothing
compiled at all, raises :class:`CompileHealthError`. The counters it read are in the report
it yields, for the run's JSON.

Resetting dynamo does not drop inductor's caches on disk (``torch._dynamo.reset`` clears
in-process state only: "It does NOT affect any file system caches"): a run that traces a
graph an earlier run compiled (the same model, the same precision config, the same shapes;
other weights and another seed do not matter) loads it from inductor's FX graph cache (and
AOTAutograd's, where it applies) instead of compiling it again. Not yet a graph with a site
on the ``loka::gemm`` custom op (the emulated backend's; the GPU backends call their kernels
directly): the op's ``tag`` argument, unique per layer instance (its non-finite counter), is
a constant of the graph, so each fresh model's graph is a new one. :func:`compile_cache_counts`
says how often the cache served the latest run.

AOTAutograd's cache (the traced forward + backward, before inductor) bypasses any graph with a
custom ``autograd.Function`` unless ``torch._functorch.config.
autograd_cache_allow_custom_autograd_functions`` is set (default False in torch 2.13; the H200
receipts' torch 2.11 bypassed every FP8 run: ``aot_bypass``), and every FP8 site is one
(LokaLinear's, torchao's float8 matmul): such a run traced its forward and backward again even
when inductor's cache then served every compiled graph (on the H200, large Wukong at 8192: a
cached FP8 rerun of e2e took ~7 s more than a cached bf16 one, whose AOT cache hit).
:func:`strict_compile` sets it for its run (:data:`AOT_CACHE_CUSTOM_FUNCTIONS`): the cache key
holds the function's traced forward and backward subgraphs, so a changed function is a new key.
On the CPU, a second run of one FP8 config: AOT hit, first step 0.39 s against 1.12 s bypassed.

:func:`allow_sparse_gradients` works around an inductor bug that a sparse embedding gradient
can run into (:class:`~loka_tune.objectives.step.TrainStep` calls it before compiling): see
its docstring.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["CompileHealthError", "strict_compile", "dynamo_report", "compile_cache_counts", "allow_sparse_gradients"]


#: strict_compile lets AOTAutograd's cache take graphs with custom autograd.Functions (see above)
AOT_CACHE_CUSTOM_FUNCTIONS = True

_SPARSE_PATCHED: list[bool] = []  # set once allow_sparse_gradients has looked (and patched if needed)


def allow_sparse_gradients() -> bool:
    """Let inductor compile a backward that builds a sparse gradient (``nn.Embedding(sparse=True)``,
    the tables of every reference model); returns True when it had to patch inductor.

    Inductor's post-grad passes re-propagate fake tensors after re-inplacing a scatter
    (``FakeTensorUpdater.incremental_update``) and compare each recomputed node's storage with
    the old one's (``torch._inductor.fx_utils.get_storage``); a sparse COO tensor has no
    storage, so a sparse gradient downstream of any re-inplaced op fails the compile with
    ``NotImplementedError: Cannot access storage of SparseTensorImpl`` (torch 2.13 on the
    Interformer's backward; pytorch/pytorch#170761, open); a graph without a re-inplaced op
    before its sparse gradient (the tiny DLRM's, Wukong's) escapes it. The patch answers, for a tensor without storage, an identity of its own: "not
    the same storage", so the updater takes the recomputed fake tensor (always correct, only
    conservative). Applied only when this torch still fails on a sparse tensor; idempotent.
    """
    if _SPARSE_PATCHED:
        return _SPARSE_PATCHED[0]
    import torch

    try:
        from torch._inductor import fx_utils
    except ImportError:  # pragma: no cover - every torch 2.x has it
        _SPARSE_PATCHED.append(False)
        return False
    original = getattr(fx_utils, "get_storage", None)
    if original is None:  # a torch that reorganized the updater: nothing to patch
        _SPARSE_PATCHED.append(False)
        return False
    probe = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 2), (3, 2),
                                    check_invariants=True)
    try:
        original(probe)
        needed = False  # this torch handles storage-less tensors
    except (NotImplementedError, RuntimeError):
        needed = True
    if needed:
        def get_storage(t: torch.Tensor) -> int:
            if not torch._C._has_storage(t):
                return -id(t)  # a sparse tensor: its own identity, never equal to another tensor's storage
            return int(original(t))

        fx_utils.get_storage = get_storage
    _SPARSE_PATCHED.append(needed)
    return needed


class CompileHealthError(RuntimeError):
    """A compiled run broke its graph, ran eagerly, or hit the recompile limit."""


def dynamo_report() -> dict[str, Any]:
    """Dynamo's counters that say how a compiled run went (frames, graphs, breaks, caches)."""
    from torch._dynamo.utils import counters

    stats, frames = counters["stats"], counters["frames"]
    return {
        "frames_total": int(frames.get("total", 0)),
        "frames_ok": int(frames.get("ok", 0)),
        "unique_graphs": int(stats.get("unique_graphs", 0)),
        "calls_captured": int(stats.get("calls_captured", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "graph_break_reasons": [r.split("\n")[0][:200] for r in counters["graph_break"]],
        "fxgraph_cache_hits": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
        "compile_cache": compile_cache_counts(),
    }


#: compile_split's parts, in its order: (its name, dynamo's ``dynamo_timed`` key). Tracing is
#: dynamo's; forward and backward are inductor's compiles of the two graphs (the backward's runs
#: in the first backward pass). Inside them: kernel codegen (inductor writing its kernels, each
#: handed to its pool of compile workers right away if the pool is up), module load (running the
#: generated module: a kernel not yet handed over is handed over then, or compiled in this process
#: while the pool is still not up, one after another) and kernel wait (for the pool's kernels).
COMPILE_PARTS = (("tracing", "bytecode_tracing"), ("forward", "compile_fx.<locals>.fw_compiler_base"),
                 ("backward", "compile_fx.<locals>.bw_compiler"), ("kernel codegen", "Scheduler.codegen"),
                 ("module load", "PyCodeCache.load_by_key_path"), ("kernel wait", "async_compile.wait"))


def compile_split() -> dict[str, float]:
    """Where a compile's seconds went, by :data:`COMPILE_PARTS` (only the parts that ran), from
    dynamo's own timers of the frame it compiled last (dynamo clears them at each new frame):
    read right after a run's first step, that step's compile. Plus ``"workers"``: the size of
    inductor's pool of compile workers, when it has one, and ``"workers_ready"`` (1.0 / 0.0) whether
    the pool had answered by then (until it does, inductor compiles its kernels in this process:
    ``torch._inductor.async_compile``). A run whose graphs came from the caches reports its tracing
    and the load alone; ``{}`` when dynamo never timed anything. Never imports dynamo or inductor."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None) or {}
    out = {name: float(sum(metrics[key])) for name, key in COMPILE_PARTS if metrics.get(key)}
    ac = sys.modules.get("torch._inductor.async_compile")
    cls = getattr(ac, "AsyncCompile", None)
    if out and ac is not None and cls is not None and getattr(ac, "_pool_set", None):
        try:
            out["workers"] = float(ac.get_compile_threads())
            ready = getattr(cls, "_ready_future", None)
            out["workers_ready"] = 1.0 if ready is not None and ready.done() else 0.0
        except Exception:  # noqa: BLE001 - a torch whose private pool state differs: report the parts alone
            pass
    return out


def compile_note(split: dict[str, float]) -> str:
    """:func:`compile_split` in words: ``"tracing 2.1s, forward 12.0s, backward 13.1s; kernel
    codegen 15.0s, module load 1.2s, kernel wait 3.0s; 16 compile workers (up)"`` (``""`` for ``{}``)."""
    graphs = [f"{name} {split[name]:.1f}s" for name, _ in COMPILE_PARTS[:3] if name in split]
    kernels = [f"{name} {split[name]:.1f}s" for name, _ in COMPILE_PARTS[3:] if name in split]
    parts = [", ".join(graphs), ", ".join(kernels)]
    if "workers" in split:
        state = "up" if split.get("workers_ready") else "not up yet"
        parts.append(f"{int(split['workers'])} compile workers ({state})")
    return "; ".join(p for p in parts if p)


#: compile_cache_counts' keys: (counter group, dynamo's counter name)
CACHE_COUNTERS = {"hits": ("inductor", "fxgraph_cache_hit"), "misses": ("inductor", "fxgraph_cache_miss"),
                  "bypass": ("inductor", "fxgraph_cache_bypass"),
                  "aot_hits": ("aot_autograd", "autograd_cache_hit"), "aot_misses": ("aot_autograd", "autograd_cache_miss"),
                  "aot_bypass": ("aot_autograd", "autograd_cache_bypass")}


def compile_cache_counts() -> dict[str, int]:
    """How the compiled graphs of the latest run were had: ``hits`` (inductor's FX graph cache
    gave a compiled graph), ``misses`` (it had none: inductor compiled it and stored it),
    ``bypass`` (a graph inductor cannot cache), and AOTAutograd's own cache of the traced
    forward + backward, ``aot_hits`` / ``aot_misses`` / ``aot_bypass`` (0 on a torch without
    it; it bypasses a graph with a custom ``autograd.Function``, a LokaLinear's, unless
    ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``, which
    :func:`strict_compile` sets: the module docstring). The latest run:
    dynamo's counters since :func:`strict_compile` last cleared them, as a run starts (so read
    right after a run, they are that run's)."""
    from torch._dynamo.utils import counters

    return {key: int(counters[group].get(name, 0)) for key, (group, name) in CACHE_COUNTERS.items()}


@contextlib.contextmanager
def strict_compile(*, max_graphs: int | None = None) -> Iterator[dict[str, Any]]:
    """Context for one compiled run (see the module docstring). Yields a dict that is filled
    with :func:`dynamo_report` at the end; raises :class:`CompileHealthError` when the run
    broke a graph, compiled nothing, or compiled more than ``max_graphs`` graphs."""
    import torch._dynamo
    import torch._dynamo.config as dcfg
    import torch._functorch.config as fcfg
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # dynamo's own patch(): restores the setting on exit (torch < 2.6 has no such setting)
    strict = {k: True for k in ("fail_on_recompile_limit_hit",) if hasattr(dcfg, k)}
    aot = {k: AOT_CACHE_CUSTOM_FUNCTIONS for k in ("autograd_cache_allow_custom_autograd_functions",)
           if hasattr(fcfg, k)}
    report: dict[str, Any] = {}
    try:
        with dcfg.patch(strict), fcfg.patch(aot):
            yield report
    except Exception as e:
        if type(e).__name__ == "FailOnRecompileLimitHit":
            raise CompileHealthError(
                f"torch.compile hit its recompile limit ({dcfg.recompile_limit}) and would have run eagerly: "
                "the compiled numbers would not be compiled ones"
            ) from e
        raise
    finally:
        report.update(dynamo_report())
    problems = []
    if report["graph_breaks"]:
        problems.append(f"{report['graph_breaks']} graph break(s): {'; '.join(report['graph_break_reasons'])}")
    if report["unique_graphs"] == 0 or report["frames_ok"] == 0:
        problems.append("nothing was compiled: the run was eager")
    if max_graphs is not None and report["unique_graphs"] > max_graphs:
        problems.append(f"{report['unique_graphs']} graphs compiled, more than the {max_graphs} expected (recompiles)")
    if problems:
        raise CompileHealthError("compiled run failed its checks: " + "; ".join(problems))
