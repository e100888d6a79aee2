"""One logger hierarchy, ``loka_tune``: the library never prints (issue 24). Its progress lines
are INFO records of ``loka_tune.tuner``; the CLI installs the handler that prints them, ``-q``
keeps warnings only, ``-v`` adds debug; a library user sees them only when asking."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from loka_tune.tuner.log import LOGGER, log, to_stderr

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _root_unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The root logger as in a fresh program (no handler, WARNING): what another test or an
    imported package configured there (a ``basicConfig``) is not the library printing."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if type(h).__name__ == "LogCaptureHandler"])
    monkeypatch.setattr(root, "level", logging.WARNING)
    # and loka_tune's own as before any CLI call (a module-scoped fixture's in-process loka-tune
    # run installs the CLI's handler outside the per-test restore of conftest.py)
    monkeypatch.setattr(LOGGER, "handlers", [])
    monkeypatch.setattr(LOGGER, "level", logging.NOTSET)


def test_the_library_prints_nothing_through_print() -> None:
    """No ``print(...)`` call in the library (the CLI layer, ``cli.py`` and ``commands/``, is the
    program: its output is what it prints); docstrings' examples are text, not calls."""
    found = []
    for path in sorted((REPO / "loka_tune").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "loka_tune/cli.py" or rel.startswith("loka_tune/commands/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"print in the library (use loka_tune.tuner.log.log or logging): {found}"


def test_a_library_call_is_silent_until_asked(capsys: pytest.CaptureFixture[str]) -> None:
    log("[loka-tune] unseen")
    assert capsys.readouterr().err == ""
    h = to_stderr()
    log("[loka-tune] seen")
    assert capsys.readouterr().err == "[loka-tune] seen\n"
    assert to_stderr(logging.WARNING) is not h and sum(type(x) is type(h) for x in LOGGER.handlers) == 1
    log("[loka-tune] quiet now")
    assert capsys.readouterr().err == ""


def test_a_library_user_s_own_logging_gets_the_records(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loka_tune"):
        log("[loka-tune] to the user's handler")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("loka_tune.tuner", logging.INFO, "[loka-tune] to the user's handler")]


@pytest.mark.parametrize("flag, shown", [(None, True), ("-q", False), ("-v", True)])
def test_the_cli_prints_the_progress_lines_and_q_silences_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               flag: str | None, shown: bool) -> None:
    """``loka-tune export`` of a study that has no trial: its error line always, and the CLI's
    handler at the level ``-q`` / ``-v`` ask for (the records below it are dropped)."""
    from loka_tune.cli import main

    (tmp_path / "s.toml").write_text('[study]\nname = "s"\n[model]\nname = "dlrm"\n[data]\nsource = "synthetic"\n')
    argv = ["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b.json")] + ([flag] if flag else [])
    assert main(argv) == 2
    assert "loka-tune export: error:" in capsys.readouterr().err
    level = {None: logging.INFO, "-q": logging.WARNING, "-v": logging.DEBUG}[flag]
    assert LOGGER.level == level
    log("[loka-tune] a progress line")
    assert ("[loka-tune] a progress line" in capsys.readouterr().err) is shown
