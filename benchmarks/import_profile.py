"""Where the compiler's import goes: ``import torch._dynamo`` and ``torch._inductor.compile_fx``,
timed in a fresh process and split by package (issue 21's ``prepare_s``).

A study's probed baseline imports the compiler before its first compiled step: on the H100 of
2026-12-07 (ninth session) that took 5.9 s of the 10.1 s outside the run, on the H200 of
2026-12-04 6.4 s (dynamo) + 4.1 s (inductor), against ~1 s each on a 2-core CPU with a CPU
build of torch. This runs the same imports, in the study's order (``import torch``, CUDA's
initialisation where there is a GPU, then dynamo, then inductor's ``compile_fx``), in a child
process under ``python -X importtime``, and adds up each module's own time (``self``, not
cumulative) by package, two dotted levels deep (``torch._dynamo``, ``torch._inductor``,
``triton.backends``, ``sympy``, ...), so the receipt says which packages the seconds are in.

    python benchmarks/import_profile.py --out $OUT/import_profile.json

Its stages' wall times come from the child's own clock; ``-X importtime`` adds its own small
overhead to every import. No number here is asserted by a test.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the child: the study's import order, each stage timed with perf_counter, as one JSON line
CHILD = """
import json, time
t = [time.perf_counter()]
import torch
t.append(time.perf_counter())
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.init()
t.append(time.perf_counter())
import torch._dynamo
t.append(time.perf_counter())
import torch._inductor.compile_fx
t.append(time.perf_counter())
names = ("torch", "cuda_init", "dynamo", "inductor_compile_fx")
print("STAGES " + json.dumps({"cuda": cuda, "torch_version": torch.__version__,
      "stages_s": {n: round(b - a, 4) for n, a, b in zip(names, t, t[1:])}}))
"""

_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)\s*$")


def package(module: str, depth: int = 2) -> str:
    """The first ``depth`` dotted components of a module's name."""
    return ".".join(module.split(".")[:depth])


def parse_importtime(text: str) -> list[tuple[str, int, int]]:
    """``(module, self_us, cumulative_us)`` of every ``import time:`` line of ``-X importtime``'s output."""
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            rows.append((m.group(4), int(m.group(1)), int(m.group(2))))
    return rows


def by_package(rows: list[tuple[str, int, int]], depth: int = 2) -> dict[str, float]:
    """Seconds of own import time per package, largest first."""
    acc: dict[str, int] = {}
    for module, self_us, _ in rows:
        p = package(module, depth)
        acc[p] = acc.get(p, 0) + self_us
    return {p: round(us / 1e6, 6) for p, us in sorted(acc.items(), key=lambda kv: -kv[1])}


def profile(python: str = sys.executable, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the child under ``-X importtime``: its stages, and its modules' own time by package."""
    proc = subprocess.run([python, "-X", "importtime", "-c", CHILD], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    stages = next((json.loads(line[len("STAGES "):]) for line in proc.stdout.splitlines()
                   if line.startswith("STAGES ")), None)
    if proc.returncode != 0 or stages is None:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"the import child failed (exit {proc.returncode}):\n{tail}")
    rows = parse_importtime(proc.stderr)
    packages = by_package(rows)
    return {
        **stages,
        "modules": len(rows),
        "own_time_s": round(sum(r[1] for r in rows) / 1e6, 6),
        "by_package_s": packages,
        "slowest_modules_s": {m: round(s / 1e6, 6) for m, s, _ in sorted(rows, key=lambda r: -r[1])[:25]},
    }


def table(result: dict[str, Any], top: int = 20) -> str:
    st = result["stages_s"]
    lines = [f"torch {result['torch_version']}, cuda {result['cuda']}: "
             + ", ".join(f"{k} {v:.2f}s" for k, v in st.items())
             + f"; {result['modules']} modules, {result['own_time_s']:.2f}s of own import time",
             "package (own time, s):"]
    lines += [f"  {p:<40} {s:8.3f}" for p, s in list(result["by_package_s"].items())[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the JSON receipt here")
    ap.add_argument("--top", type=int, default=20, help="packages to print (default 20)")
    args = ap.parse_args(argv)
    result = profile()
    print(table(result, args.top))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
