"""Held-out evaluation sets as `datasets` objects, for lm-eval's `custom_dataset` hook.

The items are regenerated from the fixed held-out seed on every load, so no
data files (and no working-directory-relative paths) are involved.
"""
from __future__ import annotations

from datasets import Dataset, DatasetDict

from evalsuite.taskgen.corpus import HELDOUT_SIZE, heldout_items


def load_skill(skill: str, size: int = HELDOUT_SIZE) -> DatasetDict:
    return DatasetDict({"test": Dataset.from_list(heldout_items(skill, size))})


# lm-eval passes task metadata as keyword arguments; only `heldout_size` is used.
def load_arith(heldout_size: int = HELDOUT_SIZE, **_) -> DatasetDict:
    return load_skill("arith", heldout_size)


def load_yesno(heldout_size: int = HELDOUT_SIZE, **_) -> DatasetDict:
    return load_skill("yesno", heldout_size)


def load_code(heldout_size: int = HELDOUT_SIZE, **_) -> DatasetDict:
    return load_skill("code", heldout_size)


def load_boxed(heldout_size: int = HELDOUT_SIZE, **_) -> DatasetDict:
    return load_skill("boxed", heldout_size)


def load_vision(heldout_size: int = HELDOUT_SIZE, **_) -> DatasetDict:
    """The rendered-image questions of the tiny VL model (evalsuite.taskgen.vision), images included."""
    from evalsuite.taskgen.corpus import heldout_vision_items

    return DatasetDict({"test": Dataset.from_list(heldout_vision_items(heldout_size))})


def vision_doc_to_image(doc: dict) -> list:
    return [doc["image"].convert("RGB")]
