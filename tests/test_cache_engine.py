"""The expert cache inside the engine: prefetches never crowd out demand, and the predictor
feeds the 'predicted' policy, with outputs unchanged."""
import contextlib
import copy

import pytest
import torch

import evalsuite
from evalsuite.engine import arch
from evalsuite.engine.cache.slots import POLICIES

from .helpers import LINK_KINDS, reference_model, use_link_kind


def routing(model, ids) -> list[list[int]]:
    """Experts each sparse layer runs for the one-row prompt `ids` (from the engine's trace)."""
    with evalsuite.offload(model, mode="resident", trace=True) as engine, torch.no_grad():
        model(input_ids=ids)
        return engine.routing_trace().prefills[0][1]


@pytest.mark.parametrize("kind", LINK_KINDS)
def test_demand_waits_for_wrong_prefetches_in_flight_instead_of_failing(kind, monkeypatch):
    # per-layer pools of exactly top-k slots, each filled by two wrong prefetches still on a slow
    # link: the demand loads must wait for them to land and evict them, not raise
    use_link_kind(monkeypatch, kind)
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    ids = torch.tensor([[17]])
    used = routing(model, ids)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    layers = [l.index for l in arch.sparse_layers(model)]
    with evalsuite.offload(model, mode="on-demand", cache_pools="per-layer", cache_capacity=2 * len(layers),
                           link="1GB/s+300000us") as engine, torch.no_grad():
        for layer, experts in zip(layers, used):
            wrong = [e for e in range(8) if e not in experts][:2]
            assert engine.prefetch(layer, wrong) == 2
        logits = model(input_ids=ids).logits
        s = engine.stats()
    assert torch.equal(logits, expected)
    # the first demand load of a layer waits for a wrong prefetch to land and evicts it. The worker holds
    # a transfer's latency (300 ms) in one piece, so the second wrong one has landed too when the second
    # load needs a slot; the lazy link, like the simulator, folds the latency into 1 ms chunks, so that
    # load preempts the second prefetch and takes the first load's slot once it is computed
    assert s["prefetch_wasted"] == (2 if kind == "worker" else 1) * len(layers) and s["stall_s"] > 0


def test_an_unused_prefetch_is_the_first_expert_a_demand_load_evicts():
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    first, second = torch.tensor([[17]]), torch.tensor([[90]])
    later = routing(model, second)
    last = arch.sparse_layers(model)[-1].index
    guess = next(e for e in range(8) if e not in later[-1])
    with evalsuite.offload(model, mode="on-demand", cache_capacity=4) as engine, torch.no_grad():
        model(input_ids=first)  # the cache is full of used experts
        if engine.cache.resident((last, guess)):
            pytest.skip("the guess is already resident")
        assert engine.prefetch(last, [guess]) == 1
        engine.cache.transfers[(last, guess)].wait(5)
        evicted = []
        record = engine._evicted
        engine._evicted = lambda key: (evicted.append(key), record(key))
        model(input_ids=second)
    assert evicted and evicted[0] == (last, guess)


@contextlib.contextmanager
def two_used_experts_per_pool():
    """A router-preserving olmoe engine with per-layer pools of two slots, each holding two used experts
    (copies landed); yields (engine, the second sparse layer's index)."""
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_pools="per-layer",
                           cache_capacity=6, window=False) as engine, torch.no_grad():
        model(input_ids=torch.tensor([[17]]))
        for transfer in list(engine.cache.transfers.values()):
            transfer.wait(5)
        yield engine, engine.layers[1].index


def test_a_prediction_s_candidates_do_not_evict_each_other():
    with two_used_experts_per_pool() as (engine, layer):
        wanted = [e for e in range(8) if not engine.cache.resident((layer, e))][:2]
        assert engine.driver.scheduler.schedule(1, wanted, 1) == 2
        resident = {key for key in engine.cache.slot_of if key[0] == layer}
    assert resident == {(layer, e) for e in wanted}


@pytest.mark.parametrize("policy", ["least-stale", "predicted"])
def test_new_policies_keep_outputs_bit_identical(policy):
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    ids = torch.tensor([[5, 40, 77, 3]])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    calls = []
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_policy=policy,
                           cache_capacity=4, link="4GB/s") as engine, torch.no_grad():
        predict = engine.cache.predict
        engine.cache.predict = lambda predictions: (calls.append(predictions), predict(predictions))
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        s = engine.stats()
    assert torch.equal(out, expected) and s["misses"] > 0
    if policy == "predicted":  # each layer sees the next one's candidates: the budget most likely experts
        second = engine.layers[1].index
        assert any(set(c) == {second} and len(c[second]) == engine.budget for c in calls)
    else:
        assert calls == []


def test_every_policy_is_an_engine_option():
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    for policy in POLICIES:
        with evalsuite.offload(model, cache_policy=policy, cache_capacity=4) as engine:
            assert engine.cache.policy == policy


def test_a_prefetch_never_evicts_a_resident_candidate_of_the_same_prediction():
    with two_used_experts_per_pool() as (engine, layer):
        resident = [e for e in range(8) if engine.cache.resident((layer, e))]
        missing = [e for e in range(8) if e not in resident]
        # the prediction ranks a resident expert first and two missing ones after it: the copies
        # may only evict the other resident expert, so one of them is sent, the resident candidate stays
        assert engine.driver.scheduler.schedule(1, [resident[0], *missing[:2]], 1) == 1
        assert engine.cache.resident((layer, resident[0]))
