"""ResultsDB: open (and create or upgrade) the results database; write runs task by task; read tables as DataFrames.

Every task is written in one transaction, so a run killed half-way keeps each task it finished. A run's
row records the writing process (pid, host, kernel start time) and a heartbeat refreshed with every task;
opening or listing the database marks 'running' runs 'incomplete' when their writer on this host is gone,
or, for writers on other hosts, when the heartbeat is older than `stale_after_s` (default 24 h).
SQLite runs in WAL mode, takes the write lock when a transaction begins (BEGIN IMMEDIATE) and waits up to
30 s for it; a write that still meets a locked database is retried, so concurrent writers lose nothing.
"""
from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timedelta, timezone

import pandas as pd
from sqlalchemy import create_engine, delete, event, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from . import provenance
from .lm_eval_rows import engine_rows, run_config, sample_rows, task_count, task_metric_rows
from .schema import RUN_STATUSES, EngineMetric, Run, Sample, TaskMetric, migrate

DEFAULT_PATH = os.path.join("results", "results.db")
_WRITER_COLUMNS = ("writer_pid", "writer_host", "writer_start", "heartbeat_at")
RUN_COLUMNS = [c.name for c in Run.__table__.columns if c.name not in ("id", "config", *_WRITER_COLUMNS)]
_ROW_COLUMNS = {table: {c.name for c in table.__table__.columns} - {"id", "run_id", "task"}
                for table in (TaskMetric, EngineMetric, Sample)}
_BUSY_TIMEOUT_MS = 30_000


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _shown(url) -> str:
    return url.render_as_string(hide_password=True)


def _resolve_url(url: str | None):
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


def _sqlite_setup(engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # SQLAlchemy's begin event below issues BEGIN itself
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        # take the write lock up front: a read lock upgraded later can fail at once instead of waiting
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _locked(exc: Exception) -> bool:
    message = str(exc).lower()
    return "locked" in message or "busy" in message or "could not serialize" in message or "deadlock" in message


def stored_config(stored) -> dict:
    """A run's `config` as read back from the database (a JSON string on some backends, a dict on others)."""
    return json.loads(stored) if isinstance(stored, str) else (stored or {})


def _json_ready(value):
    # tuples, numpy scalars, dates, paths -> plain JSON
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _plain(value):
    """A value a database driver binds: numpy scalars as Python numbers, containers as JSON text."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return value if isinstance(value, (str, int, float, bool, datetime, type(None))) else str(value)


class ResultsDB:
    def __init__(self, url: str | None = None, stale_after_s: float = 24 * 3600):
        parsed = _resolve_url(url)
        self.url, self.stale_after_s = _shown(parsed), stale_after_s
        try:
            if parsed.get_backend_name() == "sqlite":
                self.engine = create_engine(parsed, connect_args={"timeout": _BUSY_TIMEOUT_MS / 1000})
                _sqlite_setup(self.engine)
            else:
                connect_args = {"connect_timeout": 10} if parsed.get_backend_name() == "postgresql" else {}
                self.engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
            self.schema_version_found = self._write(migrate)
            if parsed.get_backend_name() == "sqlite":
                self._use_wal()
        except (NoSuchModuleError, ModuleNotFoundError, ImportError) as exc:
            raise ValueError(f"no driver for results database {self.url} ({exc}); install it or use "
                             "sqlite:/// or postgresql+psycopg://") from None
        except DBAPIError as exc:
            first_line = str(exc.orig or exc).strip().splitlines()[0]
            raise ValueError(f"cannot open results database {self.url}: {first_line}; check --db / "
                             "EVALSUITE_DB and that the server is running") from None
        self.mark_stale_runs()

    def _use_wal(self) -> None:
        """Readers and a writer at once. The mode is stored in the file, so it is set once, and only on a
        database that opened as ours (a refused file stays byte for byte as it was)."""
        raw = self.engine.raw_connection()
        try:
            cursor = raw.cursor()
            for _ in range(50):  # another process may hold the file while switching it itself
                if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                    break
                try:
                    cursor.execute("PRAGMA journal_mode=WAL")
                except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError from the raw driver
                    if not _locked(exc):
                        raise
                    time.sleep(0.1)
            cursor.close()
        finally:
            raw.close()

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing -------------------------------------------------------------------------------
    def _write(self, work, attempts: int = 8):
        """Run work(conn) in one transaction, retrying when another writer holds the database."""
        for attempt in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except OperationalError as exc:
                if attempt == attempts - 1 or not _locked(exc):
                    raise
                time.sleep(0.05 * 2 ** attempt)

    def start_run(self, config: dict) -> int:
        """A new run with status 'running'; config keys naming runs columns fill them, all keys go to `config`."""
        values = {k: _plain(config[k]) for k in RUN_COLUMNS if k in config}
        for key, value in provenance.run_defaults().items():
            values.setdefault(key, value)
        if values.get("cache_capacity") is not None:
            values["cache_capacity"] = str(values["cache_capacity"])
        if values.get("status", "running") not in RUN_STATUSES:
            raise ValueError(f"run status {values['status']!r} is not one of {', '.join(RUN_STATUSES)}")
        pid = os.getpid()
        values.update(status=values.get("status", "running"), started_at=values.get("started_at") or _now(),
                      heartbeat_at=_now(), writer_pid=pid, writer_host=provenance.host(),
                      writer_start=provenance.process_start(pid), config=_json_ready(dict(config)))
        return self._write(lambda conn: conn.execute(insert(Run).values(**values)).inserted_primary_key[0])

    def add_task(self, run_id: int, task: str, metrics: list[dict], engine: list[dict] | None = None,
                 samples: list[dict] | None = None) -> None:
        """Store one finished task of a run (replacing an earlier write of the same task) in one transaction."""
        rows = {TaskMetric: _checked(TaskMetric, metrics), EngineMetric: _checked(EngineMetric, engine or []),
                Sample: _checked(Sample, samples or [])}

        def work(conn):
            self._require_run(conn, run_id)
            for table, table_rows in rows.items():
                conn.execute(delete(table).where(table.run_id == run_id, table.task == task))
                if table_rows:
                    conn.execute(insert(table), [{**row, "run_id": run_id, "task": task} for row in table_rows])
            conn.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=_now()))

        self._write(work)

    def finish_run(self, run_id: int, status: str = "complete") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")

        def work(conn):
            self._require_run(conn, run_id)
            conn.execute(update(Run).where(Run.id == run_id).values(status=status, finished_at=_now()))

        self._write(work)

    def record_lm_eval(self, config: dict, results: dict, engine_by_task: dict | None = None) -> int:
        """Write a whole simple_evaluate() result (results, stderrs, n, logged samples) as one run."""
        run_id = self.start_run(run_config(config, results))
        try:
            self.add_lm_eval_tasks(run_id, results, engine_by_task)
        except BaseException:
            self.finish_run(run_id, "failed")
            raise
        self.finish_run(run_id, "complete")
        return run_id

    def add_lm_eval_tasks(self, run_id: int, results: dict, engine_by_task: dict | None = None) -> None:
        """Write every task of one simple_evaluate() result into a running run, each in its own transaction."""
        for task, task_results in results["results"].items():
            engine = (engine_by_task or {}).get(task)
            # '<metric>,engine' entries repeat the engine summary stored in engine_metrics
            metrics = task_metric_rows(task_results, task_count(results, task),
                                       skip_filters=("engine",) if engine else ())
            self.add_task(run_id, task, metrics, engine_rows(engine),
                          sample_rows(results.get("samples", {}).get(task, [])))

    def mark_stale_runs(self) -> list[int]:
        """Mark 'running' runs whose writer is dead (or silent for stale_after_s) 'incomplete'; returns their ids."""
        here = provenance.host()
        cutoff = _now() - timedelta(seconds=self.stale_after_s)
        with self.engine.connect() as conn:
            running = conn.execute(select(Run.id, Run.writer_pid, Run.writer_host, Run.writer_start,
                                          Run.heartbeat_at, Run.started_at).where(Run.status == "running")).all()
        stale = []
        for run in running:
            if run.writer_host == here and run.writer_pid is not None:
                dead = not provenance.process_alive(run.writer_pid, run.writer_start)
            else:
                last = run.heartbeat_at or run.started_at
                dead = last is None or last < cutoff
            if dead:
                stale.append(run.id)
        if stale:
            self._write(lambda conn: conn.execute(
                update(Run).where(Run.id.in_(stale), Run.status == "running").values(status="incomplete")))
        return stale

    def matching_run(self, config: dict) -> tuple[int, str, set[str]] | None:
        """The newest complete or incomplete run made with exactly `config` (so resuming never mixes
        answers of two configurations): its id, status and the tasks it stored; None if there is none."""
        self.mark_stale_runs()
        wanted = _json_ready(dict(config))
        with self.engine.connect() as conn:
            candidates = conn.execute(select(Run.id, Run.status, Run.config)
                                      .where(Run.status.in_(("complete", "incomplete"))).order_by(Run.id.desc())).all()
            for run_id, status, stored in candidates:
                if stored_config(stored) == wanted:
                    done = conn.execute(select(TaskMetric.task).where(TaskMetric.run_id == run_id).distinct())
                    return run_id, status, {row.task for row in done}
        return None

    def resume_run(self, run_id: int) -> None:
        """Take over an incomplete run: this process becomes its writer and it is 'running' again."""
        pid = os.getpid()

        def work(conn):
            self._require_run(conn, run_id)
            conn.execute(update(Run).where(Run.id == run_id).values(
                status="running", finished_at=None, heartbeat_at=_now(), writer_pid=pid,
                writer_host=provenance.host(), writer_start=provenance.process_start(pid)))

        self._write(work)

    @staticmethod
    def _require_run(conn, run_id) -> None:
        if conn.execute(select(Run.id).where(Run.id == run_id)).first() is None:
            raise ValueError(f"no run with id {run_id!r} in the results database")

    # ---- reading -------------------------------------------------------------------------------
    def _frame(self, statement) -> pd.DataFrame:
        with self.engine.connect() as conn:
            return pd.read_sql(statement, conn)

    def runs(self, status: str | None = None) -> pd.DataFrame:
        """All runs, newest first, after marking dead writers' runs incomplete."""
        self.mark_stale_runs()
        statement = select(Run).order_by(Run.id.desc())
        if status is not None:
            statement = statement.where(Run.status == status)
        return self._frame(statement)

    def run(self, run_id) -> dict:
        try:
            run_id = int(run_id)
        except (TypeError, ValueError):
            raise ValueError(f"run id {run_id!r} is not a number; `evalsuite runs` lists them") from None
        frame = self._frame(select(Run).where(Run.id == run_id))
        if frame.empty:
            raise ValueError(f"no run with id {run_id} in {self.url}; `evalsuite runs` lists them")
        return frame.iloc[0].to_dict()

    def _rows(self, table, run_ids) -> pd.DataFrame:
        statement = select(table).order_by(table.run_id, table.id)
        if run_ids is not None:
            statement = statement.where(table.run_id.in_([int(r) for r in run_ids]))
        return self._frame(statement).drop(columns="id")

    def task_metrics(self, run_ids=None) -> pd.DataFrame:
        return self._rows(TaskMetric, run_ids)

    def engine_metrics(self, run_ids=None) -> pd.DataFrame:
        return self._rows(EngineMetric, run_ids)

    def samples(self, run_ids=None) -> pd.DataFrame:
        return self._rows(Sample, run_ids)


def _checked(table, rows: list[dict]) -> list[dict]:
    """Rows with only known columns (a misspelt key is an error, not silently dropped data)."""
    allowed = _ROW_COLUMNS[table]
    for row in rows:
        unknown = set(row) - allowed - {"task", "run_id"}
        if unknown:
            raise ValueError(f"{table.__tablename__} has no column {', '.join(sorted(unknown))}; "
                             f"columns: {', '.join(sorted(allowed))}")
    used = sorted({k for row in rows for k in row} - {"task", "run_id"})  # one key set for executemany
    return [{k: _plain(row.get(k)) for k in used} for row in rows]
