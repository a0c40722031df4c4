"""Each family's routing formula, applied to the router's own choice, gives the router's weights."""
import pytest
import torch

from evalsuite.engine import arch
from evalsuite.zoo.tiny import TINY

from .helpers import reference_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_route_weights_reproduce_the_router(model_type, dtype):
    model = reference_model(model_type, dtype)
    family = arch.family_of(model)
    x = torch.randn(7, model.config.hidden_size, dtype=model.dtype, generator=torch.Generator().manual_seed(1))
    for layer in arch.sparse_layers(model):
        with torch.no_grad():
            logits, weights, ids = layer.router(x)
            again = family.route_weights(layer.router, logits, ids)
        assert again.dtype == weights.dtype
        assert torch.equal(again, weights)


def test_route_weights_of_another_expert_set_follow_the_formula():
    model = reference_model("qwen3_moe", "float32")  # softmax, no renormalisation by default
    layer = arch.sparse_layers(model)[0]
    logits = torch.randn(3, layer.num_experts)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    weights = arch.family_of(model).route_weights(layer.router, logits, ids)
    assert torch.allclose(weights, torch.softmax(logits, -1).gather(1, ids))


def test_sparse_layers_skip_dense_layers():
    model = reference_model("deepseek_v3", "float32")  # first_k_dense_replace=1
    assert [l.index for l in arch.sparse_layers(model)] == [1, 2]
