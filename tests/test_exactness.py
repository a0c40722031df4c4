"""On-demand offloading must not change a single bit of the model's output."""
import copy

import pytest
import torch

import evalsuite
from evalsuite.zoo.tiny import TINY

from .helpers import batch, reference_model

CAPACITIES = {"top-k": 2, "half": 0.5, "all": "all"}


def run(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return logits, tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_on_demand_is_bit_identical(model_type, dtype):
    reference = reference_model(model_type, dtype)
    inputs = {size: batch(size) for size in (1, 4)}
    expected = {size: run(reference, *inputs[size]) for size in inputs}
    for name, capacity in CAPACITIES.items():
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode="on-demand", cache_capacity=capacity) as engine:
            for size, (ids, mask) in inputs.items():
                logits, tokens = run(model, ids, mask)
                assert torch.equal(logits, expected[size][0]), f"logits differ: capacity {name}, batch {size}"
                assert torch.equal(tokens, expected[size][1]), f"tokens differ: capacity {name}, batch {size}"
            assert engine.stats()["misses"] > 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("policy,pools", [("lfu", "global"), ("lru", "per-layer")])
def test_policies_and_pools_are_exact(model_type, policy, pools):
    reference = reference_model(model_type, "float32")
    ids, mask = batch(4)
    expected = run(reference, ids, mask)
    model = copy.deepcopy(reference)
    layers = 3 if model_type != "deepseek_v3" else 2
    with evalsuite.offload(model, cache_capacity=2 * layers, cache_policy=policy, cache_pools=pools):
        got = run(model, ids, mask)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_disk_store_is_exact(model_type, tmp_path):
    reference = reference_model(model_type, "float32")
    # saving writes into the model's config: save a copy, so the shared reference stays as it was
    copy.deepcopy(reference).save_pretrained(tmp_path)
    ids, mask = batch(4)
    expected = run(reference, ids, mask)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, cache_capacity=0.5, store="disk", checkpoint=str(tmp_path)) as engine:
        got = run(model, ids, mask)
        assert engine.stats()["misses"] > 0
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_resident_mode_is_the_reference_and_close_restores():
    reference = reference_model("glm4_moe", "float32")
    ids, mask = batch(4)
    expected = run(reference, ids, mask)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="resident") as engine:
        got = run(model, ids, mask)
        stats = engine.stats()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert stats["hits"] == stats["expert_uses"] > 0 and stats["bytes_transferred"] == 0
    engine = evalsuite.offload(model, cache_capacity=2)
    engine.close()  # the experts go back into the model, the kernel back to eager
    assert model.config._experts_implementation == "eager"
    assert torch.equal(run(model, ids, mask)[0], expected[0])


@pytest.mark.parametrize("model_type, first_sparse", [("qwen3_vl_moe", 0), ("glm4v_moe", 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vision_language_text_path_is_exact(model_type, first_sparse, dtype):
    reference = reference_model(model_type, dtype)
    ids, mask = batch(4, vocab=140)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, cache_capacity=2) as engine, torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
        assert engine.layers[0].experts_path == f"model.language_model.layers.{first_sparse}.mlp.experts"
