"""The fixed-width tables every command prints: a header, a rule, one line per row.

Numbers are formatted by their column's spec and right-aligned; text is left-aligned (a column
can ask for either). A missing cell (None or NaN) prints as `-`. Each column is as wide as its
widest cell or title, so a table never needs hand-tuned widths; a column with `max_width` cuts
longer text, so one long name does not push the rest of the table off the screen.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Column:
    title: str
    spec: str = ""  # format spec for numbers, e.g. ".3f", "+.1%", "d"
    align: str | None = None  # "<" or ">"; default: ">" for a column with a spec or only numbers, else "<"
    max_width: int | None = None  # text longer than this is cut


def _is_number(value) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


def _is_missing(value) -> bool:
    return value is None or (_is_number(value) and value != value)  # NaN, of any float type


def _align(column: Column, values: list) -> str:
    if column.align:
        return column.align
    if column.spec:
        return ">"  # a numeric column, even when every cell is missing
    present = [v for v in values if not _is_missing(v)]
    return ">" if present and all(_is_number(v) for v in present) else "<"


def _cell(value, column: Column, missing: str) -> str:
    if _is_missing(value):
        return missing
    if _is_number(value):
        if column.spec.endswith("d") and float(value).is_integer():
            value = int(value)  # a count that went through a float column (pandas)
        return format(value, column.spec)
    text = str(value)
    return text[:column.max_width] if column.max_width else text


def format_table(rows: Iterable[Sequence], columns: Sequence[Column | str], *, missing: str = "-",
                 gap: int = 2, indent: str = "") -> str:
    """`rows`: one sequence of cell values per row, in the order of `columns` (a Column, or a title)."""
    columns = [c if isinstance(c, Column) else Column(c) for c in columns]
    rows = [list(r) for r in rows]
    cells = [[_cell(v, c, missing) for v, c in zip(r, columns)] for r in rows]
    aligns = [_align(c, [r[i] for r in rows]) for i, c in enumerate(columns)]
    widths = [max([len(c.title)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def line(texts) -> str:
        return (indent + (" " * gap).join(f"{t:{a}{w}}" for t, a, w in zip(texts, aligns, widths))).rstrip()

    rule = indent + "-" * (sum(widths) + gap * (len(widths) - 1))
    return "\n".join([line([c.title for c in columns]), rule] + [line(c) for c in cells])
