"""Answer extraction, and how the sandbox reports a run."""
import os

from evalsuite.scoring.answers import (
    extract_boxed_integer, extract_gsm8k_strict, extract_yes_no, score_arith, score_boxed,
)
from evalsuite.scoring.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_seconds=2.0, cpu_seconds=2)


def test_gsm8k_strict_needs_the_marker():
    assert extract_gsm8k_strict(" 3 + 4 = 7\n#### 7") == "7"
    assert extract_gsm8k_strict("#### 1,200") == "1200"
    assert extract_gsm8k_strict("#### $1,200.") == "1200"
    assert extract_gsm8k_strict("the answer is 7") is None


def test_arith_compares_the_number():
    assert score_arith({"answer": "40"}, [" 38 + 2 = 40\n#### 40.0"]) == {"exact_match": 1.0}
    assert score_arith({"answer": "40"}, [" #### 41"]) == {"exact_match": 0.0}


def test_yes_no_and_boxed_extraction():
    assert extract_yes_no(" Yes, because") == "yes"
    assert extract_yes_no(" nothing") is None
    assert extract_boxed_integer(r"\boxed{3} then \boxed{-12}") == -12
    assert extract_boxed_integer("12") is None


def test_boxed_scores_only_the_last_box_nested_braces_included():
    assert score_boxed({"answer": "3"}, [r"\boxed{3} then \boxed{\frac{1}{2}}"]) == {"exact_match": 0.0}
    assert score_boxed({"answer": "2"}, [r"\boxed{\frac{1}{2}} so \boxed{2}"]) == {"exact_match": 1.0}
    assert score_boxed({"answer": "14"}, [r" 5 + 9 = 14. The answer is \boxed{14"]) == {"exact_match": 0.0}  # cut off


def test_sandbox_reports_success_and_failure():
    assert run_python("print('ok')", FAST).exited_cleanly
    failed = run_python("assert 1 == 2", FAST)
    assert not failed.exited_cleanly and "AssertionError" in failed.stderr


def test_sandbox_kills_infinite_loop():
    result = run_python("while True:\n    pass\n", SandboxLimits(wall_seconds=1.0, cpu_seconds=1))
    assert not result.exited_cleanly and result.timed_out


def test_sandbox_limits_memory_and_file_size():
    assert not run_python("x = bytearray(2 * 1024 ** 3)", FAST).exited_cleanly
    assert not run_python("open('big', 'w').write('a' * (4 * 1024 * 1024))", FAST).exited_cleanly


def test_sandbox_scrubs_environment_and_uses_throwaway_dir():
    os.environ["EVALSUITE_SECRET_FOR_TEST"] = "x"
    try:
        result = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())", FAST)
    finally:
        del os.environ["EVALSUITE_SECRET_FOR_TEST"]
    assert "EVALSUITE_SECRET_FOR_TEST" not in result.stdout
    workdir = result.stdout.strip().splitlines()[-1]
    assert workdir != os.getcwd() and not os.path.exists(workdir)
