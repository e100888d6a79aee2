"""Arguments checked before work, through the real CLI: every numeric option is checked when the
command line is parsed (one line quoting the value and the accepted range, exit status 2),
output paths need an existing folder (or the error says how to make one), and an unwritable
``train --json`` is refused before training."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loka_tune.cli import build_parser, main

DATA = "synthetic:num_sparse=2,cardinality=50,eval_examples=64"


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err  # one line, not the usage text first
    return err.strip()


def test_every_numeric_option_of_every_command_is_range_checked() -> None:
    """No plain ``type=int`` / ``type=float`` is left: each numeric option parses through a checked type."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    unchecked = [(name, a.option_strings) for name, p in sub.choices.items() for a in p._actions
                 if a.type in (int, float)]
    assert not unchecked


@pytest.mark.parametrize("argv, quoted", [
    (["tune", "{study}", "--timeout", "-1"], "argument --timeout: expected seconds > 0, got '-1'"),
    (["tune", "{study}", "--timeout", "0"], "argument --timeout: expected seconds > 0, got '0'"),
    (["tune", "{study}", "--timeout", "inf"], "argument --timeout: expected seconds, a finite number > 0, got 'inf'"),
    (["tune", "{study}", "--n-trials", "0"], "argument --n-trials: expected a number of trials >= 1, got '0'"),
    (["tune", "{study}", "--workers", "0"], "argument --workers: expected a number of worker processes >= 1, got '0'"),
    (["tune", "{study}", "--worker-index", "-2"], "argument --worker-index: expected a worker index >= 0, got '-2'"),
    (["export", "{study}", "--trial", "-1"], "argument --trial: expected a trial number >= 0, got '-1'"),
    (["report", "{study}", "--limit", "-1"], "argument --limit: expected a number of rows >= 0, got '-1'"),
    (["train", "--model", "dlrm", "--batch-size", "0"], "argument --batch-size: expected a batch size >= 1, got '0'"),
    (["train", "--model", "dlrm", "--seed", "-1"], "argument --seed: expected a seed >= 0, got '-1'"),
    (["train", "--model", "dlrm", "--lr-sparse", "nan"],
     "argument --lr-sparse: expected a learning rate, a finite number > 0, got 'nan'"),
    (["train", "--model", "dlrm", "--nproc", "0"], "argument --nproc: expected a number of processes >= 1, got '0'"),
    (["train", "--model", "dlrm", "--eval-batches", "x"],
     "argument --eval-batches: expected a number of batches, an integer >= 1, got 'x'"),
    (["probe", "--model", "dlrm", "--out", "p", "--every", "0"],
     "argument --every: expected a number of steps >= 1, got '0'"),
    (["probe", "--model", "dlrm", "--out", "p", "--max-error", "0"],
     "argument --max-error: expected an error bound > 0, got '0'"),
    (["probe", "--model", "dlrm", "--out", "p", "--min-speedup", "-0.5"],
     "argument --min-speedup: expected a speed-up >= 0, got '-0.5'"),
])
def test_a_bad_number_is_one_line_at_parse_time(argv: list[str], quoted: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    study = tmp_path / "s.toml"
    study.write_text("this file is never read: the command line is refused first")
    err = _usage_error([a.replace("{study}", str(study)) for a in argv], capsys)
    assert err.startswith(f"loka-tune {argv[0]}: error: {quoted}")
    assert f"loka-tune {argv[0]} --help" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # no work done: no runs/, no probe folder


def test_a_missing_output_folder_says_how_to_make_it_and_creates_nothing(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "dir"
    cases = [
        (["export", str(tmp_path / "s.toml"), "--out", str(missing / "b.json")], "--out"),
        (["train", "--model", "dlrm", "--data", DATA, "--steps", "2", "--no-progress", "--json",
          str(missing / "m.json")], "--json"),
        (["probe", "--model", "dlrm", "--data", DATA, "--steps", "2", "--every", "1", "--no-progress",
          "--out", str(missing / "probe")], "--out"),
    ]
    for argv, option in cases:
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and "Traceback" not in out.err  # nothing trained, measured or exported
        assert out.err.strip() == (
            f"loka-tune {argv[0]}: error: {option}: cannot write {argv[-1]!r}: its folder"
            f" {str(Path(argv[-1]).parent)!r} does not exist; create it first (mkdir -p {Path(argv[-1]).parent})"
            " or choose another path")
        assert not (tmp_path / "no").exists()


def _unwritable(tmp_path: Path) -> Path:
    """A folder no file can be created in, even by root: /proc on Linux; else a read-only folder."""
    if Path("/proc/self").is_dir():
        return Path("/proc")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    return ro


def test_train_json_in_an_unwritable_folder_is_refused_before_training(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    target = _unwritable(tmp_path) / "loka-m.json"
    code = main(["train", "--model", "dlrm", "--data", DATA, "--steps", "2", "--no-progress", "--json", str(target)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""  # refused before training: no metrics table
    assert out.err.startswith(f"loka-tune train: error: --json: cannot write {str(target)!r}: cannot create a file"
                              f" in {str(target.parent)!r}")
    assert len(out.err.strip().splitlines()) == 1 and not target.exists()


def test_file_errors_have_no_stray_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", str(tmp_path / "missing.toml")]) == 2
    assert capsys.readouterr().err.strip() == (f"loka-tune tune: error: no such study file"
                                               f" {str(tmp_path / 'missing.toml')!r}; see studies/quickstart.toml"
                                               " for an example")
    bad = tmp_path / "bad.toml"
    bad.write_text("[study\n")
    assert main(["tune", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"loka-tune tune: error: {bad}: not valid TOML: ")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{oops")
    assert main(["train", "--config", str(bad_json), "--steps", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(f"loka-tune train: error: {bad_json}: not valid JSON (line 1")
