"""Engine metrics replayed from one batched resident pass match the engine measuring each mode."""
import copy

import pytest
import torch

import evalsuite
from evalsuite.engine.cache.slots import capacity_in_experts
from evalsuite.engine.prediction.shadows import routing_trace
from evalsuite.perf.replay import replayed_stats
from evalsuite.perf.simulate import Costs

from .helpers import batch, reference_model

COSTS = Costs(dense_s=1e-3, expert_s=2e-4, step_s=1e-3, transfer_s=1e-5, lookup_s=1e-5, miss_s=1e-5)


def _generate(model, ids, mask, tokens=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def _rows(ids, mask):
    return [(ids[r : r + 1, mask[r].bool()], mask[r : r + 1, mask[r].bool()]) for r in range(ids.shape[0])]


def _measured(model, ids, mask, **options):
    engine = evalsuite.offload(model, **options)
    for row in _rows(ids, mask):  # batch 1, one request after another, one cache throughout
        _generate(model, *row)
    stats = engine.stats()
    engine.close()
    return stats


def _recorded(model, ids, mask):
    engine = evalsuite.offload(model, mode="resident", shadows=["gate"])
    _generate(model, ids, mask)  # the whole batch at once
    _, sequences = engine.take_shadows()
    layer = engine.layers[0]
    meta = {"expert_bytes": engine.layout.nbytes}
    engine.close()
    return sequences, [l.index for l in engine.layers], layer.num_experts, layer.top_k, meta


@pytest.mark.parametrize("model_type,policy,pools", [("qwen3_moe", "lru", "global"), ("mixtral", "lfu", "global"),
                                                     ("deepseek_v3", "lru", "per-layer")])
def test_on_demand_hit_rate_replayed_equals_the_measured_engine(model_type, policy, pools):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(4, seq=12)
    sequences, layers, experts, top_k, meta = _recorded(model, ids, mask)
    trace = routing_trace(sequences, None, layers, experts, top_k, meta)
    capacity = capacity_in_experts(0.3, experts * len(layers), 1)
    measured = _measured(model, ids, mask, mode="on-demand", cache_capacity=capacity, cache_policy=policy,
                         cache_pools=pools)
    replayed = replayed_stats(trace, COSTS, capacity, "on-demand", policy, per_layer=pools == "per-layer")
    for counter in ("expert_uses", "hits", "misses", "bytes_transferred"):
        assert replayed[counter] == measured[counter], counter
    assert replayed["hit_rate"] == measured["hit_rate"] and replayed["sequences"] == 4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_router_preserving_replayed_is_within_two_points_of_measured(model_type):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(4, seq=12)
    sequences, layers, experts, top_k, meta = _recorded(model, ids, mask)
    trace = routing_trace(sequences, "gate", layers, experts, top_k, meta)
    capacity = capacity_in_experts(0.3, experts * len(layers), 1)
    # window=False sends every candidate: what is sent then depends on the predictions, not on this machine's clock
    measured = _measured(model, ids, mask, mode="router-preserving", predictor="gate", cache_capacity=capacity,
                         window=False)
    replayed = replayed_stats(trace, COSTS, capacity, "router-preserving", window=False)
    assert replayed["expert_uses"] == measured["expert_uses"]
    assert measured["prefetches"] > 0
    assert replayed["hit_rate"] == pytest.approx(measured["hit_rate"], abs=0.02)
    assert replayed["prefetch_precision"] == pytest.approx(measured["prefetch_precision"], abs=0.02)


def test_a_replay_in_the_replay_process_equals_one_run_here():
    from evalsuite.lm import plan
    from evalsuite.perf.replay import replayed_sequences

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(3)
    engine = evalsuite.offload(model, mode="resident", shadows=["gate"])
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    _, sequences = engine.take_shadows()
    layers = [l.index for l in engine.layers]
    experts, top_k = engine.layers[0].num_experts, engine.layers[0].top_k
    engine.close()
    costs = Costs(dense_s=1e-4, expert_s=5e-5, step_s=1e-4, transfer_s=3e-4, predictor_s=2e-5)
    args = (sequences, "gate", layers, experts, top_k, {"expert_bytes": 1024}, costs, experts, "router-preserving")
    here = plan._Inline.submit(replayed_sequences, *args).result()
    there = plan.replays().submit(replayed_sequences, *args).result()
    assert here == there
    assert here["expert_uses"] > 0 and here["misses"] > 0  # the replay did run, and met a cold cache


def _gate_trace():
    """A batched resident pass's trace with gate's predictions, and a cache of 30 % for it."""
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(4, seq=12)
    sequences, layers, experts, top_k, meta = _recorded(model, ids, mask)
    trace = routing_trace(sequences, "gate", layers, experts, top_k, meta)
    return trace, capacity_in_experts(0.3, experts * len(layers), 1)


def test_the_replayed_scheduler_weighs_a_prediction_at_the_engines_own_timing_of_it():
    # the engine's scheduler weighs each prediction's expected saving against its own timing of the predictor's
    # call; the replay charges the whole measured cost per prediction but must decide as that scheduler does
    from dataclasses import replace

    trace, capacity = _gate_trace()
    costly = replace(COSTS, transfer_s=2e-4, predictor_s=1e-3)  # no prefetch can pay for a 1 ms prediction
    charged = replayed_stats(trace, costly, capacity, "router-preserving")
    timed = replayed_stats(trace, replace(costly, predict_call_s=0.0), capacity, "router-preserving")
    assert timed["prefetches"] > charged["prefetches"] > 0  # (explorations only, without the engine's timing)
    assert timed["tpot_ms"]["median"] > charged["tpot_ms"]["median"]  # each prediction made is charged in full


def test_the_replayed_scheduler_weighs_a_wrong_guess_at_the_engines_timing_of_a_prefetch():
    # issuing (and cancelling) a prefetch costs the compute thread what the engine times (prefetch_s); miss_s, a
    # difference of two TPOTs, can come out at 0, which would make every wrong guess free
    from dataclasses import replace

    trace, capacity = _gate_trace()
    link = replace(COSTS, transfer_s=2e-4, miss_s=0.0)
    free = replayed_stats(trace, link, capacity, "router-preserving")
    costly = replayed_stats(trace, replace(link, prefetch_s=1e-3), capacity, "router-preserving")
    assert free["prefetches"] > costly["prefetches"]


def test_the_replay_charges_a_prediction_put_off_at_the_engines_timing_of_it(monkeypatch):
    # putting a prediction off costs the compute thread the worth test and keeping its state (the engine's
    # scheduler times it: put_off_s); the replay charges it and gives the scheduler the same figure to weigh
    from dataclasses import replace

    from evalsuite.engine.prediction.scheduler import PrefetchScheduler
    from evalsuite.perf.replay import Replay

    monkeypatch.setattr(PrefetchScheduler, "worth_predicting", lambda self, target, h: False)  # all put off
    trace, capacity = _gate_trace()
    costly = replace(COSTS, transfer_s=2e-4, predictor_s=1e-3)
    free = Replay(trace, costly, capacity, "router-preserving", trace.top_k, True, "lru")
    charged = Replay(trace, replace(costly, put_off_s=2e-4), capacity, "router-preserving", trace.top_k, True, "lru")
    for replay in (free, charged):
        replay.run()
    assert free.predict == 0.0 and charged.put_offs == free.put_offs > 0
    assert charged.predict == pytest.approx(charged.put_offs * 2e-4)
    assert charged.scheduler.put_off_s == pytest.approx(2e-4)
    assert sum(charged.tpots) > sum(free.tpots)


def test_the_replay_makes_a_step_quiet_where_the_engine_would(monkeypatch):
    # where every layer's verdict to put off stands, the engine's driver only keeps a decode step's inputs and asks
    # nothing (PredictionDriver._start_quiet): the replay makes the same steps quiet, charges each what putting one
    # prediction off costs, not each of its predictions, and still scores every prediction when its request ends
    from dataclasses import replace

    from evalsuite.engine.prediction.scheduler import PrefetchScheduler
    from evalsuite.perf.replay import Replay

    monkeypatch.setattr(PrefetchScheduler, "online_cost_s", lambda self, layer=None: 1.0)  # once judged, every one put off
    trace, capacity = _gate_trace()
    costs = replace(COSTS, transfer_s=2e-4, predictor_s=1e-3, put_off_s=2e-4)
    quiet = Replay(trace, costs, capacity, "router-preserving", trace.top_k, True, "lru")
    quiet.run()
    monkeypatch.setattr(PrefetchScheduler, "put_off_all", lambda self: False)
    asked = Replay(trace, costs, capacity, "router-preserving", trace.top_k, True, "lru")
    asked.run()
    assert quiet.quiet_steps > len(trace.steps) // 2 and asked.quiet_steps == 0
    assert quiet.put_offs == asked.put_offs and quiet.scheduler.seen == asked.scheduler.seen
    # each scored against what the cache held when it was put off, as the engine's (PrefetchScheduler.observe)
    assert sum(map(sum, quiet.scheduler.missing_seen.values())) > 0
    assert quiet.scheduler.missing_seen == asked.scheduler.missing_seen
    assert quiet.scheduler.missing_picked == asked.scheduler.missing_picked
    # each quiet step charges one put-off instead of its own: one a layer, the last layer's none at a request's end
    layers, saved = len(trace.layers), (asked.predict - quiet.predict) / 2e-4
    assert quiet.quiet_steps * (layers - 2) - 1e-6 <= saved <= quiet.quiet_steps * (layers - 1) + 1e-6


def test_the_replay_learns_precision_from_every_prediction_as_the_engine_does():
    # the engine's scheduler scores the predictions it put off when their request ends (PredictionDriver.end_request):
    # which ones are put off depends on this machine's clock, but every prediction is scored, now or then
    from dataclasses import replace

    from evalsuite.perf.replay import Replay

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(4, seq=12)
    sequences, layers, experts, top_k, meta = _recorded(model, ids, mask)
    capacity = capacity_in_experts(0.3, experts * len(layers), 1)
    engine = evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=capacity)
    for row in _rows(ids, mask):
        _generate(model, *row)
    engine.stats()  # (ends the last request)
    seen = sum(engine.driver.scheduler.seen.values())
    engine.close()
    trace = routing_trace(sequences, "gate", layers, experts, top_k, meta)
    replay = Replay(trace, replace(COSTS, predictor_s=1e-3), capacity, "router-preserving", top_k, True, "lru")
    replay.run()
    assert sum(replay.scheduler.seen.values()) == seen  # made or put off, every prediction scored
    assert replay.predict < sum(replay.scheduler.seen.values()) * 1e-3  # (most of the replay's were put off)


def test_the_replayed_miss_rate_starts_from_the_share_of_experts_the_cache_lacks(monkeypatch):
    # as Engine.miss_rate: before a layer's first decode use its rate is the share of its experts absent from the
    # cache as it stands (a prior of one miss read 1 where the prefill had filled the cache)
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler
    from evalsuite.perf.replay import Replay

    trace, capacity = _gate_trace()
    replay = Replay(trace, COSTS, capacity, "router-preserving", trace.top_k, True, "lru")
    read, judge = [], PrefetchScheduler.worth_predicting

    def reading(self, target_pos, h):
        layer = self._index[target_pos]
        if layer not in replay._layer_uses:  # no decode use of the layer yet
            held = sum(1 for key in replay.cache.slot_of if key[0] == layer)
            read.append((replay.miss_rate(layer), 1 - held / trace.experts))
        return judge(self, target_pos, h)

    monkeypatch.setattr(PrefetchScheduler, "worth_predicting", reading)
    replay.run()
    assert read and all(rate == pytest.approx(absent, rel=1e-12) for rate, absent in read)
    assert any(0 < rate < 1 for rate, _ in read)
