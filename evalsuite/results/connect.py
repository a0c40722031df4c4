"""Opening a results database: where it lives (URL resolution), SQLite's settings, a damaged-file check, and
telling a full disk from other write errors.

SQLite runs in WAL mode, takes the write lock when a transaction begins (BEGIN IMMEDIATE) and waits up to 30 s
for it. A SQLite file is checked with `PRAGMA quick_check` when it is opened, so a damaged page is reported
before anything is written, not half-way through a run.
"""
from __future__ import annotations

import errno
import os
import re

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

DEFAULT_PATH = os.path.join("results", "results.db")
BUSY_TIMEOUT_MS = 30_000
_FULL = ("database or disk is full", "no space left on device", "disk full", "could not extend file")
_PG_DISK_FULL = "53100"  # PostgreSQL's SQLSTATE disk_full


def shown(url) -> str:
    return url.render_as_string(hide_password=True)


def resolve_url(url: str | None):
    """None -> $EVALSUITE_DB -> sqlite:///results/results.db; a bare path means a SQLite file."""
    url = url or os.environ.get("EVALSUITE_DB")
    default = not url
    if default:
        os.makedirs(os.path.dirname(DEFAULT_PATH), exist_ok=True)
        url = f"sqlite:///{DEFAULT_PATH}"
    elif "://" not in url and not re.match(r"[A-Za-z][\w+.-]*:", url):
        url = f"sqlite:///{url}"
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise ValueError(f"results database URL {url!r} is not a URL; use e.g. sqlite:///results/results.db "
                         "or postgresql+psycopg://user:password@host/dbname") from None
    if parsed.drivername in ("postgresql", "postgres"):  # psycopg (3) is the driver evalsuite installs
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = os.path.dirname(os.path.abspath(parsed.database))
        if not os.path.isdir(folder):
            raise ValueError(f"results database folder {folder} does not exist; create it or choose another --db")
    return parsed


def sqlite_setup(sql_engine) -> None:
    @event.listens_for(sql_engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # SQLAlchemy's begin event below issues BEGIN itself
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sql_engine, "begin")
    def _begin(conn):
        # take the write lock up front: a read lock upgraded later can fail at once instead of waiting
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def check_sqlite_file(conn, url: str) -> None:
    """Refuse a SQLite file with damaged pages or indexes (read-only: the file is left as it is)."""
    problems = [row[0] for row in conn.exec_driver_sql("PRAGMA quick_check").all()]
    if problems != ["ok"]:
        first = str(problems[0]).strip().splitlines()[0] if problems else "no answer"
        raise ValueError(f"results database {url} is damaged (quick_check: {first}; {len(problems)} problem(s)): "
                         f"restore it from a backup, or rescue what is readable with `sqlite3 FILE .recover`, "
                         "or point --db / EVALSUITE_DB at another one")


def locked(exc: Exception) -> bool:
    message = str(exc).lower()
    return "locked" in message or "busy" in message or "could not serialize" in message or "deadlock" in message


def disk_full(exc: BaseException) -> bool:
    """Whether a failed write failed because the disk (or the database's size limit) is full."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, OSError) and orig.errno == errno.ENOSPC:
        return True
    if getattr(orig, "sqlstate", None) == _PG_DISK_FULL or getattr(orig, "pgcode", None) == _PG_DISK_FULL:
        return True
    return any(words in str(orig).lower() for words in _FULL)
