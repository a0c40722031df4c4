"""MATH-Vision (MATH-V) testmini: 304 competition problems with one image each.

Offline the rows come from EVALSUITE_DATA_DIR/mathvision_testmini (testmini.jsonl and its
images/ folder); online from the Hub dataset MathLLMs/MathVision, split testmini. 190 are
multiple choice (the answer is a letter A-E; the options are texts, or just the letters when
the choices are drawn in the image), 114 free form (a short number or expression).

The answer is the last \\boxed{...} in the generation (else the text after the last "answer
is"); a multiple-choice answer may be the letter in any usual wrapping ("(D)", "D.", "\\text{D}")
or the option's text; free-form answers compare numerically when both sides are numbers, else
as normalised text.
"""
from __future__ import annotations

import re

from datasets import DatasetDict

from .answers import last_boxed_content, strip_latex_wrappers
from .datasets import Row, SplitSource, field, load_splits, local_data_dir

LETTERS = "ABCDE"
PLACEHOLDER = re.compile(r"<image\d*>")
ANSWER_IS = re.compile(r"answer is\s*:?\s*(.+?)\s*(?:\.\s*$|\n|$)", re.IGNORECASE)
PROMPT_TAIL = ("Please reason step by step, and put your final answer within \\boxed{}. "
               "For a multiple-choice question, the final answer is the option's letter.")


def normalise_mathvision(row: Row) -> Row:
    image = field(row, "decoded_image") or field(row, "image")
    root = local_data_dir()
    if isinstance(image, str) and root is not None:  # offline: a path relative to the dataset folder
        image = str(root / "mathvision_testmini" / image)
    options = list(field(row, "options", default=[]) or [])
    return {"id": str(field(row, "id")), "question": field(row, "question"), "options": options,
            "answer": str(field(row, "answer")).strip(), "image": image,
            "multiple_choice": bool(options), "subject": field(row, "subject", default="") or ""}


def load_mathvision_testmini(**_) -> DatasetDict:
    return load_splits({"test": SplitSource("mathvision_testmini/testmini.jsonl", "MathLLMs/MathVision", None,
                                            "testmini")}, normalise_mathvision)


def doc_to_image(doc: dict) -> list:
    from PIL import Image

    image = doc["image"]
    if isinstance(image, str):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    return [image]


def doc_to_text(doc: dict) -> str:
    """One <image> (lm-eval's placeholder) first: each item has one image, composite if the text
    names several."""
    question = PLACEHOLDER.sub("", doc["question"]).strip()
    lines = ["<image>", question]
    if doc["options"] and list(doc["options"]) != list(LETTERS[:len(doc["options"])]):
        lines += ["Choices:"] + [f"{LETTERS[i]}. {text}" for i, text in enumerate(doc["options"])]
    elif doc["options"]:
        lines.append("Choices: " + ", ".join(LETTERS[:len(doc["options"])]) + " (drawn in the image)")
    return "\n".join(lines + [PROMPT_TAIL, "Solution:"])


def final_answer(text: str) -> str | None:
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    matches = ANSWER_IS.findall(text)
    return matches[-1] if matches else None


def _plain(text: str) -> str:
    text = strip_latex_wrappers(text)
    return re.sub(r"[\s$]", "", text).rstrip(".").strip()


def choice_letter(answer: str, options: list[str]) -> str | None:
    """The option letter an extracted answer names: a bare or wrapped letter, or an option's text."""
    plain = _plain(answer)
    match = re.fullmatch(r"\(?([A-E])\)?[.:)]?", plain)
    if match:
        return match.group(1)
    texts = [_plain(o) for o in options]
    if plain in texts:
        return LETTERS[texts.index(plain)]
    match = re.match(r"^\(?([A-E])\)[:.]?|^([A-E])[.:]\s", answer.strip())  # "(D) 12" or "D. 12"
    return (match.group(1) or match.group(2)) if match else None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def is_correct(doc: dict, generation: str) -> bool:
    answer = final_answer(generation)
    if answer is None:
        return False
    if doc["multiple_choice"]:
        return choice_letter(answer, doc["options"]) == doc["answer"]
    got, gold = _plain(answer), _plain(doc["answer"])
    got_n, gold_n = _number(got), _number(gold)
    if got_n is not None and gold_n is not None:
        return abs(got_n - gold_n) <= 1e-6 * max(1.0, abs(gold_n))
    return got == gold


def score_mathvision(doc: dict, results: list) -> dict[str, float]:
    return {"exact_match": float(is_correct(doc, results[0]))}
