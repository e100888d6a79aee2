"""Opening a study's Optuna storage: the URL checked before any work, the driver that the extras
install, and every way it can fail as one line naming the URL (password hidden) and the fix.

URLs: ``sqlite:///PATH`` (one machine) or ``postgresql://USER:PW@HOST:PORT/DB`` (several).
A bare ``postgresql://`` is opened with psycopg 3 (``pip install "loka-tune[postgres]"``, also
pulled by ``[dev]``), or psycopg2 where only that is installed: SQLAlchemy's own default for
the bare scheme is psycopg 3 from 2.1 on and psycopg2 before. An explicit driver
(``postgresql+psycopg2://``) is used as given. A SQLite file's folder must exist, except the
study's own output folder (``runs/<name>/``), which is created.

SQLAlchemy and the drivers are imported inside the functions.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loka_tune.errors import ConfigError, StudyError

__all__ = ["shown_url", "check_url_form", "check_storage_url", "engine_url", "open_rdb", "storage_error", "CONNECT_TIMEOUT_S"]

CONNECT_TIMEOUT_S = 10  # a server that does not answer fails in seconds, not after the OS's TCP timeout
_POSTGRES_DRIVERS = ("psycopg", "psycopg2")  # bare postgresql://: the first one installed
_INSTALL_POSTGRES = "pip install \"loka-tune[postgres]\" (psycopg 3)"
_FORMS = "sqlite:///PATH (one machine) or postgresql://USER:PW@HOST:PORT/DB (several machines)"


def shown_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs)."""
    return re.sub(r"^([\w+.-]+://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _password(url: str) -> str | None:
    m = re.match(r"^[\w+.-]+://[^:/@]*:([^@/]*)@", url)
    return m.group(1) if m and m.group(1) else None


def check_url_form(url: str, key: str) -> None:
    """A :class:`ConfigError` (``key``: the option or study-file key) unless ``url`` is a SQLite
    file or a PostgreSQL / MySQL server URL."""
    if url.startswith("sqlite:///"):
        if url == "sqlite:///" or url.startswith("sqlite:///:memory:"):
            raise ConfigError(f"got {url!r}; an in-memory database cannot be shared or resumed; give a file"
                              " such as sqlite:///runs/study/optuna.db", key=key)
        return
    if re.match(r"^(postgresql|mysql)(\+\w+)?://", url):
        return
    hint = ""
    if re.match(r"^(postgres|pg|psql|postgresql\w*)(\+\w+)?:", url):
        hint = " (did you mean postgresql://...?)"
    elif re.match(r"^sqlite\w*:", url):
        hint = " (a SQLite file is sqlite:/// then its path: sqlite:////abs/x.db, sqlite:///rel/x.db)"
    raise ConfigError(f"got {shown_url(url)!r}: not a storage URL{hint}; use {_FORMS}", key=key)


def check_storage_url(url: str, *, option: str, own_dir: Path | None = None) -> None:
    """Refuse, before any work, a URL that is not one of the two forms or a SQLite file whose
    folder does not exist (``own_dir``, the study's output folder, is created instead)."""
    check_url_form(url, option)
    if not url.startswith("sqlite:///"):
        return
    folder = Path(url[len("sqlite:///"):]).expanduser().parent
    if own_dir is not None and folder.resolve() == Path(own_dir).resolve():
        folder.mkdir(parents=True, exist_ok=True)
        return
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"got {shown_url(url)!r}: the folder {str(folder)!r} {what}; create it first"
                          f" (mkdir -p {folder}) or give a file in an existing folder", key=option)


def engine_url(url: str) -> str:
    """The URL SQLAlchemy opens: a bare ``postgresql://`` gets the installed driver (see the module
    docstring); anything else is unchanged."""
    if not url.startswith("postgresql://"):
        return url
    import sqlalchemy

    if int(sqlalchemy.__version__.split(".")[0]) < 2:  # no psycopg 3 dialect: SQLAlchemy's default
        return url
    for driver in _POSTGRES_DRIVERS:
        if importlib.util.find_spec(driver) is not None:
            return "postgresql+" + driver + url[len("postgresql"):]
    return url  # none installed: SQLAlchemy's import fails, storage_error says what to install


def engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options per database: SQLite waits on a locked file; a server
    connection is checked before use and gives up after :data:`CONNECT_TIMEOUT_S`."""
    if url.startswith("sqlite:"):
        return {"connect_args": {"timeout": 60}}
    kw: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("postgresql"):
        kw["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    return kw


def storage_error(url: str, e: BaseException) -> StudyError | None:
    """The one-line :class:`StudyError` for an exception raised while opening ``url``; None for
    one that is not about the storage (a bug, or an interrupt: raise it as it is)."""
    try:
        import sqlalchemy.exc as sa_exc
    except ImportError:  # pragma: no cover - optuna depends on SQLAlchemy
        return None
    shown = shown_url(url)
    scheme = url.split("://", 1)[0] if "://" in url else url
    head = f"cannot open the study storage {shown!r}: "
    cause = e.__cause__ if isinstance(e.__cause__, ImportError) else e
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        driver = cause.name.split(".")[0]
        if driver == "psycopg2":  # named in the URL
            fix = f"pip install psycopg2-binary, or drop '+psycopg2' from the URL for psycopg 3 ({_INSTALL_POSTGRES})"
        elif driver == "psycopg" or scheme.startswith("postgresql"):
            fix = _INSTALL_POSTGRES
        else:
            fix = f"install the Python package that provides {driver!r}, or use {_FORMS}"
        return StudyError(head + f"its database driver {driver!r} is not installed; {fix}")
    if isinstance(e, sa_exc.NoSuchModuleError):
        return StudyError(head + f"SQLAlchemy knows no database or driver {scheme!r}; use {_FORMS}"
                          f" (postgresql:// needs {_INSTALL_POSTGRES})")
    if isinstance(e, (sa_exc.ArgumentError, ValueError)) and not isinstance(e, sa_exc.DBAPIError):
        return StudyError(head + f"not a database URL ({_one_line(e, url)}); use {_FORMS}")
    if isinstance(e, sa_exc.DBAPIError):  # the driver's own error: refused, unknown host, bad password, ...
        why = _one_line(getattr(e, "orig", None) or e, url)
        if url.startswith("sqlite:"):
            fix = "check that the file's folder can be written and the file is a SQLite database"
        else:
            fix = ("check that the server runs and accepts connections there (host, port, user, password,"
                   " database; the database must exist), or use sqlite:///PATH on one machine")
        return StudyError(head + f"{why}; {fix}")
    return None


def _one_line(e: BaseException, url: str) -> str:
    """The exception's message on one line, without SQLAlchemy's "(Background on this error ...)"
    link and without the URL's password."""
    text = str(e).split("(Background on this error")[0]
    text = re.sub(r"\[SQL:.*", "", text, flags=re.S)
    text = re.sub(r"\s+", " ", text).strip().rstrip(".")
    text = re.sub(r"^\([\w.]+\) ", "", text)  # "(psycopg2.OperationalError) ..."
    pw = _password(url)
    if pw:
        text = text.replace(pw, "***")
    return text[:300] or type(e).__name__


def open_rdb(url: str, make: Callable[[str, dict[str, Any]], Any]) -> Any:
    """``make(engine_url, engine_kwargs)`` (an Optuna ``RDBStorage``), its failures to open
    ``url`` turned into one-line :class:`StudyError` s."""
    real = engine_url(url)
    try:
        return make(real, engine_kwargs(real))
    except Exception as e:
        err = storage_error(url, e)
        if err is None:
            raise
        raise err from None
