"""evalsuite's scorers as `evaluate` modules: loaded by path with no Hub, scoring with the project's own code."""
import json
import os
import subprocess
import sys

import pytest

from evalsuite.evaluate_modules import module_path
from evalsuite.scoring.code_eval import compute_code_eval

from .helpers import REPO, shared_data

LOAD = """
import json, sys
import evaluate
from evalsuite.evaluate_modules import module_path
module = evaluate.load(module_path(sys.argv[1]))
print(json.dumps(module.compute(**json.load(open(sys.argv[2])))))
"""


def compute(name: str, tmp_path, **inputs):
    """`evaluate.load(<path>).compute(**inputs)` in a fresh interpreter, offline, with its own module cache."""
    arguments = tmp_path / f"{name}-inputs.json"
    arguments.write_text(json.dumps(inputs))
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", LOAD, name, str(arguments)], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def humaneval_rows() -> list[dict]:
    with open(os.path.join(shared_data(), "humaneval", "test.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_program(row: dict) -> str:
    """The reference for a HumanEval row: the prompt (its helpers, e.g. `poly`, are the benchmark's: the
    candidate's copies are not trusted), the tests, and the call that runs them."""
    return f"{row['prompt']}\n\n{row['test']}\ncheck({row['entry_point']})\n"


@pytest.mark.skipif(shared_data() is None, reason="benchmark data directory (shared/data) not found")
def test_sandboxed_code_eval_scores_every_canonical_humaneval_solution_and_fails_wrong_ones(tmp_path):
    rows = humaneval_rows()
    assert len(rows) == 164
    right = compute("sandboxed_code_eval", tmp_path, predictions=[[r["prompt"] + r["canonical_solution"]] for r in rows],
                    references=[check_program(r) for r in rows], k=[1], timeout=10.0)
    pass_at_k, results = right
    assert pass_at_k == {"pass@1": 1.0}
    assert len(results) == 164 and all(r[0][1]["passed"] and r[0][1]["result"] == "passed" for r in results.values())
    # a body that returns nothing and another problem's solution fail; pass@2 counts the one right candidate
    chosen = rows[:3]
    wrong = compute("sandboxed_code_eval", tmp_path, references=[check_program(r) for r in chosen], k=[1, 2],
                    predictions=[[r["prompt"] + "    return None\n", r["prompt"] + rows[i + 1]["canonical_solution"],
                                  r["prompt"] + r["canonical_solution"]] for i, r in enumerate(chosen)], timeout=10.0)
    assert wrong[0] == {"pass@1": pytest.approx(1 / 3), "pass@2": pytest.approx(2 / 3)}
    assert [[c[1]["passed"] for c in wrong[1][str(i)]] for i in range(3)] == [[False, False, True]] * 3


def test_sandboxed_code_eval_reports_timeouts_and_failures_like_code_eval(tmp_path):
    test = "def check(f):\n    assert f(3) == 9\n\ncheck(square)\n"
    candidates = ["def square(x):\n    return x * x\n", "def square(x):\n    while True:\n        pass\n",
                  "def square(x):\n    return x + x\n"]
    pass_at_k, results = compute("sandboxed_code_eval", tmp_path, predictions=[candidates], references=[test],
                                 k=[1, 3, 5], timeout=1.0)
    assert pass_at_k == {"pass@1": pytest.approx(1 / 3), "pass@3": 1.0}  # pass@5: too few candidates
    outcomes = [detail["result"] for _, detail in results["0"]]
    assert outcomes[0] == "passed" and outcomes[1] == "timed out"
    assert outcomes[2].startswith("failed: AssertionError")


def test_sandboxed_code_eval_runs_candidates_only_in_the_sandbox(tmp_path):
    escape = tmp_path / "escaped"
    candidate = f"def f():\n    return 1\n\nopen({str(escape)!r}, 'w').write('out')\n"
    _, results = compute_code_eval([[candidate]], ["def check(f):\n    assert f() == 1\n\ncheck(f)\n"], k=[1])
    assert not escape.exists()  # run here, it would have written the file: the sandbox has a /tmp of its own
    assert results[0][0][1]["result"].startswith("failed: ")


def test_expert_recall_module_counts_predicted_experts_among_the_routers(tmp_path):
    scores = [[0.1, 2.3, 0.7, 1.5], [3.0, 2.0, 1.0, 0.0]]
    native = [[1, 3], [2, 3]]  # token 0: its top-2 is {1, 3}, all right; token 1: {0, 1}, none right
    assert compute("expert_recall", tmp_path, predictions=scores, references=native, k=2) == {"recall@2": 0.5}
    assert compute("expert_recall", tmp_path, predictions=scores, references=native, k=[1, 4]) == \
        {"recall@1": 0.25, "recall@4": 1.0}
    assert compute("expert_recall", tmp_path, predictions=scores, references=native) == {"recall@2": 0.5}


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="2 lists of candidates for 1 test programs: give one list"):
        compute_code_eval([["x = 1"], ["x = 2"]], ["pass"])
    with pytest.raises(ValueError, match="no evalsuite metric module 'bleu': choose one of sandboxed_code_eval"):
        module_path("bleu")
