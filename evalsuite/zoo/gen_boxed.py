"""AIME-style short integer problems with a worked solution and the answer in \\boxed{N}."""
from __future__ import annotations

import random


def _digit_sum(rng: random.Random):
    n = rng.randint(100, 9999)
    digits = [int(d) for d in str(n)]
    total = sum(digits)
    return f"What is the sum of the digits of {n}?", f"{' + '.join(map(str, digits))} = {total}", total


def _solve_addition(rng: random.Random):
    a, x = rng.randint(2, 60), rng.randint(1, 60)
    return f"If x + {a} = {x + a}, what is x?", f"x = {x + a} - {a} = {x}", x


def _solve_product(rng: random.Random):
    a, x = rng.randint(2, 9), rng.randint(2, 9)
    return f"If {a}x = {a * x}, what is x?", f"x = {a * x} / {a} = {x}", x


def _precedence(rng: random.Random):
    a, b, c = rng.randint(1, 50), rng.randint(2, 9), rng.randint(2, 9)
    return (f"Evaluate {a} + {b} * {c}.", f"{b} * {c} = {b * c}, {a} + {b * c} = {a + b * c}", a + b * c)


def _remainder(rng: random.Random):
    k = rng.randint(2, 9)
    q, r = rng.randint(1, 9), rng.randint(0, k - 1)
    n = k * q + r
    return (f"Find the remainder when {n} is divided by {k}.", f"{k} * {q} = {k * q}, {n} - {k * q} = {r}", r)


def _difference_of_squares(rng: random.Random):
    a = rng.randint(3, 12)
    b = rng.randint(1, a - 1)
    return (f"Compute {a}^2 - {b}^2.", f"{a}^2 = {a * a}, {b}^2 = {b * b}, {a * a} - {b * b} = {a * a - b * b}",
            a * a - b * b)


TEMPLATES = [_digit_sum, _solve_addition, _solve_product, _precedence, _remainder, _difference_of_squares]


def generate(rng: random.Random) -> dict:
    problem, work, answer = rng.choice(TEMPLATES)(rng)
    return {
        "prompt": f"Problem: {problem}\nSolution:",
        "completion": f" {work}. The answer is \\boxed{{{answer}}}",
        "answer": str(answer),
    }
