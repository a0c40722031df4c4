"""GSM8k-style multi-step arithmetic word problems with a worked solution ending in `#### N`."""
from __future__ import annotations

import random

NAMES = ["Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Ivy", "Leo", "Zoe", "Raj", "Kim", "Eva", "Noah", "Lily"]
ITEMS = ["apples", "pens", "cards", "stickers", "marbles", "books", "cookies", "shells", "coins", "toys"]


def _buy_then_give(rng: random.Random, name: str, item: str):
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    text = f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to a friend. How many {item} does {name} have now?"
    return text, [(a, "+", b), (a + b, "-", c)]


def _boxes_then_eat(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b)
    text = f"{name} buys {a} boxes with {b} {item} in each box. {name} gives away {c} of them. How many {item} are left?"
    return text, [(a, "*", b), (a * b, "-", c)]


def _change(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.choice([50, 60, 80, 100])
    text = f"A shop sells {item} for {a} dollars each. {name} buys {b} {item} and pays with {c} dollars. How many dollars of change does {name} get?"
    return text, [(a, "*", b), (c, "-", a * b)]


def _pages_left(rng: random.Random, name: str, item: str):
    a, b = rng.randint(5, 50), rng.randint(5, 50)
    c = rng.randint(a + b, 150)
    text = f"{name} reads {a} pages on Monday and {b} pages on Tuesday. The book has {c} pages. How many pages are left to read?"
    return text, [(a, "+", b), (c, "-", a + b)]


def _daily_gain(rng: random.Random, name: str, item: str):
    a, b, c = rng.randint(1, 40), rng.randint(2, 9), rng.randint(2, 9)
    text = f"{name} has {a} {item} and gets {b} more {item} every day for {c} days. How many {item} does {name} have after {c} days?"
    return text, [(b, "*", c), (a, "+", b * c)]


def _three_steps(rng: random.Random, name: str, item: str):
    a, k = rng.randint(2, 30), rng.randint(2, 4)
    b = rng.randint(1, a * k)
    c = rng.randint(1, 30)
    text = (f"{name} has {a} {item}. {name} makes the number of {item} {k} times larger, then loses {b} of them "
            f"and then finds {c} more. How many {item} does {name} have now?")
    return text, [(a, "*", k), (a * k, "-", b), (a * k - b, "+", c)]


TEMPLATES = [_buy_then_give, _boxes_then_eat, _change, _pages_left, _daily_gain, _three_steps]
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def generate(rng: random.Random) -> dict:
    template = rng.choice(TEMPLATES)
    question, steps = template(rng, rng.choice(NAMES), rng.choice(ITEMS))
    lines = []
    for left, op, right in steps:
        value = OPS[op](left, right)
        lines.append(f"{left} {op} {right} = {value}")
    answer = value
    return {
        "prompt": f"Question: {question}\nAnswer:",
        "completion": " " + "\n".join(lines) + f"\n#### {answer}",
        "answer": str(answer),
    }
