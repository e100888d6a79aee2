"""``loka-tune report STUDY``: the leaderboard of a study, and its plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HELP = "print a study's leaderboard and write its plots (speed vs loss, best choice map)"

DESCRIPTION = """\
STUDY is a study file (.toml) or a study name with --storage. Prints the trials (feasible
ones first, fastest first; speed-up vs bf16 and vs bf16 with the same Mods; '*' marks the
trial `loka-tune export` writes), then the confirmation stage (claimed vs confirmed speed-up,
relative log loss mean and sd over its seeds), inductor's cache hits over the compiled trial
runs (when the trials were compiled: hits / misses of its FX graph cache; a hit is a graph an
earlier run compiled, loaded instead of compiled again), the probe's sites (from the study's
probe_report.json: per site its status, probed / fallback / unprobed, and each statistic that
fell back, with why), the space (per site its recipe values and the seconds each saves per
step, and the model's last fit), a legend of its terms (NE, AUC, relative log loss, noise floor, budget),
and writes speed_vs_loss.png (trial labels, noise-floor band, Pareto front, exported trial)
and best_choice_map.png into --out-dir (default: the study's output dir). A relative log loss
within the noise floor is labelled "within noise": it cannot be told from bf16's own, neither
better nor worse.

examples:
  loka-tune report studies/quickstart.toml
  loka-tune report quickstart --storage sqlite:///runs/quickstart/optuna.db --out-dir plots/
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loka_tune.commands._args import integer

    parser.add_argument("study", help="a study file (.toml), or a study name with --storage")
    parser.add_argument("--storage", default=None, help="Optuna storage URL")
    parser.add_argument("--out-dir", default=None, help="where the plots go (default: the study's output dir)")
    parser.add_argument("--limit", type=integer("a number of rows", minimum=0), default=20,
                        help="rows of the leaderboard (default 20; 0: all)")
    parser.add_argument("--no-plots", action="store_true", help="print only")


def legend(budget_pct: float | None, noise_floor_pct: float | None) -> str:
    """A short legend of the terms the leaderboard and the confirmation use."""
    floor = "?" if noise_floor_pct is None else f"{noise_floor_pct:.3g}%"
    budget = "?" if budget_pct is None else f"{budget_pct:g}%"
    return "\n".join([
        "how to read it:",
        "  NE       normalized entropy: eval log loss / the log loss of always predicting the click rate;",
        "           1.0 = learned nothing, lower is better (good CTR models reach ~0.75-0.8)",
        "  AUC      the chance a random click is scored above a random non-click: 0.5 = guessing",
        "  relLL%   relative log loss, (config's eval log loss - bf16's) / bf16's x 100, paired: same seed,",
        "           init and data order as the bf16 baseline. + = worse than bf16, - = lower loss",
        f"  noise    the noise floor, {floor}: the largest |relLL%| of a bf16 twin (the baseline run again",
        "           from Linear weights x (1 + 2^-8 N(0,1)), about one bf16 rounding). Inside it, 'within",
        "           noise': no measurable difference from bf16, neither better nor worse",
        f"  budget   {budget}: the most relLL% a config may cost (feasible: relLL% <= budget), above the floor",
        "  vs bf16 / vs Mods: the step-time speed-up over bf16, and over bf16 with the trial's own Mods",
    ])


def _notes(within_noise: bool | None, other: str | None) -> str:
    """A row's note: "within noise" first (when it is), then the rest."""
    return ", ".join(n for n in ("within noise" if within_noise else "", other or "") if n)


def format_leaderboard(rows: list[dict], *, limit: int | None = 20) -> str:
    """The leaderboard as an aligned text table."""
    def f(v, fmt: str) -> str:  # noqa: ANN001
        return "-" if v is None else format(v, fmt)

    head = f"  {'trial':>5} {'state':<8} {'feas':<4} {'step_s':>10} {'vs bf16':>8} {'vs Mods':>8} {'relLL%':>9}" \
           f" {'NE':>7} {'AUC':>6} {'fp8':>4} {'mods':<12} note"
    lines = [head, "-" * len(head)]
    for r in rows[:limit] if limit else rows:
        # an enqueued start's label first (a start can be a cache copy or fail too), then why
        why = r["reason"] or (f"cache of {r.get('cached_from')}" if r["cache_hit"] else "")
        note = _notes(r.get("within_noise"), ", ".join(n for n in (r.get("seeded") or "", why) if n))
        mark = "* " if r.get("exported") else "  "
        lines.append(f"{mark}{r['trial']:>5} {r['state']:<8} {'yes' if r['feasible'] else 'no':<4}"
                     f" {f(r['step_time_s'], '.4g'):>10} {f(r['speedup'], '.3f'):>8}"
                     f" {f(r.get('speedup_vs_mods'), '.3f'):>8} {f(r['rel_logloss_pct'], '+.4f'):>9}"
                     f" {f(r['eval_ne'], '.4f'):>7} {f(r['eval_auc'], '.4f'):>6} {r['fp8_gemms']:>4} {r['mods']:<12} {note}")
    if any(r.get("exported") for r in rows):
        lines.append("* = the trial `loka-tune export` writes; 'vs Mods' = speed-up over bf16 with the same Mods")
    return "\n".join(lines)


def format_confirmation(c: dict | None, noise_floor_pct: float | None = None) -> str:
    """The confirmation stage's table: claimed vs confirmed speed-up, loss mean and spread (a
    mean within ``noise_floor_pct`` of zero noted "within noise")."""
    from loka_tune.tuner.results import within_noise

    if not c:
        return "confirmation: not run ([confirm] enabled = false, or no feasible trial yet)"

    def f(v, fmt: str) -> str:  # noqa: ANN001
        return "-" if v is None else format(v, fmt)

    reg = c.get("regime") or {}
    lines = [f"confirmation on seeds {c.get('seeds')} ({'compiled' if reg.get('compile') else 'eager'},"
             f" batch {reg.get('batch_size')}, speed {c.get('speed_source')}): vs bf16 + the same Mods",
             f"  {'trial':>5} {'claimed':>8} {'confirmed':>9} {'relLL% mean':>11} {'sd':>7} {'feas':<4} note"]
    for r in c.get("rows", []):
        mark = "* " if r.get("trial") == c.get("chosen") else "  "
        lines.append(f"{mark}{r['trial']:>5} {f(r.get('claimed_speedup_vs_mods'), '.3f'):>8}"
                     f" {f(r.get('speedup_vs_mods'), '.3f'):>9} {f(r.get('rel_logloss_pct'), '+.4f'):>11}"
                     f" {f(r.get('rel_logloss_sd_pct'), '.4f'):>7} {'yes' if r.get('feasible') else 'no':<4}"
                     f" {_notes(within_noise(r.get('rel_logloss_pct'), noise_floor_pct), r.get('reason', ''))}")
    lines.append("* = confirmed best (exported)" if c.get("chosen") is not None
                 else "no confirmed config within the budget (export --unconfirmed takes the search's best)")
    return "\n".join(lines)


def format_compile_cache(summary: dict | None) -> str | None:
    """One line of inductor's cache over the compiled trial runs (and the confirmation's), from
    :func:`~loka_tune.tuner.results.compile_cache_summary`; None when no trial compiled."""
    if not summary:
        return None

    def counts(c: dict, runs: str) -> str:
        rate = "-" if c.get("hit_rate") is None else f"{100 * c['hit_rate']:.0f}%"
        bypass = f", {c['bypass']} bypassed" if c.get("bypass") else ""
        return f"{c['hits']} hits / {c['misses']} misses{bypass} across {c['runs']} compiled {runs} (hit rate {rate})"

    line = "inductor cache: " + counts(summary, "trial runs")
    if summary.get("confirmation"):
        line += "; confirmation: " + counts(summary["confirmation"], "runs")
    aot = [summary.get(k) or 0 for k in ("aot_hits", "aot_misses", "aot_bypass")]
    if any(aot):
        line += f"; AOTAutograd's cache: {aot[0]} hits / {aot[1]} misses / {aot[2]} bypassed"
    return line


def _probe_report_path(cfg: Any, study_attr: dict[str, Any], out_dir: Path | None = None) -> Path | None:
    """The study's ``probe_report.json``: the first that exists of the output dir the study ran
    with (stored: ``tune --out-dir`` included), the study file's, and ``--out-dir``; else where
    the stored one would be (the line then says it is missing)."""
    stored = (study_attr.get("study") or {}).get("output_dir")
    dirs = [Path(d) for d in (stored, cfg.output_dir if cfg is not None else None, out_dir) if d is not None]
    for d in dirs:
        if (d / "probe_report.json").is_file():
            return d / "probe_report.json"
    return dirs[0] / "probe_report.json" if dirs else None


def format_probe_sites(path: Path | None) -> str:
    """The probe's sites: one line of counts, then per site its shape, status and fallbacks."""
    if path is None or not path.is_file():
        return "probe: no probe_report.json ([probe] enabled = false, or another output dir)"
    from loka_tune.errors import ProbeError
    from loka_tune.probe.report import ProbeReport

    try:
        rep = ProbeReport.load(path)
    except ProbeError as e:
        return f"probe: {e}"
    return f"probe ({path}): {rep.status_line()}\n{rep.sites_table()}"


def run(args: argparse.Namespace) -> int:
    from loka_tune.commands.export import open_existing
    from loka_tune.space.candidates import SearchSpace
    from loka_tune.tuner.results import ATTR_BASELINE, ATTR_SPACE, ATTR_STUDY, leaderboard

    if args.out_dir is not None and not args.no_plots:
        from loka_tune.commands._output import check_output

        check_output(args.out_dir, "--out-dir", is_dir=True)
    cfg, study = open_existing(args.study, args.storage)
    if ATTR_BASELINE not in study.user_attrs:  # never prepared: no baseline, no space, no trials
        from loka_tune.tuner.prepare import ATTR_PREPARE_FAILED

        why = study.user_attrs.get(ATTR_PREPARE_FAILED)
        what = f"its preparation failed ({why})" if why else "its preparation never finished"
        print(f"loka-tune report: study {study.study_name!r} has no results: {what}. Fix that and run"
              f" `loka-tune tune {args.study}` again.", file=sys.stderr)
        return 1
    rows = leaderboard(study)
    for r in rows:
        r.setdefault("cached_from", None)
    bl = study.user_attrs.get(ATTR_BASELINE) or {}
    st = study.user_attrs.get(ATTR_STUDY) or {}
    budget = (st.get("objective") or {}).get("budget_pct")
    from loka_tune.tuner.baseline import Baseline
    from loka_tune.tuner.results import compile_cache_summary, confirmation, noise_floor

    floor = noise_floor(study)
    base = Baseline.from_dict(bl)
    print(f"study {study.study_name!r}: {len(rows)} finished trials; bf16 baseline (seed {base.seeds[0]}): eval log"
          f" loss {base.logloss:.5f}, NE {base.eval_ne:.4f}, AUC {base.eval_auc:.4f}; budget {budget}%, speed"
          f" {bl.get('speed_source')}")
    print(f"noise floor {base.noise_floor_pct:.3g}% ({base.noise_floor_what()})")
    print(format_leaderboard(rows, limit=args.limit))
    print(format_confirmation(confirmation(study), floor))
    cache_line = format_compile_cache(compile_cache_summary(study))
    if cache_line:
        print(cache_line)
    print(format_probe_sites(_probe_report_path(cfg, st, args.out_dir)))
    if ATTR_SPACE in study.user_attrs:  # the recipe values and their prices; the model's last fit
        from loka_tune.space.recipe_space import space_table
        from loka_tune.tuner.proposals import model_line

        print("\n".join(x for x in (space_table(SearchSpace.from_dict(study.user_attrs[ATTR_SPACE])),
                                     model_line(study.user_attrs)) if x))
    print(legend(budget, floor))
    if not args.no_plots and ATTR_SPACE in study.user_attrs:
        from loka_tune.tuner.tracking import write_plots

        out = Path(args.out_dir) if args.out_dir else (cfg.output_dir if cfg is not None else Path("."))
        try:
            paths = write_plots(study, SearchSpace.from_dict(study.user_attrs[ATTR_SPACE]), out,
                                budget_pct=float(budget or 0.0), speed_source=str(bl.get("speed_source")))
        except ImportError as e:  # a lean GPU box without matplotlib: the leaderboard above still stands
            print(f"plots skipped: {e}; pip install matplotlib, or pass --no-plots", file=sys.stderr)
            paths = []
        for p in paths:
            print(f"wrote {p}")
    return 0
