"""Accuracy as a function of recall (evalsuite.results.recall_curve) on constructed runs whose curve is known."""
import numpy as np
import pandas as pd
import pytest

from evalsuite.results.recall_curve import (document_scores, format_recall_report, parse_recall_name,
                                            plot_recall_curves, recall_curve_report, recall_needed, recall_points,
                                            trend_tests, where_misses_hurt)

from .results_data import open_db

N = 200
LEVELS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
RESIDENT = np.array([1] * 160 + [0] * 40)  # accuracy 0.80
# documents the resident gets right that each uniform level gets wrong (nested: a lower recall loses more): 0, 0,
# 0.5, 3, 10, 20 and 30 points; so within 1 point down to 0.9 and within 5 points down to 0.8
LOST = {1.0: 0, 0.95: 0, 0.9: 1, 0.8: 6, 0.7: 20, 0.6: 40, 0.5: 60}
NEAR_LOST = {0.9: 4, 0.8: 12}
RANGE_LOST = {"early": 2, "middle": 5, "late": 20}  # at recall 0.7


def losing(count: int) -> np.ndarray:
    scores = RESIDENT.copy()
    scores[:count] = 0
    return scores


def store(db, model, task, mode, predictor, scores, doc_ids=None, recall=None, limit=None) -> int:
    """A complete run of one task: per-document 0/1 scores and, with `recall`, whole-model engine rows at k = 2
    (a wrong value) and at the router's top-k 8 (recall@K, the one to read)."""
    run_id = db.start_run({"model": model, "mode": mode, "predictor": predictor, "seed": 1, "limit": limit})
    doc_ids = range(len(scores)) if doc_ids is None else doc_ids
    samples = [{"doc_id": int(d), "metric": "exact_match", "filter": "none", "score": float(s), "correct": bool(s)}
               for d, s in zip(doc_ids, scores)]
    engine = [] if recall is None else [{"layer": None, "k": 2, "top_k": 8, "recall_at_k": 0.1},
                                        {"layer": None, "k": 8, "top_k": 8, "recall_at_k": recall}]
    db.add_task(run_id, task, [{"metric": "exact_match", "filter": "none", "value": float(np.mean(scores)),
                                "n": len(scores)}], engine, samples)
    db.finish_run(run_id)
    return run_id


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("recall")
    database = open_db(path)
    ids = {}
    rng = np.random.default_rng(7)
    # model A, task 'falling': accuracy falls with recall under every error model
    store(database, "moe-a", "falling", "resident", None, RESIDENT)
    for level in LEVELS:
        store(database, "moe-a", "falling", "speculative", f"recall-{level}", losing(LOST[level]),
              recall=level + 0.01 * (level < 1))
    for level, lost in NEAR_LOST.items():
        store(database, "moe-a", "falling", "speculative", f"recall-{level}-near", losing(lost), recall=level)
    for layers, lost in RANGE_LOST.items():
        store(database, "moe-a", "falling", "speculative", f"recall-0.7-{layers}", losing(lost), recall=0.9)
    # a real predictor that scored only half the resident's documents, in another order, plus some the resident
    # did not score: paired on the 100 shared documents, where it loses 5
    half = np.arange(99, -1, -1)
    ids["quasi"] = store(database, "moe-a", "falling", "speculative", "quasi",
                         np.r_[losing(5)[half], np.ones(10)], doc_ids=np.r_[half, np.arange(500, 510)], recall=0.83)
    ids["hybrid"] = store(database, "moe-a", "falling", "hybrid", "hybrid", losing(2), recall=0.86)
    store(database, "moe-a", "falling", "speculative", "gate", losing(0), recall=0.7, limit=50)  # other documents
    # model A, task 'flat': every level right on 70 % of documents, independently of recall
    store(database, "moe-a", "flat", "resident", None, rng.random(N) < 0.7)
    for level in LEVELS:
        store(database, "moe-a", "flat", "speculative", f"recall-{level}", rng.random(N) < 0.7, recall=level)
    # model A, task 'same': no level changes a document (against the newer of two resident runs); model A, task
    # 'broken': even recall 1.0 loses 10 points
    store(database, "moe-a", "same", "resident", None, 1 - RESIDENT)
    store(database, "moe-a", "same", "resident", None, RESIDENT)
    store(database, "moe-a", "broken", "resident", None, RESIDENT)
    for level in LEVELS:
        store(database, "moe-a", "same", "speculative", f"recall-{level}", RESIDENT, recall=level)
        store(database, "moe-a", "broken", "speculative", f"recall-{level}", losing(20), recall=level)
    # model B: three levels
    ids["b_resident"] = store(database, "moe-b", "falling", "resident", None, RESIDENT)
    for level in (1.0, 0.8, 0.5):
        ids[f"b_{level:g}"] = store(database, "moe-b", "falling", "speculative", f"recall-{level}",
                                    losing(LOST[level]), recall=level)
    database.ids = ids
    yield database
    database.close()


@pytest.fixture(scope="module")
def scores(db):
    return document_scores(db)


@pytest.fixture(scope="module")
def points(scores):
    return recall_points(scores)


NAMES = ("recall-0.8", "recall-0.8-near-late", "recall-1.0-early", "recall-1", "recall-0.95-uniform-all", "quasi",
         "hybrid", "recall-1.5", "recall-.8", "recall-0.8-late-near", "recall-0.8-far", "recall-0.8-near-", "")


def test_controlled_names_parse_and_real_predictors_do_not():
    assert parse_recall_name("recall-0.8") == (0.8, "uniform", "all")
    assert parse_recall_name("recall-0.8-near-late") == (0.8, "near", "late")
    assert parse_recall_name("recall-1.0-early") == (1.0, "uniform", "early")
    for name in NAMES[5:] + (None,):
        assert parse_recall_name(name) is None


def test_points_pair_documents_with_the_resident_and_read_recall_at_the_routers_top_k(db, points):
    quasi = points.set_index("run_id").loc[db.ids["quasi"]]
    assert quasi["n"] == 100  # the shared documents only: not its 10 others, not the resident's other 100
    assert quasi["resident"] == 1.0 and quasi["accuracy"] == pytest.approx(0.95)
    assert quasi["delta"] == pytest.approx(-0.05) and quasi["ci_low"] < -0.05 < quasi["ci_high"] <= 0
    assert quasi["test"] == "mcnemar-exact" and quasi["p_value"] == pytest.approx(2 * 0.5 ** 5)
    assert quasi["recall"] == pytest.approx(0.83) and quasi["k"] == 8 and quasi["kind"] == "predictor"
    falling = points[(points["model"] == "moe-a") & (points["task"] == "falling") & (points["kind"] == "controlled")
                     & (points["errors"] == "uniform") & (points["layers"] == "all")]
    assert dict(zip(falling["level"], falling["delta"].round(4))) == {level: -LOST[level] / N for level in LEVELS}
    # the gate run measured other documents (limit 50 against none): left out, and said so
    assert "gate" not in set(points["predictor"])
    assert any("gate" in note and "limit" in note for note in points.attrs["notes"])


def test_the_trend_test_finds_a_falling_curve_and_not_a_flat_one(scores):
    trends = trend_tests(scores).set_index(["model", "task", "errors", "layers"])
    falling = trends.loc[("moe-a", "falling", "uniform", "all")]
    assert falling["levels"] == 7 and falling["changing"] == 60 and falling["rho"] > 0.95  # 1.0 and 0.95 tie
    assert falling["p"] < 1e-6 and falling["p_ties"] < falling["p"]  # counting ties: sharper, never blunter here
    near = trends.loc[("moe-a", "falling", "near", "all")]
    assert near["levels"] == 3 and near["lowest"] == 0.8 and near["p_ties"] < 0.01  # borrows recall-1.0
    flat = trends.loc[("moe-a", "flat", "uniform", "all")]
    assert flat["p"] > 0.2 and flat["p_ties"] > 0.2
    same = trends.loc[("moe-a", "same", "uniform", "all")]
    assert same["changing"] == 0 and same["p"] == 1.0


def test_recall_needed_is_the_level_the_data_implies(scores):
    needed = recall_needed(scores).set_index(["model", "task"])
    falling = needed.loc[("moe-a", "falling")]
    assert (falling["needed_1"], falling["needed_5"]) == (0.9, 0.8)
    assert falling["low_1"] <= 0.9 <= falling["high_1"] and falling["low_5"] <= 0.8 <= falling["high_5"]
    assert falling["low_5"] == 0.8  # 0.7 (10 points down) passes for 5 in under 2.5 % of resamples
    assert needed.loc[("moe-a", "same"), "needed_1"] == 0.5  # every level qualifies: '<= lowest'
    assert pd.isna(needed.loc[("moe-a", "broken"), "needed_5"])  # none does: '> highest'
    b = needed.loc[("moe-b", "falling")]  # 1.0, 0.8 and 0.5 tested, 0.8 three points down
    assert (b["needed_1"], b["needed_5"]) == (1.0, 0.8)


def test_where_misses_hurt_lists_each_layer_range_against_resident(points):
    hurt = where_misses_hurt(points)
    assert list(hurt["layers"]) == ["all", "early", "middle", "late"]
    assert set(hurt["level"]) == {0.7} and list(hurt["drop"].round(3)) == [0.10, 0.01, 0.025, 0.10]
    late = hurt.iloc[3]
    assert late["drop_low"] > 0 and late["drop_low"] < 0.10 < late["drop_high"] and late["p_value"] < 1e-4


def test_the_report_prints_every_part_and_writes_one_plot_per_model(db, tmp_path):
    text = recall_curve_report(db, out_dir=str(tmp_path))
    assert "moe-a / falling" in text and "Page's L" in text and "rises with recall" in text
    assert "recall needed" in text and "<= 0.5" in text and "> 1" in text and "where misses hurt" in text
    assert "recall-0.7-late" in text and "note: moe-a falling: run" in text
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["recall_curve_moe-a.png", "recall_curve_moe-b.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in written)
    assert f"wrote {tmp_path / 'recall_curve_moe-a.png'}" in text


def test_chosen_runs_and_a_model_filter_narrow_the_report(db, tmp_path):
    chosen = [db.ids[k] for k in ("b_resident", "b_1", "b_0.5")]
    scores = document_scores(db, runs=[str(r) for r in chosen])
    assert set(scores["run_id"]) == set(chosen)
    points = recall_points(scores)
    assert list(points["level"]) == [1.0, 0.5]
    paths = plot_recall_curves(points, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["recall_curve_moe-b.png"]
    only_b = document_scores(db, model="moe-b")
    assert set(only_b["model"]) == {"moe-b"} and len(set(only_b["run_id"])) == 4
    with pytest.raises(ValueError, match="no run with id 9999"):
        document_scores(db, runs=[9999])


def test_no_pairs_say_what_to_run(tmp_path):
    with open_db(tmp_path, "empty.db") as empty:
        store(empty, "moe-c", "t", "speculative", "recall-0.9", RESIDENT, recall=0.9)
        scores = document_scores(empty)
        text = format_recall_report(recall_points(scores), trend_tests(scores), recall_needed(scores),
                                    where_misses_hurt(recall_points(scores)))
    assert "evalsuite eval --modes resident,speculative" in text and "no resident run" in text
