"""Tables of the results database and the ordered migrations that bring an older database up to date.

Version 1 had runs, task_metrics, engine_metrics and samples without writer tracking; version 2 added the
writer's pid/host/start token and a heartbeat to runs (so a dead writer's run reads 'incomplete'), the
metric/filter a sample score belongs to, and lookup indexes; version 3 added a run's `uid` (names its lm-eval
JSON files), the `error` a failed run ended with, and each sample's raw generated `response` (what a resumed
run compares later modes with); version 4 added each sample's own engine metrics (recall@k and its per-layer
values, hit rate, bytes transferred, TPOT), so correctness can be read against recall; version 5 added to
engine_metrics the router's `top_k` (K: recall@K is the headline among the k a run measured), `exact_at_k`
(exact@K) and `recall_next_token` (recall_next_token@K), both on the rows of k = top_k. A new database is
created at the latest version directly; an existing one runs every migration above its stored version, in
order, in one transaction.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import (JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, inspect,
                        select, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

LATEST_VERSION = 5
RUN_STATUSES = ("running", "complete", "incomplete", "failed")


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)  # naive UTC
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    status: Mapped[str] = mapped_column(String(16), default="running")
    model: Mapped[str | None] = mapped_column(Text)
    model_fingerprint: Mapped[str | None] = mapped_column(String(128))
    mode: Mapped[str | None] = mapped_column(String(64))
    predictor: Mapped[str | None] = mapped_column(String(64))
    predictor_artifact: Mapped[str | None] = mapped_column(String(128))
    cache_capacity: Mapped[str | None] = mapped_column(String(64))  # '8', '0.5', '512MiB', 'all'
    cache_policy: Mapped[str | None] = mapped_column(String(32))
    link: Mapped[str | None] = mapped_column(String(64))
    dtype: Mapped[str | None] = mapped_column(String(32))
    device: Mapped[str | None] = mapped_column(String(64))
    hardware: Mapped[str | None] = mapped_column(Text)
    evalsuite_version: Mapped[str | None] = mapped_column(String(64))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    lm_eval_version: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int | None] = mapped_column(Integer)
    limit: Mapped[float | None] = mapped_column(Float)
    config: Mapped[dict | None] = mapped_column(JSON)
    # version 2: who writes the run, to tell a live run from one whose process died
    writer_pid: Mapped[int | None] = mapped_column(Integer)
    writer_host: Mapped[str | None] = mapped_column(String(255))
    writer_start: Mapped[str | None] = mapped_column(String(64))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime)
    # version 3: a name no other database's run shares, and why a failed run failed
    uid: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)


class TaskMetric(Base):
    __tablename__ = "task_metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task: Mapped[str] = mapped_column(String(255))
    metric: Mapped[str] = mapped_column(String(128))
    filter: Mapped[str | None] = mapped_column(String(128))
    value: Mapped[float | None] = mapped_column(Float)
    stderr: Mapped[float | None] = mapped_column(Float)
    n: Mapped[int | None] = mapped_column(Integer)
    __table_args__ = (Index("ix_task_metrics_run_task", "run_id", "task"),)


class EngineMetric(Base):
    __tablename__ = "engine_metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task: Mapped[str | None] = mapped_column(String(255))
    layer: Mapped[int | None] = mapped_column(Integer)  # NULL: the whole model
    recall_at_k: Mapped[float | None] = mapped_column(Float)
    k: Mapped[int | None] = mapped_column(Integer)
    prefetch_precision: Mapped[float | None] = mapped_column(Float)
    hit_rate: Mapped[float | None] = mapped_column(Float)
    bytes_transferred: Mapped[float | None] = mapped_column(Float)
    stall_s: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(Integer)
    # version 5: the router's top-k (K), and on the rows of k = K exact@K and recall_next_token@K
    top_k: Mapped[int | None] = mapped_column(Integer)
    exact_at_k: Mapped[float | None] = mapped_column(Float)
    recall_next_token: Mapped[float | None] = mapped_column(Float)
    __table_args__ = (Index("ix_engine_metrics_run_task", "run_id", "task"),)


class Sample(Base):
    __tablename__ = "samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task: Mapped[str] = mapped_column(String(255))
    doc_id: Mapped[int] = mapped_column(Integer)
    score: Mapped[float | None] = mapped_column(Float)
    correct: Mapped[bool | None] = mapped_column(Boolean)
    prediction: Mapped[str | None] = mapped_column(Text)
    target: Mapped[str | None] = mapped_column(Text)
    first_divergence: Mapped[int | None] = mapped_column(Integer)  # first generated token that differs
    identical_share: Mapped[float | None] = mapped_column(Float)  # share of generated tokens identical
    # version 2: lm-eval scores one document under several metrics and filters
    metric: Mapped[str | None] = mapped_column(String(128))
    filter: Mapped[str | None] = mapped_column(String(128))
    # version 3: the raw generated text (before filters), for comparing modes sample by sample
    response: Mapped[str | None] = mapped_column(Text)
    # version 4: the engine's numbers for this document alone (generated samples of the lm-eval adapters)
    recall_at_k: Mapped[float | None] = mapped_column(Float)  # mean over target layers, at k = K (top-k)
    k: Mapped[int | None] = mapped_column(Integer)
    recall_per_layer: Mapped[dict | None] = mapped_column(JSON)  # {layer: recall@k}, at that k
    hit_rate: Mapped[float | None] = mapped_column(Float)
    bytes_transferred: Mapped[float | None] = mapped_column(Float)  # a batch's bytes shared among its rows
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    __table_args__ = (Index("ix_samples_run_task", "run_id", "task"),)


TABLES = ("runs", "task_metrics", "engine_metrics", "samples")


def _v1_to_v2(conn) -> None:
    for column, sql_type in (("writer_pid", "INTEGER"), ("writer_host", "VARCHAR(255)"),
                             ("writer_start", "VARCHAR(64)"), ("heartbeat_at", "TIMESTAMP")):
        conn.execute(text(f"ALTER TABLE runs ADD COLUMN {column} {sql_type}"))
    for column in ("metric", "filter"):
        conn.execute(text(f'ALTER TABLE samples ADD COLUMN "{column}" VARCHAR(128)'))
    for table in ("task_metrics", "engine_metrics", "samples"):
        conn.execute(text(f"CREATE INDEX IF NOT EXISTS ix_{table}_run_task ON {table} (run_id, task)"))


def _v2_to_v3(conn) -> None:
    # runs stored earlier keep uid NULL: their generated texts were not stored, so they are not resumed
    conn.execute(text("ALTER TABLE runs ADD COLUMN uid VARCHAR(32)"))
    conn.execute(text("ALTER TABLE runs ADD COLUMN error TEXT"))
    conn.execute(text("ALTER TABLE samples ADD COLUMN response TEXT"))


def _v3_to_v4(conn) -> None:
    # samples stored earlier keep these NULL: compare then falls back to whole-run engine metrics
    for column, sql_type in (("recall_at_k", "FLOAT"), ("k", "INTEGER"), ("recall_per_layer", "JSON"),
                             ("hit_rate", "FLOAT"), ("bytes_transferred", "FLOAT"), ("tpot_ms", "FLOAT")):
        conn.execute(text(f"ALTER TABLE samples ADD COLUMN {column} {sql_type}"))


def _v4_to_v5(conn) -> None:
    # rows stored earlier keep these NULL: their smallest k is then taken for recall@K (evalsuite.results.compare)
    for column, sql_type in (("top_k", "INTEGER"), ("exact_at_k", "FLOAT"), ("recall_next_token", "FLOAT")):
        conn.execute(text(f"ALTER TABLE engine_metrics ADD COLUMN {column} {sql_type}"))


# (version reached, function): applied in order to every database below that version
MIGRATIONS = [(2, _v1_to_v2), (3, _v2_to_v3), (4, _v3_to_v4), (5, _v4_to_v5)]


def migrate(conn) -> int:
    """Create or upgrade the schema inside the caller's transaction; returns the version found before."""
    if conn.dialect.name == "postgresql":  # two processes opening a fresh database create it once
        conn.execute(text("SELECT pg_advisory_xact_lock(7230613)"))
    tables = set(inspect(conn).get_table_names())
    if "schema_version" not in tables:
        if tables & set(TABLES):
            raise ValueError("the database has a 'runs' table but no schema_version table: it is not an "
                             "evalsuite results database; point --db / EVALSUITE_DB at another one")
        Base.metadata.create_all(conn)
        conn.execute(SchemaVersion.__table__.insert().values(version=LATEST_VERSION))
        return 0
    found = conn.execute(select(SchemaVersion.version)).scalar()
    if found is None:
        raise ValueError("the results database has an empty schema_version table; restore it or use another database")
    if found > LATEST_VERSION:
        raise ValueError(f"the results database has schema version {found}, newer than this evalsuite "
                         f"understands ({LATEST_VERSION}); upgrade evalsuite")
    for version, step in MIGRATIONS:
        if version > found:
            step(conn)
    if found < LATEST_VERSION:
        conn.execute(SchemaVersion.__table__.update().values(version=LATEST_VERSION))
    _check_tables(conn)
    return found


def _check_tables(conn) -> None:
    """Every table and column of the current schema is there (a table dropped by hand or a half-restored file)."""
    found = inspect(conn)
    names = set(found.get_table_names())
    for table in Base.metadata.sorted_tables:
        if table.name not in names:
            raise ValueError(f"results database is missing table {table.name}: it is damaged; restore it from a "
                             "backup or point --db / EVALSUITE_DB at another one")
        missing = sorted({c.name for c in table.columns} - {c["name"] for c in found.get_columns(table.name)})
        if missing:
            raise ValueError(f"results database table {table.name} is missing column {', '.join(missing)}: it is "
                             "damaged; restore it from a backup or point --db / EVALSUITE_DB at another one")
