"""The tiny vision-language task and model: rendered images, processor, shipped model, lm-eval runs."""
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import ndimage
from transformers import AutoModelForImageTextToText, AutoProcessor

from evalsuite.lm import add_engine_metrics  # (registers the processor and the lm-eval models)
from evalsuite.scoring.answers import first_word, score_vision
from evalsuite.taskgen import vision
from evalsuite.taskgen.corpus import heldout_vision_items, heldout_vision_keys, vision_training_items
from evalsuite.zoo.train_vl import encode_batch
from evalsuite.zoo.vl_processor import build_processor

from .helpers import TASKS

VL_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3-vl-moe"


def _ink(image) -> np.ndarray:
    """Pixels clearly darker or more saturated than the grey background."""
    pixels = np.asarray(image, dtype=np.int32)
    background = pixels[0, 0]
    return np.abs(pixels - background).sum(axis=2) > 60


def _nearest_colour(image) -> str:
    pixels = np.asarray(image, dtype=np.int32)[_ink(image)].mean(axis=0)
    return min(vision.COLOURS, key=lambda name: np.abs(pixels - vision.COLOURS[name]).sum())


def test_every_answer_can_be_read_off_its_image():
    items = vision_training_items(seed=7, step=0, size=200, exclude=set())
    assert set(Counter(item["kind"] for item in items)) == set(vision.DRAW)
    digits = {}
    for item in items:
        ink = _ink(item["image"])
        if item["kind"] == "count":
            assert ndimage.label(ink)[1] == int(item["answer"])
        elif item["kind"] == "color":
            assert _nearest_colour(item["image"]) == item["answer"]
        elif item["kind"] == "bars":
            left, right = ink[:, : vision.SIZE // 2].any(axis=1).sum(), ink[:, vision.SIZE // 2:].any(axis=1).sum()
            assert (left > right) == (item["answer"] == "left")
        else:  # a digit's shape, once scaled away, is the same whatever its size, place and ink
            rows, cols = np.nonzero(ink)
            crop = ink[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
            glyph = crop[np.linspace(0, crop.shape[0] - 1, 9).astype(int)][:, np.linspace(0, crop.shape[1] - 1, 5).astype(int)]
            digits.setdefault(item["answer"], set()).add(glyph.tobytes())
    shapes = [glyph for glyphs in digits.values() for glyph in glyphs]
    assert len(set(shapes)) == len(shapes)  # no two digits look alike


def test_heldout_images_are_fixed_distinct_and_never_trained_on():
    items = heldout_vision_items()
    assert len(items) == 150 and len({(i["prompt"], i["image"].tobytes()) for i in items}) == 150
    assert [i["answer"] for i in heldout_vision_items()] == [i["answer"] for i in items]
    keys = heldout_vision_keys()
    for step in range(3):
        batch = vision_training_items(0, step, 64, keys)
        assert not keys & {(i["prompt"], i["image"].tobytes()) for i in batch}
    # excluding a batch's own images makes the same stream skip every one of them
    first = {(i["prompt"], i["image"].tobytes()) for i in vision_training_items(0, 0, 4, set())}
    assert not first & {(i["prompt"], i["image"].tobytes()) for i in vision_training_items(0, 0, 4, first)}


def test_processor_expands_the_image_slot_and_survives_a_round_trip(tmp_path):
    processor = build_processor(vision.SIZE)
    item = heldout_vision_items(1)[0]
    text = item["prompt"].replace("<image>", processor.image_token)
    enc = processor(images=[[item["image"]]], text=[text], return_tensors="pt")
    ids = enc["input_ids"][0]
    assert (ids == processor.image_token_id).sum() == (vision.SIZE // 16) ** 2  # 8-px patches, 2x2 merge
    assert torch.equal(enc["mm_token_type_ids"][0], (ids == processor.image_token_id).long())
    assert enc["pixel_values"].shape == ((vision.SIZE // 8) ** 2, 3 * 2 * 8 * 8)
    processor.save_pretrained(tmp_path)
    again = AutoProcessor.from_pretrained(tmp_path)(images=[[item["image"]]], text=[text], return_tensors="pt")
    assert all(torch.equal(enc[k], again[k]) for k in enc)


def test_training_batches_carry_loss_on_the_answer_only():
    processor = build_processor(vision.SIZE)
    items = vision_training_items(0, 0, 3, set())
    batch = encode_batch(processor, items)
    for row, item in enumerate(items):
        answer = batch["labels"][row][batch["labels"][row] != -100]
        assert processor.tokenizer.decode(answer[:-1]) == item["completion"]
        assert answer[-1] == processor.tokenizer.eos_token_id
        assert batch["weights"][row].sum().item() == pytest.approx(1.0)


def test_scorer_takes_the_first_word():
    assert first_word(" Left.\nmore") == "left" and first_word("  ") is None
    assert score_vision({"answer": "3"}, [" 3 dots"]) == {"exact_match": 1.0}
    assert score_vision({"answer": "3"}, [" 13"]) == {"exact_match": 0.0}


@pytest.fixture(scope="module")
def shipped_vl():
    torch.set_num_threads(1)
    assert (VL_MODEL / "config.json").exists(), f"{VL_MODEL} missing; run `evalsuite train-tiny --model vl`"
    return AutoModelForImageTextToText.from_pretrained(VL_MODEL).eval(), AutoProcessor.from_pretrained(VL_MODEL)


def test_shipped_vl_model_is_a_small_qwen3_vl_moe(shipped_vl):
    model, _ = shipped_vl
    assert sum(f.stat().st_size for f in VL_MODEL.glob("*")) <= 15 * 1024 * 1024
    assert model.config.model_type == "qwen3_vl_moe"
    text = model.config.text_config
    assert text.num_hidden_layers >= 4 and text.num_experts >= 8 and text.num_experts_per_tok == 2


@torch.no_grad()
def test_shipped_vl_model_reads_its_images(shipped_vl):
    model, processor = shipped_vl
    items = heldout_vision_items(24)
    right = 0
    for item in items:
        inputs = processor(images=[[item["image"]]], text=[item["prompt"].replace("<image>", processor.image_token)],
                           return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert out[0, -1].item() == processor.tokenizer.eos_token_id  # a one-word answer, then it stops
        right += first_word(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])) == item["answer"]
    assert right >= 0.6 * len(items)


def _run(model_name: str, model_args: str, limit: int) -> dict:
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model(model_name).create_from_arg_string(model_args, {"batch_size": 1, "device": "cpu"})
    if model_name == "hf-multimodal":
        lm.model.set_experts_implementation("eager")  # the kernel the engine reproduces
    results = lm_eval.simple_evaluate(model=lm, tasks=["evalsuite_vision"], limit=limit, log_samples=True,
                                      task_manager=TaskManager(include_path=TASKS))
    return add_engine_metrics(results)


def test_specmoe_vlm_answers_exactly_as_hf_multimodal():
    """lm-eval end to end: exact modes keep hf-multimodal's every generation; metrics split by token kind."""
    reference = _run("hf-multimodal", f"pretrained={VL_MODEL}", limit=8)
    expected = [s["resps"][0][0] for s in reference["samples"]["evalsuite_vision"]]
    assert any(first_word(text) is not None for text in expected)
    for mode in ("on-demand", "router-preserving"):
        predictor = ",predictor=gate" if mode == "router-preserving" else ""
        results = _run("specmoe-vlm", f"pretrained={VL_MODEL},mode={mode}{predictor},cache_capacity=0.25,link=ufs4",
                       limit=8)
        assert [s["resps"][0][0] for s in results["samples"]["evalsuite_vision"]] == expected
        metrics = results["results"]["evalsuite_vision"]
        assert metrics["exact_match,none"] == reference["results"]["evalsuite_vision"]["exact_match,none"]
        assert 0 <= metrics["image_hit_rate,engine"] <= 1 and 0 <= metrics["text_hit_rate,engine"] <= 1
        if mode == "router-preserving":
            # recall by kind is over decode tokens, as the headline: all text, none an image token
            assert "image_recall@2,engine" not in metrics and "image_hit_rate,engine" in metrics
            assert metrics["text_recall@2,engine"] == pytest.approx(metrics["recall@2,engine"])
            # every generated sample carries its own recall and hit rate (rows named through the multimodal encoder)
            for sample in results["samples"]["evalsuite_vision"]:
                assert 0 <= sample["engine"]["recall"][2]["mean"] <= 1 and 0 <= sample["engine"]["hit_rate"] <= 1


def test_the_suite_runs_vision_language_models_through_specmoe_vlm(tmp_path):
    from evalsuite.cli import default_tasks
    from evalsuite.lm.suite import is_vision_language, run_suite
    from evalsuite.results import ResultsDB

    assert is_vision_language(str(VL_MODEL)) and not is_vision_language(str(VL_MODEL.parent / "tiny-qwen3-moe"))
    assert default_tasks(str(VL_MODEL))[0] == "evalsuite_vision"
    assert "evalsuite_vision" not in default_tasks(str(VL_MODEL.parent / "tiny-qwen3-moe"))
    db_url = f"sqlite:///{tmp_path}/r.db"
    rows = run_suite([str(VL_MODEL)], ["on-demand"], ["evalsuite_vision"], limit=2, db_url=db_url,
                     out_dir=str(tmp_path), progress=lambda *_: None)
    assert [(r["model"], r["task"], r["mode"]) for r in rows] == [("tiny-qwen3-vl-moe", "evalsuite_vision", "on-demand")]
    assert 0 <= rows[0]["hit_rate"] <= 1 and rows[0]["tpot_ms"] > 0
    with ResultsDB(db_url) as db:
        stored = db.task_metrics()
    assert set(stored["task"]) == {"evalsuite_vision"} and "exact_match" in set(stored["metric"])
