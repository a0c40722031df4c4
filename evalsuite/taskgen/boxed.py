"""AIME-style short integer problems with a worked solution and the answer in \\boxed{N}.

Like the arithmetic skill, every written step is a one-digit product or
quotient, or a number below 100 plus or minus a single digit; multi-term
sums are written as running totals.
"""
from __future__ import annotations

import random


def _digit_sum(rng: random.Random):
    digits = [int(d) for d in str(rng.randint(100, 999))]
    work, total = [], digits[0]
    for d in digits[1:]:
        work.append(f"{total} + {d} = {total + d}")
        total += d
    return f"What is the sum of the digits of {''.join(map(str, digits))}?", ", ".join(work), total


def _solve_addition(rng: random.Random):
    a, x = rng.randint(2, 9), rng.randint(1, 60)
    return f"If x + {a} = {x + a}, what is x?", f"x = {x + a} - {a} = {x}", x


def _solve_product(rng: random.Random):
    a, x = rng.randint(2, 9), rng.randint(2, 9)
    return f"If {a}x = {a * x}, what is x?", f"x = {a * x} / {a} = {x}", x


def _precedence(rng: random.Random):
    a, b, c = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 9)
    return (f"Evaluate {a} + {b} * {c}.", f"{b} * {c} = {b * c}, {b * c} + {a} = {a + b * c}", a + b * c)


def _square_minus(rng: random.Random):
    a = rng.randint(2, 9)
    b = rng.randint(1, min(9, a * a - 1))
    return f"Compute {a}^2 - {b}.", f"{a}^2 = {a * a}, {a * a} - {b} = {a * a - b}", a * a - b


TEMPLATES = [_digit_sum, _solve_addition, _solve_product, _precedence, _square_minus]


def generate(rng: random.Random) -> dict:
    problem, work, answer = rng.choice(TEMPLATES)(rng)
    return {
        "prompt": f"Problem: {problem}\nSolution:",
        "completion": f" {work}. The answer is \\boxed{{{answer}}}",
        "answer": str(answer),
    }
