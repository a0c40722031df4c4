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
import time
import uuid
from datetime import datetime, timedelta, timezone

import pandas as pd
from sqlalchemy import JSON, create_engine, delete, insert, select, update
from sqlalchemy.exc import DBAPIError, NoSuchModuleError, OperationalError

from . import provenance
from .connect import BUSY_TIMEOUT_MS, check_sqlite_file, disk_full, locked, resolve_url, shown, sqlite_setup
from .lm_eval_rows import engine_rows, run_config, sample_rows, task_count, task_metric_rows
from .schema import RUN_STATUSES, EngineMetric, Run, Sample, TaskMetric, migrate

_WRITER_COLUMNS = ("writer_pid", "writer_host", "writer_start", "heartbeat_at")
RUN_COLUMNS = [c.name for c in Run.__table__.columns if c.name not in ("id", "config", *_WRITER_COLUMNS)]
_ROW_COLUMNS = {table: {c.name for c in table.__table__.columns} - {"id", "run_id", "task"}
                for table in (TaskMetric, EngineMetric, Sample)}
# JSON columns take the value itself (the column type writes the JSON); others take plain scalars
_JSON_COLUMNS = {table: {c.name for c in table.__table__.columns if isinstance(c.type, JSON)}
                 for table in _ROW_COLUMNS}


def error_line(exc: BaseException) -> str:
    """What a failed run stores: the exception type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def stored_config(stored) -> dict:
    """A run's `config` as read back from the database (a JSON string on some backends, a dict on others)."""
    return json.loads(stored) if isinstance(stored, str) else (stored or {})


def json_ready(value):
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
        parsed = resolve_url(url)
        self.url, self.stale_after_s = shown(parsed), stale_after_s
        try:
            if parsed.get_backend_name() == "sqlite":
                self.sql_engine = create_engine(parsed, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
                sqlite_setup(self.sql_engine)
            else:
                connect_args = {"connect_timeout": 10} if parsed.get_backend_name() == "postgresql" else {}
                self.sql_engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
            if parsed.get_backend_name() == "sqlite":
                self._write(lambda conn: check_sqlite_file(conn, self.url))
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
        raw = self.sql_engine.raw_connection()
        try:
            cursor = raw.cursor()
            for _ in range(50):  # another process may hold the file while switching it itself
                if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                    break
                try:
                    cursor.execute("PRAGMA journal_mode=WAL")
                except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError from the raw driver
                    if not locked(exc):
                        raise
                    time.sleep(0.1)
            cursor.close()
        finally:
            raw.close()

    def close(self) -> None:
        self.sql_engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing -------------------------------------------------------------------------------
    def _write(self, work, attempts: int = 8):
        """Run work(conn) in one transaction, retrying when another writer holds the database. A write that
        meets a full disk is rolled back whole and reported in one line."""
        for attempt in range(attempts):
            try:
                with self.sql_engine.begin() as conn:
                    return work(conn)
            except (DBAPIError, OSError) as exc:
                if disk_full(exc):
                    first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                    raise ValueError(f"results database {self.url} is full ({first}): free disk space or point "
                                     "--db / EVALSUITE_DB at another disk; the results stored before are intact") \
                        from None
                if not isinstance(exc, OperationalError) or attempt == attempts - 1 or not locked(exc):
                    raise
                time.sleep(0.05 * 2 ** attempt)

    def start_run(self, config: dict) -> int:
        """A new run with status 'running'; config keys naming runs columns fill them, all keys go to `config`."""
        values = self.new_run_row(config)
        return self._write(lambda conn: conn.execute(insert(Run).values(**values)).inserted_primary_key[0])

    def new_run_row(self, config: dict) -> dict:
        """The runs row of a new run written by this process."""
        values = {k: _plain(config[k]) for k in RUN_COLUMNS if k in config}
        for key, value in provenance.run_defaults().items():
            values.setdefault(key, value)
        if values.get("cache_capacity") is not None:
            values["cache_capacity"] = str(values["cache_capacity"])
        if values.get("status", "running") not in RUN_STATUSES:
            raise ValueError(f"run status {values['status']!r} is not one of {', '.join(RUN_STATUSES)}")
        pid = os.getpid()
        values.update(status=values.get("status", "running"), started_at=values.get("started_at") or now_utc(),
                      heartbeat_at=now_utc(), writer_pid=pid, writer_host=provenance.host(),
                      writer_start=provenance.process_start(pid), config=json_ready(dict(config)),
                      uid=values.get("uid") or uuid.uuid4().hex)
        return values

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
            conn.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=now_utc()))

        self._write(work)

    def finish_run(self, run_id: int, status: str = "complete", error: str | None = None) -> None:
        """Close a run; a failed one keeps `error` (one line: the exception type and message)."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")

        def work(conn):
            self._require_run(conn, run_id)
            conn.execute(update(Run).where(Run.id == run_id).values(status=status, finished_at=now_utc(), error=error))

        self._write(work)

    def record_lm_eval(self, config: dict, results: dict, engine_by_task: dict | None = None) -> int:
        """Write a whole simple_evaluate() result (results, stderrs, n, logged samples) as one run."""
        run_id = self.start_run(run_config(config, results))
        try:
            self.add_lm_eval_tasks(run_id, results, engine_by_task)
        except BaseException as exc:
            self.finish_run(run_id, "failed", error_line(exc))
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
        cutoff = now_utc() - timedelta(seconds=self.stale_after_s)
        with self.sql_engine.connect() as conn:
            running = conn.execute(select(Run.id, Run.writer_pid, Run.writer_host, Run.writer_start,
                                          Run.heartbeat_at, Run.started_at).where(Run.status == "running")).all()
        stale = [run.id for run in running if _writer_gone(run, here, cutoff)]
        if stale:
            self._write(lambda conn: conn.execute(
                update(Run).where(Run.id.in_(stale), Run.status == "running").values(status="incomplete")))
        return stale

    @staticmethod
    def _require_run(conn, run_id) -> None:
        if conn.execute(select(Run.id).where(Run.id == run_id)).first() is None:
            raise ValueError(f"no run with id {run_id!r} in the results database")

    # ---- reading -------------------------------------------------------------------------------
    def _frame(self, statement) -> pd.DataFrame:
        with self.sql_engine.connect() as conn:
            return pd.read_sql(statement, conn)

    def runs(self, status: str | None = None) -> pd.DataFrame:
        """All runs, newest first, after marking dead writers' runs incomplete; `expert_bits` read from each
        configuration (16 where it names none: runs stored before quantised experts)."""
        self.mark_stale_runs()
        statement = select(Run).order_by(Run.id.desc())
        if status is not None:
            statement = statement.where(Run.status == status)
        return self._runs_frame(statement)

    def _runs_frame(self, statement) -> pd.DataFrame:
        """Runs as stored, with `expert_bits` read from each configuration (16 where it names none)."""
        frame = self._frame(statement)
        frame["expert_bits"] = [stored_config(c).get("expert_bits") or 16 for c in frame["config"]]
        return frame

    def run(self, run_id) -> dict:
        try:
            run_id = int(run_id)
        except (TypeError, ValueError):
            raise ValueError(f"run id {run_id!r} is not a number; `evalsuite runs` lists them") from None
        frame = self._runs_frame(select(Run).where(Run.id == run_id))
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


def _writer_gone(run, here: str, cutoff: datetime) -> bool:
    if run.writer_host == here and run.writer_pid is not None:
        return not provenance.process_alive(run.writer_pid, run.writer_start)
    last = run.heartbeat_at or run.started_at
    return last is None or last < cutoff


def _checked(table, rows: list[dict]) -> list[dict]:
    """Rows with only known columns (a misspelt key is an error, not silently dropped data)."""
    allowed = _ROW_COLUMNS[table]
    for row in rows:
        unknown = set(row) - allowed - {"task", "run_id"}
        if unknown:
            raise ValueError(f"{table.__tablename__} has no column {', '.join(sorted(unknown))}; "
                             f"columns: {', '.join(sorted(allowed))}")
    used = sorted({k for row in rows for k in row} - {"task", "run_id"})  # one key set for executemany
    as_json = _JSON_COLUMNS[table]
    return [{k: json_ready(row.get(k)) if k in as_json else _plain(row.get(k)) for k in used} for row in rows]
