"""HumanEval pass@k with every candidate run in evalsuite's sandbox and its tests in a trusted checker that
exchanges only plain data with it (evalsuite/scoring/code_eval.py): a drop-in for the Hub's `code_eval`, with
the same compute arguments and return value.

    pass_at_k, results = code_eval.compute(predictions=[[candidate, ...], ...], references=[test, ...], k=[1, 10])

A candidate is a whole program (prompt and completion); its reference is the test program, ending in the call
that runs the tests (`check(entry_point)`) on a line of its own, and defining whatever its tests call besides the
entry point (for HumanEval pass `prompt + test + "check(entry_point)"`: the candidate's own helpers are not
trusted). No `HF_ALLOW_CODE_EVAL` is asked for: code runs only confined, and where this machine offers only the
weak confinement it runs only when EVALSUITE_SANDBOX=weak says so. The HumanEval task scores with the same code.
"""
import datasets
import evaluate

from evalsuite.scoring.code_eval import compute_code_eval

CITATION = """@article{chen2021codex, title={Evaluating Large Language Models Trained on Code},
  author={Mark Chen and others}, journal={arXiv preprint arXiv:2107.03374}, year={2021}}"""

INPUTS = """
predictions: a list of candidate lists, one list per problem.
references: one test program per problem.
k: the k of each pass@k (default [1, 10, 100]); reported for the k every problem has enough candidates for.
num_workers: candidates run at once (default 4).
timeout: wall-clock seconds per candidate (default 3.0; its CPU limit is the same, rounded up).
Returns (pass_at_k, results): {"pass@k": mean over problems}, and per problem a list of
(candidate index, {"task_id", "passed", "result", "completion_id"}).
"""


class SandboxedCodeEval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation=CITATION, inputs_description=INPUTS,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, k=(1, 10, 100), num_workers=4, timeout=3.0):
        return compute_code_eval(predictions, references, k=k, num_workers=num_workers, timeout=timeout)
