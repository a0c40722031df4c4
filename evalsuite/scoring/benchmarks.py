"""Answer extraction, lm-eval filters and per-document metrics for the benchmark tasks.

Filters have lm-eval's custom-filter signature `(resps, docs) -> filtered`, where
`resps[i]` is the list of generations (one per repeat) for document `i`.
Scorers have the `process_results(doc, results)` signature and return one value
per metric named in the task's YAML.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Iterable, Sequence

from evalsuite.scoring.sandbox import SandboxLimits, run_python

NO_ANSWER = "[invalid]"  # what a filter yields when nothing could be extracted (lm-eval's convention)

# ---------------------------------------------------------------- numbers (GSM8k)

GSM8K_STRICT = re.compile(r"#### (-?[$0-9.,]+)")
# A number as written in prose: optional sign and $, digits with optional thousands commas and decimals.
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def clean_number(text: str) -> str:
    return text.replace("$", "").replace(",", "").strip().rstrip(".")


def extract_gsm8k_strict(text: str) -> str | None:
    """The number after the first '#### ', the answer format of GSM8k's reference solutions."""
    match = GSM8K_STRICT.search(text)
    return clean_number(match.group(1)) if match else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text, for answers not written in the '#### N' format."""
    matches = NUMBER.findall(text)
    return clean_number(matches[-1]) if matches else None


def same_number(predicted: str | None, target: str) -> bool:
    """Numeric equality, so '18', '18.0' and '18.00' all match a target of 18."""
    if predicted is None:
        return False
    try:
        return Decimal(clean_number(predicted)) == Decimal(clean_number(target))
    except InvalidOperation:
        return False


# ---------------------------------------------------------------- yes / no (StrategyQA)

YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def extract_final_yes_no(text: str) -> str | None:
    """The last standalone 'yes' or 'no', lower-cased: a chain of thought ends with its verdict."""
    matches = YES_NO.findall(text)
    return matches[-1].lower() if matches else None


# ---------------------------------------------------------------- \boxed{} integers (AIME)

BOX_COMMANDS = ("\\boxed", "\\fbox", "\\framebox")
# Formatting wrappers that may surround the number inside a box, e.g. \boxed{\textbf{(211)}}.
WRAPPER = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|bf|rm)\s*\{(.*)\}$", re.DOTALL)
DEGREES = re.compile(r"\^\s*\{?\\circ\}?")


def last_boxed_content(text: str) -> str | None:
    """What is inside the last \\boxed{...} (or \\fbox / \\framebox), with nested braces balanced."""
    start = max(text.rfind(command + "{") for command in BOX_COMMANDS)
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for position in range(opening, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1:position]
    return None  # unbalanced: the generation was cut off inside the box


def parse_integer(text: str) -> int | None:
    """An integer written with light LaTeX decoration ('033', '\\textbf{(211)}', '104.', '45^\\circ')."""
    text = DEGREES.sub("", text.strip())
    while (match := WRAPPER.match(text.strip())) is not None:
        text = match.group(1)
    text = re.sub(r"[\s$(),]", "", text).rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return int(value) if value == value.to_integral_value() else None


def extract_boxed_integer(text: str) -> int | None:
    content = last_boxed_content(text)
    return None if content is None else parse_integer(content)


# ---------------------------------------------------------------- filters


def _first_generation(resps: Iterable[Sequence[str]]) -> list[str]:
    return [generations[0] if generations else "" for generations in resps]


def _or_no_answer(value) -> str:
    return NO_ANSWER if value is None else str(value)


def gsm8k_strict_filter(resps, docs) -> list[str]:
    return [_or_no_answer(extract_gsm8k_strict(text)) for text in _first_generation(resps)]


def gsm8k_flexible_filter(resps, docs) -> list[str]:
    return [_or_no_answer(extract_last_number(text)) for text in _first_generation(resps)]


def yes_no_filter(resps, docs) -> list[str]:
    return [_or_no_answer(extract_final_yes_no(text)) for text in _first_generation(resps)]


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

# lm-eval's HumanEval stop sequences: the function body ends where top-level code starts.
HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
HUMANEVAL_LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=10)
PASS_AT_K = (1, 5, 10)


def truncate_completion(completion: str) -> str:
    """Cut at the first stop sequence, in case the model server did not stop there itself."""
    cut = min((i for i in (completion.find(stop) for stop in HUMANEVAL_STOPS) if i >= 0), default=len(completion))
    return completion[:cut]


def humaneval_program(doc: dict, completion: str) -> str:
    """The prompt, the completed body, the task's tests and the call that runs them."""
    return f"{doc['prompt']}{truncate_completion(completion)}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def run_completions(doc: dict, completions: Sequence[str], limits: SandboxLimits | None = None) -> list[bool]:
    """Whether each completion passes its tests; each runs in its own sandboxed interpreter, in parallel."""
    limits = limits or HUMANEVAL_LIMITS
    workers = max(1, min(len(completions), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on subprocesses
        return list(pool.map(lambda c: run_python(humaneval_program(doc, c), limits).passed, completions))


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), as a stable running product."""
    if k > samples:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {samples}")
    if samples - correct < k:
        return 1.0
    missing_all = 1.0
    for drawn in range(samples - correct + 1, samples + 1):
        missing_all *= 1.0 - k / drawn
    return 1.0 - missing_all


def score_humaneval(doc: dict, results: list) -> dict[str, float]:
    """pass@k for every k in PASS_AT_K that the number of samples (the task's `repeats`) allows."""
    completions = results[0] if isinstance(results[0], (list, tuple)) else results
    passed = run_completions(doc, list(completions))
    return {
        f"pass_at_{k}": pass_at_k(len(passed), sum(passed), k)
        for k in PASS_AT_K if k <= len(passed)
    }
