"""Study storages as documented: the URL checked before any work, the driver the extras install,
and every bad or unreachable storage one line (exit status 2) naming the URL without its
password and the fix, through the real CLI. The working ``postgresql://`` URL on a real server:
``tests/test_tune_workers.py::test_two_workers_on_the_documented_postgresql_url``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loka_tune.errors import ConfigError, StudyError
from loka_tune.tuner.storage import check_storage_url, check_url_form, engine_url, shown_url, storage_error
from tests.conftest import free_port
from tests.test_tune import write_study

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-pw"


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process (a storage that hangs fails the test at the timeout)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "loka_tune", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=180)


def _assert_one_line_error(r: subprocess.CompletedProcess, *must: str) -> str:
    """Exit status 2, nothing on stdout, one line on stderr that names the command and holds
    ``must``; no traceback, no password."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("loka-tune ") and ": error: " in line, line
    assert "Traceback" not in r.stderr and SECRET not in r.stderr + r.stdout
    for m in must:
        assert m in line, (m, line)
    return line


# ------------------------------------------------------------------------------ the URL itself

@pytest.mark.parametrize("url, shown", [
    (f"postgresql://user:{SECRET}@db-host:5432/loka", "postgresql://user:***@db-host:5432/loka"),
    (f"postgresql+psycopg2://u:{SECRET}@127.0.0.1/db", "postgresql+psycopg2://u:***@127.0.0.1/db"),
    ("postgresql://user@db-host/loka", "postgresql://user@db-host/loka"),  # no password: unchanged
    ("sqlite:///runs/x/optuna.db", "sqlite:///runs/x/optuna.db"),
    (f"postgres://u:{SECRET}@h/db", "postgres://u:***@h/db"),  # a misspelt scheme hides it too
])
def test_shown_url_hides_the_password(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.parametrize("url, hint", [
    ("notaurl", "not a storage URL"),
    (f"postgres://u:{SECRET}@h/db", "did you mean postgresql://"),
    ("sqlite://x.db", "sqlite:////abs/x.db"),
    ("redis://localhost", "not a storage URL"),
    ("sqlite:///:memory:", "in-memory"),
])
def test_a_malformed_url_is_refused_naming_both_forms(url: str, hint: str) -> None:
    with pytest.raises(ConfigError, match="--storage") as e:
        check_url_form(url, "--storage")
    assert hint in str(e.value) and SECRET not in str(e.value)
    if "memory" not in url:
        assert "sqlite:///PATH" in str(e.value) and "postgresql://USER:PW@HOST:PORT/DB" in str(e.value)


def test_a_sqlite_file_in_a_missing_folder_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigError, match=r"does not exist; create it first \(mkdir -p .*no/such\)"):
        check_storage_url(f"sqlite:///{missing / 'x.db'}", option="--storage")
    assert not (tmp_path / "no").exists()
    # the study's own output folder (runs/<name>/) is created, parents and all
    own = tmp_path / "runs" / "study"
    check_storage_url(f"sqlite:///{own / 'optuna.db'}", option="storage.url", own_dir=own)
    assert own.is_dir()


def test_a_bare_postgresql_url_gets_the_installed_driver() -> None:
    url = "postgresql://u@h:5432/db"
    if importlib.util.find_spec("psycopg") is not None:
        assert engine_url(url) == "postgresql+psycopg://u@h:5432/db"
    elif importlib.util.find_spec("psycopg2") is not None:
        assert engine_url(url) == "postgresql+psycopg2://u@h:5432/db"
    else:
        assert engine_url(url) == url
    assert engine_url("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"  # a named driver stays
    assert engine_url("sqlite:///x.db") == "sqlite:///x.db"


def test_a_missing_driver_names_the_extra_to_install() -> None:
    try:
        raise ImportError("Failed to import DB access module") from ModuleNotFoundError("No module", name="psycopg")
    except ImportError as e:
        err = storage_error(f"postgresql://u:{SECRET}@h/db", e)
    assert isinstance(err, StudyError)
    assert "'psycopg' is not installed" in str(err) and 'pip install "loka-tune[postgres]"' in str(err)
    assert "u:***@h" in str(err) and SECRET not in str(err)


def test_an_error_that_is_not_the_storage_s_is_not_reworded() -> None:
    assert storage_error("sqlite:///x.db", KeyError("trial")) is None


# ------------------------------------------------------------------------------ through the CLI

@pytest.fixture()
def study(tmp_path: Path) -> Path:
    return write_study(tmp_path, n_trials=2)


def test_cli_a_malformed_storage_url_is_one_line_before_any_work(study: Path, tmp_path: Path) -> None:
    r = _cli("tune", str(study), "--no-tracking", "--storage", "notaurl")
    _assert_one_line_error(r, "loka-tune tune: error: --storage: got 'notaurl'", "sqlite:///PATH")
    assert not (tmp_path / "runs").exists()  # refused before the study's folder was made


def test_cli_an_unknown_dialect_or_driver_is_one_line(study: Path) -> None:
    r = _cli("tune", str(study), "--no-tracking", "--storage", f"postgresql+nodriver://u:{SECRET}@127.0.0.1/db")
    _assert_one_line_error(r, "postgresql+nodriver://u:***@127.0.0.1/db", "knows no database or driver",
                           "postgresql://USER:PW@HOST:PORT/DB")


def test_cli_a_sqlite_file_in_a_missing_folder_is_refused(study: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    r = _cli("tune", str(study), "--no-tracking", "--storage", f"sqlite:///{missing / 'x.db'}")
    _assert_one_line_error(r, "does not exist", f"mkdir -p {missing}")
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.skipif(importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is None,
                    reason="no PostgreSQL driver installed (pip install -e \".[dev]\")")
@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg2"])
def test_cli_an_unreachable_postgresql_server_is_one_line(study: Path, tmp_path: Path, scheme: str) -> None:
    if scheme.endswith("psycopg2") and importlib.util.find_spec("psycopg2") is None:
        r = _cli("tune", str(study), "--no-tracking", "--storage", f"{scheme}://u:{SECRET}@127.0.0.1:1/db")
        _assert_one_line_error(r, "'psycopg2' is not installed", "pip install psycopg2-binary, or drop '+psycopg2'")
        return
    port = free_port()  # nothing listens there: connection refused
    url = f"{scheme}://u:{SECRET}@127.0.0.1:{port}/db"
    r = _cli("tune", str(study), "--no-tracking", "--storage", url)
    _assert_one_line_error(r, f"cannot open the study storage '{scheme}://u:***@127.0.0.1:{port}/db'",
                           "check that the server runs and accepts connections")
    assert not (tmp_path / "runs" / "t" / "optuna.db").exists()
    # the commands that read a study say the same
    r = _cli("export", "t", "--storage", url, "--out", str(tmp_path / "b.json"))
    _assert_one_line_error(r, "loka-tune export: error: cannot open the study storage")
    r = _cli("report", "t", "--storage", url, "--no-plots")
    _assert_one_line_error(r, "loka-tune report: error: cannot open the study storage")


@pytest.mark.skipif(importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is None,
                    reason="no PostgreSQL driver installed (pip install -e \".[dev]\")")
def test_cli_a_server_that_does_not_answer_fails_within_the_connect_timeout(study: Path) -> None:
    """A port that accepts the connection but never answers (a hung server, a proxy): without a
    connect timeout the command would wait for ever; with it, one line after CONNECT_TIMEOUT_S."""
    import socket

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(1)  # the kernel completes the handshake; nothing ever reads or answers
        port = mute.getsockname()[1]
        r = _cli("tune", str(study), "--no-tracking", "--storage", f"postgresql://u:{SECRET}@127.0.0.1:{port}/db")
    _assert_one_line_error(r, f"'postgresql://u:***@127.0.0.1:{port}/db'", "timeout")
