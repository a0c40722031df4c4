"""pass@k of programs run in evalsuite's sandbox: one implementation for the HumanEval task's scorer
(benchmarks.score_humaneval) and for the `evaluate` module sandboxed_code_eval, a drop-in for the Hub's
`code_eval` (`compute_code_eval` takes and returns what that module's compute does).

A program is whole (the candidate, its tests and the call that runs them) and passes when the sandbox
says it ran to its end (sandbox.run_python); no code runs anywhere else.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

from evalsuite.scoring.sandbox import SandboxLimits, SandboxResult, run_python


def run_programs(programs: Sequence[str], limits: SandboxLimits, workers: int | None = None) -> list[SandboxResult]:
    """Each program in its own sandboxed interpreter, `workers` at a time (default: one per CPU)."""
    workers = max(1, min(len(programs), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on subprocesses
        return list(pool.map(lambda program: run_python(program, limits), programs))


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


def outcome(result: SandboxResult) -> str:
    """What code_eval reports per candidate: 'passed', 'timed out' or 'failed: <last line of stderr>'."""
    if result.passed:
        return "passed"
    if result.timed_out:
        return "timed out"
    last = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
    return f"failed: {last[0]}"


def compute_code_eval(predictions: Sequence[Sequence[str]], references: Sequence[str], k=(1, 10, 100),
                      num_workers: int = 4, timeout: float = 3.0) -> tuple[dict[str, float], dict[int, list]]:
    """predictions[i]: candidate programs for problem i; references[i]: its test program (ending in the call
    that runs the tests). Returns ({"pass@k": mean over problems}, {i: [(candidate index, detail), ...]})."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} lists of candidates for {len(references)} test programs: "
                         "give one list of candidates per test program")
    ks = [k] if isinstance(k, int) else list(k)
    limits = SandboxLimits(wall_seconds=timeout, cpu_seconds=max(1, math.ceil(timeout)))
    jobs = [(task, index, f"{candidate}\n{references[task]}")
            for task, candidates in enumerate(predictions) for index, candidate in enumerate(candidates)]
    details = defaultdict(list)
    for (task, index, _), result in zip(jobs, run_programs([program for *_, program in jobs], limits, num_workers)):
        details[task].append((index, {"task_id": task, "passed": result.passed, "result": outcome(result),
                                      "completion_id": index}))
    passed = [[detail["passed"] for _, detail in details[task]] for task in range(len(predictions))]
    return {f"pass@{n}": value for n, value in mean_pass_at_k(passed, ks).items()}, dict(details)
