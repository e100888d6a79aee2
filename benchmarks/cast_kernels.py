"""How far each FP8 cast and amax kernel of a compiled training step runs from its memory traffic
(issue 21): the e2e receipts' uncapped kernel lists joined with inductor's generated source.

On an H100 at B = 8192 (2026-12-06, ``e2e_static_h100_s27_*``), torchao's tensorwise line saved
5.03 ms of GEMM time on its 15 sites and gave 2.87 ms back to inductor's quantization kernels,
about 2.6 times what their traffic needs at the card's bandwidth. This script says which kernels
hold that excess, before any change to the casts is made:

- ``benchmarks/e2e.py`` records, per profiled run, every kernel that writes an FP8 operand and
  every amax reduction (``profile.fp8_casts`` / ``profile.amax``: name, ms per step, calls per
  step; :func:`loka_tune.kernels.timing.kernel_summary`);
- ``E2E_KERNEL_SRC=1 bash benchmarks/device.sh OUT e2e ...`` bundles inductor's source of those
  kernels (``OUT/cast_kernels.tgz``). With ``TORCHINDUCTOR_BENCHMARK_KERNEL=1`` set for the run,
  inductor writes each kernel's bytes moved into its source (``'kernel_num_gb'`` in
  ``inductor_meta``: what the kernel reads and writes, counted by inductor); without it this
  script estimates them from the kernel's signature and sizes (``bytes_from`` = ``estimated``, an
  upper bound: every pointer argument read or written whole, an ``in_out_ptr`` both, a pointer only
  ever indexed at ``(0)`` once; a reduction's per-row outputs are counted whole too);
- per kernel: GB per call, achieved GB/s, the time at ``--peak-gbs`` (default by device: H100
  3350, H200 4800), and the excess (ms per step above that floor); ``tiled`` marks a 2-D (y, x)
  grid, inductor's form for a kernel that writes a transposed layout.

    python benchmarks/cast_kernels.py OUT/e2e/results.json --src OUT/cast_kernels.tgz \\
        --out benchmarks/results/cast_kernels_<device>.json --md

CPU only: it reads receipts and sources, it measures nothing. Kernel names are per graph, and the
bundle holds every variant's graphs: a name that several sources share with different sizes is
marked ``ambiguous`` (its GB is the largest of them).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import re
import statistics
import tarfile
from pathlib import Path
from typing import Any

__all__ = ["parse_source", "read_sources", "analyse", "table", "PEAK_GBS"]

#: memory bandwidth in GB/s by a device-name fragment (the data sheets; the floor is a bound, not a
#: kernel's reachable speed)
PEAK_GBS = {"H100": 3350.0, "H200": 4800.0}

_DEF_RE = re.compile(r"^def (triton_\w+)\((.*?)\):", re.M | re.S)
_META_RE = re.compile(r"inductor_meta=(\{.*?\})\s*,?\s*\n", re.S)
_SIG_RE = re.compile(r"'signature':\s*(\{[^{}]*\})")
_NUMEL_RE = re.compile(r"^\s+(x|y|z|r0_|r1_|r)numel = (\d+)\s*$", re.M)
_GB_RE = re.compile(r"'kernel_num_gb':\s*([0-9.eE+-]+)")
_DTYPE_BYTES = {"fp8e4nv": 1, "fp8e5": 1, "fp8e4b15": 1, "fp8e4b8": 1, "fp8e5b16": 1, "i8": 1, "u8": 1, "i1": 1,
                "bf16": 2, "fp16": 2, "i16": 2, "fp32": 4, "i32": 4, "u32": 4, "fp64": 8, "i64": 8}


def _kernel_texts(text: str) -> list[tuple[str, str]]:
    """``(name, text)`` of every ``@triton.jit`` kernel in one generated module (a module can hold
    several: the graph's wrapper code embeds them)."""
    defs = list(_DEF_RE.finditer(text))
    out = []
    for i, m in enumerate(defs):
        start = text.rfind("@triton_heuristics", 0, m.start())
        start = start if start >= 0 and (i == 0 or start > defs[i - 1].end()) else m.start()
        end = defs[i + 1].start() if i + 1 < len(defs) else len(text)
        out.append((m.group(1), text[start:end]))
    return out


def parse_source(text: str) -> list[dict[str, Any]]:
    """Every Triton kernel of one file of inductor's output: ``name``, ``gb`` (bytes moved per call
    / 1e9), ``bytes_from`` (``inductor``: its ``kernel_num_gb``; ``estimated``; None when neither
    could be read), ``numel`` (elements of its iteration space), ``tiled`` (a 2-D y, x grid)."""
    out = []
    for name, body in _kernel_texts(text):
        numels = {k: int(v) for k, v in _NUMEL_RE.findall(body)}
        numel = math.prod(numels.values()) if numels else None
        rec: dict[str, Any] = {"name": name, "numel": numel, "tiled": "y" in numels and "x" in numels,
                               "gb": None, "bytes_from": None}
        gb = _GB_RE.search(body)
        if gb:
            rec.update(gb=float(gb.group(1)), bytes_from="inductor")
        elif numel is not None:
            est = _estimate_bytes(body, numel)
            if est is not None:
                rec.update(gb=est / 1e9, bytes_from="estimated")
        out.append(rec)
    return out


def _estimate_bytes(body: str, numel: int) -> float | None:
    """Bytes a kernel moves if each pointer argument is read or written whole (``numel`` elements
    of its dtype) and a pointer only indexed at ``(0)`` is one element."""
    sig = _SIG_RE.search(body)
    if not sig:
        return None
    try:
        signature = ast.literal_eval(sig.group(1))
    except (ValueError, SyntaxError):
        return None
    total = 0.0
    for arg, ty in signature.items():
        if not (isinstance(ty, str) and ty.startswith("*")):
            continue
        size = _DTYPE_BYTES.get(ty[1:])
        if size is None:
            return None
        uses = re.findall(rf"\b{re.escape(arg)} \+ \(?([^,)]*)\)?", body)
        scalar = bool(uses) and all(u.strip() == "0" for u in uses)
        total += size * (1 if scalar else numel) * (2 if arg.startswith("in_out_ptr") else 1)  # read and written
    return total


def read_sources(src: Path) -> dict[str, list[dict[str, Any]]]:
    """Kernels by name from a ``.tgz`` bundle or a directory of inductor's generated ``.py`` files."""
    texts: list[tuple[str, str]] = []
    if src.is_dir():
        texts = [(str(p), p.read_text(errors="replace")) for p in sorted(src.rglob("*.py"))]
    elif src.is_file():
        with tarfile.open(src) as tf:
            for m in tf.getmembers():
                f = tf.extractfile(m) if m.isfile() and m.name.endswith(".py") else None
                if f is not None:
                    texts.append((m.name, io.TextIOWrapper(f, errors="replace").read()))
    else:
        raise SystemExit(f"--src {src}: no such file or directory; pass the e2e call's cast_kernels.tgz"
                         " (E2E_KERNEL_SRC=1) or inductor's cache directory")
    by: dict[str, list[dict[str, Any]]] = {}
    for path, text in texts:
        for k in parse_source(text):
            by.setdefault(k["name"], []).append({**k, "file": path})
    return by


def _peak(meta: dict[str, Any], peak_gbs: float | None) -> float:
    if peak_gbs is not None:
        return peak_gbs
    dev = str(meta.get("device", ""))
    for frag, gbs in PEAK_GBS.items():
        if frag in dev:
            return gbs
    raise SystemExit(f"no memory bandwidth known for device {dev!r}; pass --peak-gbs (GB/s)")


#: kernel_summary keeps a kernel's first 160 characters
_NAME_CAP = 160


def _same(full: str, recorded: str) -> bool:
    """Whether a source's kernel name is the one a profile recorded (cut at :data:`_NAME_CAP`)."""
    return full == recorded or (len(recorded) >= _NAME_CAP and full.startswith(recorded))


def analyse(receipt: dict[str, Any], sources: dict[str, list[dict[str, Any]]], *,
            peak_gbs: float | None = None) -> dict[str, Any]:
    """Per variant (seeds averaged by kernel name), every cast and amax kernel of the receipt's
    profiles with its traffic, achieved bandwidth and excess over the floor; and totals."""
    runs = receipt.get("runs")
    if not isinstance(runs, list) or not runs:
        raise SystemExit("no 'runs' list; pass a benchmarks/e2e.py results.json")
    peak = _peak(receipt.get("meta") or {}, peak_gbs)
    per: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    seen_lists = False
    for r in runs:
        prof = r.get("profile") or {}
        for group in ("fp8_casts", "amax"):
            g = prof.get(group)
            if not isinstance(g, dict):
                continue
            seen_lists = True
            for k in g.get("kernels", []):
                per.setdefault(r["variant"], {}).setdefault((group, k["name"]), []).append((k["ms"], k["calls"]))
    if not seen_lists:
        raise SystemExit("the receipt's profiles hold no 'fp8_casts' / 'amax' lists (profiled before e3da5a7);"
                         " run benchmarks/e2e.py again")
    variants = {}
    for variant, kernels in per.items():
        rows = []
        for (group, name), obs in kernels.items():
            ms = statistics.fmean(o[0] for o in obs)
            calls = statistics.fmean(o[1] for o in obs)
            cands = [s for full, ss in sources.items() if _same(full, name) for s in ss]
            gbs = {s["gb"] for s in cands if s["gb"] is not None}
            gb = max(gbs) if gbs else None
            row: dict[str, Any] = {"group": group, "name": name, "calls": calls, "ms": ms,
                                   "us_per_call": 1e3 * ms / calls if calls else None, "gb_per_call": gb,
                                   "bytes_from": next((s["bytes_from"] for s in cands if s["gb"] == gb), None),
                                   "tiled": any(s["tiled"] for s in cands), "ambiguous": len(gbs) > 1,
                                   "sources": len(cands)}
            if gb is not None and calls:
                floor = calls * gb / peak * 1e3  # ms per step at the peak bandwidth
                row.update(achieved_gbs=gb * calls / (ms / 1e3) if ms > 0 else None, floor_ms=floor,
                           excess_ms=ms - floor)
            rows.append(row)
        # those with a floor by their excess, then those without source by their time
        rows.sort(key=lambda x: (x.get("excess_ms") is None, -(x.get("excess_ms") or x["ms"])))
        known = [x for x in rows if x.get("floor_ms") is not None]
        variants[variant] = {
            "kernels": rows,
            "ms": sum(x["ms"] for x in rows),
            "floor_ms": sum(x["floor_ms"] for x in known),
            "excess_ms": sum(x["excess_ms"] for x in known),
            "without_source": [x["name"] for x in rows if x.get("floor_ms") is None],
        }
    return {"meta": {k: (receipt.get("meta") or {}).get(k) for k in ("device", "torch", "batch", "date")},
            "peak_gbs": peak, "variants": variants}


def table(result: dict[str, Any], *, top: int = 12) -> str:
    lines = [f"Cast and amax kernels against {result['peak_gbs']:.0f} GB/s ({result['meta'].get('device')}, "
             f"B = {result['meta'].get('batch')}); ms per step, seeds averaged", ""]
    for variant, v in result["variants"].items():
        lines += [f"**{variant}**: {v['ms']:.2f} ms in {len(v['kernels'])} kernels, floor {v['floor_ms']:.2f} ms,"
                  f" excess {v['excess_ms']:.2f} ms" + (f" ({len(v['without_source'])} without source)"
                                                        if v["without_source"] else ""), "",
                  "| kernel | group | calls | ms | us/call | MB/call | GB/s | excess ms | tiled |",
                  "|---|---|---|---|---|---|---|---|---|"]

        def f(x: Any, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        for k in v["kernels"][:top]:
            mb = None if k["gb_per_call"] is None else 1e3 * k["gb_per_call"]
            lines.append(f"| `{k['name'][:90]}` | {k['group']} | {k['calls']:.1f} | {k['ms']:.3f} |"
                         f" {f(k['us_per_call'], '.1f')} | {f(mb, '.1f')}{' (est.)' if k['bytes_from'] == 'estimated' else ''}"
                         f"{' (ambiguous)' if k['ambiguous'] else ''} | {f(k.get('achieved_gbs'), '.0f')} |"
                         f" {f(k.get('excess_ms'), '.3f')} | {'yes' if k['tiled'] else ''} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a benchmarks/e2e.py results.json with fp8_casts / amax profiles")
    ap.add_argument("--src", type=Path, required=True, help="cast_kernels.tgz (E2E_KERNEL_SRC=1) or a directory")
    ap.add_argument("--peak-gbs", type=float, default=None, help="memory bandwidth, GB/s (default: by device name)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (and, with --md, the table beside)")
    ap.add_argument("--md", action="store_true", help="also write the table as .md beside --out")
    ap.add_argument("--top", type=int, default=12, help="kernels per variant in the table (default 12)")
    args = ap.parse_args(argv)
    if not args.results.is_file():
        raise SystemExit(f"{args.results}: no such file; pass the e2e call's e2e/results.json")
    if args.peak_gbs is not None and not (math.isfinite(args.peak_gbs) and args.peak_gbs > 0):
        raise SystemExit(f"--peak-gbs {args.peak_gbs}: a bandwidth is a positive number of GB/s, e.g. 3350")
    result = analyse(json.loads(args.results.read_text()), read_sources(args.src), peak_gbs=args.peak_gbs)
    md = table(result, top=args.top)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        if args.md:
            args.out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
