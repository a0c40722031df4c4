"""StrategyQA-style yes/no questions needing one reasoning step over stated facts.

The answer is a short chain of thought ending in "So the answer is yes." (or no), as
StrategyQA's chain-of-thought format does. Each chain is built from steps a small model can
learn: copying a name or number from the facts, comparing two things written side by side,
and a verdict that follows from the last comparison. A bare yes/no (a first version) gives
one bit of supervision per item, and the models learnt only the template that needs no
comparison.
"""
from __future__ import annotations

import random

NAMES = ["Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Ivy", "Leo", "Zoe", "Raj", "Kim", "Eva", "Noah", "Lily"]
RELATIONS = [("taller", "tallest"), ("older", "oldest"), ("faster", "fastest"), ("heavier", "heaviest"),
             ("stronger", "strongest")]
ANIMALS = [("dog", "bark", "fly"), ("bird", "fly", "bark"), ("fish", "swim", "walk"), ("cat", "climb", "swim"),
           ("horse", "run", "fly"), ("frog", "jump", "fly"), ("snake", "hiss", "run")]
THINGS = ["key", "coin", "ring", "pen", "cup", "ball", "shoe", "map", "lamp", "book", "sock", "spoon", "card", "bell"]
PETS = ["Rex", "Bo", "Kiki", "Pip", "Luna", "Milo", "Toby", "Nala"]


def _verdict(yes: bool) -> str:
    return f"So the answer is {'yes' if yes else 'no'}."


def _transitive(rng: random.Random, want_yes: bool):
    a, b, c = rng.sample(NAMES, 3)
    comparative, superlative = rng.choice(RELATIONS)
    facts = f"{a} is {comparative} than {b}. {b} is {comparative} than {c}."
    first, second = (a, c) if want_yes else (c, a)
    same = "is" if first == a else "is not"
    work = f"{a} is the {superlative}. {first} {same} {a}. {_verdict(want_yes)}"
    return facts, f"Is {first} {comparative} than {second}?", work


def _numbers(rng: random.Random, want_yes: bool):
    a, b = rng.sample(NAMES, 2)
    x, y = rng.sample(range(5, 100), 2)
    comparative, unit = rng.choice([("older", "years old"), ("taller", "inches tall"), ("heavier", "kilograms heavy")])
    facts = f"{a} is {x} {unit}. {b} is {y} {unit}."
    # Ask about whichever order makes the answer come out as requested.
    (first, fx), (second, sx) = ((a, x), (b, y)) if (x > y) == want_yes else ((b, y), (a, x))
    relation = "more" if fx > sx else "less"
    work = f"{first} is {fx} and {second} is {sx}. {fx} is {relation} than {sx}. {_verdict(want_yes)}"
    return facts, f"Is {first} {comparative} than {second}?", work


def _ability(rng: random.Random, want_yes: bool):
    pet = rng.choice(PETS)
    kind, can, cannot = rng.choice(ANIMALS)
    facts = f"{pet} is a {kind}. Every {kind} can {can} but cannot {cannot}."
    asked = can if want_yes else cannot
    work = f"{pet} is a {kind}. Every {kind} {'can' if want_yes else 'cannot'} {asked}. {_verdict(want_yes)}"
    return facts, f"Can {pet} {asked}?", work


def _membership(rng: random.Random, want_yes: bool):
    container = rng.choice(["box", "bag", "basket", "drawer", "jar"])
    things = rng.sample(THINGS, 4)
    facts = f"The {container} holds a {things[0]}, a {things[1]} and a {things[2]}."
    asked = rng.choice(things[:3]) if want_yes else things[3]
    checks = ", ".join(f"{t} {'yes' if t == asked else 'no'}" for t in things[:3])
    work = f"Looking for {asked}: {checks}. {_verdict(want_yes)}"
    return facts, f"Is there a {asked} in the {container}?", work


TEMPLATES = [_transitive, _numbers, _ability, _membership]


def generate(rng: random.Random) -> dict:
    want_yes = rng.random() < 0.5
    facts, question, work = rng.choice(TEMPLATES)(rng, want_yes)
    return {
        "prompt": f"Facts: {facts}\nQuestion: {question}\nAnswer:",
        "completion": f" {work}",
        "answer": "yes" if want_yes else "no",
    }
