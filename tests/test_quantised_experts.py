"""Quantised experts (expert_bits 8 and 4): resident at the same bits is the reference, and on-demand and
router-preserving compute exactly its logits; the link moves the packed bytes; close() gives the model back."""
import copy

import pytest
import torch

import evalsuite
from evalsuite import EngineConfig
from evalsuite.zoo.tiny import TINY

from .helpers import batch, reference_model


def run(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return logits, tokens


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_offloaded_modes_are_bit_identical_to_resident_at_the_same_bits(model_type, bits):
    reference = reference_model(model_type, "bfloat16")
    ids, mask = batch(4)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="resident", expert_bits=bits):
        expected = run(model, ids, mask)
    dense = run(reference, ids, mask)
    assert not torch.equal(expected[0], dense[0])  # the reference does run the quantised weights
    for mode, predictor in (("on-demand", None), ("router-preserving", "gate")):
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode=mode, predictor=predictor, expert_bits=bits, cache_capacity=0.5) as engine:
            logits, tokens = run(model, ids, mask)
            stats = engine.stats()
        assert torch.equal(logits, expected[0]) and torch.equal(tokens, expected[1]), mode
        assert stats["misses"] > 0


def test_a_transfer_moves_the_packed_bytes():
    reference = reference_model("qwen3_moe", "bfloat16")
    ids, mask = batch(2)
    moved = {}
    for bits in (16, 8, 4):
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode="on-demand", expert_bits=bits, cache_capacity=0.5) as engine:
            run(model, ids, mask)
            stats = engine.stats()
        moved[bits] = stats["bytes_transferred"] / stats["misses"]
        assert moved[bits] == stats["expert_bytes"]
    # codes at bits/8 bytes per weight plus a 2-byte scale and zero per group, against 2 bytes per bf16 weight
    assert moved[16] * (8 / 16) < moved[8] < moved[16] * (8 / 16 + 0.2)
    assert moved[16] * (4 / 16) < moved[4] < moved[16] * (4 / 16 + 0.2)


@pytest.mark.parametrize("mode", ["resident", "on-demand"])
def test_close_gives_the_model_its_own_weights_back(mode):
    reference = reference_model("qwen3_moe", "bfloat16")
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode=mode, expert_bits=4):
        pass
    own = dict(reference.named_parameters())
    assert all(torch.equal(p, own[name]) for name, p in model.named_parameters())


def test_bad_bits_and_group_sizes_are_one_line_before_the_model_changes():
    model = copy.deepcopy(reference_model("qwen3_moe", "bfloat16"))
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="is not one of: 16, 8, 4"):
        EngineConfig(expert_bits=3)
    with pytest.raises(ValueError, match="does not divide"):
        evalsuite.offload(model, mode="on-demand", expert_bits=4, expert_group_size=48)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert getattr(model, "_evalsuite_engine", None) is None


def test_every_mode_of_a_request_runs_at_its_bits_and_the_table_names_them():
    from evalsuite.lm.request import model_args
    from evalsuite.lm.suite import format_rows

    engine = EngineConfig(expert_bits=4, expert_group_size=32)
    for mode in ("resident", "on-demand", "speculative"):
        assert "expert_bits=4,expert_group_size=32" in model_args("m", mode, None, engine)
    assert "expert_bits" not in model_args("m", "resident", None, EngineConfig())
    row = {"model": "m", "task": "t", "metric": "acc", "mode": "resident", "predictor": None, "accuracy": 1.0,
           "recall": None, "hit_rate": 1.0, "tpot_ms": None, "identical_share": None}
    header = format_rows([{**row, "expert_bits": 4}]).splitlines()[0]
    assert "bits" in header.split()
    assert "bits" not in format_rows([{**row, "expert_bits": 16}]).splitlines()[0].split()


def test_the_simulator_prices_the_engines_packed_bytes():
    from evalsuite.perf.shapes import model_shape

    dense, eight, four = (model_shape("qwen3-30b-a3b", bits).expert_bytes for bits in (16, 8, 4))
    assert dense == model_shape("qwen3-30b-a3b").expert_bytes  # the model ships bf16 experts
    # codes at bits/8 bytes per weight and a 2-byte scale and zero per group of 64, against 2 bytes per weight
    assert eight == pytest.approx(dense * (1 + 4 / 64) / 2, rel=0.01)
    assert four == pytest.approx(dense * (0.5 + 4 / 64) / 2, rel=0.01)


def test_simulate_refuses_bits_it_cannot_price(capsys):
    from evalsuite.cli import main

    assert main(["simulate", "--model", "qwen3-30b-a3b", "--profile", "h100", "--reuse", "0.3", "--recall", "0.9",
                 "--expert-bits", "3"]) == 2
    assert "is not one of 16, 8, 4" in capsys.readouterr().err


def test_generate_runs_every_mode_at_the_bits_asked_for(tmp_path):
    import json

    from evalsuite.cli import main

    out = tmp_path / "rows.json"
    assert main(["generate", "--model", "tiny:qwen3_moe", "--modes", "resident,on-demand", "--expert-bits", "4",
                 "--max-new-tokens", "6", "--json", str(out)]) == 0
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert rows["resident"]["expert_bits"] == rows["on-demand"]["expert_bits"] == 4
    assert rows["on-demand"]["same_as_resident"] is True


def test_a_sweep_has_an_expert_bits_axis(tmp_path):
    import hashlib
    import json
    import os

    import yaml

    from evalsuite.sweep import load_sweep
    from evalsuite.sweep.grid import cell_engine, check_cells

    from .helpers import shipped_model

    grid = {"name": "bits", "models": [shipped_model()], "modes": ["resident", "on-demand"], "predictors": ["gate"],
            "cache_capacities": [0.25], "links": ["ufs4"], "tasks": ["evalsuite_arith"], "limit": 1}
    path = tmp_path / "bits.yaml"
    path.write_text(yaml.safe_dump({**grid, "expert_bits": [16, 4]}))
    cells = load_sweep(str(path)).cells()
    assert sorted((c.mode, c.expert_bits) for c in cells) == [("on-demand", 4), ("on-demand", 16), ("resident", 4),
                                                              ("resident", 16)]
    assert {cell_engine(c).expert_bits for c in cells} == {4, 16}
    assert all("4-bit experts" in c.label() for c in cells if c.expert_bits == 4)
    sixteen = next(c for c in cells if c.mode == "resident" and c.expert_bits == 16)
    # a 16-bit cell keeps the key it had before the axis: the hash of its other fields
    before = {**{k: v for k, v in vars(sixteen).items() if k != "expert_bits"}, "model": os.path.basename(sixteen.model)}
    assert hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16] == sixteen.key
    path.write_text(yaml.safe_dump({**grid, "expert_bits": [3]}))
    with pytest.raises(ValueError, match="expert_bits=3 is not one of"):
        check_cells(load_sweep(str(path)).cells(), confirm_run_unsafe_code=False, model_files=False)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_the_disk_store_reads_packed_rows_and_stays_exact(model_type, tmp_path):
    from evalsuite.cli import main

    reference = reference_model(model_type, "bfloat16")
    copy.deepcopy(reference).save_pretrained(tmp_path)  # (saving writes into the model's config: a copy)
    assert main(["pack-experts", "--model", str(tmp_path), "--expert-bits", "4", "--dtype", "bfloat16"]) == 0
    ids, mask = batch(2)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="resident", expert_bits=4):
        expected = run(model, ids, mask)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="on-demand", expert_bits=4, cache_capacity=0.5, store="disk",
                           checkpoint=str(tmp_path)) as engine:
        got = run(model, ids, mask)
        stats = engine.stats()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert stats["bytes_transferred"] == stats["misses"] * stats["expert_bytes"]


def test_the_disk_store_without_packed_rows_says_how_to_make_them(tmp_path):
    reference = reference_model("qwen3_moe", "bfloat16")
    copy.deepcopy(reference).save_pretrained(tmp_path)
    model = copy.deepcopy(reference)
    with pytest.raises(FileNotFoundError, match="run `evalsuite pack-experts --model .* --expert-bits 8"):
        evalsuite.offload(model, mode="on-demand", expert_bits=8, store="disk", checkpoint=str(tmp_path))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    from evalsuite.cli import main

    assert main(["pack-experts", "--model", str(tmp_path), "--expert-bits", "8", "--dtype", "float32"]) == 0
    with pytest.raises(ValueError, match="dense_dtype differ"):  # packed for float32, run in bfloat16
        evalsuite.offload(model, mode="on-demand", expert_bits=8, store="disk", checkpoint=str(tmp_path))


def test_eval_refuses_a_bad_group_size_or_missing_packed_rows_before_a_model_loads():
    from evalsuite.lm.preflight import check_eval

    from .helpers import shipped_model

    model = shipped_model("tiny-glm4-moe")  # experts' widths of 96 and 128
    request = dict(open_db=False)
    with pytest.raises(ValueError, match="expert_group_size=64 does not divide down_proj's input width 96"):
        check_eval([model], ["resident"], ["evalsuite_arith"], 2, engine=EngineConfig(expert_bits=4,
                                                                                   expert_group_size=64), **request)
    with pytest.raises(FileNotFoundError, match="run `evalsuite pack-experts --model .* --expert-bits 4"):
        check_eval([model], ["on-demand"], ["evalsuite_arith"], 2,
                   engine=EngineConfig(expert_bits=4, store="disk"), **request)
    check_eval([model], ["on-demand"], ["evalsuite_arith"], 2, engine=EngineConfig(expert_bits=4), **request)
