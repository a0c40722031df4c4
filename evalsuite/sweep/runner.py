"""Run a sweep's cells: here (one at a time or in a process pool) or as Ray tasks on a cluster.

Every cell writes its run to the one results database as it finishes, tagged with the sweep's
name and the cell's key. A cell whose run is stored complete is skipped, so re-running a sweep
(after an interruption, or with cells added) runs only what is missing; a cell cut off halfway
resumes its run's missing tasks (see evalsuite.lm.suite). A failing cell is tried `retries`
more times, then reported; the others go on.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

from tqdm import tqdm

from .grid import Cell, Sweep, cell_engine, check_cells

LOCAL_RAY = ("local", "")  # --ray local: start a Ray instance on this machine
# Failures worth another attempt (out of memory, a lost connection, a crashed kernel); a bad model,
# task or option (ValueError, FileNotFoundError, ...) fails the same way every time.
TRANSIENT = (RuntimeError, MemoryError, TimeoutError, ConnectionError)


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # cell label -> last error


def run_cell(cell: dict, sweep_name: str, db_url: str | None, out_dir: str, confirm_run_unsafe_code: bool,
             threads: int = 1) -> dict:
    """One cell, in whichever process runs it: its run lands in the database; returns its table rows."""
    from ..lm.suite import RunOptions, run_suite

    c = Cell(**{**cell, "tasks": tuple(cell["tasks"])})
    started = time.time()
    rows = run_suite([c.model], [c.mode], list(c.tasks), c.limit, engine=cell_engine(c), predictor=c.predictor,
                     run=RunOptions(seed=c.seed), db_url=db_url, out_dir=out_dir,
                     confirm_run_unsafe_code=confirm_run_unsafe_code, progress=lambda *_: None,
                     threads=max(1, int(threads)), extra_config={"sweep": sweep_name, "sweep_cell": c.key})
    return {"key": c.key, "rows": rows, "seconds": time.time() - started}


def completed_cells(db, sweep_name: str) -> set[str]:
    """Keys of this sweep's cells whose run is stored complete."""
    from ..results.report import sweep_runs
    from ..results.database import stored_config

    configs = sweep_runs(db.runs(status="complete"), sweep_name)["config"].map(stored_config)
    return {config["sweep_cell"] for config in configs if config.get("sweep_cell")}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def run_sweep(sweep: Sweep, db_url: str | None = None, ray_address: str | None = None,
              workers: int | None = None) -> Outcome:
    """Run every cell of `sweep` not yet stored complete; returns what ran, was skipped and failed."""
    from ..results import ResultsDB

    db_url = db_url or sweep.db
    with ResultsDB(db_url) as db:  # a bad URL fails here, before any cell starts
        backend, url = db.sql_engine.url.get_backend_name(), db.sql_engine.url
        done = completed_cells(db, sweep.name)
    if ray_address not in (None, *LOCAL_RAY) and backend == "sqlite":
        raise ValueError("cells on a Ray cluster write to one shared database: pass a PostgreSQL URL "
                         "(--db postgresql+psycopg://...); SQLite serves only a sweep on this machine")
    if backend == "sqlite":  # workers may start in another directory
        url = url.set(database=os.path.abspath(url.database))
    db_url = url.render_as_string(hide_password=False)
    cells = sweep.cells()
    outcome = Outcome(skipped=[c.label() for c in cells if c.key in done])
    todo = [c for c in cells if c.key not in done]
    # a remote cluster's workers hold the model files; the rest is checked here all the same
    check_cells(todo, bool(sweep.confirm_run_unsafe_code), model_files=ray_address in (None, *LOCAL_RAY))
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), unit="cell", desc=f"sweep {sweep.name}")
    if outcome.skipped:
        tqdm.write(f"[sweep] {len(outcome.skipped)} of {len(cells)} cells already stored: skipped")
    args = (sweep.name, db_url, os.path.abspath(sweep.out), bool(sweep.confirm_run_unsafe_code))
    if ray_address is not None:
        _on_ray(todo, args, sweep, ray_address, outcome, bar)
    else:
        _here(todo, args, sweep, workers or sweep.workers, outcome, bar)
    bar.close()
    return outcome


def _finished(outcome: Outcome, bar, cell: Cell, result: dict | None = None, error: str | None = None) -> None:
    if error is None:
        outcome.done.append(cell.label())
        tqdm.write(f"[sweep] done   {cell.label()} ({result['seconds']:.0f} s)")
    else:
        outcome.failed[cell.label()] = error
        tqdm.write(f"[sweep] FAILED {cell.label()}: {error}")
    bar.update(1)


def _here(todo: list[Cell], args: tuple, sweep: Sweep, workers: int, outcome: Outcome, bar) -> None:
    threads = sweep.resources.get("num_cpus", 1)
    if workers <= 1:
        for cell in todo:
            for attempt in range(sweep.retries + 1):
                try:
                    result = run_cell(asdict(cell), *args, threads)
                    _finished(outcome, bar, cell, result)
                    break
                except Exception as exc:  # noqa: BLE001 - any failure of a cell is reported, not fatal
                    if attempt == sweep.retries or not isinstance(exc, TRANSIENT):
                        _finished(outcome, bar, cell, error=_first_line(exc))
                        break
        return
    # spawn: a forked child would inherit torch's thread pools and the parent's open database handles
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        attempts = {cell: 0 for cell in todo}
        pending = {pool.submit(run_cell, asdict(cell), *args, threads): cell for cell in todo}
        while pending:
            future = next(as_completed(pending))
            cell = pending.pop(future)
            try:
                _finished(outcome, bar, cell, future.result())
            except Exception as exc:  # noqa: BLE001
                attempts[cell] += 1
                if attempts[cell] > sweep.retries or not isinstance(exc, TRANSIENT):
                    _finished(outcome, bar, cell, error=_first_line(exc))
                else:
                    pending[pool.submit(run_cell, asdict(cell), *args, threads)] = cell


def _on_ray(todo: list[Cell], args: tuple, sweep: Sweep, address: str, outcome: Outcome, bar) -> None:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'evalsuite[ray]' (or `pip install ray`)") from None
    started = not ray.is_initialized()  # a test or notebook may have started one already
    if started:
        ray.init(address=None if address in LOCAL_RAY else address, log_to_driver=False, include_dashboard=False)
    try:
        _submit(ray, todo, args, sweep, outcome, bar)
    finally:
        if started:
            ray.shutdown()


def _submit(ray, todo: list[Cell], args: tuple, sweep: Sweep, outcome: Outcome, bar) -> None:
    resources = dict(sweep.resources)
    options = {"num_cpus": resources.pop("num_cpus", 1), "num_gpus": resources.pop("num_gpus", 0)}
    if "memory_gb" in resources:
        options["memory"] = int(float(resources.pop("memory_gb")) * 2**30)
    if resources:
        options["resources"] = resources  # custom cluster resources, e.g. {"H200": 1}
    # Ray re-runs a cell whose worker died, or that raised a TRANSIENT error, `retries` times
    remote = ray.remote(run_cell).options(max_retries=sweep.retries, retry_exceptions=list(TRANSIENT), **options)
    pending = {remote.remote(asdict(cell), *args, options["num_cpus"]): cell for cell in todo}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        cell = pending.pop(ready[0])
        try:
            _finished(outcome, bar, cell, ray.get(ready[0]))
        except Exception as exc:  # noqa: BLE001 - RayTaskError wraps the cell's own exception
            cause = getattr(exc, "cause", None) or exc
            _finished(outcome, bar, cell, error=_first_line(cause))
