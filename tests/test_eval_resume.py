"""`evalsuite eval` killed with SIGKILL mid-run, then run again, finishes only what is missing."""
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

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


# ---- what a resume reads: this database's rows, never lm-eval JSON left under a shared --out ----------
@pytest.fixture(autouse=True)
def _one_code_version(monkeypatch):
    # the checkout is shared: a commit landing between two evaluations would change their configuration
    monkeypatch.setattr("evalsuite.lm.request.git_commit", lambda: "0" * 40)


def _suite(db, out, modes=("resident",), limit=2):
    from evalsuite.lm.suite import run_suite

    rows = run_suite([shipped_model("tiny-qwen3-moe")], list(modes), ["evalsuite_yesno"], limit,
                     db_url=f"sqlite:///{db}", out_dir=str(out), progress=lambda *_: None)
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def test_a_resume_ignores_json_another_database_wrote_under_the_shared_out_folder(tmp_path):
    out = tmp_path / "results"
    first = _suite(tmp_path / "x.db", out)
    written = set(out.iterdir())
    _suite(tmp_path / "y.db", out, limit=3)  # run 1 of another database, same model, same --out
    assert len(set(out.iterdir()) - written) == 1, "another database's run must not overwrite this one's JSON"
    for path in out.iterdir():  # whatever the folder holds, a resume must not read it
        data = json.loads(path.read_text())
        for values in data["results"].values():
            values.update({k: -1.0 for k, v in values.items() if isinstance(v, float)})
        path.write_text(json.dumps(data))
    again = _suite(tmp_path / "x.db", out)
    # the TPOT spread and the busy flag belong to the invocation that measured them; the database
    # keeps the median, which a resumed row shows
    measured_only = ("tpot_p10", "tpot_p90", "busy", "probes")  # what a run's timing saw, not stored
    assert [{k: v for k, v in r.items() if k not in measured_only} for r in again] == \
        [{k: v for k, v in r.items() if k not in measured_only} for r in first] and first[0]["accuracy"] >= 0
    assert all(r["tpot_p10"] is None for r in again) and first[0]["tpot_p10"] is not None


def test_a_resume_without_the_json_folder_keeps_the_resident_row_and_compares_with_it(tmp_path):
    db = tmp_path / "results.db"
    _suite(db, tmp_path / "first")
    rows = _suite(db, tmp_path / "elsewhere", modes=("resident", "on-demand"))
    assert [(r["mode"], r["run"]) for r in rows] == [("resident", 1), ("on-demand", 2)]
    assert rows[1]["identical_share"] == 1.0  # on-demand is exact: compared with run 1's stored texts
    with ResultsDB(f"sqlite:///{db}") as results:
        samples = results.samples([2])
        assert samples["identical_share"].tolist() == [1.0] * len(samples) and samples["first_divergence"].isna().all()
