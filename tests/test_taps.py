"""Reading a module's input without a module hook (evalsuite.engine.pass_state.input_taps)."""
import copy

import torch
from torch import nn

import evalsuite
from evalsuite.engine.pass_state.input_taps import tap_input

from .helpers import batch, reference_model
from .test_modes import artifact_for, generate


def test_a_tap_reads_the_input_and_leaves_the_output_alone():
    torch.manual_seed(0)
    norm, x = nn.LayerNorm(8), torch.randn(2, 3, 8)
    expected = norm(x)
    seen = []
    handle = tap_input(norm, seen.append)
    assert torch.equal(norm(x), expected)
    assert seen == [x] and not norm._forward_pre_hooks  # torch's fast call path: no module hook
    handle.remove()
    assert "forward" not in norm.__dict__  # the class's forward again
    norm(x)
    assert len(seen) == 1


def test_readers_share_one_tap_and_leave_in_any_order():
    linear = nn.Linear(4, 4)
    first, second = [], []
    a, b = tap_input(linear, first.append), tap_input(linear, second.append)
    linear(torch.ones(1, 4))
    assert len(first) == len(second) == 1
    a.remove()
    a.remove()  # removing twice is harmless
    linear(torch.ones(1, 4))
    assert (len(first), len(second)) == (1, 2)
    b.remove()
    assert "forward" not in linear.__dict__


def test_a_forward_set_before_the_tap_comes_back():
    linear = nn.Linear(4, 4)
    calls = []
    own = linear.forward

    def wrapped(x):
        calls.append(1)
        return own(x)
    linear.forward = wrapped
    handle = tap_input(linear, lambda x: calls.append(2))
    linear(torch.ones(1, 4))
    assert calls == [2, 1]
    handle.remove()
    assert linear.forward is wrapped


def test_the_engine_taps_the_residual_and_closing_puts_the_norms_back():
    """quasi reads the residual stream (the pre-router norm's input): through a tap, no norm hook, the same
    tokens as the unmodified model; closing the engine leaves the norms as it found them."""
    reference = reference_model("qwen3_moe")
    model = copy.deepcopy(reference)
    ids, mask = batch(2, seed=1)
    with evalsuite.offload(model, mode="router-preserving", predictor="quasi", artifact=artifact_for("qwen3_moe"),
                           cache_capacity=0.5) as engine:
        norms = [layer.norm for layer in engine.layers]
        assert all("forward" in n.__dict__ and not n._forward_pre_hooks for n in norms)
        assert torch.equal(generate(model, ids, mask), generate(reference, ids, mask))
        assert engine.driver.residual  # the tap fed the driver
    assert all("forward" not in n.__dict__ for n in norms)


def test_a_predictor_running_a_tapped_norm_feeds_no_reader():
    """The quasi state goes through the next layer's norm: as a fused call, or for a norm of another form its
    own forward without the tap, so a prediction's state is never recorded as the model's residual."""
    from evalsuite.predict.predictors import fused_norm

    torch.manual_seed(0)
    norm = nn.LayerNorm(8)  # not an RMS norm: fused_norm keeps its forward
    seen = []
    handle = tap_input(norm, seen.append)
    x = torch.randn(2, 8)
    assert torch.equal(fused_norm(norm)(x), norm(x))
    assert len(seen) == 1  # the module call alone
    handle.remove()
