"""``loka-tune export STUDY --out best.json``: the best feasible config of a study, with provenance."""

from __future__ import annotations

import argparse

HELP = "write a study's confirmed best (else best feasible) precision config (JSON, with provenance)"

DESCRIPTION = """\
STUDY is a study file (its [storage] url and name are used) or, with --storage, a study name.
The config records where it came from (study, trial, metrics, device, versions, whether the
speed was measured or modeled). When the study ran its confirmation stage ([confirm]), the
exported config is the confirmed best, and its provenance holds the claimed and the confirmed
speed-ups (vs bf16 with the same Mods) and the confirmed relative log loss with its spread. Use it with `loka-tune train ... --config best.json` or, in your
own training code, `loka_tune.apply(model, "best.json")`.

--trial N exports trial N instead (any completed trial, feasible or not: `loka-tune report`
lists them); its provenance says it was chosen ("trial_chosen": true).

examples:
  loka-tune export studies/quickstart.toml --out best.json
  loka-tune export studies/quickstart.toml --trial 3 --out trial3.json
  loka-tune export quickstart --storage sqlite:///runs/quickstart/optuna.db --out best.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loka_tune.commands._args import integer

    parser.add_argument("study", help="a study file (.toml), or a study name with --storage")
    parser.add_argument("--storage", default=None, help="Optuna storage URL (sqlite:///... or postgresql://...)")
    parser.add_argument("--out", default="best.json", help="output JSON (default best.json)")
    parser.add_argument("--trial", type=integer("a trial number", minimum=0), default=None, metavar="N",
                        help="export completed trial N instead of the best feasible one")
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
    from loka_tune.tuner.optuna_setup import load_storage
    from loka_tune.tuner.storage import shown_url

    try:
        study = optuna.load_study(study_name=name, storage=load_storage(url))
    except KeyError:
        raise StudyError(f"no study named {name!r} in {shown_url(url)!r}: run `loka-tune tune` first") from None
    return cfg, study


def run(args: argparse.Namespace) -> int:
    from loka_tune.commands._output import check_output, write_error
    from loka_tune.tuner.results import export_best

    check_output(args.out, "--out")
    _cfg, study = open_existing(args.study, args.storage)
    config = export_best(study, trial=args.trial, unconfirmed=args.unconfirmed)
    try:
        config.save(args.out)
    except OSError as e:
        raise write_error(args.out, "--out", e) from None
    from loka_tune.tuner.results import noise_note, within_budget

    p = config.provenance
    floor = p.get("noise_floor_pct")
    feasible = within_budget(p["rel_logloss_pct"], p["budget_pct"])
    print(f"wrote {args.out}: trial {p['trial']} of {p['study']!r}, speed-up {_num(p['speedup'], '.3f')}x"
          f" ({p['speed_source']}), rel. log loss {_num(p['rel_logloss_pct'], '+.4f')}%"
          f"{noise_note(p['rel_logloss_pct'], floor)} (budget {p['budget_pct']}%)"
          + ("" if feasible else "; NOT feasible: over the loss budget"))
    if p.get("confirmed"):
        sd = p.get("confirmed_rel_logloss_sd_pct")
        print(f"  confirmed on seeds {p['confirmed_seeds']}: {_num(p['confirmed_speedup'], '.3f')}x vs bf16 + same"
              f" Mods (claimed {_num(p['claimed_speedup'], '.3f')}x), rel. log loss"
              f" {_num(p['confirmed_rel_logloss_pct'], '+.4f')}%" + ("" if sd is None else f" (sd {sd:.4f})")
              + noise_note(p.get("confirmed_rel_logloss_pct"), floor))
    else:
        print("  not confirmed (the study ran no confirmation stage, the trial was chosen, or --unconfirmed)")
    return 0


def _num(x: object, spec: str) -> str:
    return "n/a" if not isinstance(x, (int, float)) else format(x, spec)
