"""The engine's prefetch policy: once a layer's router has decided, its wrong prefetches leave
the link and give their slots back, and the right ones still moving go first; outputs unchanged."""
import copy
import time

import pytest
import torch

import evalsuite
from evalsuite.engine import arch
from evalsuite.engine.pass_state.layer_state import LayerState

from .helpers import LINK_KINDS, batch, copy_and_reference, reference_model, use_link_kind

SLOW = "1GB/s+300000us"  # every copy takes 0.3 s: the prefetches are still on the link when settled

def resident_trace(model, ids, mask, tokens: int, requests: int = 1):
    """The routing a resident run of a copy of `model` records over `requests` greedy generations."""
    with evalsuite.offload(copy.deepcopy(model), mode="resident", trace=True) as resident, torch.no_grad():
        for _ in range(requests):
            resident.model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return resident.routing_trace()


def test_settling_cancels_unpicked_prefetches_frees_their_slots_and_promotes_the_picked_one():
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    layer = arch.sparse_layers(model)[0].index
    with evalsuite.offload(model, mode="on-demand", cache_capacity=8, link=SLOW) as engine:
        pool = engine.cache.pools[layer]
        free_before = len(pool.free)
        assert engine.prefetch(layer, [0, 1, 2, 3]) == 4
        picked = engine.cache.transfers[(layer, 3)]
        assert picked.prefetch
        assert engine.settle_prefetches(layer, {3, 5}) == 3
        assert [engine.cache.resident((layer, e)) for e in range(4)] == [False, False, False, True]
        assert len(pool.free) == free_before - 1  # only the picked expert holds a slot
        assert not picked.prefetch  # demand priority now
        picked.wait(5)
        assert torch.equal(engine.cache.slots[engine.cache.slot_of[(layer, 3)]], engine.store.read((layer, 3)))
        s = engine.stats()
    assert s["prefetch_cancelled"] == 3 and s["prefetches"] == 4 and s["prefetch_wasted"] == 0


def test_a_landed_prefetch_is_never_cancelled():
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    layer = arch.sparse_layers(model)[0].index
    with evalsuite.offload(model, mode="on-demand", cache_capacity=8) as engine:
        assert engine.prefetch(layer, [0]) == 1
        engine.cache.transfers[(layer, 0)].wait_landed(5)
        assert engine.settle_prefetches(layer, {4}) == 0
        assert engine.cache.resident((layer, 0))


def test_router_preserving_cancels_wrong_prefetches_and_stays_exact():
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=4)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", prefetch_budget=6,
                           cache_capacity=0.5, link="1GB/s+20000us") as engine, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        s = engine.stats()
    assert torch.equal(out, expected)
    assert s["prefetch_cancelled"] > 0
    assert s["prefetch_used"] + s["prefetch_cancelled"] <= s["prefetches"]


def sends_of_speculative_run(rows: int, budget: int | None = 6):
    """(layer, experts, demand, decode step) of every decode prefetch call of a speculative run whose window
    test would refuse every transfer (the scheduler believes a layer takes 1 ns), top-k, and the run's trace."""
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(rows)
    with evalsuite.offload(model, mode="speculative", predictor="gate", prefetch_budget=budget,
                           cache_capacity=0.5, link="4GB/s+2000us", trace=rows == 1) as engine, torch.no_grad():
        scheduler = engine.driver.scheduler
        scheduler.layer_at = lambda pos, now, stalled, missed: setattr(scheduler, "layer_s", 1e-9)
        sends, prefetch = [], engine.prefetch

        def recorded(layer, experts, demand=False, keep=()):
            if engine.forward.decoding:  # the steps the trace holds so far: this one's index
                sends.append((layer, list(experts), demand, len(engine.tracer.trace.steps) if rows == 1 else None))
            return prefetch(layer, experts, demand, keep)

        engine.prefetch = recorded
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        top_k, first = engine.layers[0].top_k, engine.layers[0].index
        trace = engine.routing_trace() if rows == 1 else None
    return [s for s in sends if s[0] != first], top_k, trace  # the first sparse layer never speculates


def test_speculative_sends_the_whole_predicted_set_at_demand_priority_without_a_window():
    sends, top_k, _ = sends_of_speculative_run(rows=1)
    assert sends, "a closed window must not stop experts that will certainly execute"
    assert all(demand for _, _, demand, _ in sends)
    assert all(len(experts) == top_k for _, experts, _, _ in sends)  # budget 6 clamped to top-k


@pytest.mark.parametrize("budget", [None, 6])  # top-k (the set read off the ranking), and beyond it
def test_a_speculating_layer_is_sent_exactly_the_experts_it_then_executes(budget):
    sends, _, trace = sends_of_speculative_run(rows=1, budget=budget)
    executed = {(step, trace.layers.index(layer)): sorted(experts) for layer, experts, _, step in sends}
    assert len(executed) == len(sends) > 0  # one send per speculating layer and step
    for (step, pos), experts in executed.items():
        assert sorted(trace.steps[step][pos].executed) == experts


def test_speculative_sends_for_a_batch_are_the_union_of_each_row_s_top_k():
    sends, top_k, _ = sends_of_speculative_run(rows=3)
    assert sends and all(top_k <= len(experts) <= 3 * top_k for _, experts, _, _ in sends)
    assert all(len(set(experts)) == len(experts) for _, experts, _, _ in sends)


def test_the_first_sparse_layer_is_predicted_across_tokens_and_its_recall_scored():
    model, ids, mask, expected = copy_and_reference(rows=2, tokens=5)
    # window=False: every prediction is made and sent (none is left for after the request)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5,
                           window=False) as engine, torch.no_grad():
        sends, prefetch = [], engine.prefetch
        engine.prefetch = lambda layer, experts, demand=False, keep=(): (sends.append(layer), prefetch(layer, experts, demand, keep))[1]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        first = engine.layers[0].index
        stats = engine.stats()
        recall = stats["recall_next_token"][engine.layers[0].top_k]
    assert torch.equal(out, expected)
    # scored on its own (recall_next_token@K), never in recall@k's within-token mean
    assert set(recall["layers"]) == {first} and 0 <= recall["layers"][first] <= 1
    assert recall["samples"] == 2 and first not in stats["recall"][engine.layers[0].top_k]["layers"]
    assert first in sends  # the scheduler was asked to prefetch it


def test_trace_oracle_replays_a_resident_run_with_recall_one_on_the_same_tokens(tmp_path):
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=5)
    resident_trace(model, ids, mask, 5, requests=2).save(tmp_path / "trace.json")  # the replay follows both requests
    with evalsuite.offload(model, mode="router-preserving", predictor="trace-oracle", cache_capacity=0.5,
                           predictor_path=str(tmp_path / "trace.json")) as engine, torch.no_grad():
        for _ in range(2):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(out, expected)
        stats = engine.stats()
    top_k = engine.layers[0].top_k
    assert stats["recall"][top_k]["mean"] == 1.0 and stats["exact"][top_k]["mean"] == 1.0
    assert set(stats["recall"][top_k]["layers"]) == {l.index for l in engine.layers[1:]}
    assert stats["recall_next_token"][top_k]["mean"] == 1.0


def test_trace_oracle_builds_a_request_decode_scores_at_its_prefill():
    # a decode prediction of the free predictor is a lookup into what the request's prefill built: each step's
    # scores are the recorded routing ranked K, K-1, ..., and asking again gives the very same tensor
    model, ids, mask, _ = copy_and_reference(rows=1, tokens=4)
    trace = resident_trace(model, ids, mask, 4)
    with evalsuite.offload(model, mode="router-preserving", predictor="trace-oracle", artifact=trace,
                           cache_capacity=0.5) as engine, torch.no_grad():
        oracle = engine.driver.predictor
        oracle.on_token(decoding=False)
        prompt = torch.zeros(ids.shape[1], model.config.hidden_size)
        oracle.scores(LayerState(0, prompt, None, None, None), 1)  # the prefill's prediction of sparse layer 1
        oracle.on_token(decoding=True)
        token = LayerState(0, prompt[:1], None, None, None)
        first = oracle.scores(token, 1)
        assert first is oracle.scores(token, 1)
        native = trace.steps[trace.prefills[0][0]][1].native
        assert first.shape == (1, engine.layers[1].num_experts)
        assert first[0].topk(len(native)).indices.tolist() == native
        assert first[0].count_nonzero() == len(native)


def test_trace_oracle_ranks_its_decode_scores_as_the_scheduler_would_without_a_tensor_call(monkeypatch):
    # the driver ranks a prediction with predictor.ranked where there is one; trace-oracle's decode scores are the
    # recorded experts ranked K, K-1, ..., so it gives their list: the very ranking scheduler.ranked computes
    from evalsuite.engine.prediction.scheduler import ranked

    model, ids, mask, expected = copy_and_reference(rows=1, tokens=5)
    trace = resident_trace(model, ids, mask, 5)
    with evalsuite.offload(model, mode="router-preserving", predictor="trace-oracle", artifact=trace,
                           cache_capacity=0.5) as engine, torch.no_grad():
        oracle, top_k = engine.driver.predictor, engine.layers[0].top_k
        given, oracle_ranked = [], oracle.ranked

        def checked(scores, budget):
            out = oracle_ranked(scores, budget)
            given.append((out, ranked(scores, budget), oracle._last is not None and scores is oracle._last[0]))
            for wider in (budget + 1, budget + 3):  # beyond the recorded experts: scheduler.ranked's own tail
                assert oracle_ranked(scores, wider) == ranked(scores, wider)
            return out

        monkeypatch.setattr(engine.driver, "rank", checked)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)
    shortcut = [(mine, theirs) for mine, theirs, looked_up in given if looked_up]
    assert len(shortcut) >= 4 * len(engine.layers) - 1  # every decode prediction of the 4 decode steps
    assert all(mine == theirs and len(mine) == top_k for mine, theirs in shortcut)


def test_trace_oracle_without_a_trace_is_refused_in_one_line():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with pytest.raises(ValueError, match="record one with"):
        evalsuite.offload(model, mode="router-preserving", predictor="trace-oracle")


@pytest.mark.parametrize("kind", LINK_KINDS)
def test_a_cancelled_prefetch_that_never_started_gives_its_victim_back(kind, monkeypatch):
    use_link_kind(monkeypatch, kind)
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    layer = arch.sparse_layers(model)[0].index
    with evalsuite.offload(model, mode="on-demand", cache_capacity=4, link="1GB/s+50000us") as engine:
        cache = engine.cache
        assert engine.prefetch(layer, [0, 1, 2, 3]) == 4
        for e in range(4):  # land, then a use confirms each: four used experts fill the cache
            cache.transfers[(layer, e)].wait_landed(5)
            cache.pin((layer, e))
            cache.unpin((layer, e))
        assert engine.prefetch(layer, [4, 5]) == 2  # 4 moves first and evicts 0; 5 waits and evicts 1
        moving, queued = cache.transfers[(layer, 4)], cache.transfers[(layer, 5)]
        deadline = time.monotonic() + 5
        while moving.untouched and time.monotonic() < deadline:  # the link starts on it
            time.sleep(1e-3)
        assert not moving.untouched and queued.untouched
        cancel = engine.transfers.cancel

        def slow_cancel(transfer):  # the compute thread is held up after each cancel (another thread, a GC
            landed = cancel(transfer)  # pause): 4 reaches its chunk's end and the link is free meanwhile
            time.sleep(5e-3)
            return landed

        monkeypatch.setattr(engine.transfers, "cancel", slow_cancel)
        assert engine.settle_prefetches(layer, set()) == 2
        assert [cache.resident((layer, e)) for e in range(6)] == [False, True, True, True, False, False]
        # expert 1's weights are still in the slot it got back, and it is the next to be evicted again
        assert torch.equal(cache.slots[cache.slot_of[(layer, 1)]], engine.store.read((layer, 1)))
        assert cache.pools[layer].victim(lambda k: True) == (layer, 1)
        s = engine.stats()
    assert s["prefetch_cancelled"] == 2 and s["victims_restored"] == 1
