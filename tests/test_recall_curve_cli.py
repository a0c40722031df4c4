"""`evalsuite recall-curve`: the grid it asks the replay plan for, bad input in one line, and one small curve
end to end (stored as ordinary runs, reported with recall-1.0 at resident's accuracy)."""
import pytest

from evalsuite.cli import main
from evalsuite.results import ResultsDB
from evalsuite.sweep.recall_curve import CurveGrid, run_recall_curve

from .helpers import eval_request, shipped_model


def test_the_grid_names_each_configuration_once():
    grid = CurveGrid(levels=(1.0, 0.8), errors=("uniform", "near"), layers=("all", "late"), range_levels=(0.5,),
                     real=("gate",), hybrid=False)
    assert grid.controlled() == ["recall-1.0", "recall-0.8", "recall-0.8-near", "recall-0.5-late",
                                 "recall-0.5-near-late"]
    assert grid.predictor_spec() == "speculative=" + ",".join(grid.controlled() + ["gate"])
    assert grid.modes() == ["resident", "speculative"]


@pytest.mark.parametrize("argv, message", [
    (["--levels", "1.0,high"], "take numbers in [0, 1]"),
    (["--levels", "1.0,1.5"], "not in [0, 1]"),
    (["--errors", "far"], "error model 'far'"),
    (["--layers", "top"], "layer range 'top'"),
    (["--model", "no/such/model"], "no/such/model"),
])
def test_bad_input_is_one_line_before_a_model_loads(argv, message, capsys, tmp_path):
    code = main(["recall-curve", *argv, "--tasks", "evalsuite_arith", "--db", f"sqlite:///{tmp_path}/r.db"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_a_small_curve_is_stored_and_reported(tmp_path):
    url = f"sqlite:///{tmp_path}/curve.db"
    grid = CurveGrid(levels=(1.0, 0.8, 0.5), errors=("uniform",), real=("gate",), hybrid=False)
    request = eval_request(batch_size=4)
    report, wall_s = run_recall_curve([shipped_model()], ["evalsuite_arith"], 8, grid, engine=request["engine"],
                                      run=request["run"], db_url=url, out_dir=str(tmp_path / "out"),
                                      plot_dir=str(tmp_path / "plots"), progress=lambda *_: None)
    with ResultsDB(url) as db:
        runs = db.runs()
    assert sorted(runs["predictor"].fillna("-")) == ["-", "gate", "recall-0.5", "recall-0.8", "recall-1.0"]
    line = next(line for line in report.splitlines() if " recall-1.0 " in line)
    assert "+0.0  [+0.0, +0.0]" in line  # recall-1.0 answers every document as resident does
    assert "trend (uniform misses, all layers; 3 levels" in report
    assert (tmp_path / "plots" / "recall_curve_tiny-qwen3-moe.png").stat().st_size > 0
    assert wall_s > 0
