"""lm-eval filters and per-document metrics for the benchmark tasks (GSM8k, StrategyQA, AIME, HumanEval).

The answer rules themselves live in answers.py, shared with the project's own tasks. GSM8k's
strict-match and StrategyQA's final yes/no use lm-eval's own `regex` filter in the YAMLs, with
the patterns answers.GSM8K_STRICT and answers.YES_NO; the filters here are the ones lm-eval has
no exact equivalent for. They have lm-eval's custom-filter signature `(resps, docs) -> filtered`,
where `resps[i]` is the list of generations (one per repeat) for document `i`. Scorers have the
`process_results(doc, results)` signature and return one value per metric named in the YAML.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from evalsuite.scoring.answers import (
    NO_ANSWER, extract_boxed_integer, extract_last_number, parse_integer, same_number,
)
from evalsuite.scoring.code_eval import check_all, mean_pass_at_k, problem_from_doc
from evalsuite.scoring.sandbox import SandboxLimits

# ---------------------------------------------------------------- filters


def _first_generation(resps: Iterable[Sequence[str]]) -> list[str]:
    return [generations[0] if generations else "" for generations in resps]


def _or_no_answer(value) -> str:
    return NO_ANSWER if value is None else str(value)


def gsm8k_flexible_filter(resps, docs) -> list[str]:
    return [_or_no_answer(extract_last_number(text)) for text in _first_generation(resps)]


def boxed_integer_filter(resps, docs) -> list[str]:
    return [_or_no_answer(extract_boxed_integer(text)) for text in _first_generation(resps)]


def keep_all_generations(resps, docs) -> list[list[str]]:
    """Every repeat of every document, so pass@k sees all samples (lm-eval's default keeps only the first)."""
    return [list(generations) for generations in resps]


# ---------------------------------------------------------------- scorers


def _single(results: list) -> str:
    value = results[0]
    return value[0] if isinstance(value, (list, tuple)) else value


def score_gsm8k(doc: dict, results: list) -> dict[str, float]:
    """exact_match of the filtered number against the reference answer."""
    return {"exact_match": float(same_number(_single(results), doc["target"]))}


def score_yes_no(doc: dict, results: list) -> dict[str, float]:
    return {"exact_match": float(_single(results) == doc["target"])}


def score_aime(doc: dict, results: list) -> dict[str, float]:
    predicted = parse_integer(_single(results))
    return {"exact_match": float(predicted is not None and predicted in doc["accepted_answers"])}


# ---------------------------------------------------------------- HumanEval

HUMANEVAL_LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=10)
PASS_AT_K = (1, 5, 10)


def run_completions(doc: dict, completions: Sequence[str], limits: SandboxLimits | None = None) -> list[bool]:
    """Whether each completion passes its tests (code_eval.check), in parallel."""
    problems = [problem_from_doc(doc, completion) for completion in completions]
    return [verdict.passed for verdict in check_all(problems, limits or HUMANEVAL_LIMITS)]


def score_humaneval(doc: dict, results: list) -> dict[str, float]:
    """pass@k for every k in PASS_AT_K that the number of samples (the task's `repeats`) allows."""
    completions = results[0] if isinstance(results[0], (list, tuple)) else results
    passed = run_completions(doc, list(completions))
    return {f"pass_at_{k}": value for k, value in mean_pass_at_k([passed], PASS_AT_K).items()}
