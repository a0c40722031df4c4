"""Corpus assembly: training items and held-out evaluation items for the four skills.

Held-out items come from a fixed seed that training never uses, and training
items whose prompt equals a held-out prompt are dropped, so no evaluation item
is ever seen during training.
"""
from __future__ import annotations

import random
from typing import Callable

from evalsuite.taskgen import arith, boxed, code, vision, yesno

SKILLS: dict[str, Callable[[random.Random], dict]] = {
    "arith": arith.generate,
    "yesno": yesno.generate,
    "code": code.generate,
    "boxed": boxed.generate,
}
# Relative share of each skill in the training corpus (every example weighs the same
# in the loss). The two skills with written arithmetic get the most; code is learnt quickly.
SKILL_WEIGHTS = {"arith": 2.0, "yesno": 1.5, "code": 0.4, "boxed": 2.0}
HELDOUT_SEED = 20_240_917
HELDOUT_SIZE = 150


def _skill_rng(seed: int, skill: str) -> random.Random:
    # One independent stream per (seed, skill) so adding a skill never shifts another.
    return random.Random(f"{seed}:{skill}")


def heldout_items(skill: str, size: int = HELDOUT_SIZE) -> list[dict]:
    """`size` distinct evaluation items for `skill`, identical on every call."""
    rng = _skill_rng(HELDOUT_SEED, skill)
    items, seen = [], set()
    while len(items) < size:
        item = SKILLS[skill](rng)
        if item["prompt"] not in seen:
            seen.add(item["prompt"])
            items.append(dict(item, id=f"{skill}-{len(items)}"))
    return items


def heldout_prompts() -> set[str]:
    return {item["prompt"] for skill in SKILLS for item in heldout_items(skill)}


def training_items(skill: str, seed: int, size: int, exclude: set[str] | None = None) -> list[dict]:
    """`size` training items for `skill` from `seed`, skipping any prompt in `exclude`."""
    exclude = heldout_prompts() if exclude is None else exclude
    rng = _skill_rng(seed, skill)
    items = []
    while len(items) < size:
        item = SKILLS[skill](rng)
        if item["prompt"] not in exclude:
            items.append(item)
    return items


def training_corpus(seed: int, size_per_skill: int) -> list[dict]:
    """All skills' training items (size_per_skill scaled by SKILL_WEIGHTS), shuffled together deterministically."""
    exclude = heldout_prompts()
    corpus = [item for skill in SKILLS
              for item in training_items(skill, seed, round(size_per_skill * SKILL_WEIGHTS[skill]), exclude)]
    random.Random(seed).shuffle(corpus)
    return corpus


def _image_key(item: dict) -> tuple[str, bytes]:
    return item["prompt"], item["image"].tobytes()


def heldout_vision_items(size: int = HELDOUT_SIZE) -> list[dict]:
    """`size` distinct rendered-image items (evalsuite.taskgen.vision), identical on every call."""
    rng = _skill_rng(HELDOUT_SEED, "vision")
    items, seen = [], set()
    while len(items) < size:
        item = vision.generate(rng)
        if _image_key(item) not in seen:
            seen.add(_image_key(item))
            items.append(dict(item, id=f"vision-{len(items)}"))
    return items


def vision_training_items(seed: int, step: int, size: int, exclude: set) -> list[dict]:
    """A training batch of rendered-image items, a pure function of (seed, step); held-out images skipped."""
    rng = random.Random(f"{seed}:vision:{step}")
    items = []
    while len(items) < size:
        item = vision.generate(rng)
        if _image_key(item) not in exclude:
            items.append(item)
    return items


def heldout_vision_keys(size: int = HELDOUT_SIZE) -> set:
    return {_image_key(item) for item in heldout_vision_items(size)}
