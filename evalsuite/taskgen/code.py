"""HumanEval-style tiny Python functions: signature + docstring prompt, one-line body, assert-based test."""
from __future__ import annotations

import random

FUNC_NAMES = ["solve", "compute", "transform", "helper", "calc", "process", "func", "answer", "apply", "evaluate"]
INT_ARGS = ["x", "n", "a", "num", "value"]
STR_ARGS = ["s", "text", "word"]
LIST_ARGS = ["xs", "nums", "items", "values"]

# (argument kind, docstring, body expression); {a} is the argument name, {k} a small constant.
FAMILIES = [
    ("int", "Return {a} plus {k}.", "{a} + {k}"),
    ("int", "Return {a} minus {k}.", "{a} - {k}"),
    ("int", "Return {a} times {k}.", "{a} * {k}"),
    ("int", "Return {a} divided by {k}, rounded down.", "{a} // {k}"),
    ("int", "Return the remainder of {a} divided by {k}.", "{a} % {k}"),
    ("int", "Return True if {a} is divisible by {k}.", "{a} % {k} == 0"),
    ("int", "Return True if {a} is greater than {k}.", "{a} > {k}"),
    ("int", "Return the larger of {a} and {k}.", "max({a}, {k})"),
    ("int", "Return the smaller of {a} and {k}.", "min({a}, {k})"),
    ("int", "Return the square of {a}.", "{a} * {a}"),
    ("int", "Return the absolute value of {a}.", "abs({a})"),
    ("str", "Return {a} in upper case.", "{a}.upper()"),
    ("str", "Return {a} reversed.", "{a}[::-1]"),
    ("str", "Return the length of {a}.", "len({a})"),
    ("str", "Return {a} repeated {k} times.", "{a} * {k}"),
    ("str", "Return the first character of {a}.", "{a}[0]"),
    ("str", "Return the last character of {a}.", "{a}[-1]"),
    ("str", "Return the first {k} characters of {a}.", "{a}[:{k}]"),
    ("list", "Return the sum of {a}.", "sum({a})"),
    ("list", "Return the largest element of {a}.", "max({a})"),
    ("list", "Return the smallest element of {a}.", "min({a})"),
    ("list", "Return the number of elements in {a}.", "len({a})"),
    ("list", "Return {a} sorted in increasing order.", "sorted({a})"),
    ("list", "Return a list of every element of {a} plus {k}.", "[v + {k} for v in {a}]"),
    ("list", "Return a list of every element of {a} times {k}.", "[v * {k} for v in {a}]"),
    ("list", "Return the elements of {a} that are greater than {k}.", "[v for v in {a} if v > {k}]"),
]
WORDS = ["cat", "apple", "moon", "river", "stone", "code", "tree", "light", "bird", "house", "green", "sky"]


def _sample_input(rng: random.Random, kind: str):
    if kind == "int":
        return rng.randint(-20, 60)
    if kind == "str":
        return rng.choice(WORDS)
    return [rng.randint(0, 30) for _ in range(rng.randint(1, 5))]


def generate(rng: random.Random) -> dict:
    kind, doc, expr = rng.choice(FAMILIES)
    name = rng.choice(FUNC_NAMES)
    arg = rng.choice({"int": INT_ARGS, "str": STR_ARGS, "list": LIST_ARGS}[kind])
    k = rng.randint(2, 19)
    doc, expr = doc.format(a=arg, k=k), expr.format(a=arg, k=k)
    reference = eval(f"lambda {arg}: {expr}")  # our own generated expression, never model output
    asserts = []
    for _ in range(3):
        value = _sample_input(rng, kind)
        asserts.append(f"    assert candidate({value!r}) == {reference(value)!r}")
    prompt = f'def {name}({arg}):\n    """{doc}"""\n'
    return {
        "prompt": prompt,
        "completion": f"    return {expr}\n",
        "test": "def check(candidate):\n" + "\n".join(asserts) + "\n",
        "entry_point": name,
        "answer": f"    return {expr}\n",
    }
