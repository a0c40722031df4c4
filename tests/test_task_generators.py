"""Generators are deterministic, internally consistent, and held-out items never reach training."""
import random

import pytest

from evalsuite.scoring.answers import score_arith, score_boxed, score_code, score_yesno
from evalsuite.taskgen.corpus import (
    SKILL_WEIGHTS, SKILLS, heldout_items, heldout_prompts, training_corpus, training_items,
)
from evalsuite.zoo.tokenizer import build_tokenizer

SCORERS = {"arith": score_arith, "yesno": score_yesno, "boxed": score_boxed}


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_generator_is_deterministic_per_seed(skill):
    first = [SKILLS[skill](random.Random(7)) for _ in range(5)]
    again = [SKILLS[skill](random.Random(7)) for _ in range(5)]
    assert first == again
    assert training_items(skill, 3, 50) == training_items(skill, 3, 50)
    assert training_items(skill, 3, 50) != training_items(skill, 4, 50)


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_heldout_is_stable_and_distinct(skill):
    items = heldout_items(skill)
    assert items == heldout_items(skill)
    assert len({item["prompt"] for item in items}) == len(items) >= 100


def test_no_heldout_prompt_in_training_corpus():
    held = heldout_prompts()
    corpus = training_corpus(seed=0, size_per_skill=2000)
    assert len(corpus) == sum(round(2000 * weight) for weight in SKILL_WEIGHTS.values())
    assert not held & {item["prompt"] for item in corpus}


def test_training_filter_drops_excluded_prompts():
    # Excluding the first prompts a seed would produce must change what that seed yields.
    natural = training_items("yesno", 11, 20, exclude=set())
    filtered = training_items("yesno", 11, 20, exclude={natural[0]["prompt"]})
    assert natural[0]["prompt"] not in {item["prompt"] for item in filtered}


@pytest.mark.parametrize("skill", ["arith", "yesno", "boxed"])
def test_reference_completion_scores_as_correct(skill):
    for item in heldout_items(skill):
        assert SCORERS[skill](item, [item["completion"]]) == {"exact_match": 1.0}


def test_arith_worked_solution_is_correct_arithmetic():
    for item in heldout_items("arith")[:100]:
        *steps, final = item["completion"].strip().split("\n")
        for step in steps:
            expression, value = step.split(" = ")
            assert eval(expression) == int(value)  # our own generated "a op b" strings
        assert final == f"#### {steps[-1].split(' = ')[1]}"


def test_reference_code_passes_and_wrong_code_fails():
    items = heldout_items("code")[:4]
    for item in items:
        assert score_code(item, [item["completion"]]) == {"pass_at_1": 1.0}
        assert score_code(item, ["    return None\n"]) == {"pass_at_1": 0.0}


def test_tokenizer_round_trips_every_skill():
    tokenizer = build_tokenizer()
    for skill in SKILLS:
        for item in heldout_items(skill)[:10]:
            text = item["prompt"] + item["completion"]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text)  # one token per character
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
