"""StrategyQA-style yes/no questions needing one reasoning step over stated facts."""
from __future__ import annotations

import random

NAMES = ["Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Ivy", "Leo", "Zoe", "Raj", "Kim", "Eva", "Noah", "Lily"]
RELATIONS = [("taller", "tall"), ("older", "old"), ("faster", "fast"), ("heavier", "heavy"), ("stronger", "strong")]
ANIMALS = [("dog", "bark", "fly"), ("bird", "fly", "bark"), ("fish", "swim", "walk"), ("cat", "climb", "swim"),
           ("horse", "run", "fly"), ("frog", "jump", "fly"), ("snake", "hiss", "run")]
THINGS = ["key", "coin", "ring", "pen", "cup", "ball", "shoe", "map", "lamp", "book", "sock", "spoon", "card", "bell"]
PETS = ["Rex", "Bo", "Kiki", "Pip", "Luna", "Milo", "Toby", "Nala"]


def _transitive(rng: random.Random, want_yes: bool):
    a, b, c = rng.sample(NAMES, 3)
    comparative, _ = rng.choice(RELATIONS)
    facts = f"{a} is {comparative} than {b}. {b} is {comparative} than {c}."
    first, second = (a, c) if want_yes else (c, a)
    return facts, f"Is {first} {comparative} than {second}?"


def _numbers(rng: random.Random, want_yes: bool):
    a, b = rng.sample(NAMES, 2)
    x, y = rng.sample(range(5, 100), 2)
    comparative, unit = rng.choice([("older", "years old"), ("taller", "inches tall"), ("heavier", "kilograms heavy")])
    facts = f"{a} is {x} {unit}. {b} is {y} {unit}."
    # Ask about whichever order makes the answer come out as requested.
    first, second = (a, b) if (x > y) == want_yes else (b, a)
    return facts, f"Is {first} {comparative} than {second}?"


def _ability(rng: random.Random, want_yes: bool):
    pet = rng.choice(PETS)
    kind, can, cannot = rng.choice(ANIMALS)
    facts = f"{pet} is a {kind}. Every {kind} can {can} but cannot {cannot}."
    return facts, f"Can {pet} {can if want_yes else cannot}?"


def _membership(rng: random.Random, want_yes: bool):
    container = rng.choice(["box", "bag", "basket", "drawer", "jar"])
    things = rng.sample(THINGS, 4)
    facts = f"The {container} holds a {things[0]}, a {things[1]} and a {things[2]}."
    asked = rng.choice(things[:3]) if want_yes else things[3]
    return facts, f"Is there a {asked} in the {container}?"


TEMPLATES = [_transitive, _numbers, _ability, _membership]


def generate(rng: random.Random) -> dict:
    want_yes = rng.random() < 0.5
    facts, question = rng.choice(TEMPLATES)(rng, want_yes)
    answer = "yes" if want_yes else "no"
    return {
        "prompt": f"Facts: {facts}\nQuestion: {question}\nAnswer:",
        "completion": f" {answer}",
        "answer": answer,
    }
