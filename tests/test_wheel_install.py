"""A wheel built from the checkout, installed outside it, carries every file the package reads (the task
files of the top-level tasks/ among them, as evalsuite/tasks/) and runs `evalsuite eval` on a shipped model
path, finding every task from the installed copy alone."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from .helpers import REPO, shipped_model

# What a wheel is built from: the checkout without what is not the package's (models stay in models/).
TOP_LEFT_OUT = {".git", ".venv", "models", "results", "build", ".pytest_cache", ".hypothesis"}
ANYWHERE_LEFT_OUT = shutil.ignore_patterns("__pycache__", "*.egg-info")


def left_out(folder: str, names: list[str]) -> set[str]:
    top = TOP_LEFT_OUT if os.path.samefile(folder, REPO) else set()
    return top & set(names) | ANYWHERE_LEFT_OUT(folder, names)


def run(command, cwd, env=None, timeout=900) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder holding the installed package, its bin folder, an empty working directory)."""
    root = tmp_path_factory.mktemp("wheel")
    source, site, elsewhere = root / "source", root / "site", root / "elsewhere"
    shutil.copytree(REPO, source, ignore=left_out)  # a copy: no build/ leftovers of the checkout in the wheel
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
         "-w", str(root / "dist")], cwd=root)
    wheel = next((root / "dist").glob("evalsuite-*.whl"))
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], cwd=root)
    elsewhere.mkdir()
    return site, site / "bin", elsewhere


def installed_env(site) -> dict:
    return {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def source_files(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(here, name), folder) for here, dirs, names in os.walk(folder)
            if "__pycache__" not in here for name in names if not name.endswith(".pyc")}


def test_the_wheel_carries_every_file_of_the_package(installed):
    site, _, _ = installed
    # evalsuite/, and the top-level tasks/ as evalsuite/tasks/ (pyproject's package-dir)
    files = source_files(os.path.join(REPO, "evalsuite")) | {
        os.path.join("tasks", f) for f in source_files(os.path.join(REPO, "tasks"))}
    assert {"tasks/hooks.py", "tasks/evalsuite_arith.yaml"} <= files
    missing = sorted(f for f in files if not (site / "evalsuite" / f).is_file())
    assert missing == []
    assert not (site / "models").exists() and not (site / "evalsuite" / "models").exists()


INDEX = """
import json, os
from lm_eval.tasks import TaskManager
import evalsuite
from evalsuite.tasks import TASKS_DIR
names = sorted(f[:-5] for f in os.listdir(TASKS_DIR) if f.endswith(".yaml"))
known = TaskManager(include_path=TASKS_DIR, include_defaults=False).all_tasks  # the project's tasks alone
print(json.dumps({"package": evalsuite.__file__, "tasks_dir": TASKS_DIR, "yamls": names,
                  "unknown": [n for n in names if n not in known]}))
"""


def test_the_installed_copy_finds_every_task_from_outside_the_source_tree(installed):
    site, _, elsewhere = installed
    out = json.loads(run([sys.executable, "-c", INDEX], cwd=elsewhere, env=installed_env(site)).stdout.splitlines()[-1])
    assert out["package"] == str(site / "evalsuite" / "__init__.py")
    assert out["tasks_dir"] == str(site / "evalsuite" / "tasks")
    assert {"evalsuite_arith", "gsm8k_es", "humaneval_es", "evalsuite_all"} <= set(out["yamls"])
    assert out["unknown"] == []


def test_installed_evalsuite_eval_runs_a_shipped_model_by_its_path(installed):
    site, bin_dir, elsewhere = installed
    db = elsewhere / "results.db"
    result = run([str(bin_dir / "evalsuite"), "eval", "--model", shipped_model("tiny-qwen3-moe"), "--modes", "resident",
                  "--tasks", "evalsuite_arith", "--limit", "2", "--db", f"sqlite:///{db}",
                  "--out", str(elsewhere / "json")], cwd=elsewhere, env=installed_env(site))
    table = result.stdout
    assert "evalsuite_arith" in table and "resident" in table
    assert len(list((elsewhere / "json").glob("*.json"))) == 1


def test_without_model_the_shipped_models_are_looked_for_under_the_working_directory(tmp_path, monkeypatch, capsys):
    from evalsuite.cli import default_models, main
    from evalsuite.lm.preflight import check_eval

    db = f"sqlite:///{tmp_path / 'results.db'}"
    monkeypatch.chdir(REPO)  # a checkout's root: they are there
    check_eval(default_models(), ["resident"], ["evalsuite_yesno"], 1, db_url=db)
    monkeypatch.chdir(tmp_path)  # anywhere else: one line saying what to pass
    assert main(["eval", "--modes", "resident", "--tasks", "evalsuite_yesno", "--limit", "1", "--db", db]) == 2
    assert "no model directory 'models/tiny-qwen3-moe'" in capsys.readouterr().err


RECALL = """
import json, evaluate
from evalsuite.evaluate_modules import module_path
path = module_path("expert_recall")
recall = evaluate.load(path).compute(predictions=[[0.1, 2.3, 0.7, 1.5]], references=[[1, 3]], k=2)
print(json.dumps({"path": path, "recall": recall}))
"""


def test_the_installed_evaluate_modules_load_by_path(installed, tmp_path):
    site, _, elsewhere = installed
    env = {**installed_env(site), "HF_HOME": str(tmp_path / "hf"), "HF_EVALUATE_OFFLINE": "1"}
    out = json.loads(run([sys.executable, "-c", RECALL], cwd=elsewhere, env=env).stdout.splitlines()[-1])
    assert out == {"path": str(site / "evalsuite" / "evaluate_modules" / "expert_recall"), "recall": {"recall@2": 1.0}}
