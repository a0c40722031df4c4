"""Controlled-recall predictors (recall-R): the router's own choice with a seeded share replaced. recall-1.0 is
the unmodified model; the measured recall@K is the target; errors land where their name says."""
import copy

import pytest
import torch

import evalsuite
from evalsuite import EngineConfig
from evalsuite.engine import arch
from evalsuite.lm.plan import plan_passes
from evalsuite.zoo.tiny import TINY

from .helpers import batch, reference_model


def generate(model, ids, mask, tokens=12):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def speculate(model_type, predictor, rows=8, tokens=16, seed=0, hooks=None):
    """(generated tokens, stats) of a speculative run executing `predictor`; `hooks(model)` before generating."""
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(rows, seed=1)
    with evalsuite.offload(model, mode="speculative", predictor=predictor, keep_experts=True,
                           recall_seed=seed) as engine:
        if hooks is not None:
            hooks(model)
        out = generate(model, ids, mask, tokens)
        return out, engine.stats()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_recall_one_executes_the_routers_own_choice(model_type):
    reference = reference_model(model_type)
    ids, mask = batch(4, seed=1)
    out, stats = speculate(model_type, "recall-1.0", rows=4, tokens=12)
    assert torch.equal(out, generate(reference, ids, mask))
    assert stats["recall"][stats["top_k"]]["mean"] == 1.0


@pytest.mark.parametrize("name", ["recall-0.95", "recall-0.8", "recall-0.5", "recall-0.9-near", "recall-0.7-near"])
def test_measured_recall_is_the_target_for_every_seed(name):
    target = float(name.split("-")[1])
    for seed in range(3):
        out, stats = speculate("qwen3_moe", name, seed=seed)
        measured = stats["recall"][stats["top_k"]]["mean"]
        assert abs(measured - target) <= 0.01, (seed, measured)
    assert measured < 1.0  # (the target is not met by executing the router's choice)


def test_seeds_draw_different_errors_and_one_seed_repeats():
    first, _ = speculate("qwen3_moe", "recall-0.7", seed=0)
    again, _ = speculate("qwen3_moe", "recall-0.7", seed=0)
    other, _ = speculate("qwen3_moe", "recall-0.7", seed=1)
    assert torch.equal(first, again) and not torch.equal(first, other)


def executed_with_logits(model_type, predictor):
    """Per speculated layer, (router logits, the experts executed) of every decode token, read from the router's
    output after the engine replaced it."""
    seen = {}

    def hooks(model):
        for pos, layer in enumerate(arch.sparse_layers(model)):
            def record(module, args, output, pos=pos):
                if args[0].shape[0] == 8:  # a decode step of the 8 rows (a prefill has rows x prompt tokens)
                    seen.setdefault(pos, []).append((output[0].detach().clone(), output[2].detach().clone()))
            layer.router.register_forward_hook(record)
    speculate(model_type, predictor, hooks=hooks)
    return seen


def test_near_misses_are_the_routers_next_ranked_experts():
    # K = 2 at recall 0.5: each token keeps its top-ranked expert and gets the third-ranked instead of the second
    for pos, steps in executed_with_logits("qwen3_moe", "recall-0.5-near").items():
        for logits, executed in steps:
            ranked = logits.argsort(dim=-1, descending=True)
            expected = ranked[:, [0, 2]] if pos > 0 else ranked[:, :2]  # the first sparse layer never speculates
            assert torch.equal(executed.sort(dim=-1).values, expected.sort(dim=-1).values)


def test_uniform_errors_reach_beyond_the_near_misses():
    beyond = 0
    for pos, steps in executed_with_logits("qwen3_moe", "recall-0.5").items():
        for logits, executed in steps:
            rank = logits.argsort(dim=-1, descending=True).argsort(dim=-1)  # each expert's rank
            beyond += int((rank.gather(1, executed) > 2).sum())
    assert beyond > 0


def test_errors_stay_in_their_layer_range():
    _, stats = speculate("qwen3_moe", "recall-0.5-late")
    layers = stats["recall"][stats["top_k"]]["layers"]  # decoder layer -> recall@K
    first, last = min(layers), max(layers)
    assert layers[first] == 1.0 and abs(layers[last] - 0.5) <= 0.01
    with pytest.raises(ValueError, match="middle third"):  # two speculated layers: an early and a late one
        speculate("qwen3_moe", "recall-0.5-middle")


@pytest.mark.parametrize("options, message", [
    (dict(mode="router-preserving", predictor="recall-0.8"), "can only be executed"),
    (dict(mode="resident", predictor="recall-0.8"), "can only be executed"),
    (dict(mode="resident", shadows=["recall-0.8"]), "rows that execute it"),
    (dict(mode="speculative", row_predictors=["recall-0.8", "gate"]), "separate passes"),
    (dict(mode="speculative", predictor="recall-1.2"), "is not one of"),
    (dict(mode="speculative", predictor="recall-0.8-far"), "is not one of"),
])
def test_refused_where_it_makes_no_sense(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_the_plan_generates_controlled_levels_in_a_pass_of_their_own():
    passes = plan_passes(["resident", "speculative"], "speculative=recall-1.0,recall-0.8,recall-0.5,gate,quasi")
    assert [p.label for p in passes] == ["resident", "speculative/gate+quasi",
                                         "speculative/recall-1.0+recall-0.8+recall-0.5"]


def test_no_token_loses_more_than_the_level_implies():
    # K = 2 at recall 0.6: 0.8 experts per token on average, so each token loses one expert or none, never both
    for pos, steps in executed_with_logits("qwen3_moe", "recall-0.6").items():
        for logits, executed in steps:
            native = logits.topk(2, dim=-1).indices
            kept = (executed[:, :, None] == native[:, None, :]).any(-1).sum(-1)
            assert (kept >= 1).all() and (pos == 0 or (kept == 1).any())


def test_generate_refuses_it_for_an_exact_mode_before_the_model_loads(monkeypatch, capsys):
    from evalsuite import generate
    from evalsuite.cli import main

    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["generate", "--model", "models/tiny-qwen3-moe", "--modes", "speculative,router-preserving",
                 "--predictor", "recall-0.8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "can only be executed" in err[0]


def test_the_seed_is_a_whole_number_flag():
    from evalsuite.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["eval", "--recall-seed", "3"]).recall_seed == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--recall-seed", "three"])
