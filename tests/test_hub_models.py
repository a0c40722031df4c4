"""A Hugging Face Hub id as the model: resolved offline through a populated local cache, refused in one line
(before anything is stored) when the cache does not hold it."""
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from .helpers import TASKS, shipped_model

BIN = os.path.dirname(sys.executable)
REPO_ID = "evalsuite-test/tiny-qwen3-moe"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An HF_HOME whose hub cache holds REPO_ID at REVISION (the layout huggingface_hub writes: the files under
    snapshots/<commit>, refs/main naming that commit), filled from the shipped tiny model."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(shipped_model(), repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return home


def offline(hf_home) -> dict:
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def eval_command(model: str, tmp_path) -> list[str]:
    return [os.path.join(BIN, "evalsuite"), "eval", "--model", model, "--modes", "resident,on-demand", "--tasks",
            "evalsuite_yesno", "--limit", "2", "--store", "disk", "--db", f"sqlite:///{tmp_path / 'r.db'}",
            "--out", str(tmp_path / "json")]


def test_eval_runs_a_hub_model_from_the_local_cache_offline(hf_home, tmp_path):
    done = subprocess.run(eval_command(REPO_ID, tmp_path), env=offline(hf_home), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(tmp_path / "r.db") as conn:
        rows = conn.execute("SELECT model, status, config FROM runs ORDER BY id").fetchall()
    assert [(model, status) for model, status, _ in rows] == [(REPO_ID, "complete")] * 2
    config = json.loads(rows[1][2])
    assert config["model_path"].endswith(os.path.join("snapshots", REVISION))
    assert REPO_ID in done.stdout and "1.000" in done.stdout  # on-demand: every token as resident's
    assert any(name.startswith(f"1-{REPO_ID.replace('/', '--')}-resident") for name in os.listdir(tmp_path / "json"))


def test_a_hub_id_not_in_the_cache_gets_one_line_and_nothing_is_stored(hf_home, tmp_path):
    done = subprocess.run(eval_command("evalsuite-test/not-cached", tmp_path), env=offline(hf_home),
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "'evalsuite-test/not-cached'" in lines[0] and "hf download evalsuite-test/not-cached" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0] and "--model DIR" in lines[0]
    if (tmp_path / "r.db").exists():  # the preflight may have created the schema, never a run
        with sqlite3.connect(tmp_path / "r.db") as conn:
            assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_the_lm_eval_adapter_takes_a_hub_id_as_pretrained(hf_home):
    done = subprocess.run(
        [os.path.join(BIN, "evalsuite-lm-eval"), "--model", "specmoe", "--model_args",
         f"pretrained={REPO_ID},mode=on-demand,store=disk,cache_capacity=0.25", "--include_path", TASKS,
         "--tasks", "evalsuite_yesno", "--limit", "1"], env=offline(hf_home), capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hit_rate" in done.stdout
    missing = subprocess.run(
        [os.path.join(BIN, "evalsuite-lm-eval"), "--model", "specmoe", "--model_args",
         "pretrained=evalsuite-test/not-cached", "--include_path", TASKS, "--tasks", "evalsuite_yesno",
         "--limit", "1"], env=offline(hf_home), capture_output=True, text=True, timeout=300)
    last = missing.stderr.strip().splitlines()[-1]
    assert missing.returncode == 2 and last.startswith("evalsuite-lm-eval: error:") and "pretrained=DIR" in last
