"""The runs / report / compare / gate subcommands, added to a parser the way evalsuite's CLI adds them."""
import argparse

import pytest

from evalsuite.results.cli import add_commands

from .results_data import make_run, open_db


def _run(argv):
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture
def stored(tmp_path):
    db = open_db(tmp_path)
    make_run(db, mode="resident", correct=[1, 1, 1, 0], tpot_ms=10.0)
    make_run(db, mode="speculative", predictor="quasi", correct=[1, 0, 1, 0], tpot_ms=7.0, recall=0.8)
    return str(tmp_path / "results.db")


def test_runs_lists_newest_first(stored, capsys):
    assert _run(["runs", "--db", stored]) == 0
    header, rule, *lines = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["id", "started_at", "status"] and set(rule) == {"-"}
    assert lines[0].split()[0] == "2" and "speculative" in lines[0] and "0.5" in lines[0]
    assert lines[1].split()[0] == "1" and "0.75" in lines[1]


def test_compare_and_report(stored, tmp_path, capsys):
    assert _run(["compare", "1", "2", "--db", stored, "--csv", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    assert "run B = 2 (speculative/quasi, 16-bit experts) vs run A = 1 (resident, 16-bit experts)" in out
    assert "-0.2500" in out and (tmp_path / "c.csv").exists()
    assert _run(["report", "--db", stored, "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "index.html").exists() and "wrote" in capsys.readouterr().out


def test_gate_exit_codes(stored, tmp_path):
    rules = tmp_path / "gates.yaml"
    rules.write_text("- {name: tpot, where: {mode: speculative}, engine_metric: tpot_ms, max: 8}\n")
    assert _run(["gate", "--config", str(rules), "--db", stored]) == 0
    rules.write_text("- {name: tpot, where: {mode: speculative}, engine_metric: tpot_ms, max: 5}\n")
    assert _run(["gate", "--config", str(rules), "--db", stored]) == 1


def test_bad_input_is_a_one_line_error(stored, tmp_path):
    with pytest.raises(ValueError, match="no run with id 9"):
        _run(["compare", "1", "9", "--db", stored])
    with pytest.raises(FileNotFoundError, match="gates file .*nope.yaml not found"):
        _run(["gate", "--config", str(tmp_path / "nope.yaml"), "--db", stored])
    with pytest.raises(ValueError, match="cannot open results database"):
        _run(["runs", "--db", "postgresql+psycopg://u:p@127.0.0.1:1/x"])
    assert not (tmp_path / "nope.yaml").exists()


def test_runs_lists_each_runs_tasks_and_limit(tmp_path, capsys):
    db = open_db(tmp_path)
    run = make_run(db, correct=[1, 0], limit=2)
    db.add_task(run, "yesno", [{"metric": "acc", "filter": "none", "value": 0.5, "n": 2}])
    make_run(db, task="yesno")  # no limit: every document
    assert _run(["runs", "--db", str(tmp_path / "results.db")]) == 0
    header, _, newest, oldest = capsys.readouterr().out.splitlines()
    assert "tasks" in header.split() and "limit" in header.split()
    assert "arith,yesno" in oldest.split() and "2" in oldest.split()
    assert "yesno" in newest.split() and "arith" not in newest
