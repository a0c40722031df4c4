"""Results database: schema creation and upgrade, locations, bad URLs, writing runs and lm-eval output."""
import sqlite3
from datetime import datetime, timedelta

import pandas as pd
import pytest
from sqlalchemy import inspect, text

from evalsuite.results import ResultsDB
from evalsuite.results.schema import LATEST_VERSION

from .results_data import make_run, open_db

# The first released schema, written out by hand: what an old results.db holds.
V1_SCHEMA = """
CREATE TABLE schema_version (version INTEGER PRIMARY KEY);
INSERT INTO schema_version VALUES (1);
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started_at DATETIME, finished_at DATETIME,
  status VARCHAR(16), model TEXT, model_fingerprint VARCHAR(128), mode VARCHAR(64), predictor VARCHAR(64),
  predictor_artifact VARCHAR(128), cache_capacity VARCHAR(64), cache_policy VARCHAR(32), link VARCHAR(64),
  dtype VARCHAR(32), device VARCHAR(64), hardware TEXT, evalsuite_version VARCHAR(64), git_commit VARCHAR(64),
  lm_eval_version VARCHAR(64), seed INTEGER, "limit" FLOAT, config JSON);
CREATE TABLE task_metrics (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id),
  task VARCHAR(255), metric VARCHAR(128), filter VARCHAR(128), value FLOAT, stderr FLOAT, n INTEGER);
CREATE TABLE engine_metrics (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id),
  task VARCHAR(255), layer INTEGER, recall_at_k FLOAT, k INTEGER, prefetch_precision FLOAT, hit_rate FLOAT,
  bytes_transferred FLOAT, stall_s FLOAT, ttft_ms FLOAT, tpot_ms FLOAT, tokens INTEGER);
CREATE TABLE samples (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id),
  task VARCHAR(255), doc_id INTEGER, score FLOAT, correct BOOLEAN, prediction TEXT, target TEXT,
  first_divergence INTEGER, identical_share FLOAT);
INSERT INTO runs (id, started_at, finished_at, status, model, mode, config)
  VALUES (1, '2025-01-02 03:04:05.000000', '2025-01-02 04:00:00.000000', 'complete', 'old-model', 'resident', '{}');
INSERT INTO task_metrics (run_id, task, metric, filter, value, stderr, n) VALUES (1, 'arith', 'acc', 'none', 0.75, 0.1, 4);
INSERT INTO samples (run_id, task, doc_id, score, correct, prediction, target) VALUES (1, 'arith', 0, 1.0, 1, '4', '4');
"""


def _version(db):
    with db.sql_engine.connect() as conn:
        return conn.execute(text("SELECT version FROM schema_version")).scalar()


def test_new_database_has_every_table_at_the_latest_version(tmp_path):
    db = open_db(tmp_path)
    names = set(inspect(db.sql_engine).get_table_names())
    assert {"schema_version", "runs", "task_metrics", "engine_metrics", "samples"} <= names
    assert _version(db) == LATEST_VERSION and db.schema_version_found == 0
    with db.sql_engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_v1_database_upgrades_in_place_keeping_its_runs(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(V1_SCHEMA)
    db = ResultsDB(f"sqlite:///{path}")
    assert db.schema_version_found == 1 and _version(db) == LATEST_VERSION
    columns = {c["name"] for c in inspect(db.sql_engine).get_columns("runs")}
    assert {"writer_pid", "writer_host", "heartbeat_at", "error", "uid"} <= columns
    assert {"metric", "filter", "response"} <= {c["name"] for c in inspect(db.sql_engine).get_columns("samples")}
    old = db.run(1)
    assert (old["model"], old["status"], old["started_at"]) == ("old-model", "complete", datetime(2025, 1, 2, 3, 4, 5))
    assert db.task_metrics([1])["value"].tolist() == [0.75]
    # the upgraded database takes new runs with the new columns
    new = make_run(db, correct=(1, 1))
    assert db.samples([new])["metric"].tolist() == ["exact_match", "exact_match"]
    assert db.samples([1])["prediction"].tolist() == ["4"]
    db.close()
    assert ResultsDB(f"sqlite:///{path}").schema_version_found == LATEST_VERSION  # upgrades once


def test_newer_schema_is_refused_without_changes(tmp_path):
    path = tmp_path / "future.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(V1_SCHEMA.replace("VALUES (1);", "VALUES (99);", 1))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="schema version 99, newer .*upgrade evalsuite"):
        ResultsDB(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_default_location_is_results_db_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVALSUITE_DB", raising=False)
    make_run(ResultsDB())
    assert (tmp_path / "results" / "results.db").exists()
    monkeypatch.setenv("EVALSUITE_DB", f"sqlite:///{tmp_path / 'other.db'}")
    assert ResultsDB().runs().empty
    assert ResultsDB(str(tmp_path / "results" / "results.db")).runs()["status"].tolist() == ["complete"]


@pytest.mark.parametrize("url, message", [
    ("nosuchdb://host/x", "no driver for results database"),
    ("postgresql+psycopg://user:secret@127.0.0.1:1/evalsuite", "cannot open results database .*server is running"),
    ("sqlite:////no/such/folder/results.db", "folder /no/such/folder does not exist"),
    ("sqlite:/results.db", "not a URL"),
    ("postgresql://user@host:port/db", "not a URL"),
])
def test_bad_urls_raise_one_line_value_errors(url, message):
    with pytest.raises(ValueError, match=message) as caught:
        ResultsDB(url)
    assert "\n" not in str(caught.value) and "secret" not in str(caught.value)


def test_a_file_that_is_not_a_database_is_left_alone(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("my precious notes\n" * 200)
    with pytest.raises(ValueError, match="cannot open results database"):
        ResultsDB(str(path))
    assert path.read_text() == "my precious notes\n" * 200


def test_a_foreign_database_with_a_runs_table_is_refused(tmp_path):
    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE runs (x INTEGER)")
    with pytest.raises(ValueError, match="not an evalsuite results database"):
        ResultsDB(str(path))


def test_run_columns_config_and_provenance(tmp_path):
    db = open_db(tmp_path)
    run_id = db.start_run({"model": "m", "mode": "speculative", "cache_capacity": 8, "limit": 20,
                           "temperature": 0.0, "predictor_path": "/tmp/p.safetensors"})
    run = db.run(run_id)
    assert run["status"] == "running" and run["cache_capacity"] == "8" and run["limit"] == 20
    assert run["config"]["temperature"] == 0.0 and run["config"]["predictor_path"] == "/tmp/p.safetensors"
    assert run["hardware"] and run["evalsuite_version"] and run["lm_eval_version"] == "0.4.13"
    db.finish_run(run_id, "complete")
    assert db.run(run_id)["finished_at"] is not None


def test_add_task_replaces_an_earlier_write_of_the_same_task(tmp_path):
    db = open_db(tmp_path)
    run_id = db.start_run({"model": "m"})
    db.add_task(run_id, "t", [{"metric": "acc", "value": 0.1}], [], [{"doc_id": 0, "score": 0.0}])
    db.add_task(run_id, "t", [{"metric": "acc", "value": 0.9}], [], [{"doc_id": 0, "score": 1.0}])
    assert db.task_metrics([run_id])["value"].tolist() == [0.9]
    assert db.samples([run_id])["score"].tolist() == [1.0]


def test_bad_rows_and_ids_are_refused(tmp_path):
    db = open_db(tmp_path)
    run_id = db.start_run({})
    with pytest.raises(ValueError, match="engine_metrics has no column recal_at_k"):
        db.add_task(run_id, "t", [], [{"recal_at_k": 0.5}], [])
    with pytest.raises(ValueError, match="no run with id 999"):
        db.add_task(999, "t", [{"metric": "acc", "value": 1.0}])
    with pytest.raises(ValueError, match="not one of"):
        db.finish_run(run_id, "done")
    with pytest.raises(ValueError, match="no run with id 42"):
        db.run(42)


def test_a_run_on_another_host_goes_incomplete_when_its_heartbeat_is_old(tmp_path):
    db = open_db(tmp_path)
    quiet, recent, mine = db.start_run({}), db.start_run({}), db.start_run({})
    with db.sql_engine.begin() as conn:
        conn.execute(text("UPDATE runs SET writer_host = 'elsewhere', heartbeat_at = :t WHERE id = :id"),
                     {"t": datetime.utcnow() - timedelta(days=2), "id": quiet})
        conn.execute(text("UPDATE runs SET writer_host = 'elsewhere' WHERE id = :id"), {"id": recent})
    statuses = dict(zip(*open_db(tmp_path).runs()[["id", "status"]].to_numpy().T))
    assert statuses == {quiet: "incomplete", recent: "running", mine: "running"}  # this process is alive


def test_record_lm_eval_writes_metrics_stderr_and_samples(tmp_path):
    db = open_db(tmp_path)
    results = {
        "results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.25,
                              "exact_match,flexible-extract": 1.0, "exact_match_stderr,flexible-extract": "N/A"},
                    "arc_easy": {"alias": "arc_easy", "acc,none": 1.0, "acc_stderr,none": 0.0, "acc_norm,none": 0.5,
                                 "acc_norm_stderr,none": 0.3}},
        "n-samples": {"gsm8k": {"original": 1319, "effective": 2}, "arc_easy": {"original": 2376, "effective": 1}},
        "samples": {
            "gsm8k": [{"doc_id": d, "target": "42", "filter": f, "metrics": ["exact_match"], "exact_match": s,
                       "filtered_resps": [r], "resps": [["raw"]]}
                      for d, f, s, r in ((0, "strict-match", 1.0, "42"), (1, "strict-match", 0.0, "[invalid]"),
                                         (0, "flexible-extract", 1.0, "42"), (1, "flexible-extract", 1.0, "41"))],
            "arc_easy": [{"doc_id": 7, "target": 2, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 1.0,
                          "acc_norm": 0.0, "filtered_resps": [(-1.5, False), (-0.5, True)]}]},
        "config": {"model": "hf", "model_args": "pretrained=tiny", "limit": 2, "random_seed": 0},
        "lm_eval_version": "0.4.13",
    }
    run_id = db.record_lm_eval({"mode": "resident", "model": "tiny"}, results,
                               engine_by_task={"gsm8k": {"tpot_ms": 12.5, "hit_rate": 0.75}})
    run = db.run(run_id)
    assert (run["status"], run["model"], run["limit"], run["seed"]) == ("complete", "tiny", 2, 0)
    metrics = db.task_metrics([run_id]).set_index(["task", "metric", "filter"])
    assert metrics.loc[("gsm8k", "exact_match", "strict-match"), ["value", "stderr", "n"]].tolist() == [0.5, 0.25, 2]
    assert pd.isna(metrics.loc[("gsm8k", "exact_match", "flexible-extract"), "stderr"])
    assert len(metrics) == 4
    samples = db.samples([run_id])
    strict = samples[(samples["task"] == "gsm8k") & (samples["filter"] == "strict-match")]
    assert strict["correct"].tolist() == [True, False] and strict["prediction"].tolist() == ["42", "[invalid]"]
    arc = samples[samples["task"] == "arc_easy"].set_index("metric")
    assert arc.loc["acc_norm", "score"] == 0.0 and arc.loc["acc", "target"] == "2"
    assert arc.loc["acc", "prediction"] == "[[-1.5, false], [-0.5, true]]"
    assert db.engine_metrics([run_id])[["task", "tpot_ms"]].values.tolist() == [["gsm8k", 12.5]]


def test_record_lm_eval_marks_the_run_failed_when_writing_breaks(tmp_path):
    db = open_db(tmp_path)
    with pytest.raises(ValueError, match="no column"):
        db.record_lm_eval({"model": "m"}, {"results": {"t": {"acc,none": 1.0}}}, engine_by_task={"t": {"bogus": 1}})
    assert db.runs()["status"].tolist() == ["failed"]


def test_record_lm_eval_takes_the_engine_summary_of_the_lm_eval_adapter(tmp_path):
    db = open_db(tmp_path)
    counters = {"expert_uses": 40, "hits": 30, "misses": 10, "prefetches": 12, "prefetch_used": 9,
                "prefetch_wasted": 3, "bytes_transferred": 4096, "stall_s": 0.002}
    summary = {**counters, "hit_rate": 0.75, "prefetch_precision": 0.75, "requests": 2, "tokens": 16,
               "ttft_ms": {"mean": 9.0, "median": 8.0, "n": 2}, "tpot_ms": {"mean": 3.0, "median": 2.5, "n": 2},
               "layers": {"0": {**counters, "hit_rate": 0.5}, "1": {**counters, "hit_rate": 1.0}},
               "recall": {"2": {"mean": 0.8, "layers": {"1": 0.8}, "samples": 2},
                          "4": {"mean": 0.95, "layers": {"1": 0.95}, "samples": 2}},
               "mode": "speculative", "predictor": "quasi", "cache_experts": 8, "link": "pcie4"}
    results = {"results": {"arith": {"acc,none": 0.5, "acc_stderr,none": 0.1, "tpot_ms,engine": 2.5,
                                     "hit_rate,engine": 0.75}}}
    run_id = db.record_lm_eval({"model": "tiny", "mode": "speculative"}, results, {"arith": summary})
    assert db.task_metrics([run_id])["metric"].tolist() == ["acc"]  # the ',engine' copies are not task metrics
    engine = db.engine_metrics([run_id])
    whole = engine[engine["layer"].isna()].set_index("k")
    assert whole.loc[2, ["recall_at_k", "hit_rate", "tpot_ms", "ttft_ms", "tokens"]].tolist() == [0.8, 0.75, 2.5, 8.0, 16]
    assert whole.loc[4, "recall_at_k"] == 0.95
    per_layer = engine.dropna(subset=["layer"]).set_index(["layer", "k"])
    assert per_layer.loc[(1, 2), ["recall_at_k", "hit_rate"]].tolist() == [0.8, 1.0]
    assert pd.isna(per_layer.loc[(0, 2), "recall_at_k"]) and per_layer.loc[(0, 4), "hit_rate"] == 0.5


def test_a_failed_run_keeps_its_error(tmp_path):
    db = open_db(tmp_path)
    run_id = db.start_run({"model": "m"})
    db.finish_run(run_id, "failed", error="AssertionError: requested max tokens to generate (512) ...")
    assert db.run(run_id)["error"] == "AssertionError: requested max tokens to generate (512) ..."
    assert db.run(make_run(db))["error"] is None


def test_every_run_gets_its_own_uid(tmp_path):
    db = open_db(tmp_path)
    uids = {db.run(db.start_run({"model": "m"}))["uid"] for _ in range(3)}
    assert len(uids) == 3 and all(isinstance(u, str) and len(u) >= 16 for u in uids)
