"""GSM8k-style multi-step arithmetic word problems with a worked solution ending in `#### N`.

Difficulty is chosen for a 3-million-parameter character-level model: every
step is a single-digit product or a sum/difference of a number below 100 and
a single digit, so each written digit follows from a one-digit table and a
carry. Results are never negative.
"""
from __future__ import annotations

import random

NAMES = ["Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Ivy", "Leo", "Zoe", "Raj", "Kim", "Eva", "Noah", "Lily"]
ITEMS = ["apples", "pens", "cards", "stickers", "marbles", "books", "cookies", "shells", "coins", "toys"]


def _buy_then_give(rng: random.Random, name: str, item: str):
    a, b, c = rng.randint(5, 60), rng.randint(2, 9), rng.randint(1, 9)
    text = f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to a friend. How many {item} does {name} have now?"
    return text, [(a, "+", b), (a + b, "-", c)]


def _boxes_then_give(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, min(9, a * b))
    text = f"{name} buys {a} boxes with {b} {item} in each box. {name} gives away {c} of them. How many {item} are left?"
    return text, [(a, "*", b), (a * b, "-", c)]


def _price_plus_extra(rng: random.Random, name: str, item: str):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
    text = (f"A shop sells {item} for {a} dollars each. {name} buys {b} {item} and a bag for {c} dollars. "
            f"How many dollars does {name} pay?")
    return text, [(a, "*", b), (a * b, "+", c)]


def _pages_per_day(rng: random.Random, name: str, item: str):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    text = (f"{name} reads {a} pages every day for {b} days and then {c} more pages on the last evening. "
            f"How many pages does {name} read in total?")
    return text, [(a, "*", b), (a * b, "+", c)]


def _daily_gain(rng: random.Random, name: str, item: str):
    a, b, c = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 9)
    text = f"{name} has {a} {item} and gets {b} more {item} every day for {c} days. How many {item} does {name} have after {c} days?"
    return text, [(b, "*", c), (b * c, "+", a)]


def _three_steps(rng: random.Random, name: str, item: str):
    a, k = rng.randint(2, 9), rng.randint(2, 9)
    b = rng.randint(1, min(9, a * k))
    c = rng.randint(1, 9)
    text = (f"{name} has {a} {item}. {name} makes the number of {item} {k} times larger, then loses {b} of them "
            f"and then finds {c} more. How many {item} does {name} have now?")
    return text, [(a, "*", k), (a * k, "-", b), (a * k - b, "+", c)]


TEMPLATES = [_buy_then_give, _boxes_then_give, _price_plus_extra, _pages_per_day, _daily_gain, _three_steps]
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def generate(rng: random.Random) -> dict:
    template = rng.choice(TEMPLATES)
    question, steps = template(rng, rng.choice(NAMES), rng.choice(ITEMS))
    lines = []
    for left, op, right in steps:
        value = OPS[op](left, right)
        lines.append(f"{left} {op} {right} = {value}")
    return {
        "prompt": f"Question: {question}\nAnswer:",
        "completion": " " + "\n".join(lines) + f"\n#### {value}",
        "answer": str(value),
    }
