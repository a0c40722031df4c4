"""Vision-language MoE through the engine: images included, outputs exact, metrics by token kind."""
import copy

import pytest
import torch

import evalsuite

from .helpers import reference_model

IMAGE, START, END = 150, 152, 153  # the tiny VL configs' image / vision-start / vision-end token ids
VL_TYPES = ["qwen3_vl_moe", "glm4v_moe"]


def image_inputs(rows: int = 1, seed: int = 0):
    """Text, one 4x4-patch image (4 image tokens after the 2x2 merge), more text; per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, 140, (rows, 5), generator=g), torch.tensor([[START] + [IMAGE] * 4 + [END]] * rows),
                     torch.randint(3, 140, (rows, 4), generator=g)], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).int(),
            "pixel_values": torch.randn(16 * rows, 3 * 2 * 8 * 8, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * rows)}


@pytest.mark.parametrize("model_type", VL_TYPES)
@pytest.mark.parametrize("mode, predictor", [("on-demand", None), ("router-preserving", "gate")])
def test_image_and_text_tokens_give_the_unmodified_logits(model_type, mode, predictor):
    reference = reference_model(model_type)
    inputs = image_inputs(rows=2)
    with torch.no_grad():
        expected = reference(**inputs).logits
        tokens = reference.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode=mode, predictor=predictor, cache_capacity=3) as engine, torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)
        assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0), tokens)
        assert engine.stats()["misses"] > 0


@pytest.mark.parametrize("model_type", VL_TYPES)
def test_hit_rate_and_recall_are_split_by_token_kind(model_type):
    model = copy.deepcopy(reference_model(model_type))
    inputs = image_inputs()
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=4) as engine:
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
        kinds = engine.stats()["by_token_kind"]
    layers, top_k = len(engine.layers), engine.layers[0].top_k
    # 4 image tokens in the prefill; 11 text tokens in the prefill plus 2 decode steps
    assert kinds["image"]["tokens_x_experts"] == 4 * top_k * layers
    assert kinds["text"]["tokens_x_experts"] == (inputs["input_ids"].shape[1] - 4 + 2) * top_k * layers
    for kind in ("image", "text"):
        assert 0 <= kinds[kind]["hit_rate"] <= 1 and 0 <= kinds[kind][f"recall@{top_k}"] <= 1


def test_text_only_models_report_no_token_kinds():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, cache_capacity=4) as engine, torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 6)))
        assert engine.stats()["by_token_kind"] is None


def test_a_vision_language_model_directory_loads_for_the_text_commands(tmp_path):
    """generate, calibrate and bench load a model directory through load_model: a vision-language one loads as
    one (a causal-LM class refuses its config), from memory or without its experts (store=disk), and is
    calibrated on text."""
    from evalsuite.generate import load_model
    from evalsuite.predict.calibrate import calibrate

    reference_model("qwen3_vl_moe").save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    skeleton, _ = load_model(str(tmp_path), store="disk")
    assert type(model).__name__ == type(skeleton).__name__ == "Qwen3VLMoeForConditionalGeneration"
    ids = torch.randint(3, 140, (2, 9), generator=torch.Generator().manual_seed(0))
    artifact = calibrate(model, [(ids, torch.ones_like(ids))], predictor="estimator", hidden=8, epochs=1)
    assert set(artifact.meta["next_token_recall"]) == {"gate", "estimator"}
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with evalsuite.offload(skeleton, mode="on-demand", store="disk", cache_capacity=3):
            assert torch.equal(skeleton(input_ids=ids).logits, expected)
