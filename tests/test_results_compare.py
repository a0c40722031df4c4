"""compare(): paired tests and CIs on constructed runs, checked against values computed independently."""
import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import bootstrap

from evalsuite.cli import main
from evalsuite.results.compare import bootstrap_ci, compare, engine_deltas, format_comparison, mcnemar_exact

from .results_data import make_run, open_db


def exact_mcnemar_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar from the binomial formula: 2 * P(X <= min) for X ~ Bin(n, 1/2), capped at 1."""
    n, low = only_a + only_b, min(only_a, only_b)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2 ** n)


def test_binary_scores_get_the_exact_mcnemar_p_value(tmp_path):
    db = open_db(tmp_path)
    # 30 both right, 6 both wrong, 11 right only in A, 3 right only in B
    a = [1] * 30 + [0] * 6 + [1] * 11 + [0] * 3
    b = [1] * 30 + [0] * 6 + [0] * 11 + [1] * 3
    run_a = make_run(db, mode="resident", correct=a, tpot_ms=20.0, recall=None, hit_rate=0.4)
    run_b = make_run(db, mode="speculative", correct=b, tpot_ms=14.0, recall=0.85, hit_rate=0.7)
    table = compare(db, run_a, run_b)
    assert len(table) == 1
    row = table.iloc[0]
    assert (row["task"], row["metric"], row["n"], row["test"]) == ("arith", "exact_match", 50, "mcnemar-exact")
    assert (row["a_better"], row["b_better"]) == (11, 3)
    assert row["p_value"] == pytest.approx(exact_mcnemar_p(11, 3), rel=1e-12)
    assert row["p_value"] == pytest.approx(0.057373046875)  # 2 * (1 + 14 + 91 + 364) / 2**14
    assert row["delta"] == pytest.approx((33 - 41) / 50)
    assert row["ci_low"] < row["delta"] < row["ci_high"] and row["ci_high"] < 0.02
    assert row["tpot_ms_delta"] == pytest.approx(-6.0) and row["hit_rate_delta"] == pytest.approx(0.3)
    assert math.isnan(row["recall_at_k_delta"])  # resident has no recall
    text = format_comparison(table)
    assert "arith" in text and "mcnemar-exact" in text and "-0.1600" in text


def test_mcnemar_edge_cases():
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == (0, 0, 1.0)
    assert mcnemar_exact([1] * 6, [0] * 6)[2] == pytest.approx(exact_mcnemar_p(6, 0))  # 2 / 64


def test_non_binary_scores_get_wilcoxon(tmp_path):
    db = open_db(tmp_path)
    run_a, run_b = db.start_run({"mode": "resident"}), db.start_run({"mode": "speculative"})
    rng = np.random.default_rng(3)
    base = rng.uniform(0.2, 0.8, 40)
    for run_id, scores in ((run_a, base), (run_b, base - 0.05 - rng.uniform(0, 0.02, 40))):
        db.add_task(run_id, "summ", [{"metric": "rouge", "value": float(np.mean(scores))}], [],
                    [{"doc_id": i, "metric": "rouge", "score": float(s)} for i, s in enumerate(scores)])
        db.finish_run(run_id)
    row = compare(db, run_a, run_b).iloc[0]
    assert row["test"] == "wilcoxon" and row["p_value"] < 1e-6  # every document got worse
    assert -0.07 < row["ci_low"] < row["delta"] < row["ci_high"] < -0.05


def test_tasks_without_samples_fall_back_to_task_metrics(tmp_path):
    db = open_db(tmp_path)
    run_a, run_b = db.start_run({}), db.start_run({})
    db.add_task(run_a, "mmlu", [{"metric": "acc", "filter": "none", "value": 0.61, "n": 100}])
    db.add_task(run_b, "mmlu", [{"metric": "acc", "filter": "none", "value": 0.58, "n": 100}])
    row = compare(db, run_a, run_b).iloc[0]
    assert row["delta"] == pytest.approx(-0.03) and row["test"] == "none (no samples)" and math.isnan(row["p_value"])


def test_only_documents_both_runs_scored_are_paired(tmp_path):
    db = open_db(tmp_path)
    run_a = make_run(db, correct=[1, 1, 1, 1, 0, 0])
    run_b = make_run(db, correct=[1, 1, 0, 0])  # the last two documents are missing
    row = compare(db, run_a, run_b).iloc[0]
    assert row["n"] == 4 and row["value_a"] == 1.0 and row["value_b"] == 0.5


def test_bootstrap_ci_is_seeded_and_covers_the_mean():
    a, b = np.zeros(100), np.r_[np.ones(20), np.zeros(80)]
    assert bootstrap_ci(a, b) == bootstrap_ci(a, b)
    low, high = bootstrap_ci(a, b)
    assert 0.1 < low < 0.2 < high < 0.3


def test_bootstrap_ci_is_scipys_paired_percentile_bootstrap():
    rng = np.random.default_rng(5)
    a = rng.uniform(0, 1, 60)
    b = a + rng.normal(0.05, 0.01, 60)  # strongly paired: an unpaired bootstrap would be ~30x wider
    expected = bootstrap((a, b), lambda x, y, axis=-1: np.mean(y - x, axis=axis), paired=True, n_resamples=2000,
                         method="percentile", random_state=np.random.default_rng(0)).confidence_interval
    assert bootstrap_ci(a, b) == pytest.approx((expected.low, expected.high), rel=1e-12)
    low, high = bootstrap_ci(a, b)
    assert 0.04 < low < 0.05 < high < 0.06
    assert all(math.isnan(v) for v in bootstrap_ci([1.0], [0.0]))  # one document: nothing to resample


def test_unknown_run_ids_are_value_errors(tmp_path):
    db = open_db(tmp_path)
    run_a = make_run(db)
    with pytest.raises(ValueError, match="no run with id 77"):
        compare(db, run_a, 77)
    with pytest.raises(ValueError, match="not a number"):
        compare(db, "latest", run_a)


def test_engine_deltas_use_the_smallest_recall_k(tmp_path):
    db = open_db(tmp_path)
    run_a, run_b = make_run(db, recall=0.5, k=2), db.start_run({})
    db.add_task(run_b, "arith", [{"metric": "exact_match", "filter": "none", "value": 0.75}],
                [{"layer": None, "k": 4, "recall_at_k": 0.99, "tpot_ms": 9.0},
                 {"layer": None, "k": 2, "recall_at_k": 0.7, "tpot_ms": 9.0}])
    row = compare(db, run_a, run_b).iloc[0]
    assert row["recall_at_k_b"] == pytest.approx(0.7) and row["recall_at_k_delta"] == pytest.approx(0.2)


def configured_run(db, correct, task="arith", **config) -> int:
    """A finished run of `task` whose stored config holds `config` (model fingerprint, tasks, limit, ...)."""
    run_id = db.start_run({"model": "tiny-qwen3-moe", "mode": "resident", **config})
    db.add_task(run_id, task, [{"metric": "exact_match", "filter": "none", "value": float(np.mean(correct)),
                                "n": len(correct)}],
                [{"layer": None, "hit_rate": 0.5, "tpot_ms": 10.0}],
                [{"doc_id": i, "metric": "exact_match", "filter": "none", "score": float(c)}
                 for i, c in enumerate(correct)])
    db.finish_run(run_id)
    return run_id


SAME = {"model_fingerprint": "f00d", "tasks": ["arith"], "limit": 10, "num_fewshot": 0, "seed": 1234, "batch_size": 1,
        "gen_kwargs": None, "apply_chat_template": False}


@pytest.mark.parametrize("changed, said", [
    ({"model_fingerprint": "beef", "model": "OLMoE"}, "model fingerprint (f00d vs beef)"),
    ({"tasks": ["arith", "yesno"]}, "task set (arith vs arith,yesno)"),
    ({"limit": 5}, "limit (10 vs 5)"),
    ({"num_fewshot": 5}, "few-shot (0 vs 5)"),
    ({"seed": 7}, "seed (1234 vs 7)"),
    ({"batch_size": 4}, "batch size (1 vs 4)"),
    ({"gen_kwargs": {"temperature": 0.7, "do_sample": True}},
     "generation arguments (none vs do_sample=True,temperature=0.7)"),
    ({"apply_chat_template": True}, "chat template (False vs True)")])
def test_runs_that_measured_different_things_are_refused_unless_forced(tmp_path, changed, said):
    db = open_db(tmp_path)
    run_a = configured_run(db, [1, 0, 1, 1] * 3, **SAME)
    run_b = configured_run(db, [1, 1, 1, 0] * 3, **{**SAME, **changed})
    with pytest.raises(ValueError, match="--force") as refused:
        compare(db, run_a, run_b)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    forced = compare(db, run_a, run_b, force=True)
    assert forced.attrs["warnings"] == [f"runs {run_a} and {run_b} differ in {said}"]
    assert f"WARNING: runs {run_a} and {run_b} differ in {said}" in format_comparison(forced)
    assert compare(db, run_a, configured_run(db, [1, 1, 1, 1] * 3, **SAME)).attrs["warnings"] == []


def test_the_cli_refuses_with_exit_2_and_warns_when_forced(tmp_path, capsys):
    db = open_db(tmp_path)
    path = str(tmp_path / "results.db")
    configured_run(db, [1, 0, 1, 1, 0], **{**SAME, "limit": 5})
    configured_run(db, [1, 0, 1, 1, 1, 1, 0, 1, 1, 1], **SAME)
    assert main(["compare", "1", "2", "--db", path]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and refused.err.count("\n") == 1 and "limit (5 vs 10)" in refused.err
    assert main(["compare", "1", "2", "--db", path, "--force"]) == 0
    forced = capsys.readouterr()
    assert "warning: runs 1 and 2 differ in limit (5 vs 10)" in forced.err
    assert "WARNING: runs 1 and 2 differ in limit (5 vs 10)" in forced.out
    # the deltas pair 5 documents, the engine numbers are whole-run (5 and 10 documents): said, not hidden
    assert "whole-run deltas (A over 5 documents, B over 10)" in forced.out


def test_settings_stored_before_they_were_recorded_are_said_to_be_unknown(tmp_path):
    db = open_db(tmp_path)
    run_a = make_run(db, model="tiny:qwen3_moe")  # stores model and seed only
    run_b = make_run(db, model="tiny:qwen3_moe", mode="on-demand")
    text = format_comparison(compare(db, run_a, run_b))
    assert f"note: model fingerprint unknown for run {run_a} and {run_b} (stored before it was recorded): " \
           "compared model names instead" in text
    for name in ("task set", "limit", "few-shot"):
        assert f"note: {name} unknown for run {run_a} and {run_b}" in text
    assert "seed unknown" not in text
    other = make_run(db, model="tiny:olmoe")
    with pytest.raises(ValueError, match="model \\(tiny:qwen3_moe vs tiny:olmoe\\)"):
        compare(db, run_a, other)


def test_runs_sharing_no_task_metric_are_an_error(tmp_path, capsys):
    db = open_db(tmp_path)
    run_a, run_b = make_run(db, task="arith"), make_run(db, task="yesno")
    with pytest.raises(ValueError, match="share no task metric .*A has arith, B has yesno"):
        compare(db, run_a, run_b)
    with pytest.raises(ValueError, match="share no task metric among tasks gsm8k"):
        compare(db, run_a, make_run(db, task="arith"), tasks=["gsm8k"])
    assert main(["compare", str(run_a), str(run_b), "--db", str(tmp_path / "results.db")]) == 2
    assert "share no task metric" in capsys.readouterr().err


def test_the_paired_test_decides_and_a_disagreeing_ci_is_called_out(tmp_path):
    db = open_db(tmp_path)
    # 4 documents only B gets right, none only A: McNemar p = 2 / 2**4 = 0.125, yet the bootstrap CI excludes 0
    run_a = make_run(db, correct=[0] * 4 + [1] * 8 + [0] * 8)
    run_b = make_run(db, correct=[1] * 4 + [1] * 8 + [0] * 8)
    table = compare(db, run_a, run_b)
    row = table.iloc[0]
    assert row["p_value"] == pytest.approx(0.125) and row["ci_low"] > 0 and row["significant"] == False  # noqa: E712
    text = format_comparison(table)
    assert "significance (mcnemar-exact, p < 0.05): paired 0/1 outcomes" in text
    assert "is secondary" in text
    assert "note: arith exact_match: the bootstrap CI excludes 0 but mcnemar-exact p = 0.125 >= 0.05: not " \
           "significant" in text
    agreeing = compare(db, run_a, run_a)
    assert "note: arith exact_match" not in format_comparison(agreeing)


def _samples(hit_rates, tpot):
    return pd.DataFrame({"task": "arith", "doc_id": range(len(hit_rates)), "metric": "exact_match",
                         "hit_rate": hit_rates, "tpot_ms": tpot})


def test_engine_metrics_are_compared_on_the_paired_documents_when_stored_per_document():
    whole_a = pd.DataFrame({"task": ["arith"], "layer": [None], "k": [None], "hit_rate": [0.9], "tpot_ms": [5.0],
                            "recall_at_k": [None], "bytes_transferred": [None]})
    whole_b = whole_a.assign(hit_rate=0.1, tpot_ms=50.0)
    # A scored 10 documents, B only the first 4: the paired deltas use those 4 of A's, not A's whole run
    samples_a = _samples([0.5] * 4 + [1.0] * 6, [10.0] * 4 + [2.0] * 6)
    samples_b = _samples([0.7] * 4, [12.0] * 4)
    row = engine_deltas(samples_a, samples_b, whole_a, whole_b).loc["arith"]
    assert row["engine_basis"] == "paired" and row["engine_n"] == 4
    assert row["hit_rate_a"] == pytest.approx(0.5) and row["hit_rate_b"] == pytest.approx(0.7)
    assert row["tpot_ms_a"] == pytest.approx(10.0) and math.isnan(row["recall_at_k_a"])
    without = engine_deltas(samples_a.drop(columns=["hit_rate", "tpot_ms"]), samples_b, whole_a, whole_b)
    assert without.loc["arith", "engine_basis"] == "whole-run" and without.loc["arith", "hit_rate_a"] == 0.9


def test_a_gate_over_runs_that_measured_different_things_fails_with_the_reason(tmp_path):
    from evalsuite.results.gate import evaluate_gates

    db = open_db(tmp_path)
    configured_run(db, [1, 1, 1, 1, 0], **{**SAME, "limit": 5})
    run_b = configured_run(db, [1, 1, 1, 1, 1, 0, 1, 1, 1, 1], **SAME)
    db._write(lambda conn: conn.exec_driver_sql(f"UPDATE runs SET mode = 'speculative' WHERE id = {run_b}"))
    rule = {"name": "drop", "compare": {"baseline": {"mode": "resident"}, "candidate": {"mode": "speculative"}},
            "metric": "exact_match", "max_drop": 0.02}
    row = evaluate_gates(db, [rule]).iloc[0]
    assert not row["passed"] and "limit (5 vs 10)" in row["detail"]


def test_stored_per_sample_recall_is_compared_paired_and_a_task_without_it_whole_run(tmp_path):
    db = open_db(tmp_path)
    correct = [1, 1, 0, 1]
    run_a = make_run(db, mode="router-preserving", predictor="gate", correct=correct, recall=0.5,
                     sample_recall=[0.6, 0.5, 0.4, 0.7])
    run_b = make_run(db, mode="router-preserving", predictor="quasi", correct=correct, recall=0.6,
                     sample_recall=[0.9, 0.8, 0.6, 0.9])
    for run, recall in ((run_a, 0.5), (run_b, 0.6)):  # a loglikelihood task: no per-sample engine values
        db.add_task(run, "yesno", [{"metric": "acc", "filter": "none", "value": 0.5, "n": 2}],
                    [{"layer": None, "k": 2, "recall_at_k": recall}],
                    [{"doc_id": d, "metric": "acc", "filter": "none", "score": 1.0, "correct": True} for d in (0, 1)])
    table = compare(db, run_a, run_b).set_index("task")
    assert table.loc["arith", "engine_basis"] == "paired"
    assert table.loc["arith", "recall_at_k_delta"] == pytest.approx((0.9 + 0.8 + 0.6 + 0.9 - 2.2) / 4)
    assert table.loc["yesno", "engine_basis"] == "whole-run"
    assert table.loc["yesno", "recall_at_k_delta"] == pytest.approx(0.1)
