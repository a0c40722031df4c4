"""The one table layout every command prints: header, rule, numbers right-aligned by their spec, text
left-aligned, missing cells as '-'."""
import math

from evalsuite.table import Column, format_table


def test_numbers_align_right_text_left_under_a_header_and_rule():
    text = format_table([["resident", 0.5, None, 3], ["router-preserving", math.nan, 0.25, 12.0]],
                        ["mode", Column("accuracy", ".3f"), Column("hit", ".3f"), Column("n", "d")])
    assert text.splitlines() == [
        "mode               accuracy    hit   n",
        "--------------------------------------",
        "resident              0.500      -   3",
        "router-preserving         -  0.250  12",
    ]


def test_long_text_is_cut_and_no_line_ends_in_spaces():
    lines = format_table([["a-very-long-task-name", "x"], ["t", "a longer detail"]],
                         [Column("task", max_width=6), "detail"], indent="  ").splitlines()
    assert lines[2] == "  a-very  x" and lines[3] == "  t       a longer detail"
    assert lines[1] == "  " + "-" * len("a-very  a longer detail")
    assert all(line == line.rstrip() for line in lines)


def test_a_numeric_column_with_every_cell_missing_still_aligns_right():
    lines = format_table([["x", None]], ["name", Column("recall", "+.4f")]).splitlines()
    assert lines[2] == "x          -"
