"""Every knob of `evalsuite eval` and `make eval` reaches the engine and the stored run."""
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from evalsuite.lm.preflight import check_eval, task_manager
from evalsuite.lm.suite import EVAL_ENGINE, model_args

from .helpers import shipped_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def manager():
    return task_manager()


def request(modes, **options):
    return dict(models=[shipped_model()], modes=modes, tasks=["evalsuite_yesno"], limit=1, open_db=False, **options)


def test_each_mode_gets_its_own_predictor_when_none_is_given():
    assert "predictor=hybrid" in model_args("m", "hybrid", None, EVAL_ENGINE)
    assert "predictor=quasi" in model_args("m", "speculative", None, EVAL_ENGINE)
    assert "predictor=adapter" in model_args("m", "router-preserving", None, EVAL_ENGINE)
    assert "predictor=" not in model_args("m", "on-demand", None, EVAL_ENGINE)


@pytest.mark.parametrize("modes, predictor, named", [(["hybrid"], "gate", "hybrid"),
                                                      (["speculative", "hybrid"], "quasi", "hybrid"),
                                                      (["on-demand"], "gate", "on-demand"),
                                                      (["resident", "on-demand"], "hybrid", "on-demand")])
def test_a_predictor_that_does_not_fit_its_mode_is_refused(manager, modes, predictor, named):
    with pytest.raises(ValueError, match=named) as info:
        check_eval(**request(modes, predictor=predictor), manager=manager)
    assert "\n" not in str(info.value)


def test_fitting_predictors_pass(manager):
    check_eval(**request(["resident", "on-demand", "speculative"], predictor="gate"), manager=manager)
    check_eval(**request(["hybrid"], predictor="hybrid"), manager=manager)
    check_eval(**request(["hybrid", "on-demand", "speculative"], predictor=None), manager=manager)


def make_eval(*variables) -> str:
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", "eval", *variables], cwd=REPO, env=ENV,
                         capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if "evalsuite eval" in line)


def test_make_eval_leaves_the_predictor_to_each_mode_and_passes_the_artifact():
    assert "--predictor" not in make_eval("MODE=hybrid")
    assert "--predictor 'quasi'" in make_eval("MODE=speculative", "PREDICTOR=quasi")
    assert "--predictor-path art.safetensors" in make_eval("PREDICTOR_PATH=art.safetensors")


def test_cache_and_store_options_reach_the_engine_and_the_stored_run(tmp_path):
    db = tmp_path / "r.db"
    command = [os.path.join(os.path.dirname(sys.executable), "evalsuite"), "eval", "--model", shipped_model(),
               "--modes", "on-demand", "--tasks", "evalsuite_yesno", "--limit", "1", "--cache-policy", "lfu",
               "--cache-pools", "per-layer", "--store", "disk", "--db", f"sqlite:///{db}", "--out", str(tmp_path)]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(db) as conn:
        config = json.loads(conn.execute("SELECT config FROM runs").fetchone()[0])
    assert (config["cache_policy"], config["cache_pools"], config["store"]) == ("lfu", "per-layer", "disk")
    assert "cache_policy=lfu" in config["model_args"] and "store=disk" in config["model_args"]


def test_eval_errors_name_the_commands_own_flags(tmp_path):
    """A missing artifact or a bad option is named as `--predictor-path`/`--cache-policy`, never as model_args."""
    base = [os.path.join(os.path.dirname(sys.executable), "evalsuite"), "eval", "--model", shipped_model(),
            "--tasks", "evalsuite_yesno", "--limit", "1", "--db", f"sqlite:///{tmp_path / 'r.db'}"]
    for extra, flag in ((["--modes", "speculative", "--cache-policy", "fifo"], "--cache-policy: invalid choice: 'fifo'"),
                        (["--modes", "on-demand", "--cache-capacity", "-1"], "--cache-capacity -1")):
        done = subprocess.run(base + extra, env=ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and flag in done.stderr and "=" not in done.stderr.split(flag)[0], done.stderr


def test_make_eval_compares_modes_from_one_cost_measurement_where_it_can():
    """On the CPU the main job replays its TPOTs from one cost measurement per model (order-stable); a device
    the replay cannot measure on, or PLAN=measure, times every configuration."""
    assert "--plan replay" in make_eval()
    assert "--plan measure" in make_eval("DEVICE=cuda")
    assert "--plan measure" in make_eval("PLAN=measure")
