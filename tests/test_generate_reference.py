"""`evalsuite generate` compares every mode with a resident pass, whichever modes were asked for."""
import copy

import pytest

from evalsuite.cli import main
from evalsuite.generate import compare_modes, format_table

from .helpers import reference_model


@pytest.mark.parametrize("modes", [["on-demand", "router-preserving"], ["on-demand", "resident"]])
def test_every_mode_is_compared_with_resident(modes):
    model = copy.deepcopy(reference_model("qwen3_moe"))
    rows = compare_modes(model, None, modes, prompts=["a", "b"], max_new_tokens=3, cache_capacity=4,
                         predictor="gate")  # a random model has no calibration artifact
    assert [r["mode"] for r in rows] == ["resident"] + [m for m in modes if m != "resident"]
    assert rows[0]["same_as_resident"] is None and rows[0]["requested"] == ("resident" in modes)
    assert all(r["same_as_resident"] is True for r in rows[1:])  # both must reproduce resident exactly
    table = format_table(rows).splitlines()
    assert table[2].split()[:3] == ["resident", "-", "ref"]  # mode, predictor, same
    assert [line.split()[:3] for line in table[3:2 + len(rows)]] == [
        [r["mode"], "gate" if r["mode"] == "router-preserving" else "-", "yes"] for r in rows[1:]]
    assert ("not among --modes" in table[-1]) == ("resident" not in modes)


def test_cli_without_resident_runs_it_as_the_reference(capsys):
    assert main(["generate", "--model", "tiny:qwen3_moe", "--modes", "on-demand,router-preserving",
                 "--max-new-tokens", "2", "--cache-capacity", "4", "--predictor", "gate"]) == 0
    captured = capsys.readouterr()
    assert "changed the output" not in captured.err
    lines = captured.out.splitlines()
    assert lines[2].split()[:3] == ["resident", "-", "ref"] and lines[3].split()[:3] == ["on-demand", "-", "yes"]
    assert lines[4].split()[:3] == ["router-preserving", "gate", "yes"]
