"""`evalsuite paper-tables`: the seeds' tables read from stored runs."""
import pytest

from evalsuite.cli import main
from evalsuite.results.paper_tables import accuracy_table, recall_table

from .results_data import make_run, open_db

RESIDENT = (1, 1, 1, 1, 0, 1, 1, 1)
SPECULATIVE = (1, 0, 0, 1, 0, 1, 0, 1)
HYBRID = (1, 1, 0, 1, 0, 1, 1, 1)


def stored(tmp_path):
    db = open_db(tmp_path)
    make_run(db, mode="resident", correct=RESIDENT)
    make_run(db, mode="speculative", predictor="gate", correct=(0,) * 8)  # another predictor: not seed A's row
    make_run(db, mode="speculative", predictor="quasi", correct=SPECULATIVE, recall=0.7, k=2)
    make_run(db, mode="hybrid", predictor="hybrid", correct=HYBRID, recall=0.8, k=2)
    make_run(db, mode="router-preserving", predictor="adapter", correct=RESIDENT, recall=0.75, k=2)
    return db


def test_the_accuracy_table_pairs_documents_and_says_what_hybrid_recovers(tmp_path):
    with stored(tmp_path) as db:
        table = accuracy_table(db)
    row = table.to_dict("records")[0]
    r, s, h = (sum(x) / 8 for x in (RESIDENT, SPECULATIVE, HYBRID))
    assert (row["resident"], row["speculative"], row["hybrid"]) == (r, s, h)
    assert row["drop"] == pytest.approx(r - s) and row["recovered"] == pytest.approx((h - s) / (r - s))
    low, high = row["drop_ci"]
    assert low <= r - s <= high and low < high


def test_the_recall_table_lists_each_predicting_run_and_the_cli_prints_both(tmp_path, capsys):
    with stored(tmp_path) as db:
        table = recall_table(db)
    # the gate run stored no recall: nothing to list for it
    assert set(zip(table["mode"], table["predictor"])) == {
        ("speculative", "quasi"), ("hybrid", "hybrid"), ("router-preserving", "adapter")}
    assert table.set_index("predictor").loc["adapter", "recall@2"] == 0.75
    assert main(["paper-tables", "--db", str(tmp_path / "results.db")]) == 0
    out = capsys.readouterr().out
    assert "recall (SpecPrefetch)" in out and "accuracy (Speculating Experts)" in out and "hybrid recovers" in out


def test_no_runs_say_what_to_run(tmp_path, capsys):
    open_db(tmp_path, "empty.db").close()
    assert main(["paper-tables", "--db", str(tmp_path / "empty.db")]) == 0
    assert "evalsuite eval --modes resident,speculative,hybrid" in capsys.readouterr().out


def test_each_precision_of_a_model_is_a_row_of_its_own(tmp_path, capsys):
    db = open_db(tmp_path, "bits.db")
    for bits, correct in ((None, [1, 1, 0, 1]), (4, [1, 0, 0, 1])):
        make_run(db, mode="resident", correct=[1, 1, 1, 1], expert_bits=bits)
        make_run(db, mode="speculative", predictor="quasi", correct=correct, recall=0.7, expert_bits=bits)
    table = accuracy_table(db)
    assert list(table["bits"]) == [16, 4]  # the newest 4-bit run does not stand in for the 16-bit one
    assert list(table["speculative"]) == [0.75, 0.5]
    assert list(recall_table(db)["bits"]) == [16, 4]
    db.close()
    assert main(["paper-tables", "--db", f"sqlite:///{tmp_path}/bits.db"]) == 0
    assert " bits " in capsys.readouterr().out
