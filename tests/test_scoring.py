"""Answer extraction and the code sandbox."""
import os

from evalsuite.scoring.answers import extract_gsm8k_strict, extract_last_boxed, extract_yes_no
from evalsuite.scoring.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_seconds=2.0, cpu_seconds=2)


def test_gsm8k_strict_needs_the_marker():
    assert extract_gsm8k_strict(" 3 + 4 = 7\n#### 7") == "7"
    assert extract_gsm8k_strict("#### 1,200") == "1200"
    assert extract_gsm8k_strict("the answer is 7") is None


def test_yes_no_and_boxed_extraction():
    assert extract_yes_no(" Yes, because") == "yes"
    assert extract_yes_no(" nothing") is None
    assert extract_last_boxed(r"\boxed{3} then \boxed{-12}") == "-12"
    assert extract_last_boxed("12") is None


def test_sandbox_reports_success_and_failure():
    assert run_python("print('ok')", FAST).passed
    failed = run_python("assert 1 == 2", FAST)
    assert not failed.passed and "AssertionError" in failed.stderr


def test_sandbox_kills_infinite_loop():
    result = run_python("while True:\n    pass\n", SandboxLimits(wall_seconds=1.0, cpu_seconds=1))
    assert not result.passed


def test_sandbox_limits_memory_and_file_size():
    assert not run_python("x = bytearray(2 * 1024 ** 3)", FAST).passed
    assert not run_python("open('big', 'w').write('a' * (4 * 1024 * 1024))", FAST).passed


def test_sandbox_scrubs_environment_and_uses_throwaway_dir():
    os.environ["EVALSUITE_SECRET_FOR_TEST"] = "x"
    try:
        result = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())", FAST)
    finally:
        del os.environ["EVALSUITE_SECRET_FOR_TEST"]
    assert "EVALSUITE_SECRET_FOR_TEST" not in result.stdout
    workdir = result.stdout.strip().splitlines()[-1]
    assert workdir != os.getcwd() and not os.path.exists(workdir)
