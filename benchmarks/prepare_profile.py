"""Where a study's preparation spends its time: the preparation alone (``run_study(n_trials=0)``:
baselines, noise twins, probe, pricing; no trial, no confirmation), from a fresh process, so a
cold machine's imports and first compile are in it as the study meets them.

    python benchmarks/prepare_profile.py --study studies/wukong_h200.toml --work /tmp/p \
        --out $OUT/prepare_profile.txt [--profile] [--sequential]

Writes ``--out``: the first line JSON (``wall_s``, the study's ``prepare_s`` and its phases);
with ``--profile`` the main thread under cProfile, then its functions by cumulative and by own
time and the callers of the read-back, the twin's build and the imports (cProfile slows
Python-heavy parts such as inductor's compile, and sees no other thread: read shares, not
seconds), and ``--work``/prepare.prof for ``python -m pstats``. The study's own log lines (its
phases) go to stderr as always.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="studies/wukong_h200.toml", help="the study file (default %(default)s)")
    ap.add_argument("--work", type=Path, required=True, help="a fresh folder for the study's files and prepare.prof")
    ap.add_argument("--out", type=Path, required=True, help="the text summary to write")
    ap.add_argument("--device", default="cuda", help="the study's device (default %(default)s)")
    ap.add_argument("--top", type=int, default=70, help="rows per table (default %(default)s)")
    ap.add_argument("--profile", action="store_true", help="the main thread under cProfile (slower)")
    ap.add_argument("--sequential", action="store_true",
                    help="the probe's read-back and measurement after the noise twin, as on a CPU (the A/B"
                         " of prepare.beside_twin; default: as the study runs on this device)")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if a.profile:
        prof.enable()
    from loka_tune.tuner.log import to_stderr
    from loka_tune.tuner.loop import run_study
    from loka_tune.tuner.study import load_study

    to_stderr()  # the study's own lines, as the CLI prints them
    if a.sequential:
        from loka_tune.tuner import prepare

        prepare.beside_twin = lambda device: False  # type: ignore[assignment]

    cfg = load_study(a.study).with_output_dir(a.work)
    study = run_study(cfg, device=a.device, n_trials=0, confirm=False, tracking=False, progress=False)
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    attrs = study.user_attrs
    buf.write(json.dumps({"wall_s": wall, "prepare_s": attrs.get("loka.prepare_s"),
                          "phases": attrs.get("loka.prepare_phases"), "profiled": a.profile,
                          "sequential": a.sequential, "device": a.device}) + "\n")
    if a.profile:
        prof.disable()
        prof.dump_stats(str(a.work / "prepare.prof"))
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(a.top)
        st.sort_stats("tottime").print_stats(a.top)
        for pat in ("perturb_weights", "make_model", "deepcopy", "_find_and_load", "wait", "synchronize"):
            st.sort_stats("cumulative").print_callers(pat, 12)
    a.out.write_text(buf.getvalue())
    print(f"prepare_profile: {wall:.1f}s wall{' under cProfile' if a.profile else ''} -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
