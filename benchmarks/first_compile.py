"""The first compiled step of a study's bf16 baseline, from a fresh process on cold caches
(issue 21's ``prepare_s``): where its seconds go, and what starting the compiler early buys.

On the H200 the first compiled step of the B = 8192 baseline took 18.5 s, 21.7 s and 29.4 s in
three studies of one preparation code (BENCHMARKS.md), with 3-12 s more before the run began:
that spread alone decides whether preparation meets its 60 s. Each run here is a child process
with empty inductor and Triton cache folders (a fresh machine's first study), that imports
torch, builds the study's data source and its bf16 model, and trains it compiled for a few
steps at the study's batch through the study's own path (``run_train``: ``strict_compile``, the
trainer's first step timed with the device synchronised). Its compile is split by dynamo's own
timers (:func:`loka_tune.objectives.compiled.compile_split`: tracing, the forward and backward
compiles, kernel codegen, module load, the wait for the compile workers, whether they were up).

Arms (``--arms``; the runs interleave them, ``--reps`` rounds):

* ``plain``: as ``loka-tune tune`` runs today (inductor starts its pool of compile workers when
  the first graph reaches it);
* ``warm_pool``: inductor's pool started (``maybe_warm_pool``, what inductor itself calls then)
  right after ``import torch``, before the source and the model are built;
* ``import_thread``: dynamo and inductor imported in a thread meanwhile (the warm-up reverted in
  527e15b on one pair of runs: 28.2 s with it, 18.5 s without).

    python benchmarks/first_compile.py --study studies/wukong_h200.toml --arms plain,warm_pool \\
        --reps 2 --budget 240 --out $OUT/first_compile.json

No wall-clock number here is asserted by a test; the receipt says what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("plain", "warm_pool", "import_thread")


def _imports() -> None:
    try:
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # noqa: BLE001 - the run's own import says what is wrong, in the main thread
        pass


def child(arm: str, study: str, steps: int, device: str, out: Path) -> None:
    """One run (in its own process): the arm's warm-up, the source and model, a compiled run."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    if arm == "warm_pool":
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    elif arm == "import_thread":
        threading.Thread(target=_imports, name="first-compile-imports", daemon=True).start()
    t_arm = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from dataclasses import replace

    from loka_tune.applier import apply
    from loka_tune.config import PrecisionConfig
    from loka_tune.tuner.build import make_model, make_source, run_train, train_config
    from loka_tune.tuner.study import load_study

    cfg = load_study(study)
    source = make_source(cfg)
    model = make_model(cfg, source, seed=0)
    apply(model, PrecisionConfig())
    tcfg = train_config(cfg, 0, device=device)
    tcfg = replace(tcfg, compile=True, steps=steps, warmup_steps=min(tcfg.warmup_steps, steps - 1),
                   window=min(tcfg.window, steps), eval_batches=1)
    t_built = time.perf_counter()
    res = run_train(model, source, tcfg)
    t_end = time.perf_counter()
    ph = res.phases_s
    row = {
        "arm": arm, "status": res.status, "device": str(res.device), "batch": tcfg.batch_size, "steps": steps,
        "import_torch_s": t_torch - t0, "arm_s": t_arm - t_torch, "build_s": t_built - t_arm,
        "setup_s": ph.get("setup"), "first_step_s": ph.get("first_step"),
        # process start (after the interpreter) to the end of the first compiled step
        "to_first_step_s": (t_built - t0) + float(ph.get("setup", 0.0)) + float(ph.get("first_step", 0.0)),
        "compile_s": res.compile_s, "wall_s": t_end - t0, "torch": torch.__version__,
    }
    out.write_text(json.dumps(row, indent=1))


def _summary(rows: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in arms:
        ok = [r for r in rows if r["arm"] == arm and r.get("status") == "ok"]
        if not ok:
            out[arm] = {"runs": 0}
            continue
        med = {k: statistics.median(float(r[k]) for r in ok) for k in ("to_first_step_s", "first_step_s", "build_s")}
        out[arm] = {"runs": len(ok), **{f"median_{k}": v for k, v in med.items()},
                    "first_step_s": [round(float(r["first_step_s"]), 2) for r in ok]}
    base = out.get("plain", {}).get("median_to_first_step_s")
    for arm in arms:
        m = out[arm].get("median_to_first_step_s")
        if base and m and arm != "plain":
            out[arm]["saved_vs_plain_s"] = base - m
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="studies/wukong_h200.toml", help="the study file whose bf16 baseline compiles")
    ap.add_argument("--arms", default="plain,warm_pool,import_thread", help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--reps", type=int, default=2, help="rounds over the arms (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (default 3; the first compiles)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--budget", type=float, default=240.0, help="start no run after this many seconds (default 240)")
    ap.add_argument("--run-timeout", type=float, default=150.0, help="seconds one run may take (default 150)")
    ap.add_argument("--out", type=Path, required=True, help="the receipt (JSON)")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.study, a.steps, a.device, a.child_out)
        return 0
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad or not arms:
        ap.error(f"--arms {a.arms!r}: {bad or 'none'} not among {', '.join(ARMS)}")
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: at least 2 (the first compiles; the trainer times the rest)")
    from loka_tune.objectives.compiled import compile_note  # light: imports no torch

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for rep in range(a.reps):
        for arm in arms:
            if time.perf_counter() - t0 > a.budget:
                print(f"[first_compile] budget {a.budget:.0f}s spent: {len(rows)} run(s) made", flush=True)
                break
            with tempfile.TemporaryDirectory(prefix="first-compile-") as tmp:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
                res = Path(tmp) / "row.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", arm, "--child-out", str(res),
                       "--study", a.study, "--steps", str(a.steps), "--device", a.device, "--out", str(a.out)]
                t = time.perf_counter()
                try:
                    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.run_timeout)
                    err = None if p.returncode == 0 else (p.stderr or p.stdout)[-2000:]
                except subprocess.TimeoutExpired:
                    err = f"timed out after {a.run_timeout:.0f}s"
                row = json.loads(res.read_text()) if res.exists() else {"arm": arm, "status": "error"}
                row.update(rep=rep, process_s=time.perf_counter() - t, error=err)
            rows.append(row)
            print(f"[first_compile] {arm:13s} rep {rep}: {row.get('status')}, to the first step's end"
                  f" {row.get('to_first_step_s', float('nan')):.1f}s (first step {row.get('first_step_s') or float('nan'):.1f}s:"
                  f" {compile_note(row.get('compile_s') or {})}), process {row['process_s']:.1f}s"
                  + (f"; error: {err.splitlines()[-1] if err.strip() else err}" if err else ""), flush=True)
    meta = {"study": a.study, "device": a.device, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d"),
            "torch": next((r.get("torch") for r in rows if r.get("torch")), None), "wall_s": time.perf_counter() - t0}
    summary = _summary(rows, arms)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if rows and all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
