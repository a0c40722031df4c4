"""The prefetch scheduler: decode-only layer time without stalls, late copies still sent when
they hide part of their time, and an expected-value rule from each rank's observed precision."""
from types import SimpleNamespace

import pytest
import torch

from evalsuite.engine.prediction import scheduler as scheduler_module
from evalsuite.engine.prediction.scheduler import PrefetchScheduler, ranked

from .scheduler_fakes import FakeEngine, candidates, scores_ranking


def test_candidates_are_ranked_by_confidence_summed_over_rows():
    assert ranked(scores_ranking([3, 5, 1]), 2) == [3, 5]
    two = torch.cat([scores_ranking([6, 2]), scores_ranking([2, 6])])  # each row is sure of another expert
    two[1, 2] = 20.0  # the second row is far surer of expert 2 than the first is of expert 6
    assert ranked(two, 2) == [2, 6]


def at(monkeypatch, seconds):
    monkeypatch.setattr(scheduler_module.time, "perf_counter", lambda: seconds)


def test_layer_time_is_decode_only_and_leaves_out_stalls(monkeypatch):
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    for pos, t in ((0, 0.0), (1, 4.9)):  # prefill: slow layers
        at(monkeypatch, t)
        s.layer_started(pos, decoding=False)
    assert s.layer_s is None
    at(monkeypatch, 10.0)
    s.layer_started(0, decoding=True)
    engine.stalled_s += 0.3  # the layer waited 0.3 s for a copy
    at(monkeypatch, 10.5)
    s.layer_started(1, decoding=True)
    assert abs(s.layer_s - 0.2) < 1e-9
    s.new_request()  # what a decode layer takes carries over: the next request's first token is judged with it
    assert abs(s.layer_s - 0.2) < 1e-9
    at(monkeypatch, 20.0)
    s.layer_started(1, decoding=True)  # a new request's first router: no layer before it in this request
    assert abs(s.layer_s - 0.2) < 1e-9
    s.forget()  # as a new engine
    assert s.layer_s is None


def test_the_next_token_s_first_layer_gets_the_measured_time_from_the_last_layer(monkeypatch):
    """The last sparse layer predicts the next token's first one: between the two routers run the LM head,
    sampling and the layers before the first sparse one, far more than one layer_s. It is measured the same
    way (decode only, stalls out), and is that prediction's lead; the others keep layer_s."""
    engine = FakeEngine()  # two sparse layers
    s = PrefetchScheduler(engine, budget=2)
    for pos, t in ((0, 10.0), (1, 10.2)):
        at(monkeypatch, t)
        s.layer_started(pos, decoding=True)
    assert s.wrap_s is None and s.lead_s(0, 1) == s.layer_s  # not measured yet: one layer's time
    engine.stalled_s += 0.1  # the first layer of the next token waited 0.1 s for a copy
    at(monkeypatch, 10.9)
    s.layer_started(0, decoding=True)
    assert abs(s.wrap_s - 0.6) < 1e-9 and abs(s.layer_s - 0.2) < 1e-9
    assert s.lead_s(0, 1) == s.wrap_s and s.lead_s(1, 1) == s.layer_s
    s.new_request()
    assert abs(s.wrap_s - 0.6) < 1e-9
    s.forget()
    assert s.wrap_s is None


def test_the_longer_lead_of_the_next_token_s_first_layer_lets_a_copy_behind_another_go():
    """One prefetch is queued ahead (a 1 s copy): a candidate behind it starts 1 s after the demand loads.
    Within a token (0.5 s to the next router) it would save nothing; across tokens (1.5 s) it saves half."""
    engine = FakeEngine(prefetches_queued=1)
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.wrap_s = 0.5, 1.5
    assert s.schedule(1, candidates([3, 5]), h=1) == 0
    assert s.schedule(0, candidates([3, 5]), h=1) >= 1 and engine.sent[-1][0] == 3


def test_a_copy_that_lands_after_the_layer_starts_still_goes():
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.5  # half a copy's time before the layer starts: it hides half of it
    assert s.schedule(1, candidates([3, 5]), h=1) >= 1
    assert engine.sent[0][0] == 3


def test_a_wrong_guess_costs_half_a_chunk_of_the_link_s_own_time():
    """A wrong prefetch moving when its router decides holds the demand loads to its chunk's end. On an emulated
    link the chunk's time is the link's figure (bytes over bandwidth): a copy's latency is no part of it, and on
    the SD card, where it is a third of a copy, a chunk's share of the copy's time charged 0.73 ms, not 0.5. Here
    half a 1 s copy is latency: 0.1 s chunks of its 500 bytes, not 0.5 s. At a precision of a third, a copy that
    hides 0.2 s pays against 0.05 s (half a chunk) wasted two times in three, not against 0.25 s."""
    from evalsuite.engine.link.lazy import LazyLink
    from evalsuite.engine.link.profiles import LINKS
    from evalsuite.engine.link.worker import TransferWorker

    sent = {}
    for chunk_s in (0.1, None):  # None: a real link, whose chunk is its share of a copy's measured time
        engine = FakeEngine()
        engine.transfers.chunk_bytes, engine.transfers.chunk_s = 500, chunk_s
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s = 0.2
        s.seen[7], s.picked[7] = 1, [0, 0]  # (0 + 1) / (1 + 2): right a third of the time
        s.schedule(1, candidates([3, 5]), h=1)
        sent[chunk_s] = engine.sent
    assert sent == {0.1: [[3]], None: []}
    assert LazyLink(None, LINKS["sdcard"]).chunk_s == pytest.approx(1e-3)  # 90 kB at 90 MB/s
    worker = TransferWorker(None, torch.device("cpu"), LINKS["sdcard"])
    try:
        assert worker.chunk_s == pytest.approx(1e-3)
    finally:
        worker.close()


def sent_past_victims(regret, spare, seen, picked):
    """What schedule sends for a layer whose rank 0 was picked `picked` of `seen` times, a copy hiding 0.3 s of 1 s,
    with victims asked for again at `regret` and `spare` slots free of used experts."""
    engine = FakeEngine()
    engine.cache = SimpleNamespace(resident=lambda key: False, victim_regret=lambda: regret,
                                   spare=lambda layer: spare)
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.3
    s.seen[7], s.picked[7] = seen, [picked, 0]  # rank 0: (picked + 1) / (seen + 2)
    s.schedule(1, candidates([3, 5]), h=1)
    return engine.sent


def test_a_wrong_guess_that_takes_a_used_expert_s_slot_is_charged_the_victims_asked_for_again():
    """A wrong prefetch whose copy starts takes a used expert's slot for good; the cache measures how often such a
    victim is asked for again while it would still have been resident (victim_regret), and each such use is a
    miss. At a precision of a half, a copy hiding 0.3 s pays against 5 ms (half a chunk) wasted; with every victim
    asked for again it would also lose what a hit saves (a whole 1 s copy here) half the time, and is not sent,
    unless a free slot or an unconfirmed guess can be taken instead of a used expert (`spare`)."""
    assert sent_past_victims(0.0, 0, 2, 1) == [[3]]
    assert sent_past_victims(1.0, 0, 2, 1) == []
    assert sent_past_victims(1.0, 1, 2, 1) == [[3]]


def test_a_right_guess_that_takes_a_used_expert_s_slot_is_charged_its_victim_too():
    """A right prefetch keeps the used expert it evicted out as well: where that expert is asked for before it would
    have gone anyway (victim_regret), the prefetch only moved a miss to it, and with its copy half hidden, added
    the rest. A guess right 90 % of the time that hides 0.3 s of a 1 s copy is sent while victims are asked for
    again a fifth of the time, not when half are (0.9 · (0.3 − 0.5) < 0, however sure), and always where a
    free slot or an unconfirmed guess can be taken instead."""
    assert sent_past_victims(0.2, 0, 8, 8) == [[3]]
    assert sent_past_victims(0.5, 0, 8, 8) == []
    assert sent_past_victims(0.5, 1, 8, 8) == [[3]]


def test_a_rank_the_router_never_confirms_is_not_sent():
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    for _ in range(200):  # rank 0 always picked, rank 1 never
        s.observe(7, candidates([3, 5]), {3})
    s.layer_s = 10.0
    s.schedule(1, candidates([2, 4]), h=1)
    assert engine.sent == [[2]]
    assert s.precision(7)[0] > 0.99 and s.precision(7)[1] < 0.01


def test_nothing_is_sent_once_the_prefetches_queued_ahead_outlast_the_layer():
    engine = FakeEngine(prefetches_queued=5)
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.5
    assert s.schedule(1, candidates([3, 5]), h=1) == 0
    assert not any(engine.sent)


def test_demand_loads_ahead_do_not_close_the_window():
    """The layer's own demand loads delay the compute as much as the prefetch: the prefetch still
    has the layer's compute time to move in after them, so it is sent."""
    engine = FakeEngine(prefetches_queued=0)
    engine.transfers.pending = lambda: 5  # five demand loads the compute waits for
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.5
    s.schedule(1, candidates([3, 5]), h=1)
    assert engine.sent and engine.sent[0][:1] == [3]


def test_a_prefetch_whose_issue_costs_more_than_it_could_save_is_not_sent():
    """A copy of 1 s saves at most 1 s; when issuing and cancelling a wrong guess costs the compute
    thread 10 s, a guess right half the time is not worth it, while a sure one still is."""
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 10.0
    engine.prefetch_cost_s = 10.0
    for _ in range(200):  # rank 0 always picked, rank 1 half the time
        s.observe(7, candidates([3, 5]), {3, 5} if len(engine.sent) % 2 else {3})
        engine.sent.append(None)
    engine.sent = []
    s.schedule(1, candidates([2, 4]), h=1)
    assert engine.sent == [[2]]
    engine.prefetch_cost_s = 0.0
    s.schedule(1, candidates([2, 4]), h=1)
    assert engine.sent[-1] == [2, 4]


def test_a_right_prefetch_is_charged_what_it_costs_beyond_the_demand_load_it_spares():
    """Issuing and settling a prefetch costs the compute thread c whether it is right or wrong; a right one
    spares a demand load's d. A sure guess that would hide 1 s is not worth 1.5 s of issuing when a demand
    load costs nothing to start, and is when starting one costs as much as issuing a prefetch (d = c)."""
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 10.0
    for _ in range(200):  # rank 0 always picked
        s.observe(7, candidates([3, 5]), {3})
    engine.prefetch_cost_s, engine.demand_cost_s = 1.5, 0.0
    s.schedule(1, candidates([2, 4]), h=1)
    assert not engine.sent
    engine.demand_cost_s = 1.5
    s.schedule(1, candidates([2, 4]), h=1)
    assert engine.sent == [[2]]
    engine.demand_cost_s = None  # not measured: taken as c
    s.schedule(1, candidates([6, 1]), h=1)
    assert engine.sent[-1] == [6]


def put_off_steps(s, engine, misses):
    """Decode steps of two sparse layers whose prediction for layer 1 the scheduler puts off (it costs far more
    than a copy): at step i layer 1 misses misses[i] experts and stalls 0.1 s plus 0.3 s per miss."""
    s.layer_s, s.predict_s, now = 10.0, 100.0, 0.0
    for m in misses:
        s.layer_at(0, now, engine.stalled_s, engine.missed)
        assert not s.worth_predicting(1, 1)
        now += 1.0
        s.layer_at(1, now, engine.stalled_s, engine.missed)
        engine.missed += m
        engine.stalled_s += 0.1 + 0.3 * m
        now += 1.0 + 0.1 + 0.3 * m
    s.layer_at(0, now, engine.stalled_s, engine.missed)  # the last step's stall is recorded here


def test_a_right_prefetch_saves_what_one_more_miss_stalls_where_that_is_less_than_its_copy():
    """Demand copies overlap the compute of the layer's other experts, so one more miss can stall less than a
    copy takes: the scheduler fits a put-off step's stall to its misses (0.3 s each here, against 1 s copies)
    and credits a right prefetch with that; where misses never vary (no slope to fit), with the layer's stall
    per expected miss (0.7 s a step over two misses: 0.35 s). At even odds a candidate issued for 0.2 s of the
    compute thread is worth sending to save a 1 s copy (before any step is measured), not 0.3 or 0.35 s."""
    from evalsuite.engine.prediction.scheduler import MISS_FIT_AFTER

    engine = FakeEngine()
    engine.prefetch_cost_s, engine.demand_cost_s = 0.2, 0.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 10.0
    assert s.schedule(1, candidates([3, 5]), h=1) == 2
    s = PrefetchScheduler(engine, budget=2)
    put_off_steps(s, engine, [2] * MISS_FIT_AFTER * 2)
    assert s.stall_per_miss() is None  # every step missed two: no slope to fit
    assert s._hit_saves(1.0, 7) == pytest.approx(0.35)
    s.layer_s = 10.0
    assert s.schedule(1, candidates([3, 5]), h=1) == 0
    s = PrefetchScheduler(engine, budget=2)
    put_off_steps(s, engine, [1, 3, 0, 2] * (MISS_FIT_AFTER // 4))
    assert s.stall_per_miss() == pytest.approx(0.3)
    s.layer_s = 10.0
    assert s.schedule(1, candidates([3, 5]), h=1) == 0


def test_a_wrong_guess_is_charged_half_a_chunk_of_the_demand_loads_time():
    """A wrong prefetch delays the demand loads only if it is still moving when its router cancels it, and
    then by what is left of its chunk: half a chunk on average. A candidate at even odds that would hide
    three quarters of a chunk (the chunk: 10 ms of a 1 s copy) is worth sending."""
    engine = FakeEngine()
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.0075
    assert s.schedule(1, candidates([3, 5]), h=1) == 1 and engine.sent == [[3]]
