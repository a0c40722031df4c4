"""report(): CSV tables, PNG plots and an HTML page from constructed runs; plots without data are skipped."""
import re

import pandas as pd
import pytest

from evalsuite.results.plots import pareto_front
from evalsuite.results.report import report

from .results_data import make_run, open_db

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _runs(db):
    make_run(db, mode="resident", correct=[1] * 9 + [0], tpot_ms=40.0, hit_rate=1.0, cache_capacity=1.0)
    for predictor, recall, tpot, right in (("gate", [0.9, 0.8, 0.7, 0.6], 18.0, 9), ("quasi", [0.95, 0.9, 0.85, 0.8], 15.0, 8),
                                           ("adapter", [0.97, 0.93, 0.9, 0.88], 22.0, 7)):
        for capacity, hit in ((0.25, 0.45), (0.5, 0.7), (0.75, 0.88)):
            make_run(db, mode="speculative", predictor=predictor, correct=[1] * right + [0] * (10 - right),
                     tpot_ms=tpot / capacity ** 0.3, recall=sum(recall) / 4, hit_rate=hit, cache_capacity=capacity,
                     layer_recall=recall, sample_recall=[0.95] * right + [0.4] * (10 - right))
    make_run(db, mode="on-demand", correct=[1] * 9 + [0], tpot_ms=60.0, hit_rate=0.5, cache_capacity="512MiB")


def test_report_writes_html_pngs_and_csvs(tmp_path):
    db = open_db(tmp_path)
    _runs(db)
    out = tmp_path / "report"
    made = report(db, str(out))
    assert made["notes"] == []
    assert sorted(p.name for p in out.glob("*.png")) == ["accuracy_vs_recall.png", "accuracy_vs_tpot.png",
                                                        "hit_rate_vs_capacity.png", "recall_per_layer.png"]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    page = (out / "index.html").read_text()
    assert set(re.findall(r"src='([^']+)'", page)) == {"accuracy_vs_recall.png", "accuracy_vs_tpot.png",
                                                      "hit_rate_vs_capacity.png", "recall_per_layer.png"}
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 11 and summary.set_index("id").loc[1, "accuracy"] == pytest.approx(0.9)
    assert {"runs.csv", "task_metrics.csv", "engine_metrics.csv"} <= {p.name for p in out.glob("*.csv")}
    layers = pd.read_csv(out / "engine_metrics.csv").dropna(subset=["layer"])
    assert set(layers["predictor"]) == {"gate", "quasi", "adapter"} and set(layers["layer"]) == {0, 1, 2, 3}


def test_plots_without_data_are_skipped_with_a_note(tmp_path):
    db = open_db(tmp_path)
    run_id = db.start_run({"mode": "resident"})
    db.add_task(run_id, "arith", [{"metric": "acc", "value": 0.5}])
    db.finish_run(run_id)
    made = report(db, str(tmp_path / "report"))
    assert made["plots"] == [] and len(made["notes"]) == 4
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("Skipped:") == 4 and "<img" not in page
    assert report(open_db(tmp_path, "empty.db"), str(tmp_path / "empty"))["plots"] == []


def test_pareto_front_keeps_only_undominated_points():
    tpot = [10, 12, 11, 20, 15, 9]
    accuracy = [0.70, 0.80, 0.65, 0.85, 0.80, 0.60]
    assert pareto_front(tpot, accuracy).tolist() == [5, 0, 1, 3]  # rising TPOT, rising accuracy


def _two_task_sets(db):
    """Run 1 on arith alone; run 2 over arith and yesno (mean of both), faster and more accurate on average."""
    make_run(db, mode="resident", correct=[1, 0, 0, 0], tpot_ms=20.0, limit=4)
    run = make_run(db, mode="on-demand", correct=[1, 1, 1, 0], tpot_ms=10.0, limit=4)
    db.add_task(run, "yesno", [{"metric": "exact_match", "filter": "none", "value": 1.0, "n": 4}],
                [{"layer": None, "hit_rate": 0.5, "tpot_ms": 10.0}])


def test_runs_over_other_task_sets_or_limits_get_fronts_of_their_own(tmp_path):
    from evalsuite.results.cli import format_pareto
    from evalsuite.results.report import pareto_table, summary_table

    db = open_db(tmp_path)
    _two_task_sets(db)
    make_run(db, mode="speculative", correct=[0, 0, 0, 0], tpot_ms=30.0, limit=8)  # arith again, other documents
    runs = db.runs()
    summary = summary_table(runs, db.task_metrics(), db.engine_metrics())
    assert summary.set_index("id")["tasks"].to_dict() == {1: "arith", 2: "arith,yesno", 3: "arith"}
    front = pareto_table(summary)
    assert sorted(front["id"]) == [1, 2, 3]  # run 2 dominates neither: its mean is over another task set
    text = format_pareto(front)
    for heading in ("tiny:qwen3_moe: tasks arith, limit 4", "tiny:qwen3_moe: tasks arith,yesno, limit 4",
                    "tiny:qwen3_moe: tasks arith, limit 8"):
        assert heading in text
