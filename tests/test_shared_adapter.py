"""adapter-shared (one correction network shared by every anchor layer, SpecPrefetch's `correction` fusion), held-out
recall and trainable parameter counts from calibration, and the shared experts in the quasi state."""
import copy

import pytest
import torch
import torch.nn.functional as F

import evalsuite
from evalsuite import cli
from evalsuite.engine import arch
from evalsuite.engine.pass_state.layer_state import LayerState
from evalsuite.predict import Artifact, ArtifactError, build_predictor
from evalsuite.predict.calibrate import (calibrate, calibration_texts, collect, default_vectors, split_batches,
                                         token_batches)
from evalsuite.predict.predictors import router_logits

from .helpers import batch, reference_model, shipped_model


def random_batches(count, rows=2, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 128, (rows, width), generator=g), torch.ones(rows, width, dtype=torch.long))
            for _ in range(count)]


def random_state(layers, pos, rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, experts = layers[pos].router.weight.shape[1], layers[pos].num_experts
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(rows)])
    return LayerState(pos, torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g), ids,
                      torch.rand(rows, 2, generator=g))


def by_hand(art, x, pos):
    """The shared adapter's correction, with plain torch modules holding the artifact's tensors (not the code the
    predictor and the training share)."""
    width, count = art.meta["shared_width"], art.meta["shared_blocks"]
    t = {k.split(".", 1)[1]: v for k, v in art.tensors.items() if k.startswith("adapter_shared.")}
    with torch.no_grad():
        h = x @ t["proj.weight"].T + t["proj.bias"] + t["embed"][pos]
        for i in range(count):
            norm = torch.nn.LayerNorm(width)
            norm.weight.copy_(t[f"block.{i}.norm.weight"])
            norm.bias.copy_(t[f"block.{i}.norm.bias"])
            inner = F.gelu(norm(h) @ t[f"block.{i}.fc1.weight"].T + t[f"block.{i}.fc1.bias"], approximate="tanh")
            h = h + inner @ t[f"block.{i}.fc2.weight"].T + t[f"block.{i}.fc2.bias"]
        norm = torch.nn.LayerNorm(width)
        norm.weight.copy_(t["norm.weight"])
        norm.bias.copy_(t["norm.bias"])
        return norm(h) @ t["head.weight"].T + t["head.bias"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])  # a softmax router, a sigmoid one with groups
def test_an_untrained_shared_adapter_predicts_exactly_as_the_gate(model_type):
    model = reference_model(model_type)
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    art = calibrate(model, random_batches(3), predictor="adapter-shared", shared_width=8, shared_blocks=2, epochs=0)
    shared, gate = build_predictor("adapter-shared", layers, family, art), build_predictor("gate", layers, family)
    assert not art.tensors["adapter_shared.head.weight"].any()  # the head starts at zero
    for pos in range(len(layers) - 1):
        state = random_state(layers, pos, seed=pos)
        assert torch.equal(shared.scores(state, 1), gate.scores(state, 1))
    x = torch.randn(3, layers[-1].router.weight.shape[1])
    assert torch.equal(shared.next_token_scores(x), gate.next_token_scores(x))  # across the token boundary: the gate
    for key in ("recall", "heldout_recall"):
        assert art.meta[key]["adapter-shared"] == art.meta[key]["gate"]
    with pytest.raises(ValueError, match="predicts horizons"):
        build_predictor("adapter-shared", layers, family, art, horizon=2)


def test_a_trained_shared_adapter_computes_its_formula_and_beats_the_gate_on_held_out_tokens():
    """On the shipped tiny GLM-4.5-style model (trained, so its routing follows the text), a short training of the
    shared adapter lowers the KL to the native router and raises recall@K over the gate's on held-out batches;
    its scores are the next router's logits plus the correction, computed here by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shipped_model("tiny-glm4-moe")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = list(token_batches(calibration_texts(None, 32), tokenizer, model.config.vocab_size, batch_size=4,
                                 max_len=64))
    torch.manual_seed(0)
    art = calibrate(model, batches, predictor="adapter-shared", shared_width=16, shared_blocks=1, epochs=10, lr=3e-3)
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    assert art.meta["heldout_batches"] == 2 and art.meta["heldout_tokens"] > 0  # 20 % of 8 batches
    held = collect(model, layers, batches[-2:])
    predictor = build_predictor("adapter-shared", layers, family, art)
    gate_kl, shared_kl = 0.0, 0.0
    for pos in range(len(layers) - 1):
        x, target = held[pos]["x"], held[pos + 1]["logits"].float().log_softmax(-1)
        base = router_logits(layers[pos + 1].router, x)
        logits = base + by_hand(art, x, pos)
        with torch.no_grad():
            scores = predictor.scores(LayerState(pos, x, held[pos]["residual"], held[pos]["ids"],
                                                 held[pos]["weights"]), 1)
        assert torch.allclose(scores, family.selection_scores(layers[pos + 1].router, logits), atol=1e-5)
        gate_kl += F.kl_div(base.log_softmax(-1), target, log_target=True, reduction="batchmean").item()
        shared_kl += F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean").item()
    assert shared_kl < 0.8 * gate_kl
    mean = {name: sum(per_layer.values()) / len(per_layer) for name, per_layer in art.meta["heldout_recall"].items()}
    assert mean["adapter-shared"] > mean["gate"] + 0.02


def test_trainable_parameters_are_what_the_architectures_imply():
    model = reference_model("qwen3_moe")  # hidden 64, 8 experts, 3 sparse layers: 2 anchor layers
    layers = arch.sparse_layers(model)
    d, blocks, rank, hidden = 8, 2, 3, 5
    art = calibrate(model, random_batches(2), predictor="all", rank=rank, hidden=hidden, shared_width=d,
                    shared_blocks=blocks, epochs=0)
    D, E, anchors = 64, 8, len(layers) - 1
    nn = torch.nn
    shared = nn.ModuleList([nn.Linear(D, d), nn.Embedding(anchors, d), nn.LayerNorm(d), nn.Linear(d, E)]
                           + [nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)])
                              for _ in range(blocks)])
    estimator = nn.Sequential(nn.Linear(D, hidden), nn.Linear(hidden, E))
    # an adapter and an estimator per anchor layer, and one for the next token's first sparse layer
    assert art.meta["parameters"] == {
        "gate": 0, "quasi": 0, "frequency": 0, "adapter": (anchors + 1) * rank * (D + E),
        "adapter-shared": sum(p.numel() for p in shared.parameters()),
        "estimator": (anchors + 1) * sum(p.numel() for p in estimator.parameters())}
    assert art.meta["parameters"]["adapter-shared"] == d * (D + E + anchors + 3) + blocks * (4 * d * d + 5 * d) + E
    assert art.meta["statistics"] == {"quasi": len(layers) * E * D, "frequency": len(layers) * E}  # not trained
    only = calibrate(model, random_batches(2), predictor="adapter-shared", shared_width=d, epochs=0)
    assert set(only.meta["parameters"]) == {"gate", "quasi", "frequency", "adapter-shared"}


def test_held_out_batches_are_the_last_fifth_and_never_calibrate():
    assert [len(split_batches(list(range(n)))[1]) for n in (1, 2, 4, 5, 10, 16)] == [0, 1, 1, 1, 2, 3]
    assert split_batches(list(range(5)), heldout=0.0) == (list(range(5)), [])
    assert split_batches(list(range(5)), heldout=0.5) == ([0, 1, 2], [3, 4])
    with pytest.raises(ValueError, match="heldout=1.0"):
        split_batches([1, 2], heldout=1.0)
    model = reference_model("glm4_moe")
    layers = arch.sparse_layers(model)
    batches = random_batches(5)
    art = calibrate(model, batches, predictor="adapter-shared", shared_width=8, epochs=1)
    fitted = collect(model, layers, batches[:4])
    assert art.meta["tokens"] == 4 * 24 and art.meta["heldout_tokens"] == 24 and art.meta["heldout_batches"] == 1
    assert torch.allclose(art.default_vectors(layers[0].index), default_vectors(layers[0], fitted[0]))
    assert set(art.meta["heldout_recall"]) == set(art.meta["recall"])
    assert all(list(art.meta["heldout_recall"][k]) == list(art.meta["recall"][k]) for k in art.meta["recall"])
    one = calibrate(model, batches[:1], predictor="gate", epochs=0)  # nothing to hold out: all calibrate
    assert one.meta["heldout_batches"] == 0 and one.meta["heldout_recall"] == {} and one.meta["tokens"] == 24


def _damaged(art, name):
    tensors, meta = dict(art.tensors), dict(art.meta)
    if name == "missing":
        del tensors["adapter_shared.block.0.fc2.weight"]
    elif name == "shape":
        tensors["adapter_shared.head.weight"] = tensors["adapter_shared.head.weight"].T.contiguous()
    elif name == "nan":
        tensors["adapter_shared.embed"] = tensors["adapter_shared.embed"].clone()
        tensors["adapter_shared.embed"][0, 0] = float("nan")
    elif name == "no width":
        del meta["shared_width"]
    elif name == "fewer blocks":  # tensors of a block the metadata does not name
        meta["shared_blocks"] = 0
    return Artifact(tensors, meta)


@pytest.mark.parametrize("damage,message", [
    ("missing", "no 'adapter_shared.block.0.fc2.weight'.*evalsuite calibrate"),
    ("shape", "adapter_shared.head.weight has shape \\(8, 8\\).*needs \\(4, 8\\)"),
    ("nan", "adapter_shared.embed holds values that are not finite"),
    ("no width", "adapter-shared size .*shared_width=None"),
    ("fewer blocks", "adapter_shared.block.0.fc1.bias is not part of its adapter-shared"),
])
def test_a_damaged_shared_adapter_is_refused_before_a_run(tmp_path, damage, message):
    model = reference_model("qwen3_moe")  # 8 experts; the head shape below at width 8: (8, 8) vs its transpose
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    art = calibrate(model, random_batches(2), predictor="adapter-shared", shared_width=8, shared_blocks=1, epochs=1)
    build_predictor("adapter-shared", layers, family, art)  # whole: accepted
    if damage == "shape":
        art = calibrate(model, random_batches(2), predictor="adapter-shared", shared_width=4, shared_blocks=1,
                        epochs=0)
        message = "adapter_shared.head.weight has shape \\(4, 8\\).*needs \\(8, 4\\)"
    bad = _damaged(art, damage)
    with pytest.raises(ArtifactError, match=message) as caught:
        build_predictor("adapter-shared", layers, family, bad)
    assert "\n" not in str(caught.value)
    path = str(tmp_path / "predictor.safetensors")
    bad.save(path)  # from a file, through offload: refused before the model is touched
    victim = copy.deepcopy(model)
    with pytest.raises(ArtifactError, match=message):
        evalsuite.offload(victim, mode="router-preserving", predictor="adapter-shared", predictor_path=path)
    assert victim.model.layers[0].mlp.experts.gate_up_proj.numel() > 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "qwen2_moe"])
def test_router_preserving_is_exact_with_the_shared_adapter_and_the_quasi_state_with_shared_experts(model_type):
    reference = reference_model(model_type)
    layers, family = arch.sparse_layers(reference), arch.family_of(reference)
    torch.manual_seed(0)
    art = calibrate(reference, random_batches(3, rows=4), predictor="adapter-shared", shared_width=8, shared_blocks=1,
                    epochs=3, lr=1e-2)
    state = random_state(layers, 0)
    trained = build_predictor("adapter-shared", layers, family, art).scores(state, 1)
    assert not torch.equal(trained, build_predictor("gate", layers, family).scores(state, 1))  # it was trained
    ids, mask = batch(2)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for predictor in ("adapter-shared", "quasi"):
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode="router-preserving", predictor=predictor, artifact=art,
                               cache_capacity=0.5) as engine, torch.no_grad():
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected), predictor
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                              pad_token_id=0), tokens), predictor
            assert engine.predictor.name == predictor and engine.stats()["recall"][2]["mean"] is not None
            if predictor == "quasi":  # the shared experts read the router input, where the model has them
                assert ("x" in engine.predictor.reads) == (model_type != "qwen3_moe")


def test_the_quasi_state_adds_the_shared_experts_where_the_artifact_says_so():
    model = reference_model("glm4_moe")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    art = calibrate(model, random_batches(2), predictor="gate", epochs=0)
    assert art.meta["quasi_shared_experts"] is True  # the default (QuasiPredictor)
    older = Artifact(art.tensors, {k: v for k, v in art.meta.items() if k != "quasi_shared_experts"})
    off = calibrate(model, random_batches(2), predictor="gate", epochs=0, quasi_shared_experts=False)
    state = random_state(layers, 0)
    with torch.no_grad():
        shared = layers[0].block.shared_experts(state.x)
        routed = build_predictor("quasi", layers, family, older).quasi_state(state)  # made before: without them
        assert torch.equal(build_predictor("quasi", layers, family, off).quasi_state(state), routed)
        norm = layers[1].norm
        plain = state.residual + (state.weights.unsqueeze(-1) * art.default_vectors(layers[0].index)[state.ids]).sum(1)
        assert torch.allclose(routed, norm.forward(plain), atol=1e-6)
        assert torch.allclose(build_predictor("quasi", layers, family, art).quasi_state(state),
                              norm.forward(plain + shared), atol=1e-6)
    assert build_predictor("quasi", layers, family, older).reads == ("residual", "ids", "weights")


def test_calibrate_prints_parameters_beside_held_out_recall(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["calibrate", "--model", "tiny:qwen3_moe", "--out", str(out), "--prompts", "16", "--epochs", "1",
                     "--rank", "2", "--hidden", "4", "--shared-width", "8", "--shared-blocks", "1"])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    art = Artifact.load(str(out / "predictor.safetensors"))
    assert art.meta["heldout_batches"] == 1 and art.meta["shared_width"] == 8  # 16 texts: two batches of 8
    header = next(i for i, line in enumerate(printed) if "trainable parameters" in line)
    assert printed[header].split() == ["predictor", "trainable", "parameters", "held-out", "recall@K", "calibration",
                                       "recall@K"]
    rows = {line.split()[0]: line.split()[1:] for line in printed[header + 1:header + 7]}
    assert set(rows) == {"gate", "quasi", "frequency", "adapter", "adapter-shared", "estimator"}
    for name, (count, held, _) in rows.items():
        assert int(count.rstrip("*").replace(",", "")) == art.meta["parameters"][name]
        per_layer = art.meta["heldout_recall"][name]
        assert float(held) == pytest.approx(sum(per_layer.values()) / len(per_layer), abs=5e-4)
    assert rows["quasi"][0] == "0*" and any(line.startswith("  * not trained: quasi's default vectors")
                                            for line in printed)
    assert cli.main(["calibrate", "--model", "tiny:qwen3_moe", "--out", str(out), "--shared-blocks", "-1"]) == 2
    assert "--shared-blocks must be 0 or more" in capsys.readouterr().err
