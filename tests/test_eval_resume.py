"""`evalsuite eval` killed with SIGKILL mid-run, then run again, finishes only what is missing."""
import os
import sqlite3
import subprocess
import sys
import time

from evalsuite.results import ResultsDB

from .helpers import shipped_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def stored_tasks(path) -> int:
    if not os.path.exists(path):
        return 0
    try:
        with sqlite3.connect(path, timeout=5) as conn:
            return conn.execute("SELECT COUNT(DISTINCT task) FROM task_metrics").fetchone()[0]
    except sqlite3.OperationalError:  # tables not created yet
        return 0


def test_killed_eval_resumes_and_stores_every_result_once(tmp_path):
    db = tmp_path / "results.db"
    command = [os.path.join(os.path.dirname(sys.executable), "evalsuite"), "eval", "--model",
               shipped_model("tiny-qwen3-moe"), "--modes", "resident", "--tasks", "evalsuite_yesno,evalsuite_arith",
               "--limit", "4", "--db", f"sqlite:///{db}", "--out", str(tmp_path / "json")]
    first = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while stored_tasks(db) < 1 and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    first.kill()  # SIGKILL: no cleanup of any kind
    first.wait()
    assert stored_tasks(db) == 1, "the first task should be stored and the second cut off"
    with ResultsDB(f"sqlite:///{db}") as results:
        assert results.runs()["status"].tolist() == ["incomplete"]

    again = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming run 1 (incomplete): 1 of 2 tasks stored" in again.stdout
    with ResultsDB(f"sqlite:///{db}") as results:
        runs = results.runs()
        assert runs["status"].tolist() == ["complete"] and runs["id"].tolist() == [1]
        samples = results.samples([1])
        per_doc = samples.groupby(["task", "doc_id", "metric", "filter"], dropna=False).size()
        assert set(samples["task"]) == {"evalsuite_yesno", "evalsuite_arith"}
        assert (per_doc == 1).all() and len(per_doc) == 8  # 4 documents per task, each stored once
