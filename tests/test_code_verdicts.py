"""A completion that implements nothing scores 0, however it attacks the grader.

Each class of attack is tried through both ways code is scored: the lm-eval task's scorer
(benchmarks.run_completions / score_humaneval, answers.score_code) and the `evaluate` module
(evaluate.load(...sandboxed_code_eval)). Every attack here passed on a grader that ran the tests in
the candidate's process; the verdict now comes from a checker the candidate cannot reach, which
receives only plain data.
"""
import ast
import json
import os

import pytest

from evalsuite.scoring import answers
from evalsuite.scoring import benchmarks as bm
from evalsuite.scoring.code_eval import problem_from_doc, problem_from_reference
from evalsuite.scoring.sandbox import SandboxLimits
from tests.helpers import shared_data
from tests.test_evaluate_modules import compute
from tests.test_sandbox_escapes import SQUARE_DOC
from tests.test_sandbox_leftovers import no_leftovers  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_leftovers")

LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=4)
CORRECT = "    return x * x\n"

# Classes of attack, each a function body that returns without computing the answer.
STEAL_THE_TOKEN = (  # re-create the signal module (no import event), and walk up from a handler's frame
    "    import importlib.machinery, importlib.util, os\n"
    "    spec = importlib.machinery.BuiltinImporter.find_spec('_signal')\n"
    "    sig = importlib.util.module_from_spec(spec)\n"
    "    spec.loader.exec_module(sig)\n"
    "    def grab(number, frame):\n"
    "        while frame is not None:\n"
    "            found = dict(frame.f_locals)\n"
    "            if 'token' in found and 'result_fd' in found:\n"
    "                os.write(found['result_fd'], found['token'])\n"
    "                os._exit(0)\n"
    "            frame = frame.f_back\n"
    "    sig.signal(sig.SIGUSR1, grab)\n"
    "    os.kill(os.getpid(), sig.SIGUSR1)\n"
)
READ_THE_TESTS = (  # find the assert that calls us with these arguments, return its expected value
    "    arguments = list(locals().values())\n"
    "    import ast, os\n"
    "    for name in os.listdir('.'):\n"
    "        try:\n"
    "            tree = ast.parse(open(name).read())\n"
    "        except Exception:\n"
    "            continue\n"
    "        for node in ast.walk(tree):\n"
    "            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):\n"
    "                try:\n"
    "                    if [ast.literal_eval(a) for a in node.left.args] == arguments:\n"
    "                        return ast.literal_eval(node.comparators[0])\n"
    "                except ValueError:\n"
    "                    pass\n"
)
ALWAYS_EQUAL = ("    class Anything:\n        def __eq__(self, other):\n            return True\n"
                "    return Anything()\n")
PATCH_BUILTINS = "    import builtins\n    builtins.abs = lambda value: 0\n    return 0.5\n"
PATCH_MATH = "    import math\n    math.fabs = lambda value: 0.0\n    return 0.0\n"
DECORATE_THE_CHECK = "    return None\n@lambda f: (lambda c: None)\n"


def read_the_answers(data_dir: str) -> str:
    """Run the benchmark's canonical solution of whichever problem takes these arguments, read from the data folder."""
    return ("    arguments = list(locals().values())\n"
            "    import json\n"
            f"    rows = [json.loads(line) for line in open({os.path.join(data_dir, 'humaneval', 'test.jsonl')!r})]\n"
            "    for row in rows:\n"
            "        space = {}\n"
            "        exec(row['prompt'] + row['canonical_solution'], space)\n"
            "        solution = space[row['entry_point']]\n"
            "        if solution.__code__.co_argcount == len(arguments) and row['prompt'] in open('program.py').read():\n"
            "            return solution(*arguments)\n")


def humaneval() -> dict[str, dict]:
    with open(os.path.join(shared_data(), "humaneval", "test.jsonl")) as f:
        return {row["task_id"]: row for row in map(json.loads, f)}


def reference_of(doc: dict) -> str:
    """code_eval's reference for a HumanEval document: the prompt's helpers (not its stub of the entry
    point), the tests, and the call that runs them."""
    tree = ast.parse(doc["prompt"])
    helpers = [node for node in tree.body if getattr(node, "name", None) != doc["entry_point"]]
    return f"{ast.unparse(ast.Module(helpers, []))}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def both_paths(tmp_path, doc: dict, bodies: list[str]) -> tuple[list[bool], list[bool]]:
    """Per body: passed through the lm-eval task's scorer, and through evaluate.load(...sandboxed_code_eval)."""
    task = bm.run_completions(doc, bodies, LIMITS)
    _, results = compute("sandboxed_code_eval", tmp_path, predictions=[[doc["prompt"] + b for b in bodies]],
                         references=[reference_of(doc)], k=[1], timeout=LIMITS.wall_seconds)
    return task, [detail["passed"] for _, detail in results["0"]]


def test_attacks_on_the_grader_score_zero_through_both_paths(tmp_path):
    bodies = [CORRECT, STEAL_THE_TOKEN, READ_THE_TESTS, ALWAYS_EQUAL, DECORATE_THE_CHECK, CORRECT]
    task, module = both_paths(tmp_path, SQUARE_DOC, bodies)
    expected = [True, False, False, False, False, True]
    assert task == expected and module == expected, (task, module)
    assert answers.score_code(SQUARE_DOC, [READ_THE_TESTS]) == {"pass_at_1": 0.0}
    assert answers.score_code(SQUARE_DOC, [CORRECT]) == {"pass_at_1": 1.0}


@pytest.mark.skipif(shared_data() is None, reason="benchmark data directory (shared/data) not found")
def test_patching_what_the_tests_use_or_reading_the_answers_scores_zero(tmp_path):
    rows = humaneval()
    cases = [("HumanEval/2", [PATCH_BUILTINS]), ("HumanEval/32", [PATCH_MATH]),
             ("HumanEval/0", [read_the_answers(shared_data()), ALWAYS_EQUAL, STEAL_THE_TOKEN])]
    for task_id, bodies in cases:
        doc = rows[task_id]
        right = doc["canonical_solution"]
        task, module = both_paths(tmp_path, doc, [right, *bodies])
        expected = [True] + [False] * len(bodies)
        assert task == expected and module == expected, (task_id, task, module)


def test_the_checker_binds_the_benchmarks_helpers_not_the_candidates():
    # The candidate redefines the helper its test calls: the checker still uses the prompt's own.
    doc = {"prompt": "def double(x):\n    return 2 * x\n\n\ndef quad(x):\n    \"\"\"double(double(x))\"\"\"\n",
           "test": "def check(candidate):\n    assert candidate(3) == double(double(3))\n", "entry_point": "quad"}
    honest = "    return double(double(x))\n"
    cheat = "    return 0\n\n\ndef double(x):\n    return 0\n"
    assert bm.run_completions(doc, [honest, cheat], LIMITS) == [True, False]


def test_references_must_end_in_the_call_that_runs_the_tests():
    with pytest.raises(ValueError, match="must end in the call that runs its tests"):
        problem_from_reference("def f():\n    return 1\n", "assert f() == 1\n")
    problem = problem_from_doc(SQUARE_DOC, CORRECT)
    assert problem.entry_point == "square" and problem.run.strip() == "check(square)"
    assert "assert candidate(3) == 9" in problem.test and "assert" not in problem.program
