"""Measured GEMM timings: a GPU harness and a persistent cache.

:func:`time_gemm` times one ``(backend, choice)`` on one canonical GEMM shape and role, the
way a training step runs it: the operands arrive in the role's layout (dgrad's ``W^T`` and
wgrad's ``dY^T``, ``X^T`` are transposed *views*, exactly what :class:`LokaLinear` hands
the backend), quantization of both operands is included, kernels run back to back inside a
CUDA graph (so the CPU's launch cost is not counted, as under ``torch.compile`` + CUDA graphs),
and inputs rotate over several freshly drawn random sets whose total size exceeds the L2
cache, so every call reads its operands from HBM. The result is the median over several
graph replays of (replay time / calls per replay).

:class:`TimingCache` stores results in a JSON file keyed by device name, library versions,
role, shape and choice id, so a study never times the same thing twice. It is plain Python
and works on CPU; only the timing functions need a GPU (they raise :class:`BackendError`
without one).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from loka_tune.config import GemmChoice, GemmRole
from loka_tune.errors import BackendError, ConfigError, UnsupportedChoiceError

__all__ = [
    "TimingResult",
    "TimingCache",
    "EnvironmentKeyed",
    "timing_key",
    "environment",
    "require_cuda",
    "make_operands",
    "time_fn",
    "time_gemm",
    "time_choices",
    "copy_bandwidth",
    "is_gpu_activity",
    "gpu_activity_us",
    "kernel_summary",
    "kernel_kind",
    "is_gemm_kernel",
    "is_fp8_cast_kernel",
    "is_amax_kernel",
    "KERNEL_KINDS",
    "GEMM_KERNEL_RE",
]

_CACHE_VERSION = 1


@dataclass(frozen=True)
class TimingResult:
    """One measurement: median seconds per call and how it was taken."""

    seconds: float
    spread: float  # (max - min) / median over replays: the noise of this measurement
    calls: int  # calls timed in total
    method: str  # "graph" (CUDA graph replay) or "events" (eager loop between CUDA events)

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "spread": self.spread, "calls": self.calls, "method": self.method}


def timing_key(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str,
               device: str, versions: str) -> str:
    """The cache key: ``device|versions|role|mxkxn|choice``."""
    c = choice if isinstance(choice, str) else choice.short_str()
    return f"{device}|{versions}|{GemmRole(role).value}|{m}x{k}x{n}|{c}"


def environment() -> dict[str, str]:
    """Device name and library versions of this process (the environment part of the key).

    Lazily imports the optional libraries; missing ones are recorded as ``"-"``.
    """
    env = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for mod, name in (("triton", "triton"), ("fbgemm_gpu", "fbgemm"), ("torchao", "torchao")):
        try:
            env[name] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - any failure means "not usable here"
            env[name] = "-"
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return env


def _versions_str(env: Mapping[str, str]) -> str:
    return ",".join(f"{k}={env[k]}" for k in sorted(env) if k != "device")


class EnvironmentKeyed:
    """The environment part of a cache key, ``device`` (GPU name) and ``versions`` (libraries),
    resolved lazily from :func:`environment` (which imports libraries) unless given; a cache
    sets ``self._device`` and ``self._versions`` (None: resolve)."""

    _device: str | None
    _versions: str | None

    @property
    def device(self) -> str:
        if self._device is None:
            self._device = environment()["device"]
        return self._device

    @property
    def versions(self) -> str:
        if self._versions is None:
            self._versions = _versions_str(environment())
        return self._versions


class TimingCache(EnvironmentKeyed):
    """A JSON file of timings, keyed by :func:`timing_key`. Writes are atomic.

    ``device`` / ``versions`` default to this process's :func:`environment`; pass them to
    read a cache recorded elsewhere (e.g. an H200 cache on a laptop).
    """

    def __init__(self, path: str | Path, *, device: str | None = None, versions: str | None = None) -> None:
        self.path = Path(path)
        self._device = device
        self._versions = versions
        self._data: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                obj = json.loads(self.path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"timing cache {str(self.path)!r} is not valid JSON ({e.msg} at line {e.lineno});"
                    " delete it to start a new one",
                    key="timing_cache",
                ) from None
            if not isinstance(obj, dict) or obj.get("version") != _CACHE_VERSION:
                raise ConfigError(
                    f"timing cache {str(self.path)!r} has version {obj.get('version') if isinstance(obj, dict) else None!r};"
                    f" this loka-tune writes version {_CACHE_VERSION}: delete the file to start a new one",
                    key="timing_cache",
                )
            self._data = dict(obj.get("entries", {}))

    def key(self, choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str) -> str:
        return timing_key(choice, m, k, n, role, self.device, self.versions)

    def get(self, choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str) -> float | None:
        """Cached median seconds, or ``None``."""
        e = self._data.get(self.key(choice, m, k, n, role))
        return None if e is None else float(e["seconds"])

    def entry(self, choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str) -> dict[str, Any] | None:
        return self._data.get(self.key(choice, m, k, n, role))

    def put(self, choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str,
            result: TimingResult | float, *, save: bool = True) -> None:
        if isinstance(result, TimingResult):
            rec = result.to_dict()
        else:
            rec = {"seconds": float(result), "spread": None, "calls": None, "method": "given"}
        if not (rec["seconds"] > 0 and math.isfinite(rec["seconds"])):
            raise ValueError(f"a timing must be a positive finite number of seconds, got {rec['seconds']!r}")
        rec["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._data[self.key(choice, m, k, n, role)] = rec
        if save:
            self.save()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self._data)

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": self._data}, indent=0, sort_keys=True))
        tmp.replace(self.path)
        return self.path


# ----------------------------------------------------------------------------- profiler events
def is_gpu_activity(event: Any) -> bool:
    """A kernel, copy or set on the GPU's timeline; not a user annotation (``record_function``
    ranges such as ``Optimizer.step#Adam.step`` are drawn on the GPU timeline too, spanning the
    kernels they launched: counting them would count those kernels twice)."""
    if event.device_type != torch.autograd.DeviceType.CUDA:
        return False
    if getattr(event, "is_user_annotation", False):
        return False
    return not _ANNOTATION_RE.match(event.name)


#: names of annotation ranges (older torch builds do not flag them as user annotations)
_ANNOTATION_RE = re.compile(r"^(Optimizer\.|ProfilerStep#|## |CompiledFunction|autograd::|aten::)")


def gpu_activity_us(events: Iterable[Any]) -> float:
    """Microseconds of GPU activity (kernels, copies, sets) among ``torch.profiler`` events."""
    return float(sum(e.time_range.elapsed_us() for e in events if is_gpu_activity(e)))


#: kernel names of matrix products: cuBLAS / cuBLASLt (gemm, nvjet, sm90_xmma, their split-K
#: reductions), CUTLASS (FBGEMM's f8f8bf16*), torch._scaled_mm, our Triton GEMMs and inductor's
#: mm templates (``triton_tem_fused_mm_...``); :func:`is_gemm_kernel` also leaves out inductor's
#: own pointwise and reduction kernels, whose names can hold these words
GEMM_KERNEL_RE = re.compile(r"gemm|nvjet|xmma|cutlass|f8f8bf16|scaled_mm|_mm_|mm_kernel|matmul|wgmma|splitkreduce", re.I)
#: inductor's generated kernels that are no matrix product: pointwise (``triton_poi_``) and
#: reductions (``triton_red_``, ``triton_per_``). Inductor names a fused kernel after the ops its
#: nodes came from, so the cast that feeds a ``_scaled_mm`` can be ``triton_poi_fused__scaled_mm_
#: _to_copy_clamp_...``: a quantization kernel, counted as GEMM time until 2026-12-06
_INDUCTOR_NON_GEMM_RE = re.compile(r"^triton_(poi|red|per)_")
#: FP8 matrix products: cuBLASLt's FP8 nvjet kernels (``nvjet_sm90_qqtst_...``: q for an FP8
#: operand), FBGEMM's f8f8bf16, ``_scaled_mm`` (inductor's scaled-mm templates) and our FP8 GEMMs
_FP8_GEMM_RE = re.compile(r"nvjet_sm\d+_q|f8f8|scaled_mm|fp8|e4m3|e5m2", re.I)
#: what else a training step runs, by name, first match wins (after the GEMMs); "other" the rest
_KIND_RES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("embedding", re.compile(r"index|embedding|gather|scatter|radix|sort|segment|unique", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|optimizer|adam|sgd", re.I)),
    ("reduction", re.compile(r"^triton_(red|per)_|reduce|norm|softmax|amax", re.I)),
    ("pointwise", re.compile(r"^triton_poi_|elementwise|_cast|cast_|quantize", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)
#: the kinds :func:`kernel_kind` returns, in the order :func:`kernel_summary` lists them
KERNEL_KINDS: tuple[str, ...] = ("gemm_fp8", "gemm", *(k for k, _ in _KIND_RES), "other")


#: inductor's kernels that write an FP8 operand: named after the ``_scaled_mm`` they feed (the
#: cast of ``x``, ``w``, ``dy`` and their transposed copies; 2026-12-06 on an H100, e.g.
#: ``triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_view_4``), and the dual
#: cast's kernel, which inductor launches under its own name from ``loka::cast_dual_inline``, and
#: the benchmark kernels named ``_fp8cast_*`` (``benchmarks/delayed_scales.py``, ``fp8_chain.py``:
#: a norm or a cast that writes FP8 operands and takes their amax in the same pass)
_FP8_CAST_RE = re.compile(r"^(triton_(poi|red|per)_fused_\w*_scaled_mm|_dual_cast_kernel|_fp8cast_\w+)")
#: inductor's reductions that take an amax (``abs`` then ``amax`` / ``max``), mostly fused into the
#: producer's own reduction (a norm's forward or backward): their time is not the amax's alone
_AMAX_RE = re.compile(r"^triton_(red|per)_fused_\w*abs\w*_(amax|max)_")


def is_fp8_cast_kernel(name: str) -> bool:
    """Whether an inductor kernel writes an FP8 copy of a GEMM operand (:data:`_FP8_CAST_RE`)."""
    return _FP8_CAST_RE.match(name) is not None


def is_amax_kernel(name: str) -> bool:
    """Whether an inductor reduction takes an amax for FP8 scaling (:data:`_AMAX_RE`)."""
    return _AMAX_RE.match(name) is not None


def is_gemm_kernel(name: str) -> bool:
    """Whether a GPU kernel's ``name`` is a matrix product (:data:`GEMM_KERNEL_RE`, not one of
    inductor's pointwise or reduction kernels)."""
    return not _INDUCTOR_NON_GEMM_RE.match(name) and GEMM_KERNEL_RE.search(name) is not None


def kernel_kind(name: str) -> str:
    """What a GPU kernel does, by its name: one of :data:`KERNEL_KINDS` (``gemm_fp8`` an FP8
    matrix product, ``gemm`` any other; then embedding, optimizer, reduction, pointwise, copy,
    other). A reading of names, not of the work: a fused inductor kernel is counted under the
    kind of its prefix (a reduction that also casts is a reduction)."""
    if is_gemm_kernel(name):
        return "gemm_fp8" if _FP8_GEMM_RE.search(name) else "gemm"
    if _INDUCTOR_NON_GEMM_RE.match(name):  # by its prefix, whatever ops it fused
        return "reduction" if not name.startswith("triton_poi_") else "pointwise"
    return next((kind for kind, rx in _KIND_RES if rx.search(name)), "other")


def kernel_summary(kernels: Iterable[tuple[str, float]], steps: int, *, top: int = 15) -> dict[str, Any]:
    """``kernels``: ``(name, microseconds)`` of every GPU activity (kernels, copies, sets) over
    ``steps`` steps (a training step's, or a timed cell's iterations). Returns per-step
    milliseconds: ``gpu_ms`` (all activities), ``gemm_ms`` (by name, :func:`is_gemm_kernel`),
    ``gemm_share``, ``kinds`` (ms per :func:`kernel_kind`, every kind of :data:`KERNEL_KINDS`),
    ``kernels_per_step``, ``top`` (name, ms per step, calls per step, kind), and, uncapped,
    ``fp8_casts`` and ``amax`` (``{"ms", "calls", "kernels"}``: every kernel that
    :func:`is_fp8_cast_kernel` / :func:`is_amax_kernel` names, largest first: the quantization
    overhead that ``top`` would cut off)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps=}")
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    total = sum(sum(v) for v in by_name.values()) / 1e3 / steps
    kinds = dict.fromkeys(KERNEL_KINDS, 0.0)
    for n, v in by_name.items():
        kinds[kernel_kind(n)] += sum(v) / 1e3 / steps
    gemm = kinds["gemm"] + kinds["gemm_fp8"]
    ranked_all = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    ranked = ranked_all[:top]

    def entry(n: str, v: list[float]) -> dict[str, Any]:
        return {"name": n[:160], "ms": sum(v) / 1e3 / steps, "calls": len(v) / steps, "kind": kernel_kind(n)}

    def group(pick: Callable[[str], bool]) -> dict[str, Any]:
        chosen = [(n, v) for n, v in ranked_all if pick(n)]
        return {"ms": sum(sum(v) for _, v in chosen) / 1e3 / steps, "calls": sum(len(v) for _, v in chosen) / steps,
                "kernels": [entry(n, v) for n, v in chosen]}

    return {
        "gpu_ms": total,
        "gemm_ms": gemm,
        "gemm_share": gemm / total if total > 0 else math.nan,
        "kinds": kinds,
        "kernels_per_step": sum(len(v) for v in by_name.values()) / steps,
        "top": [entry(n, v) for n, v in ranked],
        "fp8_casts": group(is_fp8_cast_kernel),
        "amax": group(is_amax_kernel),
    }



# ----------------------------------------------------------------------------- GPU part
def require_cuda(what: str = "timing") -> None:
    """Raise :class:`BackendError` unless a CUDA device is usable."""
    if not torch.cuda.is_available():
        raise BackendError(
            f"{what} needs a CUDA GPU and none is visible here; on a CPU machine use the cost"
            " model (loka_tune.kernels.costmodel.estimate_gemm_seconds), whose numbers are 'modeled'"
        )


def make_operands(m: int, k: int, n: int, role: GemmRole | str, *, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cuda", generator: torch.Generator | None = None,
                  a_std: float = 1.0, b_std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """Random canonical operands ``a (m, k)``, ``b (n, k)`` laid out as the role delivers them.

    fwd: both contiguous; dgrad: ``b`` a transposed view of a contiguous ``(k, n)`` tensor
    (``W^T``); wgrad: ``a`` and ``b`` transposed views (``dY^T``, ``X^T``).
    Never zeros: normal values (activation-like ``a``, weight-like ``b``).
    """
    role = GemmRole(role)

    def rnd(shape: tuple[int, int], std: float) -> torch.Tensor:
        t = torch.randn(shape, device=device, dtype=torch.float32, generator=generator) * std
        return t.to(dtype)

    if role == GemmRole.FWD:
        return rnd((m, k), a_std), rnd((n, k), b_std)
    if role == GemmRole.DGRAD:
        return rnd((m, k), a_std), rnd((k, n), b_std).t()
    return rnd((k, m), a_std).t(), rnd((k, n), b_std).t()


def _cuda_time(fn: Callable[[], Any], reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_fn(fns: Sequence[Callable[[], Any]], *, target_s: float = 2e-3, replays: int = 7,
            use_graph: bool = True, max_calls: int = 400) -> TimingResult:
    """Median seconds per call of ``fns`` run round-robin (one fn per input set).

    Warm-up (compilation, autotuning) runs every fn twice first. With ``use_graph`` the calls
    are captured in a CUDA graph whose replays are timed with CUDA events; if capture fails
    (a library that syncs or allocates outside the caching allocator) it falls back to an
    eager loop timed with events (method ``"events"``), which also counts launch gaps.
    """
    require_cuda("time_fn")
    for _ in range(2):
        for f in fns:
            f()
    torch.cuda.synchronize()
    est = _cuda_time(lambda: [f() for f in fns], 1) / len(fns)
    calls = int(min(max_calls, max(len(fns), math.ceil(target_s / max(est, 1e-7)))))
    calls = max(len(fns), calls - calls % len(fns))
    seq = [fns[i % len(fns)] for i in range(calls)]
    method = "events"
    runner: Callable[[], Any]
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for f in fns:  # warm up on the capture stream
                    f()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for f in seq:
                    f()
            graph.replay()
            torch.cuda.synchronize()
            runner, method = graph.replay, "graph"
        except Exception:  # noqa: BLE001 - any capture failure: time eagerly instead
            torch.cuda.synchronize()
            runner = lambda: [f() for f in seq]  # noqa: E731
    else:
        runner = lambda: [f() for f in seq]  # noqa: E731
    runner()
    times = [_cuda_time(runner, 1) / calls for _ in range(replays)]
    med = statistics.median(times)
    return TimingResult(med, (max(times) - min(times)) / med, calls * replays, method)


def _n_sets(bytes_per_set: int, *, l2_bytes: int = 60 << 20, cap_bytes: int = 4 << 30) -> int:
    want = math.ceil(3 * l2_bytes / max(bytes_per_set, 1))
    return int(max(2, min(8, want, max(1, cap_bytes // max(bytes_per_set, 1)))))


def time_gemm(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str, *,
              cache: TimingCache | None = None, refresh: bool = False, seed: int = 0,
              dtype: torch.dtype = torch.bfloat16, use_graph: bool = True,
              replays: int = 7, target_s: float = 2e-3) -> float:
    """Measured median seconds of one GEMM ``A (m, k) @ B (n, k)^T`` under ``choice`` in
    ``role`` on this process's GPU, quantization included (see the module docstring).

    With ``cache``: returns a cached value unless ``refresh``; stores new ones. Raises
    :class:`BackendError` without a GPU and :class:`UnsupportedChoiceError` when the backend
    cannot run the choice.
    """
    res = time_gemm_result(choice, m, k, n, role, cache=cache, refresh=refresh, seed=seed, dtype=dtype,
                           use_graph=use_graph, replays=replays, target_s=target_s)
    return res.seconds


def time_gemm_result(choice: GemmChoice | str, m: int, k: int, n: int, role: GemmRole | str, *,
                     cache: TimingCache | None = None, refresh: bool = False, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, use_graph: bool = True,
                     replays: int = 7, target_s: float = 2e-3) -> TimingResult:
    """Like :func:`time_gemm`, returning the whole :class:`TimingResult`."""
    from loka_tune.kernels.registry import check_supported, get_backend

    choice = GemmChoice.parse(choice) if isinstance(choice, str) else choice
    role = GemmRole(role)
    if cache is not None and not refresh:
        e = cache.entry(choice, m, k, n, role)
        if e is not None:
            return TimingResult(float(e["seconds"]), e.get("spread") or 0.0, e.get("calls") or 0,
                                e.get("method") or "cached")
    require_cuda("time_gemm")
    check_supported(choice, role, "cuda", (m, k, n))
    backend = get_backend(choice.backend)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    per_set = (m + n) * k * torch.tensor([], dtype=dtype).element_size()
    sets = [make_operands(m, k, n, role, dtype=dtype, generator=gen) for _ in range(_n_sets(per_set))]
    fns = [(lambda a=a, b=b: backend.gemm(a, b, choice, role)) for a, b in sets]
    res = time_fn(fns, target_s=target_s, replays=replays, use_graph=use_graph)
    del sets, fns
    if cache is not None:
        cache.put(choice, m, k, n, role, res)
    return res


def time_choices(choices: Iterable[GemmChoice | str], m: int, k: int, n: int, role: GemmRole | str, *,
                 cache: TimingCache | None = None, **kw: Any) -> dict[str, float | str]:
    """Time several choices on one shape and role: ``{choice id: seconds}``, or the reason
    (a string) for choices the backend cannot run here."""
    out: dict[str, float | str] = {}
    for c in choices:
        c = GemmChoice.parse(c) if isinstance(c, str) else c
        try:
            out[c.short_str()] = time_gemm(c, m, k, n, role, cache=cache, **kw)
        except UnsupportedChoiceError as e:
            out[c.short_str()] = f"unsupported: {e}"
    return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    require_cuda("copy_bandwidth")
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    # an idle GPU starts at low clocks (345 MHz SM seen on the H200): run ~0.3 s of copies
    # first, then take the best of three measurements
    t_end = time.time() + 0.3
    while time.time() < t_end:
        dst.copy_(src)
        torch.cuda.synchronize()
    best = min(time_fn([lambda: dst.copy_(src)], target_s=20e-3, replays=7).seconds for _ in range(3))
    return 2 * nbytes / best
