"""One answer rule per format: the project's tasks and the benchmarks read a generation the same way.

Each check sends the same generation through a project task (tasks/evalsuite_*.yaml) and the
benchmark task of the same format, with the filters and scorer their YAMLs name, and needs no
benchmark data.
"""

import pytest

from evalsuite.scoring import answers
from evalsuite.scoring.code_eval import problem_from_doc
from evalsuite.scoring.mathvision import is_correct

from .task_filters import apply_filter, filter_steps, score

SQUARE_DOC = {
    "prompt": "def square(x):\n    \"\"\"Return x squared.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n",
    "entry_point": "square",
}


def test_benchmark_yamls_use_lm_evals_regex_filter_with_the_shared_patterns():
    assert filter_steps("gsm8k_es", "strict-match") == [
        {"function": "regex", "regex_pattern": answers.GSM8K_STRICT.pattern}, {"function": "take_first"}]
    assert filter_steps("gsm8k_es_5shot", "strict-match") == filter_steps("gsm8k_es", "strict-match")
    assert filter_steps("strategyqa_es_cot", "final-yes-no") == [
        {"function": "regex", "regex_pattern": answers.YES_NO.pattern, "group_select": -1},
        {"function": "lowercase"}, {"function": "take_first"}]


GSM8K_GENERATIONS = ["#### $1,000", "#### 1,000", "#### 1000.", "#### 1000.00", "5 + 5 = 10\n#### 1000\n#### 7",
                     "#### -$5", "#### 7\n#### 1000", "The answer is 1000.", "####1000", ""]


@pytest.mark.parametrize("generation", GSM8K_GENERATIONS)
@pytest.mark.parametrize("target", ["1000", "-5", "7"])
def test_gsm8k_format_scores_alike_in_evalsuite_arith_and_gsm8k_es(generation, target):
    project = score("evalsuite_arith", {"answer": target}, generation)
    benchmark = score("gsm8k_es", {"target": target}, generation, "strict-match")
    assert project == benchmark


def test_a_dollar_sign_after_the_marker_is_part_of_the_number():
    assert answers.extract_gsm8k_strict("#### $1,000") == "1000"
    assert score("evalsuite_arith", {"answer": "1000"}, "#### $1,000") == {"exact_match": 1.0}
    assert score("gsm8k_es", {"target": "1000"}, "#### $1,000", "strict-match") == {"exact_match": 1.0}


YES_NO_GENERATIONS = ["So the answer is yes.", "Yes, but no. So the answer is NO.",
                      "Nobody knows; yesterday it rained.", "no", " YES", "The answer: no!", ""]


@pytest.mark.parametrize("generation", YES_NO_GENERATIONS)
def test_yes_no_reads_alike_in_evalsuite_yesno_and_strategyqa_es_cot(generation):
    [filtered] = apply_filter("strategyqa_es_cot", "final-yes-no", [generation])
    assert filtered == (answers.extract_yes_no(generation) or answers.NO_ANSWER)
    for target in ("yes", "no"):
        assert (score("evalsuite_yesno", {"answer": target}, generation)
                == score("strategyqa_es_cot", {"target": target}, generation, "final-yes-no"))


BOXED_GENERATIONS = [r"so \boxed{12}", r"\boxed{3} and then \boxed{12}", r"\boxed{12} then \boxed{\frac{1}{2}}",
                     r"\boxed{\textbf{12}}", r"\boxed{\text{\textbf{(12)}}}", r"\boxed{012}", r"$\fbox{12}$",
                     r"\boxed{12", r"\boxed{x+12}", r"\boxed{Infinity}", r"\boxed{NaN}", "12"]


@pytest.mark.parametrize("generation", BOXED_GENERATIONS)
def test_boxed_answers_read_alike_in_evalsuite_boxed_and_aime(generation):
    assert (score("evalsuite_boxed", {"answer": "12"}, generation)
            == score("aime24_es", {"accepted_answers": [12]}, generation, "boxed-integer"))


def test_the_last_box_is_the_answer_even_when_it_is_nested():
    # An earlier integer box must not stand in for a last box holding a fraction.
    generation = r"First \boxed{3}, halved: \boxed{\frac{1}{2}}"
    assert answers.last_boxed_content(generation) == r"\frac{1}{2}"
    assert score("evalsuite_boxed", {"answer": "3"}, generation) == {"exact_match": 0.0}
    assert score("evalsuite_boxed", {"answer": "12"}, r"\boxed{\mathbf{12}}") == {"exact_match": 1.0}


def test_latex_wrappers_unwrap_alike_for_mathvision_and_aime():
    assert answers.strip_latex_wrappers(r"\textbf{\text{B}} and \mathrm{x}") == "B and x"
    multiple_choice = {"multiple_choice": True, "options": ["1", "2", "3", "4", "5"], "answer": "B"}
    assert is_correct(multiple_choice, r"\boxed{\textbf{\text{B}}}")
    assert answers.extract_boxed_integer(r"\boxed{\textbf{\text{12}}}") == 12


CODE_COMPLETIONS = ["    return x * x\n", "    return x * x\n\nprint('side effect')\nraise SystemExit(1)\n",
                    "    return x + x\n", "    return x * x\n# trailing note\nraise SystemExit(1)\n"]


@pytest.mark.parametrize("completion", CODE_COMPLETIONS)
def test_code_scores_alike_in_evalsuite_code_and_humaneval(completion):
    assert (score("evalsuite_code", SQUARE_DOC, completion)
            == score("humaneval_es", SQUARE_DOC, completion, "create_test"))


@pytest.mark.parametrize("completion", CODE_COMPLETIONS + ["    return x\nx = 1\n", ""])
def test_the_tests_run_in_the_checker_never_in_the_program(completion):
    problem = problem_from_doc(SQUARE_DOC, completion)
    assert problem.run.strip() == "check(square)" and problem.entry_point == "square"
    assert "check" not in problem.program and SQUARE_DOC["test"] in problem.test
