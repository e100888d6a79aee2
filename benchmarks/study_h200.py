"""Issue 13's receipt: does a study's claimed speed-up hold in end-to-end training?

One run of a study (default ``studies/wukong_h200.toml``: compiled trials at the production
batch, see its ``[regime]``), its export, then one ``benchmarks/e2e.py`` run of that export
(bf16, bf16 + the export's Mods, the export; paired seeds; compiled like the study's regime, at
its batch), and one JSON that puts the three side by side::

    python benchmarks/study_h200.py --out benchmarks/results/study_h200.json --work $OUT/study_h200

Keys: ``prepare_s`` (the study's preparation: baselines + probe + space; target <= 60 s on the
H200), ``compile`` (the regime the trials were timed in), ``study_speedup`` (the export's
claimed speed-up vs bf16 with the same Mods: its trial's), ``confirmed_speedup`` (the
confirmation stage's, same reference), ``e2e_speedup`` (e2e.py's ``speedup_vs_bf16_mods`` of
the export), ``study_vs_e2e`` = |study - e2e| / e2e (target <= 0.03), the relative log losses
beside them, ``inductor_cache_hit_rate`` (inductor's FX graph cache over the compiled trial
runs: hits / (hits + misses + bypass); ``inductor_cache`` has the counts, the confirmation's
too: the study's ``loka.compile_cache``), and the commands that produced them. ``--skip-tune`` / ``--skip-e2e`` reuse the
work folder's earlier results (``assemble`` alone is what the CPU test checks).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGET_PREPARE_S = 60.0  # issue 13
TARGET_GAP = 0.03  # |study - e2e| / e2e


def assemble(provenance: dict[str, Any], e2e: dict[str, Any], prepare_s: float | None,
             commands: list[str] | None = None, inductor_cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """The receipt from the export's provenance, e2e.py's results.json, the preparation time and
    the study's inductor cache counts (``compile_cache_summary``; None: no trial compiled)."""
    rows = {r["variant"]: r for r in e2e.get("rows", [])}
    cfg_row = rows.get("config") or {}
    e2e_speedup = cfg_row.get("speedup_vs_bf16_mods")
    study = provenance.get("claimed_speedup")
    regime = provenance.get("confirmed_regime") or provenance.get("regime") or {}
    gap = abs(study - e2e_speedup) / e2e_speedup if study and e2e_speedup else None
    meta = e2e.get("meta") or {}
    return {
        "study": provenance.get("study"), "trial": provenance.get("trial"),
        "prepare_s": prepare_s,
        "compile": bool(regime.get("compile")), "batch_size": regime.get("batch_size"),
        "study_speedup": study,
        "study_speedup_vs_bf16": provenance.get("claimed_speedup_vs_bf16"),
        "confirmed_speedup": provenance.get("confirmed_speedup"),
        "confirmed_rel_logloss_pct": provenance.get("confirmed_rel_logloss_pct"),
        "confirmed_rel_logloss_sd_pct": provenance.get("confirmed_rel_logloss_sd_pct"),
        "e2e_speedup": e2e_speedup,
        "e2e_speedup_vs_bf16": cfg_row.get("speedup_vs_bf16"),
        "e2e_rel_ll_pct_vs_bf16_mods": cfg_row.get("rel_ll_pct_vs_bf16_mods"),
        "e2e_compile": meta.get("compile"), "e2e_batch": meta.get("batch"), "e2e_seeds": meta.get("seeds"),
        "study_vs_e2e": gap,
        "inductor_cache_hit_rate": (inductor_cache or {}).get("hit_rate"), "inductor_cache": inductor_cache,
        "pass": {"prepare_s": prepare_s is not None and prepare_s <= TARGET_PREPARE_S,
                 "compile": bool(regime.get("compile")) and bool(meta.get("compile")),
                 "study_vs_e2e": gap is not None and gap <= TARGET_GAP},
        "device": meta.get("device"), "torch": meta.get("torch"), "date": time.strftime("%Y-%m-%d"),
        "commands": commands or [],
    }


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if rc:
        raise SystemExit(f"{cmd[:4]} failed (exit {rc}); see {log}")


def _stored_study(study_file: Path, out_dir: Path) -> Any:
    """The study as the work folder's optuna.db holds it."""
    import optuna

    from loka_tune.tuner.study import load_study

    cfg = load_study(study_file).with_output_dir(out_dir)
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage.url)


def _prepare_s(study_file: Path, out_dir: Path) -> float | None:
    """The preparation seconds the study stored (``loka.prepare_s``)."""
    from loka_tune.tuner.results import ATTR_PREPARE_S

    v = _stored_study(study_file, out_dir).user_attrs.get(ATTR_PREPARE_S)
    return None if v is None else float(v)


def _inductor_cache(study_file: Path, out_dir: Path) -> dict[str, Any] | None:
    """Inductor's cache counts over the study's compiled trial runs and its confirmation's."""
    from loka_tune.tuner.results import compile_cache_summary

    return compile_cache_summary(_stored_study(study_file, out_dir))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=REPO / "studies" / "wukong_h200.toml")
    ap.add_argument("--work", type=Path, required=True, help="folder for the study's files, the export and e2e's")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "study_h200.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-trials", type=int, default=None, help="override the study's trial budget")
    ap.add_argument("--tune-timeout", type=float, default=None,
                    help="start no trial after this many seconds (the confirmation still runs)")
    ap.add_argument("--e2e-steps", type=int, default=150)
    ap.add_argument("--e2e-seeds", default="0,1")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)

    from loka_tune.config import PrecisionConfig
    from loka_tune.tuner.build import train_config
    from loka_tune.tuner.study import load_study

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "study_h200.log"
    study_dir, best, e2e_dir = work / "study", work / "best.json", work / "e2e"
    py = sys.executable
    tune = [py, "-m", "loka_tune", "tune", str(args.study), "--device", args.device, "--out-dir", str(study_dir),
            "--no-tracking"] + ([] if args.n_trials is None else ["--n-trials", str(args.n_trials)]) \
        + ([] if args.tune_timeout is None else ["--timeout", str(args.tune_timeout)])
    export = [py, "-m", "loka_tune", "export", str(args.study), "--storage",
              f"sqlite:///{study_dir / 'optuna.db'}", "--out", str(best)]
    if not args.skip_tune:
        _run(tune, log)
        _run(export, log)
    prov = PrecisionConfig.load(best).provenance
    regime = train_config(load_study(args.study), device=args.device)  # the regime e2e must train in
    e2e = [py, "benchmarks/e2e.py", "--study", str(args.study), "--config", str(best), "--batch",
           str(regime.batch_size), "--steps", str(args.e2e_steps), "--seeds", args.e2e_seeds,
           "--variants", "bf16,bf16_mods,config", "--device", args.device, "--out", str(e2e_dir)]
    e2e += ["--compile"] if regime.compile else []
    e2e += ["--cuda-graphs"] if regime.cuda_graphs else []
    if not args.skip_e2e:
        _run(e2e, log)
    if not (e2e_dir / "results.json").is_file():
        print(f"no e2e results in {e2e_dir} yet: run again with --skip-tune (without --skip-e2e)")
        return 2
    results = json.loads((e2e_dir / "results.json").read_text())
    receipt = assemble(prov, results, _prepare_s(args.study, study_dir),
                       commands=[" ".join(c[1:]) for c in (tune, export, e2e)],
                       inductor_cache=_inductor_cache(args.study, study_dir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(receipt, indent=1))
    print(json.dumps({k: receipt[k] for k in ("prepare_s", "compile", "study_speedup", "confirmed_speedup",
                                              "e2e_speedup", "study_vs_e2e", "inductor_cache_hit_rate", "pass")},
                     indent=1))
    return 0 if all(receipt["pass"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
