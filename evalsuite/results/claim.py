"""Which run an evaluation writes: the configuration is claimed in one transaction, so two evaluations of one
configuration started at once never both run it.

The lookup of the newest run with exactly the same configuration and the taking over (or the insert of a new
run) happen in one transaction: SQLite's BEGIN IMMEDIATE serialises it, PostgreSQL an advisory lock held to
the end of the transaction. A run that another live process is writing is answered as 'running': the caller
waits and claims again; once that process finishes, every task is stored; once it dies, its run reads
'incomplete' and is resumed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from sqlalchemy import insert, select, text, update

from . import provenance
from .schema import Run, TaskMetric
from .database import json_ready, now_utc, stored_config

_CLAIM_LOCK = 7230614  # pg_advisory_xact_lock key of claims (7230613 guards schema creation)


@dataclass
class Claim:
    run_id: int
    uid: str
    status: str  # 'new'; the status the run had ('complete', 'incomplete'); 'running' while another writes it
    done: set[str] = field(default_factory=set)  # tasks it already stored


def claim_run(db, config: dict, fresh: bool = False) -> Claim:
    """The run to write `config` into: the newest run made with exactly `config` (taken over unless it holds
    every task), or a new one (always, with `fresh`)."""
    db.mark_stale_runs()
    wanted = json_ready(dict(config))
    values = db.new_run_row(config)
    me = (values["writer_pid"], values["writer_host"], values["writer_start"])

    def work(conn):
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({_CLAIM_LOCK})"))
        if not fresh:
            candidates = conn.execute(select(Run.id, Run.uid, Run.status, Run.config, Run.writer_pid,
                                             Run.writer_host, Run.writer_start)
                                      .where(Run.status.in_(("running", "complete", "incomplete")))
                                      .order_by(Run.id.desc())).all()
            for run in candidates:
                if stored_config(run.config) == wanted:
                    return _take(conn, run, me, config)
        run_id = conn.execute(insert(Run).values(**values)).inserted_primary_key[0]
        return Claim(run_id, values["uid"], "new")

    return db._write(work)


def _take(conn, run, me: tuple, config: dict) -> Claim:
    done = {row.task for row in conn.execute(select(TaskMetric.task).where(TaskMetric.run_id == run.id).distinct())}
    if run.status == "running" and (run.writer_pid, run.writer_host, run.writer_start) != me:
        return Claim(run.id, run.uid, "running", done)
    if run.uid is None:
        raise ValueError(f"run {run.id} has this configuration but was stored before evalsuite kept the generated "
                         "texts a resume compares with; pass --fresh to start a new run")
    if set(config.get("tasks", ())) - done:  # this process becomes its writer
        pid = os.getpid()
        conn.execute(update(Run).where(Run.id == run.id).values(
            status="running", finished_at=None, error=None, heartbeat_at=now_utc(), writer_pid=pid,
            writer_host=provenance.host(), writer_start=provenance.process_start(pid)))
    return Claim(run.id, run.uid, run.status, done)
