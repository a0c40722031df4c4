"""`evalsuite generate` compares every mode with a resident pass, whichever modes were asked for, wherever
resident fits."""
import copy

import pytest

from evalsuite.cli import main
from evalsuite.generate import MEMORY_ENV, compare_modes, format_table, free_memory, load_model, resident_shortfall

from .helpers import reference_model, shipped_model


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


# A model loaded without its experts (--store disk) runs resident only where its experts fit the memory free on
# its device; the memory figure is given (compare_modes' available_memory, or EVALSUITE_AVAILABLE_MEMORY).

def test_a_skeleton_whose_experts_do_not_fit_runs_its_modes_without_resident():
    model, tokenizer = load_model(shipped_model(), store="disk")
    rows = compare_modes(model, tokenizer, ["on-demand"], prompts=["a"], max_new_tokens=2, available_memory="1MiB",
                         cache_capacity=4, store="disk")
    assert [r["mode"] for r in rows] == ["on-demand"]  # no resident run: its experts were never read in whole
    assert rows[0]["same_as_resident"] is None and "do not fit the 1.0 MiB free on cpu" in rows[0]["no_reference"]
    lines = format_table(rows).splitlines()
    assert lines[2].split()[:3] == ["on-demand", "-", "-"]
    assert lines[-1].startswith("same -: resident did not run, so no tokens are compared: its experts (")
    assert len([line for line in lines if "resident" in line]) == 1  # one line says why
    with pytest.raises(ValueError, match="--modes resident needs every expert in memory: its experts"):
        compare_modes(model, tokenizer, ["resident", "on-demand"], prompts=["a"], max_new_tokens=2,
                      available_memory=2**20, cache_capacity=4, store="disk")


def test_a_skeleton_that_fits_keeps_its_resident_reference():
    model, tokenizer = load_model(shipped_model(), store="disk")
    experts = resident_shortfall(model, 1)
    assert experts is not None and resident_shortfall(model, "64GiB") is None
    rows = compare_modes(model, tokenizer, ["on-demand"], prompts=["a"], max_new_tokens=2, available_memory="64GiB",
                         cache_capacity=4, store="disk")
    assert [r["mode"] for r in rows] == ["resident", "on-demand"] and rows[1]["same_as_resident"] is True
    assert "no_reference" not in rows[1] and "did not run" not in format_table(rows)


def test_a_model_loaded_whole_is_its_own_reference_whatever_the_memory_figure():
    model, _ = load_model(shipped_model())  # its experts are in memory already
    assert resident_shortfall(model, 1) is None
    assert free_memory("cpu", "1.5GiB") == 3 * 2**29 and free_memory("cpu", 1000) == 1000 and free_memory("cpu") > 0
    with pytest.raises(ValueError, match="EVALSUITE_AVAILABLE_MEMORY='lots'"):
        free_memory("cpu", "lots")


def test_cli_store_disk_without_room_for_resident_says_why_in_one_line(capsys, monkeypatch):
    args = ["generate", "--model", shipped_model(), "--store", "disk", "--cache-capacity", "4", "--max-new-tokens",
            "2", "--prompt", "a"]
    monkeypatch.setenv(MEMORY_ENV, "1MiB")
    assert main(args + ["--modes", "on-demand"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:3] == ["on-demand", "-", "-"] and out[-1].startswith("same -: resident did not run")
    assert main(args + ["--modes", "resident,on-demand"]) == 2  # refused in one line, nothing run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalsuite: error: --modes resident needs every expert in memory")
    monkeypatch.delenv(MEMORY_ENV)  # the tiny model fits this machine: resident runs, as it always did
    assert main(args + ["--modes", "on-demand"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:3] == ["resident", "-", "ref"] and out[3].split()[:3] == ["on-demand", "-", "yes"]
