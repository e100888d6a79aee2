from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the repo; skips the test where it is absent (a fresh clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data samples not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch intra-op thread per test, restored after. Tiny CPU matmuls and models gain
    nothing from threads, and on a loaded 2-core machine OpenMP barriers stall badly and make
    wall times flaky; per test, so a test that changes the thread count cannot leak it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_TORCH_CONFIGS = ("torch._dynamo.config", "torch._inductor.config")


_GONE = object()


def _config_snapshot(keys: dict[str, dict[str, object]] | None = None) -> dict[str, dict[str, object]]:
    """Each loaded config's settings read as a user reads them (``getattr``: a deleted setting
    is hidden, not removed from the config's own listing); ``keys``: the settings to read."""
    import sys
    import warnings

    out = {}
    for name in _TORCH_CONFIGS:
        if name in sys.modules:
            mod = sys.modules[name]
            names = keys[name] if keys is not None and name in keys else mod.get_config_copy()
            with warnings.catch_warnings():  # reading a deprecated setting warns (once per process)
                warnings.simplefilter("ignore")
                out[name] = {k: getattr(mod, k, _GONE) for k in names}
    return out


@pytest.fixture(autouse=True)
def _loka_logging_as_it_was() -> Iterator[None]:
    """The ``loka_tune`` logger's handlers and level as they were before the test: an in-process
    ``loka-tune`` call (``cli.main``) installs its stderr handler, which must not make a later
    test's library calls print (the library alone is silent)."""
    import logging

    logger = logging.getLogger("loka_tune")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _torch_config_intact() -> Iterator[None]:
    """Fails the test that leaves torch's dynamo/inductor config changed: a setting deleted,
    or a value not restored. ``monkeypatch.setattr`` on these modules does that under
    pytest >= 9.2 (their settings are not in the module's ``__dict__``, so undoing deletes
    them, and every later ``torch.compile`` fails); use the config's own ``patch(...)``."""
    before = _config_snapshot()
    yield
    after = _config_snapshot(before)
    for name, was in before.items():
        now = after[name]
        changed = sorted(k for k in was if now[k] is not was[k] and now[k] != was[k])
        if changed:
            pytest.fail(f"{name} changed by this test: {changed[:8]}; patch it with "
                        f"`with {name}.patch(key=value):`, not monkeypatch.setattr", pytrace=False)


# ------------------------------------------------------------------------------ PostgreSQL

POSTGRES_ENV = "LOKA_TEST_POSTGRES_URL"  # a server's URL (.ci/run starts one on loopback): its tests must run


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).is_file():
            return str(d / name)
    return None


def free_port() -> int:
    """A loopback TCP port nothing listens on (right now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _own_server() -> Iterator[str]:
    """A throw-away PostgreSQL server in a temporary folder on a free loopback port, as the
    ``postgres`` account when running as root (initdb refuses root); skips where none can start."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    base = Path(tempfile.mkdtemp(prefix="loka-pg-"))  # not under tmp_path: its parents are private to root
    data = base / "pgdata"
    run_as: list[str] = []
    try:
        if os.geteuid() == 0:
            if not shutil.which("runuser"):
                pytest.skip("running as root without runuser: cannot start PostgreSQL")
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no 'postgres' user")
            data.mkdir()
            os.chown(data, pw.pw_uid, pw.pw_gid)
            os.chmod(base, 0o755)
            run_as = ["runuser", "-u", "postgres", "--"]
        port = free_port()
        r = subprocess.run([*run_as, initdb, "-D", str(data), "-A", "trust", "-U", "postgres"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"initdb failed: {r.stderr[-500:]}")
        r = subprocess.run([*run_as, pg_ctl, "-D", str(data), "-l", str(data / "server.log"), "-w", "-t", "60", "-o",
                            f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"PostgreSQL did not start: {r.stdout[-300:]} {r.stderr[-300:]}")
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*run_as, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _database_on(server: str, *, required: bool) -> Iterator[str]:
    """A new, empty database on the server at ``server`` (a ``postgresql://`` URL), dropped after."""
    try:
        import psycopg
    except ImportError:
        msg = "psycopg (3) is not installed: pip install -e \".[dev]\" (or \"loka-tune[postgres]\")"
        if required:
            pytest.fail(f"{POSTGRES_ENV} is set but {msg}")
        pytest.skip(msg)
    name = f"loka_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(server, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")
    except psycopg.Error as e:
        if required:
            pytest.fail(f"{POSTGRES_ENV}={server!r}: cannot create a database there: {e}")
        pytest.skip(f"cannot create a database on {server!r}: {e}")
    parts = urlsplit(server)
    try:
        yield urlunsplit(("postgresql", parts.netloc, f"/{name}", "", ""))
    finally:
        with contextlib.suppress(psycopg.Error), psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture()
def postgres_url() -> Iterator[str]:
    """The URL of a fresh database on a PostgreSQL server, in the documented form
    ``postgresql://USER@HOST:PORT/DB`` (no driver named: loka-tune opens it with psycopg 3).

    Where ``LOKA_TEST_POSTGRES_URL`` is set (``.ci/run`` starts a server on loopback and sets
    it), the database is made on that server and a server that cannot be used FAILS the test:
    CI must run it. Elsewhere a throw-away server is started here, and the test skips where
    none can start (no PostgreSQL binaries)."""
    server = os.environ.get(POSTGRES_ENV)
    if server:
        with _database_on(server, required=True) as url:
            yield url
        return
    with _own_server() as own, _database_on(own, required=False) as url:
        yield url
