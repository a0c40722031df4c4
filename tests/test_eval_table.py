"""What `evalsuite eval`'s table says of each row: the predictor it ran, where speculation could not act, and
what a speculating mode's hit rate counts."""
from evalsuite.lm.runs import table_rows
from evalsuite.lm.suite import format_rows


def results(task: str, decoded: bool, hit_rate: float = 0.97) -> dict:
    values = {"exact_match,none": 0.5, "recall@2,engine": 0.7, "hit_rate,engine": hit_rate}
    if decoded:
        values["tpot_ms,engine"] = 4.0
    return {"results": {task: values}}


def rows_of(mode: str, predictor, task: str, decoded: bool) -> list[dict]:
    return table_rows(results(task, decoded), "m", mode, predictor, {}, 1, 1.0)


def table_line(table: str, *words) -> str:
    return next(line for line in table.splitlines() if all(word in line.split() for word in words))


def test_every_row_names_its_predictor():
    table = format_rows(rows_of("router-preserving", "adapter", "gen", True) + rows_of("speculative", "quasi", "gen", True)
                        + rows_of("resident", None, "gen", True))
    assert "predictor" in table.splitlines()[0].split()
    assert "adapter" in table_line(table, "router-preserving") and "quasi" in table_line(table, "speculative")


def test_speculation_on_a_task_that_only_prefills_reads_not_applicable():
    rows = rows_of("speculative", "quasi", "mc", False) + rows_of("resident", None, "mc", False) \
        + rows_of("speculative", "quasi", "gen", True)
    table = format_rows(rows)
    assert "n/a (prefill)" in table_line(table, "speculative", "mc")
    assert "0.500" in table_line(table, "resident", "mc") and "0.500" in table_line(table, "speculative", "gen")
    assert "n/a (prefill): the task scores loglikelihoods" in table


def test_a_speculating_modes_hit_rate_is_marked_and_explained():
    table = format_rows(rows_of("speculative", "quasi", "gen", True) + rows_of("router-preserving", "gate", "gen", True))
    assert "0.970§" in table_line(table, "speculative") and "§" not in table_line(table, "router-preserving")
    assert "hit by construction" in table
    assert "§" not in format_rows(rows_of("router-preserving", "gate", "gen", True))


def test_a_default_run_without_benchmark_data_says_what_it_skipped(monkeypatch, capsys, tmp_path):
    import evalsuite.lm.preflight as preflight
    import evalsuite.lm.suite as suite
    from evalsuite.cli import main

    from .helpers import shipped_model

    monkeypatch.setattr(suite, "run_suite", lambda *args, **kwargs: rows_of("resident", None, "gen", True))
    monkeypatch.setattr(preflight, "check_eval", lambda *args, **kwargs: None)
    monkeypatch.setenv("EVALSUITE_DATA_DIR", "")  # none; and restored after main() sets it below
    argv = ["eval", "--model", shipped_model("tiny-qwen3-moe"), "--modes", "resident"]
    assert main(argv) == 0
    assert "real benchmarks (GSM8k, StrategyQA; MATH-Vision for a vision-language model) were skipped" in \
        capsys.readouterr().out
    assert main(argv + ["--data-dir", str(tmp_path)]) == 0
    assert "skipped" not in capsys.readouterr().out
