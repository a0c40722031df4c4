"""Sweeps: the grid, local and Ray runs giving the same stored results, resuming an interrupted sweep."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from evalsuite.results import ResultsDB
from evalsuite.sweep import load_sweep, run_sweep
from evalsuite.sweep.runner import completed_cells

from .helpers import REPO, shipped_model

GRID = {"models": [shipped_model("tiny-qwen3-moe")], "modes": ["resident", "on-demand", "speculative"],
        "predictors": ["gate"], "cache_capacities": [0.25], "links": ["ufs4"], "tasks": ["evalsuite_arith"],
        "limit": 1, "seeds": [0], "resources": {"num_cpus": 1}}


def write_sweep(tmp_path, name="grid", **fields) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **GRID, "out": str(tmp_path / "out"), **fields}))
    return str(path)


def stored(db_url: str, sweep: str) -> dict:
    """cell key -> {task/metric/filter: value} for every complete run of the sweep."""
    with ResultsDB(db_url) as db:
        runs = db.runs(status="complete")
        metrics = db.task_metrics()
    out = {}
    for run_id, config in zip(runs["id"], runs["config"]):
        config = json.loads(config) if isinstance(config, str) else config
        if config.get("sweep") == sweep:
            assert config["sweep_cell"] not in out, "a cell stored twice"
            rows = metrics[metrics["run_id"] == run_id]
            out[config["sweep_cell"]] = {f"{r.task}/{r.metric}/{r.filter}": r.value for r in rows.itertuples()}
    return out


def test_grid_collapses_axes_a_mode_ignores(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, modes=["resident", "on-demand", "router-preserving"],
                                   predictors=["gate", {"name": "adapter", "path": "calib/{model}/p.safetensors"}],
                                   cache_capacities=[0.25, 0.5], seeds=[0, 1]))
    cells = sweep.cells()
    by_mode = {m: [c for c in cells if c.mode == m] for m in sweep.modes}
    assert len(by_mode["resident"]) == 2  # one per seed: no cache, link or predictor
    assert len(by_mode["on-demand"]) == 4  # caches x seeds
    assert len(by_mode["router-preserving"]) == 8  # predictors x caches x seeds
    assert {c.predictor_path for c in by_mode["router-preserving"]} == {None, "calib/tiny-qwen3-moe/p.safetensors"}
    assert len({c.key for c in cells}) == len(cells) == 14
    assert [c.key for c in load_sweep(write_sweep(tmp_path, modes=["resident"], seeds=[0, 1])).cells()] == \
        [c.key for c in by_mode["resident"]]  # a cell's key depends on the cell only


@pytest.mark.parametrize("fields, message", [
    ({"modes": ["resident", "turbo"]}, "unknown mode(s) turbo"),
    ({"colour": "red"}, "unknown field(s) colour"),
    ({"limit": 0}, "`limit` must be a whole number"),
    ({"predictors": [{"name": "gate", "file": "x"}]}, "a predictor is a name or"),
])
def test_bad_sweep_files_get_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=".*") as info:
        load_sweep(write_sweep(tmp_path, **fields))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("fields, message", [
    ({"cache_capacities": [-1]}, "cache_capacity=-1"),
    ({"modes": ["resident", "speculative"], "predictors": ["psychic"]}, "psychic"),
    ({"links": ["carrier-pigeon"]}, "carrier-pigeon"),
    ({"tasks": ["evalsuite_arith", "no_such_task"]}, "no_such_task"),
    ({"models": [shipped_model("tiny-qwen3-moe"), "/nonexistent/model"]}, "/nonexistent/model"),
    ({"tasks": ["evalsuite_code"]}, "confirm_run_unsafe_code"),
])
def test_invalid_cells_are_refused_before_any_cell_runs(tmp_path, fields, message):
    db_url = f"sqlite:///{tmp_path}/sweep.db"
    sweep = load_sweep(write_sweep(tmp_path, **{"modes": ["resident", "on-demand"], **fields}))
    with pytest.raises((ValueError, FileNotFoundError), match=".*") as info:
        run_sweep(sweep, db_url=db_url)
    assert message in str(info.value) and "\n" not in str(info.value)
    with ResultsDB(db_url) as db:
        assert db.runs().empty


def test_a_ray_cluster_needs_a_shared_database(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path))
    with pytest.raises(ValueError, match="PostgreSQL"):
        run_sweep(sweep, db_url=f"sqlite:///{tmp_path}/r.db", ray_address="ray://cluster:10001")


def test_local_and_ray_sweeps_store_the_same_results(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path))
    local_db, ray_db = f"sqlite:///{tmp_path}/local.db", f"sqlite:///{tmp_path}/ray.db"
    outcome = run_sweep(sweep, db_url=local_db)
    assert len(outcome.done) == 3 and not outcome.failed

    import ray  # a test extra

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        outcome = run_sweep(sweep, db_url=ray_db, ray_address="local")
    finally:
        ray.shutdown()
    assert len(outcome.done) == 3 and not outcome.failed
    local, on_ray = stored(local_db, "grid"), stored(ray_db, "grid")
    assert set(local) == {c.key for c in sweep.cells()}
    assert on_ray == local  # same cells, same accuracies
    assert all("evalsuite_arith/exact_match/none" in metrics for metrics in local.values())


def test_an_interrupted_sweep_resumes_with_only_the_missing_cells(tmp_path):
    db_url = f"sqlite:///{tmp_path}/sweep.db"
    path = write_sweep(tmp_path, db=db_url)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "evalsuite.cli", "sweep", path]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:  # kill it once the first cell is stored
            time.sleep(0.5)
            if os.path.exists(tmp_path / "sweep.db"):
                with ResultsDB(db_url) as db:
                    if completed_cells(db, "grid"):
                        break
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    first = stored(db_url, "grid")
    assert 1 <= len(first) < 3

    outcome = run_sweep(load_sweep(path), workers=2)  # the rest, two cells at once
    assert len(outcome.skipped) == len(first) and len(outcome.done) == 3 - len(first) and not outcome.failed
    after = stored(db_url, "grid")
    assert len(after) == 3 and all(after[key] == value for key, value in first.items())
    again = run_sweep(load_sweep(path))
    assert len(again.skipped) == 3 and not again.done
