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
        stats = engine.stats()
    kinds = stats["by_token_kind"]
    layers, top_k = len(engine.layers), engine.layers[0].top_k
    # 4 image tokens in the prefill; 11 text tokens in the prefill plus 2 decode steps
    assert kinds["image"]["tokens_x_experts"] == 4 * top_k * layers
    assert kinds["text"]["tokens_x_experts"] == (inputs["input_ids"].shape[1] - 4 + 2) * top_k * layers
    for kind in ("image", "text"):
        assert 0 <= kinds[kind]["hit_rate"] <= 1
    # recall by kind is the headline's, over decode tokens: every one is text, so image tokens have none
    for name, scores in ((f"recall@{top_k}", stats["recall"][top_k]), (f"exact@{top_k}", stats["exact"][top_k])):
        assert kinds["image"][name] is None
        assert kinds["text"][name] == pytest.approx(scores["mean"]) and 0 <= kinds["text"][name] <= 1


@pytest.mark.parametrize("quiet", [False, True])
def test_a_vision_language_model_puts_predictions_off_and_still_counts_recall_by_kind(monkeypatch, quiet):
    """Recall by token kind no longer makes every decode prediction online (which cost tiny-qwen3-vl-moe 1.0-1.4 ms
    a 6 ms token on the SD card): one put off, or a whole quiet token's, is counted by kind when its request ends,
    with its forward pass's kinds, and the recalls equal those of the same run with every prediction made online."""
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    reference = reference_model("qwen3_vl_moe")
    inputs = image_inputs()

    def run(online: bool):
        with monkeypatch.context() as patched:
            patched.setattr(PrefetchScheduler, "worth_predicting", lambda self, target, h: online)
            patched.setattr(PrefetchScheduler, "put_off_all", lambda self: quiet and not online)
            model = copy.deepcopy(reference)
            with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=4,
                                   link="ufs4") as engine, torch.no_grad():
                model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0)
                return engine.stats()["by_token_kind"], engine.driver

    (put_off, driver), (online, _) = run(False), run(True)
    assert driver.put_off > 0 and (driver.quiet_tokens > 0) == quiet
    top_k = reference.config.text_config.num_experts_per_tok
    recall = f"recall@{top_k}"  # (hit rates differ: only online predictions send prefetches)
    assert {kind: put_off[kind][recall] for kind in put_off} == {kind: online[kind][recall] for kind in online}
    assert 0 < put_off["text"][recall] < 1


def test_a_text_only_pass_is_counted_by_kind_as_the_masks_count_it():
    """A pass whose every token is text (each decode step) is counted without the masks' tensor calls: the same
    hits and uses as through the masks; a pass with an image token or padding goes through the masks. Recall by
    kind reads the masks when the request ends."""
    from evalsuite.engine.metrics import KindCounts
    from evalsuite.engine.prediction.request_recall import kind_masks
    from evalsuite.engine.pass_state.token_kinds import TokenKinds

    image_ids = torch.tensor([IMAGE])
    text_only = TokenKinds.of(image_ids, torch.tensor([[5], [7], [9]]), torch.ones(3, 4, dtype=torch.long))
    assert text_only.all_text
    assert not TokenKinds.of(image_ids, torch.tensor([[5, IMAGE]]), None).all_text
    assert not TokenKinds.of(image_ids, torch.tensor([[5], [7]]), torch.tensor([[1, 1], [1, 0]])).all_text
    masked = TokenKinds(text_only.image, text_only.text)  # the same positions, counted through the masks
    g = torch.Generator().manual_seed(0)
    fast, slow = KindCounts(), KindCounts()
    for layer in range(3):
        top_k = torch.randint(0, 8, (3, 2), generator=g)
        hit_of = {e: bool(torch.rand(1, generator=g) < 0.5) for e in range(8)}
        for kinds, counts in ((text_only, fast), (masked, slow)):
            kinds.count_hits(counts, top_k, hit_of)
    assert fast.hits == slow.hits and fast.hits["text"][1] == 3 * 2 * 3
    # recall by kind (scored when a request ends) reads each step's masks: every decode token text
    made = [(torch.zeros(3, 8), None, None)] * 2
    masks = kind_masks(made, [text_only, masked])
    assert masks["text"].tolist() == [True] * 6 and masks["image"].tolist() == [False] * 6
    assert kind_masks(made, [None, None]) == {}


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
