"""The answer rules: how a final answer is read out of a generation, defined once for every task.

The project's own tasks (scored below) and the benchmarks (benchmarks.py, mathvision.py) read
numbers, yes/no verdicts and \\boxed{} answers with these same functions, so
one generation extracts the same way whichever task scores it. Where a benchmark YAML uses
lm-eval's own regex filter instead, its pattern is the one defined here (tests/test_answer_rules.py
checks that).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from evalsuite.scoring.code_eval import check, problem_from_doc

NO_ANSWER = "[invalid]"  # what a filter yields when nothing could be extracted (lm-eval's convention)

# ---------------------------------------------------------------- numbers (GSM8k format)

# lm-eval's gsm8k strict-match pattern with `$` allowed, so `#### $1,000` reads as 1000.
GSM8K_STRICT = re.compile(r"#### (\-?[$0-9.,]+)")
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
    """Numeric equality, so '18', '18.0', '18.00' and '$18' all match a target of 18."""
    if predicted is None:
        return False
    try:
        return Decimal(clean_number(predicted)) == Decimal(clean_number(str(target)))
    except InvalidOperation:
        return False


# ---------------------------------------------------------------- yes / no (StrategyQA format)

# Case-insensitive inline, so the same pattern works in lm-eval's regex filter (which takes no flags).
YES_NO = re.compile(r"(?i)\b(yes|no)\b")


def extract_yes_no(text: str) -> str | None:
    """The last standalone 'yes' or 'no', lower-cased: a chain of thought ends with its verdict."""
    matches = YES_NO.findall(text)
    return matches[-1].lower() if matches else None


# ---------------------------------------------------------------- \boxed{} answers

BOX_COMMANDS = ("\\boxed", "\\fbox", "\\framebox")
# A formatting command around a piece of an answer, e.g. \textbf{(211)} or \text{D}; innermost first.
LATEX_WRAPPER = re.compile(r"\\(?:text|textbf|mathbf|mathrm|bf|rm)\s*\{([^{}]*)\}")
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


def strip_latex_wrappers(text: str) -> str:
    """The text with every formatting wrapper replaced by its content, nested ones included."""
    while (unwrapped := LATEX_WRAPPER.sub(r"\1", text)) != text:
        text = unwrapped
    return text


def parse_integer(text: str) -> int | None:
    """An integer written with light LaTeX decoration ('033', '\\textbf{(211)}', '104.', '45^\\circ')."""
    text = strip_latex_wrappers(DEGREES.sub("", text.strip()))
    text = re.sub(r"[\s$(),]", "", text).rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return int(value) if value.is_finite() and value == value.to_integral_value() else None


def extract_boxed_integer(text: str) -> int | None:
    """The integer in the last box; None when the last box holds anything else (a fraction, an expression)."""
    content = last_boxed_content(text)
    return None if content is None else parse_integer(content)


# ---------------------------------------------------------------- one-word answers (the tiny VL task)


def first_word(text: str) -> str | None:
    """The first word, lower-cased and without punctuation."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return words[0] if words else None


# ---------------------------------------------------------------- the project's tasks (process_results)


def score_arith(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(same_number(extract_gsm8k_strict(results[0]), doc["answer"]))}


def score_yesno(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(extract_yes_no(results[0]) == doc["answer"])}


def score_boxed(doc: dict, results: list[str]) -> dict[str, float]:
    predicted = extract_boxed_integer(results[0])
    return {"exact_match": float(predicted is not None and predicted == int(doc["answer"]))}


def score_code(doc: dict, results: list[str]) -> dict[str, float]:
    """The project's code task: HumanEval's layout, checked the same way (code_eval.check)."""
    return {"pass_at_1": float(check(problem_from_doc(doc, results[0])).passed)}


def score_vision(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(first_word(results[0]) == doc["answer"])}
