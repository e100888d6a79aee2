"""The GPU runners are named by what they measure: one ``benchmarks/device.sh OUT PART``.

No file under ``benchmarks/`` (its receipts in ``results/`` aside) is named after an issue; every
part in device.sh's usage line is handled by one of its ``case`` branches (and nothing else is);
every ``device.sh ... PART`` that README.md or BENCHMARKS.md names is a known part; and a dry run
of each part, with ``python3`` replaced by a recorder, calls only scripts, CLI commands and test
files that exist, with flags they define (``add_argument``, read with ``ast``; the CLI: its parser).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "benchmarks" / "device.sh"
BASH = shutil.which("bash")


def _text() -> str:
    return DEVICE.read_text()


def _usage_parts() -> list[str]:
    m = re.search(r'^usage="usage: device\.sh OUT ([a-z0-9|-]+)"$', _text(), re.M)
    assert m, "device.sh has no usage=\"usage: device.sh OUT a|b|...\" line"
    return m.group(1).split("|")


def _handled_parts() -> set[str]:
    """The parts device.sh dispatches on: ``[ "$part" = X ]`` tests and ``case "$part"`` labels."""
    text = _text()
    handled = set(re.findall(r'\[ "\$part" = ([a-z0-9-]+) \]', text))
    for block in re.findall(r'^case "\$part" in\n(.*?)^esac', text, re.M | re.S):
        for labels in re.findall(r"^  ([a-z0-9|-]+)\)", block, re.M):
            handled.update(labels.split("|"))
    return handled


def test_no_benchmark_file_is_named_after_an_issue() -> None:
    bad = [
        str(p.relative_to(REPO))
        for p in (REPO / "benchmarks").rglob("*")
        if "results" not in p.relative_to(REPO / "benchmarks").parts
        and re.search(r"issue_?\d", p.name, re.I)
    ]
    assert not bad, f"benchmark files named after an issue: {bad}; name them by what they measure"


def test_device_sh_parses() -> None:
    if BASH is None:
        pytest.skip("no bash")
    r = subprocess.run([BASH, "-n", str(DEVICE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_usage_part_is_handled_and_nothing_else() -> None:
    parts = _usage_parts()
    assert len(parts) == len(set(parts)), parts
    handled = _handled_parts()
    assert set(parts) - handled == set(), f"in the usage line, not handled: {set(parts) - handled}"
    assert handled - set(parts) == set(), f"handled, not in the usage line: {handled - set(parts)}"
    # the header comment shows each part's command
    for part in parts:
        assert f'bash benchmarks/device.sh "$OUT" {part} ' in _text(), f"header comment lacks part {part}"


def test_docs_name_only_known_parts() -> None:
    parts = set(_usage_parts())
    seen = []
    for doc in ("README.md", "BENCHMARKS.md", "benchmarks/results/BENCHMARKS_gpu_section.md"):
        text = (REPO / doc).read_text()
        for m in re.finditer(r"benchmarks/device\.sh\s+\S+\s+([A-Za-z0-9_-]+)", text):
            if m.group(1) == "PART":  # the placeholder of the runner's own description
                continue
            seen.append(m.group(1))
            assert m.group(1) in parts, f"{doc} names device.sh part {m.group(1)!r}; the parts: {sorted(parts)}"
        # and no runner that is gone
        for m in re.finditer(r"benchmarks/([\w.-]+\.sh)\b", text):
            assert (REPO / "benchmarks" / m.group(1)).is_file(), f"{doc} names benchmarks/{m.group(1)}, which is gone"
    assert seen, "BENCHMARKS.md names no device.sh part"


_RECORDER = """#!/usr/bin/env bash
# records one python3 call (argv as a JSON list), answers the helpers device.sh asks.
# One os.write of the whole line on an O_APPEND descriptor: the two ends of a pipeline record at the
# same time, and print() under PYTHONUNBUFFERED writes the list and its newline apart (CI interleaved them)
"$REAL_PY" -c 'import json, os, sys
fd = os.open(os.environ["RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, (json.dumps(sys.argv[1:]) + "\\n").encode())
os.close(fd)' "$@"
case "$1" in
  -) exec "$REAL_PY" "$@" ;;
  -c) case "$2" in *batch_size*) echo 8192 ;; *output_dir*) echo "$FAKE_RUNS" ;; esac ;;
esac
exit 0
"""


def _dry_run(tmp_path: Path, part: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """device.sh OUT PART with ``python3`` a recorder: the python3 calls it made."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text(_RECORDER)
    (fake / "python3").chmod(0o755)
    record = tmp_path / f"{part}.jsonl"
    record.write_text("")
    run_env = {
        "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "REAL_PY": sys.executable,
        "RECORD": str(record),
        "FAKE_RUNS": str(tmp_path / "runs"),
        "LOKA_TUNE_CACHE_DIR": str(tmp_path / "cache"),
        **(env or {}),
    }
    assert BASH is not None
    r = subprocess.run([BASH, str(DEVICE), str(tmp_path / "out" / part), part], cwd=REPO, env=run_env,
                       capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    assert calls, f"{part}: no python3 call (exit {r.returncode}): {r.stderr[-2000:]}"
    return calls


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


_HELP: dict[tuple[str, ...], str] = {}


def _help(cmd: tuple[str, ...]) -> str:
    """The flags ``cmd`` accepts, as text: a benchmark script's ``add_argument("--...")`` strings
    read with ``ast`` (no torch import: each script's ``--help`` cost seconds), the CLI's from
    its parser (``loka_tune.cli.build_parser``, in-process: light)."""
    if cmd not in _HELP:
        if cmd[:2] == ("-m", "loka_tune"):
            import argparse

            from loka_tune.cli import build_parser

            parser = build_parser()
            subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            _HELP[cmd] = subs.choices[cmd[2]].format_help()
        else:
            tree = ast.parse((REPO / cmd[0]).read_text())
            flags = [arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                     for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            assert flags, f"{cmd[0]}: no add_argument flag found (not an argparse script?)"
            _HELP[cmd] = " ".join(flags)
    return _HELP[cmd]


def _check_call(argv: list[str]) -> str | None:
    """What the call runs (a script, ``loka_tune SUB``, pytest), after checking its flags exist."""
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    if argv[0] in ("-", "-c") or argv[:2] == ["-m", "pip"]:
        return None
    if argv[:2] == ["-m", "pytest"]:
        files = [a for a in argv[2:] if a.startswith("tests/")]
        assert files, argv
        for f in files:
            assert (REPO / f.split("::")[0]).is_file(), f"pytest of a missing file {f}"
        return "pytest"
    if argv[:2] == ["-m", "loka_tune"]:
        cmd: tuple[str, ...] = ("-m", "loka_tune", argv[2])
        rest = argv[3:]
    elif argv[0].startswith("benchmarks/") or argv[0].startswith("tests/"):
        assert (REPO / argv[0]).is_file(), f"runs a missing script {argv[0]}"
        if argv[0].startswith("tests/"):
            return argv[0]
        cmd = (argv[0], argv[1]) if argv[0].endswith("gemm_suite.py") else (argv[0],)
        rest = argv[len(cmd):]
    else:
        raise AssertionError(f"unexpected python3 call {argv}")
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(cmd)))
    missing = _flags(rest) - known
    assert not missing, f"{' '.join(cmd)}: flags not in its --help: {sorted(missing)} (call {argv})"
    return " ".join(cmd)


# study-e2e needs a study's folder carried back in .carry/w: its script is study's, checked there
DRY_PARTS = [p for p in _usage_parts() if p != "study-e2e"]


@pytest.mark.skipif(BASH is None, reason="no bash")
@pytest.mark.parametrize("part", DRY_PARTS)
def test_each_part_calls_existing_scripts_with_known_flags(tmp_path: Path, part: str) -> None:
    calls = _dry_run(tmp_path, part)
    ran = {c for c in (_check_call(a) for a in calls) if c}
    assert ran, f"{part} ran no benchmark, test or CLI command: {calls}"


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_e2e_picks_the_modeled_plan_of_the_study_and_batch(tmp_path: Path) -> None:
    def config(**env: str) -> str:
        (e2e,) = [c for c in _dry_run(tmp_path, "e2e", env) if c[0] == "benchmarks/e2e.py"]
        return e2e[e2e.index("--config") + 1]

    assert config() == "benchmarks/results/wukong_large_modeled_plan.json"
    assert config(BATCH="32768") == "benchmarks/results/wukong_large_modeled_plan_b32768.json"
    assert config(STUDY="studies/interformer_h200.toml") == "benchmarks/results/interformer_large_modeled_plan.json"
    assert config(CONFIG="x.json") == "x.json"


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_unknown_part_is_refused_before_any_work(tmp_path: Path) -> None:
    r = subprocess.run([BASH, str(DEVICE), str(tmp_path / "out"), "issue11"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown part issue11" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "out").exists()
