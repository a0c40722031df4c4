"""Predictions put off to their request's end (evalsuite.engine.prediction.put_off) in a running engine: made after the
request where they cannot pay, with the same recall; quiet tokens; what the scheduler is told they cost; and
online where the link is slow."""
import time

import pytest
import torch

import evalsuite
from evalsuite.engine.cache.fetching import fading_keep

from .helpers import copy_and_reference, shipped_model
from .test_modes import artifact_for


def recall_and_put_off(link, window=True):
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=12)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5, link=link,
                           window=window, trace=True) as engine, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        s, trace = engine.stats(), engine.routing_trace()
        put_off = engine.driver.put_off
    assert torch.equal(out, expected)
    return s["recall"], s["prefetches"], put_off, [[r.predicted for r in step] for step in trace.steps]


def test_a_prediction_that_cannot_pay_is_made_after_the_request_with_the_same_recall():
    # no link emulation: copies take microseconds, less than predicting costs, so predictions wait
    recall, _, put_off, predicted = recall_and_put_off(None)
    online_recall, _, online_put_off, online_predicted = recall_and_put_off(None, window=False)
    assert put_off > 0 and online_put_off == 0
    assert recall == online_recall  # the same predictor calls, made later
    assert predicted == online_predicted  # the trace holds them too


def record_of_run(may_put_off_tokens: bool, predictor: str = "gate"):
    """A router-preserving run of 24 tokens, quiet tokens allowed or not: its output, recall, trace predictions,
    per-rank precision and quiet tokens."""
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=24)
    artifact = artifact_for("qwen3_moe") if predictor != "gate" else None
    with evalsuite.offload(model, mode="router-preserving", predictor=predictor, artifact=artifact,
                           cache_capacity=0.5, trace=True) as engine, torch.no_grad():
        engine.driver.may_put_off_tokens = may_put_off_tokens
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        s, trace, scheduler = engine.stats(), engine.routing_trace(), engine.driver.scheduler
        assert torch.equal(out, expected)
        return (s["recall"], [[r.predicted for r in step] for step in trace.steps], dict(scheduler.seen),
                dict(scheduler.picked), engine.driver.quiet_tokens)


@pytest.mark.parametrize("predictor", ["gate", "estimator"])  # it reads x; the residual, ids and weights
def test_a_token_whose_every_prediction_is_put_off_only_keeps_inputs_and_records_the_same(monkeypatch, predictor):
    """Where every layer's verdict to put off stands, a decode token is quiet: its layers keep the inputs their
    predictions read and nothing else, and its predictions are made from them after the request, for the same
    recall, trace and per-rank precision as predictions put off one by one (the same as made online: the test
    above). Here making a prediction online is said to cost a second, so every verdict, once judged, puts it off."""
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    monkeypatch.setattr(PrefetchScheduler, "online_cost_s", lambda self, layer=None: 1.0)
    *quiet_record, quiet_tokens = record_of_run(True, predictor)
    *record, none = record_of_run(False, predictor)
    # 23 decode steps: the first, with no layer time, predicts its second layer online; the next judges that layer
    assert quiet_tokens == 21 and none == 0
    assert quiet_record == record


def test_a_warm_engine_judges_a_request_s_first_token_with_what_it_measured(monkeypatch):
    """The layer time and the verdicts resting on it carry over from one request to the next: where nothing pays, a
    second request puts every decode prediction off from its first token, where a new engine's first decode token,
    with no layer time measured, predicts online; clear_cache starts over as a new engine, its miss rate and
    missing share too."""
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    monkeypatch.setattr(PrefetchScheduler, "online_cost_s", lambda self, layer=None: 1.0)
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=24)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5,
                           trace=True) as engine, torch.no_grad():
        driver = engine.driver

        def put_off_in_a_request():
            before = driver.put_off
            out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
            assert torch.equal(out, expected)
            return driver.put_off - before

        every = 23 * driver.predicted_per_token  # each decode step's predictions
        assert put_off_in_a_request() == every - 1  # a new engine: its first decode token predicts one layer online
        assert put_off_in_a_request() == every
        engine.clear_cache()
        assert driver.scheduler.layer_s is None and not driver.scheduler.put_off_all()
        for layer in engine.layers:  # the emptied cache is expected to lack every candidate, as a new engine's
            assert engine.miss_rate(layer.index) == 1.0
            assert driver.scheduler.missing_share(layer.index) == [1.0] * engine.budget


def test_predictions_put_off_teach_the_scheduler_which_candidates_were_missing_when_put_off(monkeypatch):
    """Each prediction put off, one by one or in a quiet token, is scored when its request ends against the experts
    of its layer the cache held when it was put off: the scheduler's counts of missing candidates (pm, q) are
    those counted again here from the cache as each prediction was put off and the trace's predictions."""
    from evalsuite.engine.prediction.driver import PredictionDriver
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    monkeypatch.setattr(PrefetchScheduler, "online_cost_s", lambda self, layer=None: 1.0)  # every verdict: put off
    held = {}  # (decode step, target position) -> the target layer's experts in the cache when predicted
    on_router = PredictionDriver.on_router

    def noting(self, pos, *args):
        if self.engine.forward.decoding:
            step = held.setdefault("steps", -1) + (pos == 0)
            held["steps"] = step
            target = self.target_of[pos]
            if target is not None:  # (the last layer predicts the next step's first)
                layer = self.layer_of[target]
                held[step + (target == 0), target] = {e for l, e in self.engine.cache.slot_of if l == layer}
        return on_router(self, pos, *args)

    monkeypatch.setattr(PredictionDriver, "on_router", noting)
    model, ids, mask, expected = copy_and_reference(rows=1, tokens=16)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5,
                           trace=True) as engine, torch.no_grad():
        scheduler = engine.driver.scheduler
        scheduler.layer_s = scheduler.predict_s = 1e-3  # measured before: the first decode token is judged too
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(out, expected)
        engine.stats()  # (ends the request)
        trace, budget = engine.routing_trace(), engine.budget
        assert engine.driver.put_off == 15 * engine.driver.predicted_per_token and engine.driver.quiet_tokens > 10
        seen = {layer: [0] * budget for layer in trace.layers}
        picked = {layer: [0] * budget for layer in trace.layers}
        for step, routings in enumerate(trace.steps):
            for pos, routing in enumerate(routings):
                if not routing.predicted:
                    continue
                for rank, e in enumerate(routing.predicted[:budget]):
                    if e not in held[step, pos]:
                        seen[trace.layers[pos]][rank] += 1
                        picked[trace.layers[pos]][rank] += e in routing.native
        assert sum(map(sum, seen.values())) > 0
        assert scheduler.missing_seen == seen and scheduler.missing_picked == picked


@pytest.mark.parametrize("predictor, ahead", [("gate", (True, False, False)), ("estimator", (False, True, True))])
def test_a_quiet_token_keeps_no_input_its_predictions_do_not_read(monkeypatch, predictor, ahead):
    """A quiet token keeps each layer's ids (recall's native routing) and of (x, residual, weights) only those the
    prediction made from that layer reads (`ahead`: gate reads x, the estimator the residual, ids and weights); the
    last layer's prediction, for the next token's first layer, reads x alone. A tensor kept to the request's end
    is one more object for the collector until then."""
    from evalsuite.engine.prediction.driver import PredictionDriver
    from evalsuite.engine.prediction.put_off import PutOffToken
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    monkeypatch.setattr(PrefetchScheduler, "online_cost_s", lambda self, layer=None: 1.0)
    kept, end_request = [], PredictionDriver.end_request

    def read_then_end(driver):
        tokens = {id(step): step for steps in driver.current.values() for step in steps if type(step) is PutOffToken}
        kept.extend((driver.target_of, token.inputs) for token in tokens.values() if token.complete())
        end_request(driver)

    monkeypatch.setattr(PredictionDriver, "end_request", read_then_end)
    record_of_run(True, predictor)
    assert kept
    fields = PutOffToken.FIELDS
    for target_of, inputs in kept:
        for pos, target in enumerate(target_of):
            x, residual, ids, weights = inputs[pos * fields:pos * fields + 4]
            assert ids is not None
            read = ahead if target else (True, False, False)
            assert (x is not None, residual is not None, weights is not None) == read


def test_a_quiet_token_makes_each_layer_s_prediction_from_the_inputs_it_kept():
    """PutOffToken: layer 1's prediction is made from layer 0's inputs, the next token's first from the last
    layer's; the first layer's is the one carried in. A kept tensor changed in place since is refused, as a
    PutOffPrediction's is."""
    from types import SimpleNamespace

    from evalsuite.engine.prediction.put_off import PutOffPrediction, PutOffToken

    driver = SimpleNamespace(target_of=[1, 0], source_of=[1, 0], reads_of=[("x",), ("x",)],
                             quiet_keeps=[(True, False, False)] * 2,
                             engine=SimpleNamespace(budget=1), _score_ahead=lambda s: s.x, _score_next=lambda s: -s.x)
    ids, weights = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)

    def token(first=None):
        made = PutOffToken(driver, first)
        for resident, x in enumerate((torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[3.0, 4.0, -1.0]]))):
            made.keep(x, None, ids, weights, resident)
        return made

    carried = PutOffPrediction(lambda s: s.x, ("x",), 1, 1, torch.tensor([[0.0, 0.0, 5.0]]), None, ids, weights)
    quiet = token(carried)
    assert quiet.complete()
    assert quiet.prediction_for(0) is carried and quiet.prediction_for(0)() == [2]
    assert quiet.prediction_for(1)() == [1]  # layer 0's x, scored ahead
    assert quiet.made_at(1)() == [2]  # layer 1's x, scored for the next token's first layer (-x)
    assert [quiet.made_at(pos).resident for pos in (0, 1)] == [0, 1]  # what the cache held as each layer ran
    changed = token()
    changed.inputs[0].add_(1)  # layer 0's x (PutOffToken.inputs: FIELDS entries a layer, x first)
    with pytest.raises(RuntimeError, match="changed in place"):
        changed.prediction_for(1).scores()


def test_a_prediction_put_off_keeps_the_state_it_reads_and_refuses_one_changed_in_place():
    """A put-off prediction keeps its layer's tensors rather than copies (every tiny family's recall with
    predictions put off is checked in test_modes): if the model ever wrote one in place, it would score
    another state, so it says so instead."""
    from evalsuite.engine.pass_state.layer_state import LayerState
    from evalsuite.engine.prediction.put_off import PutOffPrediction

    state = LayerState(0, torch.ones(1, 4), None, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    kept = PutOffPrediction(lambda s: s.x.sum(), ("x",), 1, 0, state.x, None, state.ids, state.weights)
    changed = PutOffPrediction(lambda s: s.x.sum(), ("x",), 1, 0, state.x, None, state.ids, state.weights)
    other = LayerState(0, torch.ones(1, 4), None, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    unread = PutOffPrediction(lambda s: s.x.sum(), ("x",), 1, 0, other.x, None, other.ids, other.weights)
    assert kept.scores() == 4.0
    state.x.add_(1)
    with pytest.raises(RuntimeError, match="changed in place"):
        changed.scores()
    assert kept.scores() == 4.0  # made once, before the change
    other.weights.mul_(2)  # a field the prediction does not read may change
    assert unread.scores() == 4.0


def test_a_prediction_put_off_is_timed_from_its_layers_router(monkeypatch):
    """What the scheduler weighs a put-off prediction by (put_off_s, which the replay also charges) is the driver's
    whole work at the layer, the layer's timing and the last prediction's record included: that work happens only
    because predictions are made, so on-demand loading does not pay it. Here the layer timing is made 3 ms slow."""
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    timed = PrefetchScheduler.layer_at

    def slow_layer_at(self, pos, now, stalled, missed):
        timed(self, pos, now, stalled, missed)
        time.sleep(0.003)

    monkeypatch.setattr(PrefetchScheduler, "worth_predicting", lambda self, target, h: False)  # all put off
    monkeypatch.setattr(PrefetchScheduler, "layer_at", slow_layer_at)
    model, ids, mask, _ = copy_and_reference(1, 4)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5, link="ufs4") as engine, \
            torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert engine.driver.put_off > 0
        assert engine.driver.scheduler.put_off_s >= 0.003


def test_settling_a_layer_s_prefetches_is_left_out_of_the_prediction_made_there(monkeypatch):
    """Settling the prefetches sent for a layer (cancelling the wrong, promoting the right) is the prefetches' cost,
    which the scheduler weighs per prefetch (Engine.prefetch_cost_s): the prediction made at the same router does
    not pay for it too. Here settling is made 5 ms slow, and every prediction is made online and sent."""
    from evalsuite.engine.offload import Engine

    settle, settled = Engine.settle_prefetches, []

    def slow_settle(self, layer, confirmed):
        time.sleep(0.005)
        settled.append(layer)
        return settle(self, layer, confirmed)

    monkeypatch.setattr(Engine, "settle_prefetches", slow_settle)
    model, ids, mask, _ = copy_and_reference(1, 6)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.3, link="ufs4",
                           window=False) as engine, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert len(settled) >= 10
        assert engine.driver.scheduler.predict_s < 0.0025  # (with the settling: 5 ms and more)


def test_on_a_slow_link_predictions_are_made_and_sent_online():
    """The trained tiny model on the SD card: a copy takes three layers' time, so once the scheduler
    has seen how often the gate predictor is right (one online prediction in EXPLORE_EVERY, then all
    that pay), most predictions are made during decoding and prefetched."""
    from evalsuite.generate import load_model
    from evalsuite.perf.decode import greedy

    model, tokenizer = load_model(shipped_model())
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.25,
                           link="sdcard") as engine:
        greedy(model, ids, 24)  # learns each rank's precision
        first = engine.driver.put_off
        engine.reset_stats()
        greedy(model, ids, 24)
        s, put_off = engine.stats(), engine.driver.put_off - first
    predictions = 23 * len(engine.layers)
    assert s["prefetches"] > 0 and put_off < predictions / 3


def test_the_miss_rate_the_scheduler_reads_counts_recent_decode_uses_only():
    """A prefill starts on a cold cache: counting its misses would keep the rate high long after the
    cache warmed, and so would a decode's first tokens, which miss far more than the rest: older uses fade
    (MISS_RATE_MEMORY steps). With every expert fitting, a decode use misses only the first time its expert runs.
    The prior, one use, misses as often as the layer's experts are absent from the cache: before any decode use,
    the share the prefill did not bring."""
    model, ids, mask, _ = copy_and_reference(rows=1, tokens=12)
    with evalsuite.offload(model, mode="on-demand", cache_capacity="all", trace=True) as engine, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # a prefill alone
        after_prefill = {layer.index: engine.miss_rate(layer.index) for layer in engine.layers}
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        trace = engine.routing_trace()
        rates = {layer: engine.miss_rate(layer) for layer in trace.layers}
    first, (_, prefill) = trace.prefills
    assert any(0 < rate < 1 for rate in after_prefill.values())  # a prior neither 0 nor the old 1
    keep = fading_keep(engine.layers[0].top_k)  # older uses fade
    for pos, layer in enumerate(trace.layers):
        assert after_prefill[layer] == pytest.approx(1 - len(set(first[1][pos])) / trace.experts, rel=1e-12)
        seen, uses, missed = set(first[1][pos]) | set(prefill[pos]), 0.0, 0.0
        for step in trace.steps:
            for e in sorted(set(step[pos].native)):
                uses, missed, seen = uses * keep + 1, missed * keep + (e not in seen), seen | {e}
        absent = 1 - len(seen) / trace.experts  # nothing is evicted: the cache holds every expert that ran
        assert rates[layer] == pytest.approx((missed + absent) / (uses + 1), rel=1e-12)


def test_a_prediction_s_cost_counts_scheduling_it_but_not_issuing_its_prefetches(monkeypatch):
    """The scheduler weighs what a prediction made online costs the compute thread beyond one put off: the
    driver times the whole online path (predictor, ranking, scheduling) on its clock, and leaves out issuing
    the prefetches, which the scheduler weighs per prefetch (Engine.prefetch_cost_s)."""
    from types import SimpleNamespace

    from evalsuite.engine.prediction import driver as prediction

    clock = [0.0]
    monkeypatch.setattr(prediction, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model, ids, mask, _ = copy_and_reference(rows=1, tokens=8)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.25) as engine, \
            torch.no_grad():
        scheduler, prefetch, schedule = engine.driver.scheduler, engine.prefetch, engine.driver.scheduler.schedule
        issued = []

        def issue(*args, **kwargs):  # issuing takes 1 s of the driver's clock, all of it counted as issuing
            clock[0] += 1.0
            engine.prefetch_work_s += 1.0
            issued.append(prefetch(*args, **kwargs))
            return issued[-1]

        def scheduling(*args, **kwargs):  # the scheduler's own work: 0.25 s
            clock[0] += 0.25
            return schedule(*args, **kwargs)

        def put_off(target, h):  # every other prediction is put off, which takes 0.125 s
            clock[0] += 0.125
            return len(issued) % 2 == 0

        engine.prefetch, scheduler.schedule, scheduler.worth_predicting = issue, scheduling, put_off
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert sum(issued) > 0 and engine.driver.put_off > 0
    assert abs(scheduler.predict_s - 0.375) < 1e-3  # the worth test and scheduling; issuing left out
    assert abs(scheduler.put_off_s - 0.125) < 1e-9 and abs(scheduler.online_cost_s() - 0.25) < 1e-3
