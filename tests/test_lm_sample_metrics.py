"""Each generated sample carries its own engine metrics: in lm-eval's logged samples, in the results database, and
through `evalsuite-lm-eval --db`; prefetch precision is left out where speculation makes it 1.0 by construction."""
import json
import sys

import lm_eval
import pytest
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from evalsuite.lm import add_engine_metrics  # (registers specmoe)
from evalsuite.lm import cli
from evalsuite.results.database import stored_config

from .helpers import TASKS, shipped_model
from .results_data import open_db

MODEL = shipped_model("tiny-qwen3-moe")
TASK = "evalsuite_arith"


@pytest.fixture(scope="module")
def manager():
    return TaskManager(include_path=TASKS)


def adapter(engine_args: str, batch_size: int):
    return get_model("specmoe").create_from_arg_string(f"pretrained={MODEL},{engine_args}",
                                                       {"batch_size": batch_size, "device": "cpu"})


def evaluate(lm, manager, **kwargs) -> dict:
    return add_engine_metrics(lm_eval.simple_evaluate(model=lm, tasks=[TASK], log_samples=True, task_manager=manager,
                                                      **kwargs))


def per_document(results) -> dict[int, dict]:
    return {s["doc_id"]: s["engine"] for s in results["samples"][TASK]}


@pytest.fixture(scope="module")
def speculative_batched(manager):
    lm = adapter("mode=speculative,predictor=gate,cache_capacity=0.25", batch_size=2)
    try:
        yield evaluate(lm, manager, limit=5)
    finally:
        lm.engine.close()


def test_every_batch_row_reaches_its_own_sample_once(speculative_batched):
    results = speculative_batched
    summary, documents = results["engine"][TASK], per_document(results)
    assert sorted(documents) == list(range(5))
    # each row counted once: the documents' shares add up to the task's bytes, their recall averages to its recall
    assert sum(d["bytes_transferred"] for d in documents.values()) == pytest.approx(summary["bytes_transferred"])
    for layer, whole in summary["recall"][2]["layers"].items():
        assert sum(d["recall"][2]["layers"][layer] for d in documents.values()) / 5 == pytest.approx(whole)
    for d in documents.values():
        layers = d["recall"][2]["layers"]
        assert d["recall"][2]["mean"] == pytest.approx(sum(layers.values()) / len(layers))
        assert 0 <= d["hit_rate"] <= 1 and d["tpot_ms"] > 0
    # rows of one batch share their request's hit rate and TPOT: five documents at batch 2 make three requests
    assert len({(d["hit_rate"], d["tpot_ms"]) for d in documents.values()}) == summary["requests"] == 3
    assert "prefetch_precision,engine" not in results["results"][TASK]  # 1.0 by construction when speculating
    assert summary["prefetch_precision"] is None and summary["prefetches"] > 0


def test_the_samples_table_stores_each_documents_engine_metrics(speculative_batched, tmp_path):
    results = speculative_batched
    db = open_db(tmp_path)
    run_id = db.record_lm_eval({"model": "tiny-qwen3-moe", "mode": "speculative"}, results, results["engine"])
    stored = db.samples([run_id]).drop_duplicates("doc_id").set_index("doc_id")
    for doc, engine in per_document(results).items():
        row = stored.loc[doc]
        assert (row["recall_at_k"], row["k"]) == (pytest.approx(engine["recall"][2]["mean"]), 2)
        assert row["recall_per_layer"] == {str(layer): pytest.approx(v)
                                           for layer, v in engine["recall"][2]["layers"].items()}
        assert row[["hit_rate", "bytes_transferred", "tpot_ms"]].tolist() == pytest.approx(
            [engine["hit_rate"], engine["bytes_transferred"], engine["tpot_ms"]])


def test_a_documents_recall_is_its_own_whichever_documents_ran_beside_it(manager):
    # router-preserving: recall depends on the document alone (not on the cache), so a document keeps its recall
    # when evaluated among other documents, which lm-eval runs in another order
    # (documents are matched by content: lm-eval numbers the documents of `samples=` its own way)
    lm = adapter("mode=router-preserving,predictor=gate,cache_capacity=0.25", batch_size=1)
    try:
        together = recall_by_content(evaluate(lm, manager, limit=4))
        apart = recall_by_content(evaluate(lm, manager, samples={TASK: [3, 1]}))
    finally:
        lm.engine.close()
    assert len(together) == 4 and len(set(together.values())) == 4  # the documents are told apart by their recall
    assert len(apart) == 2 and apart == {doc: together[doc] for doc in apart}


def recall_by_content(results) -> dict[str, tuple]:
    """Per document, its own recall@k at every k, exact@K and recall_next_token@K (evalsuite.engine.metrics)."""
    return {s["doc_hash"]: tuple(values["mean"] for metric in ("recall", "exact", "recall_next_token")
                                 for _, values in sorted(s["engine"][metric].items()))
            for s in results["samples"][TASK]}


def test_lm_eval_cli_with_db_stores_the_run_and_logs_per_sample_metrics(tmp_path, monkeypatch, capsys):
    out, db_path = tmp_path / "out", tmp_path / "results.db"
    monkeypatch.setattr(sys, "argv", [
        "evalsuite-lm-eval", "--model", "specmoe", "--model_args",
        f"pretrained={MODEL},mode=speculative,predictor=gate,cache_capacity=0.25", "--device", "cpu",
        "--include_path", TASKS, "--tasks", TASK, "--limit", "2", "--db", str(db_path), "--log_samples",
        "--output_path", str(out)])
    cli.main()
    assert "stored as run 1" in capsys.readouterr().err
    db = open_db(tmp_path)
    run = db.run(1)
    assert (run["status"], run["model"], run["mode"], run["predictor"], run["limit"]) == \
        ("complete", "tiny-qwen3-moe", "speculative", "gate", 2)
    assert run["model_fingerprint"] and stored_config(run["config"])["source"] == "evalsuite-lm-eval"
    assert "exact_match" in set(db.task_metrics([1])["metric"])
    assert db.engine_metrics([1])["recall_at_k"].notna().any()
    stored = db.samples([1]).drop_duplicates("doc_id").set_index("doc_id")
    logged = [json.loads(line) for path in out.rglob("samples_*.jsonl") for line in path.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in logged) == sorted(stored.index) == [0, 1]
    for sample in logged:  # lm-eval's own --log_samples file carries what the database stores
        assert sample["engine"]["recall"]["2"]["mean"] == pytest.approx(stored.loc[sample["doc_id"], "recall_at_k"])
        assert sample["engine"]["bytes_transferred"] == pytest.approx(
            stored.loc[sample["doc_id"], "bytes_transferred"])


def test_lm_eval_cli_refuses_a_bad_db_in_one_line_before_loading_a_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["evalsuite-lm-eval", "--model", "specmoe", "--model_args",
                                      f"pretrained={tmp_path / 'no-such-model'}", "--tasks", TASK,
                                      "--db", str(tmp_path / "no-such-dir" / "r.db")])
    with pytest.raises(SystemExit) as exit_code:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_code.value.code == 2 and err.count("\n") == 0
    assert err.startswith("evalsuite-lm-eval: error:") and "no-such-dir" in err and "no-such-model" not in err
