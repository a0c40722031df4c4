"""Answer extraction and per-item metrics for the project's lm-eval tasks."""
from __future__ import annotations

import re

from evalsuite.scoring.sandbox import SandboxLimits, run_python

# GSM8k's "strict-match" pattern from lm-eval's gsm8k task.
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
BOXED = re.compile(r"\\boxed\{\s*(-?[0-9][0-9,]*)\s*\}")


def _normalise_number(text: str) -> str:
    return text.replace(",", "").rstrip(".")


def extract_gsm8k_strict(text: str) -> str | None:
    """The number after the first `#### `, as lm-eval's strict-match filter takes it."""
    match = GSM8K_STRICT.search(text)
    return _normalise_number(match.group(1)) if match else None


def extract_yes_no(text: str) -> str | None:
    """The last standalone yes/no word, lower-cased: a chain of thought ends with its verdict."""
    matches = YES_NO.findall(text)
    return matches[-1].lower() if matches else None


def extract_last_boxed(text: str) -> str | None:
    """The integer inside the last \\boxed{...}."""
    matches = BOXED.findall(text)
    return _normalise_number(matches[-1]) if matches else None


def code_program(doc: dict, completion: str) -> str:
    """HumanEval-style program: prompt + completion, then the tests called on the entry point."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\ncheck({doc['entry_point']})\n"


def code_passes(doc: dict, completion: str, limits: SandboxLimits | None = None) -> bool:
    return run_python(code_program(doc, completion), limits).passed


def score_arith(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(extract_gsm8k_strict(results[0]) == doc["answer"])}


def score_yesno(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(extract_yes_no(results[0]) == doc["answer"])}


def score_boxed(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(extract_last_boxed(results[0]) == doc["answer"])}


def score_code(doc: dict, results: list[str]) -> dict[str, float]:
    return {"pass_at_1": float(code_passes(doc, results[0]))}


def first_word(text: str) -> str | None:
    """The first word, lower-cased and without punctuation: the tiny VL task's one-word answers."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return words[0] if words else None


def score_vision(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(first_word(results[0]) == doc["answer"])}
