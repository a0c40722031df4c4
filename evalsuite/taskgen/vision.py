"""Rendered images with one-word answers, for the tiny vision-language model.

Four kinds of question, each answerable only by looking at the image:
  count  - how many dots (1-4)               -> a digit
  color  - the colour of the one shape       -> red / green / blue / yellow
  bars   - which of two bars is taller       -> left / right
  digit  - a seven-segment digit             -> the digit

Everything is drawn with Pillow's primitives (no fonts), so an item is a pure
function of the random stream on every machine.
"""
from __future__ import annotations

import random

from PIL import Image, ImageDraw

SIZE = 64  # pixels per side: 8x8 patches of 8 px, 16 tokens after the 2x2 merge
IMAGE_SLOT = "<|vision_start|><image><|vision_end|>"  # lm-eval puts the image token at <image>
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
INKS = [(0, 0, 0), (90, 60, 20), (120, 30, 120), (20, 90, 110)]  # for everything whose colour does not matter
QUESTIONS = {
    "count": "How many dots are there?",
    "color": "What color is the shape?",
    "bars": "Which bar is taller, left or right?",
    "digit": "What digit is shown?",
}
# Seven-segment layout: segment -> (x0, y0, x1, y1) in a unit box 2 wide, 4 tall.
SEGMENTS = {"a": (0, 0, 2, 0), "b": (2, 0, 2, 2), "c": (2, 2, 2, 4), "d": (0, 4, 2, 4),
            "e": (0, 2, 0, 4), "f": (0, 0, 0, 2), "g": (0, 2, 2, 2)}
DIGIT_SEGMENTS = ["abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg"]


def _canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    shade = rng.randint(225, 255)
    image = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
    return image, ImageDraw.Draw(image)


def _dots(rng: random.Random) -> tuple[Image.Image, str]:
    image, draw = _canvas(rng)
    count, radius = rng.randint(1, 4), rng.randint(4, 6)
    centres: list[tuple[int, int]] = []
    while len(centres) < count:  # rejection-sample centres that keep the dots apart
        x, y = rng.randint(radius + 1, SIZE - radius - 2), rng.randint(radius + 1, SIZE - radius - 2)
        if all((x - u) ** 2 + (y - v) ** 2 > (2 * radius + 4) ** 2 for u, v in centres):
            centres.append((x, y))
    ink = rng.choice(INKS)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=ink)
    return image, str(count)


def _coloured_shape(rng: random.Random) -> tuple[Image.Image, str]:
    image, draw = _canvas(rng)
    name = rng.choice(sorted(COLOURS))
    half = rng.randint(8, 18)
    x, y = rng.randint(half + 1, SIZE - half - 2), rng.randint(half + 1, SIZE - half - 2)
    box = (x - half, y - half, x + half, y + half)
    if rng.random() < 0.5:
        draw.ellipse(box, fill=COLOURS[name])
    else:
        draw.rectangle(box, fill=COLOURS[name])
    return image, name


def _bars(rng: random.Random) -> tuple[Image.Image, str]:
    image, draw = _canvas(rng)
    heights = [rng.randint(8, 56), rng.randint(8, 56)]
    while abs(heights[1] - heights[0]) < 8:  # a visible difference of at least one patch
        heights[1] = rng.randint(8, 56)
    width, base = rng.randint(8, 12), SIZE - rng.randint(2, 5)
    for centre, height in zip((SIZE // 4 + rng.randint(-3, 3), 3 * SIZE // 4 + rng.randint(-3, 3)), heights):
        draw.rectangle((centre - width // 2, base - height, centre + width // 2, base), fill=rng.choice(INKS))
    return image, "left" if heights[0] > heights[1] else "right"


def _digit(rng: random.Random) -> tuple[Image.Image, str]:
    image, draw = _canvas(rng)
    digit = rng.randrange(10)
    scale, thick = rng.randint(7, 11), rng.randint(3, 5)
    x0 = rng.randint(4, SIZE - 2 * scale - 4 - thick)
    y0 = rng.randint(4, SIZE - 4 * scale - 4 - thick)
    ink = rng.choice(INKS)
    for segment in DIGIT_SEGMENTS[digit]:
        a, b, c, d = SEGMENTS[segment]
        draw.rectangle((x0 + a * scale, y0 + b * scale, x0 + c * scale + thick, y0 + d * scale + thick), fill=ink)
    return image, str(digit)


DRAW = {"count": _dots, "color": _coloured_shape, "bars": _bars, "digit": _digit}


def generate(rng: random.Random) -> dict:
    """One item: `image` (PIL), `prompt` (with the <image> slot), `completion` and `answer`."""
    kind = rng.choice(sorted(DRAW))
    image, answer = DRAW[kind](rng)
    return {"kind": kind, "image": image, "prompt": f"{IMAGE_SLOT}{QUESTIONS[kind]} Answer:",
            "completion": f" {answer}", "answer": answer}
