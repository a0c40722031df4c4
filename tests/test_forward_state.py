"""The per-pass state the hooks read (evalsuite.engine.pass_state.forward_pass): one `ForwardPass` per model call,
and the oracle's look-ahead pass runs under its own, after which the real one is back."""
import copy

import torch

import evalsuite

from .helpers import batch, reference_model


def test_each_model_call_has_its_own_forward_and_the_look_ahead_runs_under_a_copy():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(2)
    seen = []  # the engine's ForwardPass as the first sparse layer's router saw it, per pass
    with evalsuite.offload(model, mode="router-preserving", predictor="oracle", cache_capacity=0.5) as engine:
        engine.layers[0].router.register_forward_hook(lambda module, args, output: seen.append(engine.forward))
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert [f.looking_ahead for f in seen] == [True, False] * 3  # each pass: its look-ahead, then itself
    assert [f.decoding for f in seen] == [False, False, True, True, True, True]  # a prefill, two decode steps
    assert all(f.rows == 2 for f in seen)
    real = seen[1::2]
    assert len({id(f) for f in real}) == 3  # a new one per call, not one changed in place
    assert all(f.attention_mask.shape[1] == mask.shape[1] + step for step, f in enumerate(real))
    for look_ahead, forward in zip(seen[0::2], real):
        assert look_ahead is not forward and look_ahead.attention_mask is forward.attention_mask
