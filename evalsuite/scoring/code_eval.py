"""Code scores decided where the program under test cannot reach: one implementation for the HumanEval task
(benchmarks.score_humaneval), the project's code task (answers.score_code), gates, and the `evaluate`
module sandboxed_code_eval, a drop-in for the Hub's `code_eval` (`compute_code_eval`).

A check has two processes joined by two pipes:
- the candidate's: the program (prompt and completion) in the sandbox (sandbox.py), serving calls to its
  functions (candidate_server.py);
- the checker's: the test program, trusted, outside the sandbox (checker.py). It calls the entry point
  through a proxy that moves plain data only (wire.py), and writes the verdict on a pipe of its own.
The tests, their expected values, the verdict and the data folders never exist in the candidate's memory
or filesystem. A test that needs more than plain data across the call (a function as argument, an
identity check on an argument) fails closed; docs/reliability.md lists the HumanEval problems it affects.
"""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from evalsuite.scoring.sandbox import SandboxLimits, confined

_HERE = Path(__file__).parent
_WIRE = (_HERE / "wire.py").read_text(encoding="utf-8")
SERVER_SOURCE = _WIRE + (_HERE / "candidate_server.py").read_text(encoding="utf-8")
CHECKER_SOURCE = _WIRE + (_HERE / "checker.py").read_text(encoding="utf-8")
VERDICT_LIMIT = 64 * 1024

# lm-eval's HumanEval stop sequences: the function body ends where top-level code starts.
HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


@dataclass(frozen=True)
class CodeProblem:
    """What one check runs: `program` in the sandbox; `test` (trusted) in the checker, with `entry_point`
    bound to the candidate's function; then `run`, the statement that runs the tests."""
    program: str
    test: str
    entry_point: str
    run: str


@dataclass(frozen=True)
class Verdict:
    passed: bool
    timed_out: bool
    detail: str  # 'passed', or why not
    confinement: tuple[str, ...] = ()
    stdout: str = ""  # the candidate's own output, for diagnostics only
    stderr: str = ""


def truncate_completion(completion: str) -> str:
    """Cut at the first stop sequence, in case the model server did not stop there itself."""
    cut = min((i for i in (completion.find(stop) for stop in HUMANEVAL_STOPS) if i >= 0), default=len(completion))
    return completion[:cut]


def problem_from_reference(program: str, reference: str) -> CodeProblem:
    """code_eval's form: a whole candidate program, and a test program ending in the call that runs the
    tests, `check(<entry point>)` on a line of its own. Whatever else the tests use (a helper such as
    HumanEval's `poly`) must be defined in the reference: the candidate's copies are not trusted."""
    try:
        tree = ast.parse(reference)
    except SyntaxError as error:
        raise ValueError(f"the test program does not parse ({error.msg}, line {error.lineno})") from None
    last = tree.body[-1] if tree.body else None
    call = last.value if isinstance(last, ast.Expr) else None
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords
            and isinstance(call.args[0], ast.Name) and last.col_offset == 0):
        raise ValueError("the test program must end in the call that runs its tests, e.g. check(entry_point), "
                         "on a line of its own")
    lines = reference.splitlines(keepends=True)
    return CodeProblem(program=program, test="".join(lines[:last.lineno - 1]), entry_point=call.args[0].id,
                       run="".join(lines[last.lineno - 1:last.end_lineno]))


def problem_from_doc(doc: dict, completion: str) -> CodeProblem:
    """A HumanEval-format document (prompt, test, entry_point) and a completion of its prompt. The checker
    runs the prompt too: its helpers (HumanEval's `poly`, `encode_cyclic`) are the benchmark's, not the
    model's; its stub of the entry point is replaced by the candidate's function."""
    return problem_from_reference(doc["prompt"] + truncate_completion(completion),
                                  f"{doc['prompt']}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n")


def check(problem: CodeProblem, limits: SandboxLimits | None = None) -> Verdict:
    """Run one candidate against its tests; the verdict is the checker's alone."""
    limits = limits or SandboxLimits()
    requests_r, requests_w = os.pipe()  # checker -> candidate
    answers_r, answers_w = os.pipe()  # candidate -> checker
    verdict_r, verdict_w = os.pipe()  # checker -> here; the candidate never holds it
    checker = None
    try:
        with confined(problem.program, limits, SERVER_SOURCE, argv=(str(requests_r), str(answers_w)),
                      pass_fds=(requests_r, answers_w)) as candidate:
            os.close(requests_r)
            os.close(answers_w)
            requests_r = answers_w = -1
            job = {"test": problem.test, "entry_point": problem.entry_point, "run": problem.run,
                   "total_seconds": limits.wall_seconds, "call_seconds": limits.wall_seconds,
                   "requests_fd": requests_w, "answers_fd": answers_r, "verdict_fd": verdict_w}
            checker = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", CHECKER_SOURCE],
                                       stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       pass_fds=(requests_w, answers_r, verdict_w), env={"LANG": "C.UTF-8"})
            for fd in (requests_w, answers_r, verdict_w):
                os.close(fd)
            requests_w = answers_r = verdict_w = -1
            try:
                _, checker_err = checker.communicate(json.dumps(job).encode(),
                                                     timeout=max(0.1, candidate.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                checker.kill()
                _, checker_err = checker.communicate()
                candidate.timed_out = True
        verdict = _read_verdict(verdict_r)
    finally:
        for fd in (requests_r, requests_w, answers_r, answers_w, verdict_r, verdict_w):
            if fd >= 0:
                os.close(fd)
        if checker is not None and checker.poll() is None:
            checker.kill()
            checker.wait()
    result = candidate.result
    if verdict is None:
        verdict = {"passed": False, "timed_out": candidate.timed_out,
                   "detail": f"the checker failed: {checker_err.decode(errors='replace').strip()[-300:]}"}
    timed_out = candidate.timed_out or verdict.get("timed_out") is True
    passed = verdict["passed"] is True and not timed_out
    return Verdict(passed, timed_out, "timed out" if timed_out else verdict["detail"], result.confinement,
                   result.stdout, result.stderr)


def _read_verdict(fd: int) -> dict | None:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, VERDICT_LIMIT)
        verdict = json.loads(data[4:])
    except (BlockingIOError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("detail"), str) else None


def check_all(problems: Sequence[CodeProblem], limits: SandboxLimits | None = None,
              workers: int | None = None) -> list[Verdict]:
    """Each problem checked on its own, `workers` at a time (default: one per CPU)."""
    workers = max(1, min(len(problems), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on subprocesses
        return list(pool.map(lambda problem: check(problem, limits), problems))


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021, arXiv:2107.03374): 1 - C(n-c, k) / C(n, k), as a stable running product."""
    if k > samples:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {samples}")
    if samples - correct < k:
        return 1.0
    missing_all = 1.0
    for drawn in range(samples - correct + 1, samples + 1):
        missing_all *= 1.0 - k / drawn
    return 1.0 - missing_all


def mean_pass_at_k(passed: Sequence[Sequence[bool]], ks: Iterable[int]) -> dict[int, float]:
    """pass@k averaged over problems, for every k that each problem has enough samples for."""
    fewest = min((len(outcomes) for outcomes in passed), default=0)
    return {k: sum(pass_at_k(len(outcomes), sum(outcomes), k) for outcomes in passed) / len(passed)
            for k in ks if 0 < k <= fewest}


def outcome(verdict: Verdict) -> str:
    """What code_eval reports per candidate: 'passed', 'timed out' or 'failed: <why>'."""
    if verdict.passed:
        return "passed"
    return "timed out" if verdict.timed_out else f"failed: {verdict.detail}"


def compute_code_eval(predictions: Sequence[Sequence[str]], references: Sequence[str], k=(1, 10, 100),
                      num_workers: int = 4, timeout: float = 3.0) -> tuple[dict[str, float], dict[int, list]]:
    """predictions[i]: candidate programs for problem i; references[i]: its test program, ending in the call
    that runs the tests. Returns ({"pass@k": mean over problems}, {i: [(candidate index, detail), ...]})."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} lists of candidates for {len(references)} test programs: "
                         "give one list of candidates per test program")
    ks = [k] if isinstance(k, int) else list(k)
    limits = SandboxLimits(wall_seconds=timeout, cpu_seconds=max(1, math.ceil(timeout)))
    jobs = [(task, index, problem_from_reference(candidate, references[task]))
            for task, candidates in enumerate(predictions) for index, candidate in enumerate(candidates)]
    details = defaultdict(list)
    for (task, index, _), verdict in zip(jobs, check_all([problem for *_, problem in jobs], limits, num_workers)):
        details[task].append((index, {"task_id": task, "passed": verdict.passed, "result": outcome(verdict),
                                      "completion_id": index}))
    passed = [[detail["passed"] for _, detail in details[task]] for task in range(len(predictions))]
    return {f"pass@{n}": value for n, value in mean_pass_at_k(passed, ks).items()}, dict(details)
