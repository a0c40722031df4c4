"""Benchmark loaders for lm-eval's `custom_dataset` hook.

Each loader returns a `DatasetDict` whose rows have one normalised schema,
whichever source they came from:

* offline: when EVALSUITE_DATA_DIR is set, the JSONL files under it (laid out
  like shared/data: gsm8k/test.jsonl, humaneval/test.jsonl, ...);
* online: otherwise the Hugging Face Hub dataset that lm-eval's own task for
  the benchmark reads, via `datasets.load_dataset`.

A set EVALSUITE_DATA_DIR that lacks a file is an error, never a silent fallback
to the Hub, so an offline run cannot quietly evaluate on different data.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from datasets import Dataset, DatasetDict

DATA_DIR_ENV = "EVALSUITE_DATA_DIR"

Row = dict[str, Any]


class MissingDataError(FileNotFoundError):
    """A benchmark file is absent from the directory named by EVALSUITE_DATA_DIR."""


@dataclass(frozen=True)
class SplitSource:
    local_file: str          # relative to EVALSUITE_DATA_DIR
    hub_path: str            # the Hub dataset lm-eval's own task uses
    hub_name: str | None     # its configuration, if any
    hub_split: str


def local_data_dir() -> Path | None:
    value = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else None


def read_jsonl(path: Path) -> list[Row]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_local_split(relative_file: str) -> list[Row] | None:
    """Rows of `relative_file` under EVALSUITE_DATA_DIR; None when the variable is unset."""
    root = local_data_dir()
    if root is None:
        return None
    path = root / relative_file
    if not path.is_file():
        raise MissingDataError(f"{DATA_DIR_ENV}={root} is set but the expected file {path} does not exist")
    return read_jsonl(path)


def read_hub_split(source: SplitSource) -> list[Row]:
    from datasets import load_dataset

    return list(load_dataset(source.hub_path, source.hub_name, split=source.hub_split))


def load_splits(sources: dict[str, SplitSource], normalise: Callable[[Row], Row]) -> DatasetDict:
    splits = {}
    for split, source in sources.items():
        rows = read_local_split(source.local_file)
        if rows is None:
            rows = read_hub_split(source)
        splits[split] = Dataset.from_list([normalise(row) for row in rows])
    return DatasetDict(splits)


def field(row: Row, *names: str, default: Any = None) -> Any:
    """The first of `names` present in `row`, compared case-insensitively (Hub copies differ in casing)."""
    lowered = {key.lower(): value for key, value in row.items()}
    for name in names:
        if name.lower() in lowered:
            return lowered[name.lower()]
    return default


# ---------------------------------------------------------------- GSM8k


def gsm8k_final_answer(solution: str) -> str:
    """The number after '####' in a GSM8k solution, without thousands separators."""
    return solution.split("####")[-1].strip().replace(",", "")


def normalise_gsm8k(row: Row) -> Row:
    target = row.get("final_answer") or gsm8k_final_answer(row["answer"])
    return {"question": row["question"], "answer": row["answer"], "target": str(target)}


def load_gsm8k(**_) -> DatasetDict:
    # lm-eval passes task metadata as keyword arguments; none of it matters here.
    return load_splits(
        {
            "test": SplitSource("gsm8k/test.jsonl", "openai/gsm8k", "main", "test"),
            "train": SplitSource("gsm8k/train.jsonl", "openai/gsm8k", "main", "train"),
        },
        normalise_gsm8k,
    )


# ---------------------------------------------------------------- HumanEval

HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


def normalise_humaneval(row: Row) -> Row:
    return {name: row[name] for name in HUMANEVAL_FIELDS}


def load_humaneval(**_) -> DatasetDict:
    return load_splits(
        {"test": SplitSource("humaneval/test.jsonl", "openai/openai_humaneval", None, "test")},
        normalise_humaneval,
    )


# ---------------------------------------------------------------- StrategyQA

BIGBENCH_QUESTION = re.compile(r"^\s*Q:\s*(.*?)\s*(?:A:\s*)?$", re.DOTALL)


def bigbench_says_yes(row: Row) -> bool:
    """BIG-bench rows mark the right choice with a score of 1 among ["Yes", "No"]."""
    for choice, score in zip(row.get("multiple_choice_targets", []), row.get("multiple_choice_scores", [])):
        if score == 1:
            return choice.strip().lower() == "yes"
    return str(row["targets"][0]).strip().lower().startswith("yes")


def normalise_strategyqa(row: Row) -> Row:
    if "question" in row:  # the StrategyQA JSON layout of the offline files
        answer = bool(row["answer"])
        question, facts = row["question"], list(row.get("facts") or [])
    else:  # hails/bigbench "strategyqa_zero_shot": inputs "Q: ...\nA:"
        answer = bigbench_says_yes(row)
        match = BIGBENCH_QUESTION.match(row["inputs"])
        question, facts = (match.group(1) if match else row["inputs"].strip()), []
    return {"question": question, "answer": answer, "target": "yes" if answer else "no", "facts": facts}


def load_strategyqa(**_) -> DatasetDict:
    # Offline: the authors' unofficial dev split is the test set, their train split feeds few-shot.
    # Online: BIG-bench's copy (lm-eval's bigbench_strategyqa) with its validation/train splits.
    return load_splits(
        {
            "test": SplitSource("strategyqa/dev.jsonl", "hails/bigbench", "strategyqa_zero_shot", "validation"),
            "train": SplitSource("strategyqa/train.jsonl", "hails/bigbench", "strategyqa_zero_shot", "train"),
        },
        normalise_strategyqa,
    )


# ---------------------------------------------------------------- AIME

INTEGER = re.compile(r"-?\d+")


def normalise_aime(row: Row) -> Row:
    raw_answer = field(row, "answer")
    accepted = field(row, "accepted_answers")
    if not accepted:
        # Hub copies store the answer as int or text ("080 or 081 (both were accepted)").
        accepted = [int(number) for number in INTEGER.findall(str(raw_answer))]
    return {
        "id": str(field(row, "id", default="")),
        "problem": field(row, "problem", "question"),
        "answer": int(accepted[0]),
        "accepted_answers": [int(value) for value in accepted],
        "solution": field(row, "solution", default=None) or "",
    }


def load_aime24(**_) -> DatasetDict:
    return load_splits(
        {"test": SplitSource("aime/aime2024.jsonl", "Maxwell-Jia/AIME_2024", None, "train")}, normalise_aime
    )


def load_aime25(**_) -> DatasetDict:
    return load_splits({"test": SplitSource("aime/aime2025.jsonl", "math-ai/aime25", None, "test")}, normalise_aime)


def load_aime_1983_2024(**_) -> DatasetDict:
    return load_splits(
        {"test": SplitSource("aime/aime_1983_2024.jsonl", "gneubig/aime-1983-2024", None, "train")}, normalise_aime
    )
