"""Gates on constructed runs: each rule kind passing and failing, and rules that match no run."""
import pytest

from evalsuite.results.gate import evaluate_gates, gate, load_rules

from .results_data import make_run, open_db

GATES = """
- name: speculative accuracy
  compare: {baseline: {mode: resident}, candidate: {mode: speculative}}
  metric: exact_match
  max_drop: 0.02
  or_not_significant: 0.05
- {name: recall, where: {mode: router-preserving}, engine_metric: recall_at_k, min: 0.8}
- {name: tpot, ratio: {numerator: {mode: router-preserving}, denominator: {mode: on-demand}}, engine_metric: tpot_ms, max: 0.95}
- {name: exactness, identical_samples: {baseline: {mode: resident}, candidate: {mode: router-preserving}}}
"""
RIGHT = [1] * 40 + [0] * 10


def _write(tmp_path, text=GATES):
    path = tmp_path / "gates.yaml"
    path.write_text(text)
    return str(path)


def _passing_runs(db):
    make_run(db, mode="resident", correct=RIGHT, tpot_ms=8.0)
    make_run(db, mode="on-demand", correct=RIGHT, tpot_ms=30.0, hit_rate=0.4)
    make_run(db, mode="router-preserving", predictor="quasi", correct=RIGHT, tpot_ms=21.0, recall=0.86)
    # two more wrong answers than resident: a 4-point drop, but McNemar p = 0.5: not significant
    make_run(db, mode="speculative", predictor="quasi", correct=[1] * 38 + [0] * 12, tpot_ms=15.0, recall=0.86)


def test_all_rules_pass_on_good_runs(tmp_path, capsys):
    db = open_db(tmp_path)
    _passing_runs(db)
    assert gate(db, _write(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and "4 passed, 0 failed" in out


def test_each_rule_fails_on_bad_runs(tmp_path, capsys):
    db = open_db(tmp_path)
    _passing_runs(db)
    # newer runs win: a significant 20-point drop, low recall, slower than on-demand, one changed answer
    make_run(db, mode="speculative", predictor="quasi", correct=[1] * 30 + [0] * 20, tpot_ms=15.0)
    changed = [f"answer {i}" for i in range(50)]
    changed[7] = "something else"
    make_run(db, mode="router-preserving", predictor="quasi", correct=RIGHT, tpot_ms=29.0, recall=0.6,
             predictions=changed)
    table = evaluate_gates(db, load_rules(_write(tmp_path))).set_index("name")
    assert not table["passed"].any()
    assert table.loc["speculative accuracy", "value"] == pytest.approx(0.2)
    assert table.loc["recall", "value"] == pytest.approx(0.6)
    assert table.loc["tpot", "value"] == pytest.approx(29.0 / 30.0)
    assert table.loc["exactness", "detail"].startswith("1 of 50 sample(s) differ; first: arith doc 7")
    assert gate(db, _write(tmp_path)) == 1
    assert "0 passed, 4 failed" in capsys.readouterr().out


def test_max_drop_without_significance_escape_fails_a_small_drop(tmp_path):
    db = open_db(tmp_path)
    _passing_runs(db)
    rules = load_rules(_write(tmp_path, GATES.replace("  or_not_significant: 0.05\n", "")))
    assert evaluate_gates(db, rules).set_index("name").loc["speculative accuracy", "passed"] == False  # noqa: E712


def test_a_rule_matching_no_run_fails_and_says_so(tmp_path, capsys):
    db = open_db(tmp_path)
    make_run(db, mode="resident", correct=RIGHT)
    assert gate(db, _write(tmp_path)) == 1
    table = evaluate_gates(db, load_rules(_write(tmp_path))).set_index("name")
    assert "no complete run matches {'mode': 'speculative'}" in table.loc["speculative accuracy", "detail"]
    assert "no complete run matches {'mode': 'router-preserving'}" in table.loc["recall", "detail"]


def test_baseline_must_share_the_candidates_model_and_runs_must_be_complete(tmp_path):
    db = open_db(tmp_path)
    make_run(db, mode="resident", model="other-model", correct=RIGHT)
    make_run(db, mode="speculative", correct=RIGHT)
    make_run(db, mode="resident", correct=RIGHT, status="incomplete")
    table = evaluate_gates(db, load_rules(_write(tmp_path))).set_index("name")
    assert "with the same model as run 2" in table.loc["speculative accuracy", "detail"]


def test_bad_gate_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="gates file .*missing.yaml not found"):
        load_rules(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_rules(_write(tmp_path, "- name: [unclosed\n"))
    with pytest.raises(ValueError, match="needs exactly one of"):
        load_rules(_write(tmp_path, "- {name: vague, metric: acc, min: 0.5}\n"))
    db = open_db(tmp_path)
    make_run(db, mode="resident")
    table = evaluate_gates(db, load_rules(_write(tmp_path, "- {name: typo, where: {mdoe: resident}, metric: acc, min: 0}\n")))
    assert not table["passed"].any() and "unknown run column mdoe" in table["detail"][0]


@pytest.mark.parametrize("threshold", ["min: .nan", "min: .inf", "max: -.inf", "min: high", "max_drop: [1]",
                                       "or_not_significant: .nan", "min: true"])
def test_thresholds_must_be_finite_numbers(tmp_path, threshold):
    key = threshold.split(":")[0]
    text = f"- {{name: floor, where: {{mode: resident}}, metric: exact_match, {threshold}}}\n"
    with pytest.raises(ValueError, match=f"gate 'floor': {key} must be a finite number") as info:
        load_rules(_write(tmp_path, text))
    assert "\n" not in str(info.value)
