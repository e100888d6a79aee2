"""Compiled per-site prices: what one Linear's precision saves per training step, timed the way
the study trains it.

A *site price* is measured on one GPU for one Linear shape ``(M, K, N)`` (rows, in, out at the
batch the study trains) and one :class:`~loka_tune.config.SitePrecision` (the three GEMMs'
choices): the block ``Hard Swish -> LokaLinear(K, N, no bias)`` runs forward and backward (fwd,
dgrad and wgrad GEMMs with their quantization) under ``torch.compile(fullgraph=True)`` with bf16
autocast and fp32 master weights, as a Mods-adapted model's Linear does (its input comes from
an elementwise producer, into which inductor fuses the input's quantization). Two numbers per
cell, over ``iters`` back-to-back iterations after warm-up:

- ``gpu_s``: the GPU's busy time per iteration, the sum of the durations of every kernel, copy
  and set the iteration ran (``torch.profiler``, CUDA activity). This is what the cell costs in
  a GPU-bound step: a lone small block is host-bound, so its wall time would price the launch
  queue, not the kernels (measured: an 8192 x 1024 block takes ~0.85 ms of wall time whatever
  its precision).
- ``host_s``: the CPU's time to enqueue one iteration (no synchronisation inside the loop), and
  ``kernels``: the GPU activities per iteration.

The *saving* of a precision (:func:`saving_s`) is the GPU time it saves, less the host time it
adds where that host time is the model's too: ``LAUNCH_S`` per extra kernel launch for the
traceable backends (``torch_scaled_mm``, ``torchao``: inside a whole model's compiled graph a
lone block's per-call host time (guards, the autograd wrapper, ~1.1 ms for bf16 as much as for
FP8) is paid once per graph, not per Linear), and the whole measured host time added for the
backends whose GEMMs run as opaque custom ops (``fbgemm``, ``triton``: ~1.2 ms of host time per
Linear in a model, design.md). Checked on the H200 (2026-12-01, large Wukong, B = 8192): the
GPU-time savings of torchao's 15 filter sites under tensorwise add up to 2.7 ms, the e2e step
time they save.
Cells are cached in a JSON file (:class:`SitePriceCache`) keyed by GPU name, library versions,
shape and precision string (with :data:`DUAL_TAG` where the layer casts its shared tensorwise
operands with the dual cast, :mod:`loka_tune.kernels.dualcast`: the cells timed before it, or
under ``LOKA_DUAL_CAST=off``, price inductor's casts; both forms of the dual cast share a cell,
whose GPU time is the one kernel's, and only the opaque form is charged its host time), so a
study never times a cell twice and
studies share them; the
repository ships the H200's (``kernels/data/site_prices_h200.json``, written by
``benchmarks/site_prices.py``) and an H100 80GB's cells of the flagship B = 8192 study
(``kernels/data/site_prices_h100.json``), read-only and consulted behind the user's cache when
the GPU and versions match. Only the GPU part needs CUDA; the cache is plain Python.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from loka_tune.config import SitePrecision
from loka_tune.errors import ConfigError
from loka_tune.kernels.timing import EnvironmentKeyed, gpu_activity_us, is_gpu_activity, kernel_summary, require_cuda

__all__ = ["SitePriceCache", "site_key", "cell_precision", "DUAL_TAG", "time_site", "price_sites", "saving_s", "default_cache_path",
           "SHIPPED", "SHIPPED_H100", "LAUNCH_S", "OPAQUE"]

_VERSION = 1
#: the H200 prices shipped with the package (read-only; benchmarks/site_prices.py writes them)
SHIPPED = Path(__file__).with_name("data") / "site_prices_h200.json"
#: an H100 80GB's cells of the flagship B = 8192 study (``benchmarks/results/study_h100_s24_*``:
#: the machine's cache after that study, its 1024-row smoke cells left out), read-only
SHIPPED_H100 = Path(__file__).with_name("data") / "site_prices_h100.json"
BF16 = "bf16"


def site_key(device: str, versions: str, m: int, k: int, n: int, prec: str) -> str:
    """``device|versions|MxKxN|precision``."""
    return f"{device}|{versions}|{m}x{k}x{n}|{prec}"


#: the suffix of a cell's precision in its key when the layer casts its shared tensorwise
#: operands with the dual cast (:mod:`loka_tune.kernels.dualcast`): such a cell is a different
#: program from the same precision timed with inductor's casts (``LOKA_DUAL_CAST=off``, or a
#: cell timed before the dual cast existed), so neither answers for the other
DUAL_TAG = "+dualcast"


def cell_precision(prec: str, device: str) -> str:
    """The precision part of a cell's key: ``prec``, plus :data:`DUAL_TAG` where a compiled
    layer of that precision on ``device`` (a GPU name, or ``"cpu"``) takes the dual cast under
    the current mode. Keys that are not a site precision (``serve:<choice>``) pass unchanged."""
    if prec.startswith("serve:"):
        return prec
    return prec + DUAL_TAG if _takes_dual(SitePrecision.parse(prec), "cpu" if device == "cpu" else "cuda") else prec


def _takes_dual(p: SitePrecision, device_type: str) -> bool:
    """Whether a compiled layer of precision ``p`` on ``device_type`` takes the dual cast now."""
    from loka_tune.kernels.dualcast import takes_dual_cast
    from loka_tune.kernels.scaled import share_plan

    return takes_dual_cast(not p.is_bf16 and share_plan(p.fwd, p.dgrad, p.wgrad).any, device_type)


def default_cache_path() -> Path:
    """The user's cache: ``$LOKA_TUNE_CACHE_DIR/site_prices.json`` (default ``~/.cache/loka-tune``)."""
    root = os.environ.get("LOKA_TUNE_CACHE_DIR") or str(Path.home() / ".cache" / "loka-tune")
    return Path(root) / "site_prices.json"


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"site price cache {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno});"
                          " delete it to start a new one", key="site_prices") from None
    if not isinstance(obj, dict) or obj.get("version") != _VERSION or not isinstance(obj.get("entries"), dict):
        found = obj.get("version") if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(f"site price cache {str(path)!r} has version {found!r}; this loka-tune reads"
                          f" version {_VERSION}: delete the file to start a new one", key="site_prices")
    return dict(obj["entries"])


class SitePriceCache(EnvironmentKeyed):
    """Cells ``{gpu_s, host_s, spread, iters, when}`` by :func:`site_key`, in a JSON file (atomic writes).

    ``shipped``: read-only files consulted after the file's own entries (default: the H200's
    and the H100's files in the package; each cell's key names its device, so neither answers
    for the other). ``device`` / ``versions`` default to this process's
    :func:`~loka_tune.kernels.timing.environment` (resolved on first use).
    """

    def __init__(self, path: str | Path | None = None, *, shipped: Sequence[str | Path] | None = None,
                 device: str | None = None, versions: str | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()
        self._data = _read(self.path) if self.path.is_file() else {}
        self._shipped: dict[str, dict[str, Any]] = {}
        for p in (SHIPPED, SHIPPED_H100) if shipped is None else shipped:
            if Path(p).is_file():
                self._shipped.update(_read(Path(p)))
        self._device, self._versions = device, versions

    def key(self, m: int, k: int, n: int, prec: str) -> str:
        return site_key(self.device, self.versions, m, k, n, cell_precision(prec, self.device))

    def get(self, m: int, k: int, n: int, prec: str) -> dict[str, Any] | None:
        key = self.key(m, k, n, prec)
        return self._data.get(key) or self._shipped.get(key)

    def put(self, m: int, k: int, n: int, prec: str, cell: Mapping[str, Any], *, save: bool = True) -> None:
        g, h = float(cell["gpu_s"]), float(cell["host_s"])
        if not (math.isfinite(g) and g > 0 and math.isfinite(h) and h >= 0):
            raise ValueError(f"a site price needs gpu_s > 0 and host_s >= 0, got {g!r}, {h!r}")
        self._data[self.key(m, k, n, prec)] = {**dict(cell), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if save:
            self.save()

    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": _VERSION, "entries": self._data}, indent=0, sort_keys=True))
        tmp.replace(self.path)
        return self.path


#: host seconds per kernel launch inside a compiled graph (the H200 machine's CPU: ~4-5 us)
LAUNCH_S = 5e-6
#: backends whose GEMMs run as opaque custom ops (their Python runs at execution time)
OPAQUE = ("fbgemm", "triton", "emulated")


def saving_s(bf16: Mapping[str, Any], cell: Mapping[str, Any], prec: SitePrecision | str | None = None) -> float:
    """Seconds per step ``prec`` (timed as ``cell``) saves against bf16 at the same shape.

    GPU time saved, less ``LAUNCH_S`` per extra kernel (none unless both cells count their
    ``kernels``: a bf16 cell timed before the count existed must not price every kernel of the
    FP8 one as extra, ~85 us at 17 kernels, more than the GEMM saves at 8192 x 2048 x 2048), less the
    whole host time added when a GEMM of ``prec`` runs on an :data:`OPAQUE` backend, when the cell
    was timed with the dual cast (``cell["dual_cast"]``) and the dual cast's form now is the
    opaque custom op (``LOKA_DUAL_CAST_OP=opaque``; the default inline form is launched by inductor
    like its own kernels, and its GPU time is the opaque form's: one kernel), or when ``prec`` is
    not given; see the module docstring.
    """
    from loka_tune.kernels.dualcast import get_dual_cast_op

    gpu = float(bf16["gpu_s"]) - float(cell["gpu_s"])
    counted = cell.get("kernels") is not None and bf16.get("kernels") is not None
    extra = max(0.0, float(cell["kernels"]) - float(bf16["kernels"])) if counted else 0.0
    p = None if prec is None else SitePrecision.from_obj(prec, key="site precision")
    opaque = (p is None or (bool(cell.get("dual_cast")) and get_dual_cast_op() == "opaque")  # loka::cast_dual
              or any(not c.is_bf16 and c.backend in OPAQUE for c in (p.fwd, p.dgrad, p.wgrad)))
    host = max(0.0, float(cell["host_s"]) - float(bf16["host_s"])) if opaque else 0.0
    return gpu - LAUNCH_S * extra - host


def time_site(m: int, k: int, n: int, prec: SitePrecision | str, *, device: str = "cuda", iters: int = 10,
              reps: int = 3, top: int = 0) -> dict[str, Any]:
    """Time one cell (see the module docstring): ``{gpu_s, host_s, spread, iters, kernels}``, and
    ``dual_cast: True`` where the layer took the dual cast (:func:`cell_precision`).

    ``gpu_s`` is the median over ``reps`` profiled windows of ``iters`` iterations each;
    ``spread`` = (max - min) / median of those windows. ``top`` > 0 adds the last window's
    :func:`~loka_tune.kernels.timing.kernel_summary` per iteration: ``gemm_s`` and ``top_kernels``
    (name, ms, calls; not for the price cache: a benchmark's detail). The
    inductor settings in force when it is called (``torch._inductor.config.patch``) are the
    cell's. Raises :class:`BackendError` without CUDA and whatever the compile raises on a
    graph break (``fullgraph=True``).
    """
    require_cuda("site timing")
    from loka_tune.kernels.linear import LokaLinear

    p = SitePrecision.from_obj(prec, key="site precision")
    dev = torch.device(device)
    dual = _takes_dual(p, dev.type)
    torch.manual_seed(0)
    lin = LokaLinear(k, n, bias=False, device=dev, precision=p, name=f"{m}x{k}x{n}")
    block = torch.nn.Sequential(torch.nn.Hardswish(), lin)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device=dev, generator=g, dtype=torch.bfloat16)
    params = [x, *block.parameters()]
    # a fresh dynamo per cell, as a study's own compiled runs start (objectives/compiled.py): each
    # cell's block is a new module whose guards fail on the last's, so without it the 9th cell of
    # one process hits dynamo's recompile limit (fullgraph: the cell fails; seen in the B = 32768
    # study of 2026-12-02, 3 cells), and every earlier entry's guards would add to the host time
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)

    def step() -> None:
        for q in params:
            q.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = compiled(x)
        y.backward(dy)

    for _ in range(3):  # compile, autotune, allocator
        step()
    torch.cuda.synchronize(dev)
    gpu, host, kernels = [], [], []
    for _ in range(reps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize(dev)
            h0 = time.perf_counter()
            for _ in range(iters):
                step()
            host.append((time.perf_counter() - h0) / iters)
            torch.cuda.synchronize(dev)
        events = [e for e in prof.events() if is_gpu_activity(e)]
        gpu.append(gpu_activity_us(events) / 1e6 / iters)
        kernels.append(len(events) / iters)
    med = statistics.median(gpu)
    out: dict[str, Any] = {"gpu_s": med, "host_s": statistics.median(host), "spread": (max(gpu) - min(gpu)) / med,
                           "iters": iters * reps, "kernels": statistics.median(kernels)}
    if dual:
        from loka_tune.kernels.dualcast import get_dual_cast_op, inline_op

        out["dual_cast"] = True
        out["dual_cast_op"] = "inline" if get_dual_cast_op() == "inline" and inline_op() is not None else "opaque"
    if top > 0:
        summary = kernel_summary(((e.name, e.time_range.elapsed_us()) for e in events), iters, top=top)
        out.update(gemm_s=summary["gemm_ms"] / 1e3, top_kernels=summary["top"])
    return out


def price_sites(shapes: Mapping[str, tuple[int, int, int]], precs: Mapping[str, Sequence[str]], *,
                device: str = "cuda", cache: SitePriceCache | None = None,
                progress: Callable[[str], None] | None = None,
                timer: Callable[..., Mapping[str, Any]] | None = None,
                counts: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
    """Per site, per precision string of ``precs[site]``: the seconds per step it saves vs bf16.

    ``shapes[site]`` = ``(M, K, N)`` at the batch the study trains. Each distinct (shape,
    precision) is timed once (bf16 too, as the reference), cached in ``cache`` (default: the
    user's :func:`default_cache_path`, with the shipped H200 and H100 files read-only behind it) and saved
    after every cell, so an interrupted pricing keeps what it measured. A cell that fails to
    compile or run is priced ``-inf`` (never chosen) and its error passed to ``progress``.
    ``timer`` replaces :func:`time_site` (tests). ``counts``, when given, is filled with how the
    distinct cells were had: ``cached`` (the user's cache or the shipped file), ``timed`` and
    ``failed``.
    """
    cache = cache if cache is not None else SitePriceCache()
    timer = timer or time_site
    say = progress or (lambda _msg: None)
    cells: dict[tuple[tuple[int, int, int], str], dict[str, Any] | None] = {}
    tally = counts if counts is not None else {}
    for k in ("cached", "timed", "failed"):
        tally[k] = 0

    def cell(shape: tuple[int, int, int], prec: str) -> dict[str, Any] | None:
        key = (shape, prec)
        if key not in cells:
            hit = cache.get(*shape, prec)
            if hit is not None:
                tally["cached"] += 1
            else:
                t0 = time.perf_counter()
                try:
                    hit = dict(timer(*shape, prec, device=device))
                except Exception as e:  # noqa: BLE001 - one bad cell must not stop the pricing
                    say(f"site price {shape} {prec}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    tally["failed"] += 1
                    cells[key] = None
                    return None
                tally["timed"] += 1
                cache.put(*shape, prec, hit)
                say(f"site price {'x'.join(map(str, shape))} {prec}: gpu {hit['gpu_s'] * 1e3:.3f} ms,"
                    f" host {hit['host_s'] * 1e3:.3f} ms ({time.perf_counter() - t0:.1f}s)")
            cells[key] = hit
        return cells[key]

    out: dict[str, dict[str, float]] = {}
    for site, ps in precs.items():
        shape = tuple(int(v) for v in shapes[site])
        assert len(shape) == 3
        ref = cell(shape, BF16)
        row: dict[str, float] = {}
        for prec in ps:
            if SitePrecision.parse(prec).is_bf16:
                row[prec] = 0.0
                continue
            c = cell(shape, prec)
            row[prec] = -math.inf if c is None or ref is None else saving_s(ref, c, prec)
        out[site] = row
    return out


def distinct_cells(shapes: Mapping[str, tuple[int, int, int]], precs: Mapping[str, Iterable[str]]) -> int:
    """How many distinct (shape, precision) cells pricing ``precs`` needs, bf16 references included."""
    seen = set()
    for site, ps in precs.items():
        seen.add((tuple(shapes[site]), BF16))
        seen.update((tuple(shapes[site]), p) for p in ps)
    return len(seen)
