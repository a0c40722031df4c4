"""compare(): paired tests and CIs on constructed runs, checked against values computed independently."""
import math

import numpy as np
import pytest

from evalsuite.results.compare import bootstrap_ci, compare, format_comparison, mcnemar_exact

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
    d = np.r_[np.ones(20), np.zeros(80)]
    assert bootstrap_ci(d) == bootstrap_ci(d)
    low, high = bootstrap_ci(d)
    assert 0.1 < low < 0.2 < high < 0.3


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
