"""The shipped tiny models load, have the promised architecture, and generate answers."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evalsuite.scoring.answers import extract_yes_no
from evalsuite.zoo.configs import MODEL_NAMES
from evalsuite.taskgen.corpus import heldout_items

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
SHIPPED = [MODELS_DIR / MODEL_NAMES[kind] for kind in ("qwen", "glm")]  # the text models (VL: test_tiny_vl.py)


@pytest.fixture(scope="module", params=SHIPPED, ids=lambda p: p.name)
def shipped(request):
    torch.set_num_threads(1)
    path = request.param
    assert (path / "config.json").exists(), f"{path} missing; run the train-tiny command"
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_shipped_models_fit_the_size_budget():
    total = sum(f.stat().st_size for path in SHIPPED for f in path.glob("*"))
    assert 0 < total <= 30 * 1024 * 1024


def test_architecture_matches_its_router_family(shipped):
    model, _ = shipped
    cfg = model.config
    moe_layers = [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe_layers) >= 4 and cfg.num_experts_per_tok >= 2
    if cfg.model_type == "qwen3_moe":
        assert cfg.num_experts >= 16
        assert not hasattr(moe_layers[0].mlp, "shared_experts")
    else:
        assert cfg.model_type in ("glm4_moe", "deepseek_v3")
        assert cfg.n_routed_experts >= 16 and cfg.first_k_dense_replace == 1
        assert not hasattr(model.model.layers[0].mlp, "gate")
        assert hasattr(moe_layers[0].mlp, "shared_experts")


@torch.no_grad()
def test_generates_well_formed_answers(shipped):
    model, tokenizer = shipped
    for item in heldout_items("yesno")[:3]:
        ids = tokenizer(item["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(ids, max_new_tokens=96, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.rstrip().endswith(("So the answer is yes.", "So the answer is no."))  # the verdict form
        assert extract_yes_no(text) in ("yes", "no")
        assert out[0, -1].item() == tokenizer.eos_token_id  # stops by itself
