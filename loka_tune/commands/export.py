"""``loka-tune export STUDY --out best.json``: the best feasible config of a study, with provenance."""

from __future__ import annotations

import argparse

HELP = "write the best feasible precision config of a study (JSON, with provenance)"

DESCRIPTION = """\
STUDY is a study file (its [storage] url and name are used) or, with --storage, a study name.
The config records where it came from (study, trial, metrics, device, versions, whether the
speed was measured or modeled). When the study ran its confirmation stage ([confirm]), the
exported config is the confirmed best, and its provenance holds the claimed and the confirmed
speed-ups (vs bf16 with the same Mods) and the confirmed relative log loss with its spread. Use it with `loka-tune train ... --config best.json` or, in your
own training code, `loka_tune.apply(model, "best.json")`.

examples:
  loka-tune export studies/quickstart.toml --out best.json
  loka-tune export quickstart --storage sqlite:///runs/quickstart/optuna.db --out best.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", help="a study file (.toml), or a study name with --storage")
    parser.add_argument("--storage", default=None, help="Optuna storage URL (sqlite:///... or postgresql://...)")
    parser.add_argument("--out", default="best.json", help="output JSON (default best.json)")
    parser.add_argument("--unconfirmed", action="store_true",
                        help="export the best trial of the search even where the confirmation stage chose another"
                             " (or none)")


def open_existing(study_arg: str, storage: str | None):  # noqa: ANN201
    """The Optuna study named by a study file or by name + storage (never creates one)."""
    import optuna

    from loka_tune.errors import StudyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if study_arg.endswith(".toml"):
        from loka_tune.tuner.study import load_study

        cfg = load_study(study_arg)
        name, url = cfg.name, storage or cfg.storage.url
    else:
        if storage is None:
            raise StudyError(f"got study name {study_arg!r} without --storage; give a study file (.toml) or"
                             " --storage sqlite:///runs/<name>/optuna.db")
        cfg, name, url = None, study_arg, storage
    if url.startswith("sqlite:///"):
        from pathlib import Path

        if not Path(url[len("sqlite:///"):]).is_file():
            raise StudyError(f"no study storage at {url!r}: run `loka-tune tune {study_arg}` first")
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except KeyError:
        raise StudyError(f"no study named {name!r} in {url!r}: run `loka-tune tune` first") from None
    return cfg, study


def run(args: argparse.Namespace) -> int:
    from loka_tune.tuner.results import export_best

    _cfg, study = open_existing(args.study, args.storage)
    config = export_best(study, args.out, unconfirmed=args.unconfirmed)
    p = config.provenance
    print(f"wrote {args.out}: trial {p['trial']} of {p['study']!r}, speed-up {p['speedup']:.3f}x"
          f" ({p['speed_source']}), rel. log loss {p['rel_logloss_pct']:+.4f}% (budget {p['budget_pct']}%)")
    if p.get("confirmed"):
        sd = p.get("confirmed_rel_logloss_sd_pct")
        print(f"  confirmed on seeds {p['confirmed_seeds']}: {p['confirmed_speedup']:.3f}x vs bf16 + same Mods"
              f" (claimed {p['claimed_speedup']:.3f}x), rel. log loss {p['confirmed_rel_logloss_pct']:+.4f}%"
              + ("" if sd is None else f" (sd {sd:.4f})"))
    else:
        print("  not confirmed (the study ran no confirmation stage, or --unconfirmed)")
    return 0
