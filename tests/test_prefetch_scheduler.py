"""The prefetch scheduler: decode-only layer time without stalls, late copies still sent when
they hide part of their time, and an expected-value rule from each rank's observed precision."""
from types import SimpleNamespace

import pytest
import torch

from evalsuite.engine import scheduler as scheduler_module
from evalsuite.engine.scheduler import PrefetchScheduler, ranked


class FakeEngine:
    """What the scheduler reads: one sparse layer (index 7) of 8 experts, a 1 s-per-copy link."""

    def __init__(self, prefetches_queued=0):
        self.stalled_s = 0.0  # the engine's stall total
        self.missed = 0  # its demand loads
        self.layers = [SimpleNamespace(index=7, top_k=2), SimpleNamespace(index=7, top_k=2)]
        self.cache = SimpleNamespace(resident=lambda key: False, victim_regret=lambda: 0.0, spare=lambda layer: 0)
        self.transfers = SimpleNamespace(seconds_per_transfer=lambda: 1.0, prefetches_queued=lambda: prefetches_queued,
                                         chunk_bytes=10, chunk_s=None)
        self.layout = SimpleNamespace(nbytes=1000)  # a chunk is 10 ms of the link
        self.prefetch_cost_s = None  # issuing a prefetch costs the compute thread nothing
        self.demand_cost_s = None  # unmeasured: a right prefetch spares what it costs
        self.sent = []

    def prefetch(self, layer, experts, keep=()):
        self.sent.append(list(experts))
        return len(experts)

    def miss_rate(self, layer):
        return 1.0  # its cache holds nothing


def scores_ranking(order, rows=1):
    """Router scores (`rows` tokens) whose confidence ranks the experts in `order`."""
    s = torch.zeros(rows, 8)
    for rank, e in enumerate(order):
        s[:, e] = 10.0 - rank
    return s


def candidates(order):
    return ranked(scores_ranking(order), 2)


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
    from evalsuite.engine.lazy_link import LazyLink
    from evalsuite.engine.transfer import LINKS, TransferWorker

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
    from evalsuite.engine.scheduler import MISS_FIT_AFTER

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


def test_a_prediction_is_weighed_by_what_it_costs_beyond_putting_it_off():
    """Putting a prediction off costs the compute thread something too (the worth test, keeping its state):
    what making it online saves must exceed only the difference. At even odds two 1 s copies are expected to
    save about 1 s: a prediction of 1.2 s does not pay, unless putting it off costs 0.5 s."""
    engine = FakeEngine()
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 1.2
    assert not s.worth_predicting(1, 1)
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 1.2
    s.put_off_took(0.5)
    assert s.online_cost_s() == 1.2 - 0.5 and s.worth_predicting(1, 1)


def test_a_missing_candidate_is_judged_by_how_often_missing_candidates_were_right():
    """Only candidates missing from the cache are sent, and with a large cache what a predictor gets
    right is mostly what the cache holds already: rank 0 is right half the time over all predictions,
    never when it was missing, so a missing rank-0 candidate is not worth a costly wrong guess."""
    engine = FakeEngine()
    engine.cache = SimpleNamespace(resident=lambda key: key[1] == 3, victim_regret=lambda: 0.0, spare=lambda layer: 0)
    engine.prefetch_cost_s = 0.5  # a wrong guess costs half a copy
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 10.0
    for i in range(40):  # rank 0: expert 3 (cached, picked) or expert 4 (missing, never picked)
        made = candidates([3, 5] if i % 2 else [4, 5])
        s.schedule(1, made, h=1)
        s.observe(7, made, {3})
    assert 0.45 < s.precision(7)[0] < 0.55 and s.missing_precision(7)[0] < 0.1
    engine.sent = []
    s.schedule(1, candidates([4, 5]), h=1)
    assert not any(engine.sent)


def test_a_prediction_whose_candidates_are_always_cached_is_not_worth_making():
    """The layer misses often, but the experts this predictor names are already cached whenever it is
    scheduled: its expected saving is what its missing candidates would save, which is near nothing."""
    engine = FakeEngine()
    engine.cache = SimpleNamespace(resident=lambda key: True, victim_regret=lambda: 0.0, spare=lambda layer: 0)
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.2
    for _ in range(40):
        made = candidates([3, 5])
        s.schedule(1, made, h=1)
        s.observe(7, made, {3, 5})
    assert s.missing_share(7)[0] < 0.1
    assert not s.worth_predicting(1, 1)
    s.missing_seen.clear()  # what is known without them: the layer's miss rate says every candidate misses
    s.missing_scored.clear()
    s.missing_recent.clear()
    s._verdict.clear()  # (observe() drops a layer's verdicts when its precisions change; these were changed by hand)
    s._off_left.clear()
    assert s.worth_predicting(1, 1)



def test_what_is_missing_is_read_from_the_recent_predictions():
    """The cache turns over in a request's first tokens: candidates missing then are cached a few tokens
    later. The missing share q follows the recent scheduled predictions (MISSING_MEMORY), so a prediction
    whose candidates have been cached for a dozen tokens is no longer worth making (the miss rate too low
    to turn it), where a share over every prediction would still read the first tokens' misses."""
    engine = FakeEngine()
    resident = {"now": False}
    engine.cache = SimpleNamespace(resident=lambda key: resident["now"], victim_regret=lambda: 0.0,
                                   spare=lambda layer: 0)
    engine.miss_rate = lambda layer: 0.05
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.2
    for cached in [False] * 8 + [True] * 12:  # eight predictions find both candidates missing, then twelve none
        resident["now"] = cached
        made = candidates([3, 5])
        s.schedule(1, made, h=1)
        s.observe(7, made, {3, 5})
    cumulative = 8 / 20
    assert s.missing_share(7)[0] < cumulative / 2
    assert not s.worth_predicting(1, 1)


def test_the_missing_share_s_prior_follows_the_miss_rate_as_it_falls():
    """A new engine's first decode token misses every use (miss rate 1), and its cache then holds what the
    predictor names: later candidates are all cached while the miss rate falls. q's prior is read at the rate as it
    stands, so a few predictions on it is near the rate, and the prediction is no longer worth making; a prior
    frozen at the first prediction's rate read a third of the candidates missing four predictions on (the VL model
    at a 50 % cache kept predicting online for nothing)."""
    engine = FakeEngine()
    engine.cache = SimpleNamespace(resident=lambda key: True, victim_regret=lambda: 0.0, spare=lambda layer: 0)
    rate = {"now": 1.0}
    engine.miss_rate = lambda layer: rate["now"]
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.2
    for miss in (1.0, 0.3, 0.1, 0.05):
        rate["now"] = miss
        made = candidates([3, 5])
        s.schedule(1, made, h=1)
        s.observe(7, made, {3, 5})
    prior = 2 * (7 / 8) ** 4  # PRIOR_WEIGHT predictions, faded four times
    predictions = prior + sum((7 / 8) ** i for i in range(4))
    assert s.missing_share(7) == pytest.approx([0.05 * prior / predictions] * 2)
    assert not s.worth_predicting(1, 1)
    rate["now"] = 1.0  # the cache emptied (as Engine.clear_cache leaves it): the prior reads every candidate missing
    assert s.missing_share(7) == pytest.approx([prior / predictions] * 2)


def test_the_worth_test_queues_only_the_candidates_that_are_sent():
    """A prediction whose first candidate is always cached and second always missing and right, with a copy
    longer than the lead: schedule sends the second at once (nothing is queued before it), which hides most
    of its copy, so the prediction is worth making. Counting every rank before it as queued (a copy's time
    each) credited it with nothing and put such predictions off (Qwen3-30B-A3B shapes on the A100: 1.5 %
    of TPOT)."""
    engine = FakeEngine()
    engine.cache = SimpleNamespace(resident=lambda key: key == (7, 3), victim_regret=lambda: 0.0,
                                   spare=lambda layer: 0)
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 0.8, 0.05  # lead 0.8 s of a 1 s copy
    for _ in range(12):
        made = candidates([3, 5])
        engine.sent.clear()
        s.schedule(1, made, h=1)
        assert engine.sent == [[5]]
        s.observe(7, made, {3, 5})
    assert s.missing_share(7)[0] < 0.1 and s.missing_share(7)[1] > 0.9
    assert s.worth_predicting(1, 1)

def test_a_verdict_stands_until_an_observation_changes_the_precisions():
    """worth_predicting judges a layer once and keeps the answer (it runs at every layer of every token);
    scoring a prediction for that layer, and only that, makes it judge again."""
    engine = FakeEngine()
    engine.layers[0] = SimpleNamespace(index=6, top_k=2)  # sparse layers 6 and 7
    engine.cache = SimpleNamespace(resident=lambda key: key[1] == 3, victim_regret=lambda: 0.0, spare=lambda layer: 0)
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.2
    assert s.worth_predicting(1, 1)  # nothing known: every candidate misses, at even odds
    engine.prefetch_cost_s = 100.0  # what it rests on drifts (a wrong guess now costs more than a copy saves)
    assert s.worth_predicting(1, 1)
    made = candidates([3, 5])
    s.schedule(0, made, h=1)
    s.observe(6, made, {3})  # another layer's precisions changed
    assert s.worth_predicting(1, 1)
    s.schedule(1, made, h=1)
    s.observe(7, made, {3})
    assert not s.worth_predicting(1, 1)


def test_a_verdict_to_put_off_stands_until_the_next_exploring_ask():
    """A put-off verdict is not judged again at every layer of every token (that cost the hot path as much as the
    rest of putting a prediction off): it stands until the layer's next ask that may explore (one in
    EXPLORE_EVERY), until its precisions change (observe), or until the engine forgets (clear_cache); a new request
    keeps it, as it keeps the layer time it rests on."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    engine = FakeEngine()  # 1 s per copy
    engine.miss_rate = lambda layer: 1.0

    def scheduler():
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s, s.predict_s = 10.0, 2.0  # no prediction could pay
        assert not s.worth_predicting(1, 1)
        s.predict_s = 0.01  # now any would
        return s

    s = scheduler()
    made = [s.worth_predicting(1, 1) for _ in range(EXPLORE_EVERY)]  # asks 2 .. EXPLORE_EVERY + 1
    assert made == [False] * (EXPLORE_EVERY - 2) + [True, True]
    s = scheduler()
    s.observe(7, candidates([3, 5]), {3})
    assert s.worth_predicting(1, 1)
    s = scheduler()
    s.new_request()
    assert not s.worth_predicting(1, 1)
    s.forget()
    s.layer_s = 10.0
    assert s.worth_predicting(1, 1)


def test_a_token_is_quiet_while_every_layer_s_verdict_to_put_off_stands():
    """put_off_all, at a decode token's start: whether every layer's verdict to put off stands, so the driver need
    ask nothing in the token (a quiet token); if so, each verdict stands one ask less, as if asked. Each layer is
    asked once a token, answered or not (as before a layer time is measured), so the verdicts end at one token
    and the tokens between are all quiet."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    engine = FakeEngine()
    engine.layers = [SimpleNamespace(index=3, top_k=2), SimpleNamespace(index=7, top_k=2)]
    s = PrefetchScheduler(engine, budget=2)
    s.predict_s = 2.0  # only a perfect prediction would break even: put off, judged again every EXPLORE_EVERY asks

    def token():  # position 0 predicts position 1 (layer 7), position 1 the next token's first (layer 3)
        return [s.worth_predicting(1, 1), s.worth_predicting(0, 1)]

    assert not s.put_off_all() and s.worth_predicting(1, 1)  # the first token: no layer time yet, made online
    s.layer_s = 10.0
    assert not s.worth_predicting(0, 1)
    assert not s.put_off_all() and token() == [False, False]  # layer 7 judged now
    quiet = [s.put_off_all() for _ in range(EXPLORE_EVERY - 2)]
    assert quiet == [True] * (EXPLORE_EVERY - 3) + [False]
    assert token() == [False, False]  # both judged again, at the same ask
    assert [s.put_off_all() for _ in range(EXPLORE_EVERY)] == [True] * (EXPLORE_EVERY - 1) + [False]


def test_an_online_prediction_is_charged_the_quiet_token_it_rules_out():
    """Where every other layer's verdict is to put off, a prediction made online is all that keeps its token from
    being quiet: the token's other layers then put theirs off one by one (put_off_s each), where a quiet token
    costs about one put-off. online_cost_s charges that, only then, and only where the driver makes quiet
    tokens (not while a layer is unjudged, nor in a mode that speculates)."""
    engine = FakeEngine()
    engine.layers = [SimpleNamespace(index=i, top_k=2) for i in (3, 5, 7)]
    s = PrefetchScheduler(engine, budget=2)
    s.predict_s, s.put_off_s, s.quiet_possible = 1.0, 0.25, True
    assert s.online_cost_s() == s.online_cost_s(7) == 0.75  # layers 3 and 5 not judged yet
    s._verdict_off.update({3: True, 5: False, 7: False})
    assert s.online_cost_s(7) == 0.75  # layer 5 goes online anyway
    s._verdict_off[5] = True
    assert s.online_cost_s(7) == 0.75 + 2 * 0.25 and s.online_cost_s(3) == 0.75
    s.quiet_possible = False
    assert s.online_cost_s(7) == 0.75


def test_a_prediction_even_a_perfect_one_could_not_pay_for_is_explored_rarely():
    """A candidate saves at most its copy (t): where every candidate right and missing would still save less
    than the prediction costs, precision cannot change the verdict, only a cheaper prediction can, so one in
    EXPLORE_EVERY² is made online (to measure its cost); a prediction that could pay with better precision is
    explored once in EXPLORE_EVERY."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    engine = FakeEngine()  # 1 s per copy
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 10.0
    s.predict_s = 2.0  # two copies' worth: only a perfect prediction breaks even, so none pays
    made = [s.worth_predicting(1, 1) for _ in range(2 * EXPLORE_EVERY ** 2)]
    assert sum(made) == 2 and made[EXPLORE_EVERY ** 2 - 1]
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 1.9  # a perfect prediction would pay; one at even odds does not
    made = [s.worth_predicting(1, 1) for _ in range(3 * EXPLORE_EVERY)]
    assert sum(made) == 3 and made[EXPLORE_EVERY - 1]



def test_a_verdict_no_precision_could_turn_at_twice_the_saving_is_judged_rarely(monkeypatch):
    """Where every candidate right and missing would save under half what the prediction costs, the verdict to
    put it off stands EXPLORE_EVERY² asks, not EXPLORE_EVERY: on a fast link the tokens that judge verdicts cost
    the most, and what this one weighs drifts slowly. Its exploring asks stay where they were."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    engine = FakeEngine()  # 1 s per copy, every use missing: any prediction saves at most 2 s
    judged = []
    most_saved = PrefetchScheduler._most_saved
    monkeypatch.setattr(PrefetchScheduler, "_most_saved", lambda self, *a: judged.append(1) or most_saved(self, *a))
    made = {}
    for cost in (2.0, 5.0):
        judged.clear()
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s, s.predict_s = 10.0, cost
        made[cost] = [s.worth_predicting(1, 1) for _ in range(2 * EXPLORE_EVERY ** 2)]
        made[cost] = (sum(made[cost]), len(judged))
    rarely = EXPLORE_EVERY ** 2
    assert made[5.0] == (2, 4)  # judged at asks 1, rarely (explored), rarely + 1 and 2 · rarely (explored)
    assert made[2.0] == (2, 2 * rarely // EXPLORE_EVERY + 2)  # every EXPLORE_EVERY asks, and after each exploring


def test_what_any_prediction_could_save_counts_the_layer_s_misses_and_what_issuing_a_prefetch_costs():
    """A right candidate saves at most a copy (1 s) but issuing it costs the compute thread 0.6 s beyond the 0.1 s
    demand load it spares, and only candidates the layer uses and lacks save anything: top-k times its miss rate.
    Missing 30 % of its uses, the layer stands to gain at most 0.6 · (1 − 0.6 + 0.1) = 0.3 s from any prediction,
    less than the 0.5 s one costs online: precision cannot turn that, so one in EXPLORE_EVERY² is made online
    (budget · t alone, 2 s, left it to the precisions: an unsure no, explored one in EXPLORE_EVERY). Missing every
    use, this prediction pays (0.78 s expected): made online, put off one in EXPLORE_EVERY to measure stall_off."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    made = {}
    for miss in (0.3, 1.0):
        engine = FakeEngine()
        engine.prefetch_cost_s, engine.demand_cost_s = 0.6, 0.1
        engine.miss_rate = lambda layer, miss=miss: miss
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s, s.predict_s, s.put_off_s = 10.0, 0.6, 0.1
        s.seen[7], s.picked[7] = 100, [90, 90]  # right nine times in ten
        made[miss] = sum(s.worth_predicting(1, 1) for _ in range(EXPLORE_EVERY ** 2 - 1))
    assert made == {0.3: 0, 1.0: EXPLORE_EVERY ** 2 - 1 - EXPLORE_EVERY}


def decode_steps(s, engine, steps, stall_put_off, stall_online=0.0, chosen=frozenset({3, 4})):
    """The driver's calls over `steps` decode steps of two sparse layers (positions 0 and 1, layer 1 predicted at
    layer 0's router): layer 1's step stalls `stall_put_off` seconds when its prediction was put off, else
    `stall_online` (`stall_put_off` a list: one per put-off step, in order), and an online prediction [3, 5] is
    scored at its router, which chose `chosen` (half right by default). Returns worth_predicting's answers."""
    answers, now, stalls_put_off = [], 0.0, iter(stall_put_off if isinstance(stall_put_off, list) else ())
    for _ in range(steps):
        s.layer_at(0, now, engine.stalled_s, 0)
        online = s.worth_predicting(1, 1)
        answers.append(online)
        made = candidates([3, 5])
        if online:
            s.schedule(1, made, h=1)
        now += 1.0
        s.layer_at(1, now, engine.stalled_s, 0)
        if online:
            s.observe(7, made, set(chosen))
        stall = stall_online if online else next(stalls_put_off, stall_put_off)
        engine.stalled_s += stall
        now += 1.0 + stall
    return answers


def test_a_prediction_saves_at_most_what_its_layer_stalls_with_it_put_off():
    """The rule credits each right, missing candidate with its copy's time, but demand copies overlap the
    compute of the layer's other experts, so on-demand stalls less (on ufs4, tiny-qwen3-moe: 0.1 ms a layer
    against 0.14-0.22 ms credited). The stall of the steps whose prediction was put off caps the saving: a
    0.6 s prediction expected to save 1 s is not made where putting it off stalls 0.3 s (and, since no
    precision could then make it pay, is explored online only one in EXPLORE_EVERY²), and is where it stalls
    3 s."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    for stall, made_online in ((0.3, False), (3.0, True)):
        engine = FakeEngine()
        engine.miss_rate = lambda layer: 1.0
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s, s.predict_s = 10.0, 0.6
        answers = decode_steps(s, engine, 6 * EXPLORE_EVERY, stall)
        assert s.stall_off[7] == pytest.approx(stall)  # the put-off steps' stall only (online ones stalled nothing)
        late = answers[3 * EXPLORE_EVERY:]  # (stall_off caps the saving once it rests on STALL_OFF_AFTER steps)
        if made_online:
            assert all(late)  # sure (3 s is over twice what it must save): the next put off is one in EXPLORE_EVERY²
        else:
            assert not any(late)


def test_one_put_off_step_that_stalled_nothing_does_not_put_a_layer_off():
    """One step stalls anything from nothing (every expert resident) to several copies: a lone zero must not put
    off a layer whose other put-off steps stall 3 s (on the SD card such a zero put layers off for a dozen steps,
    each a copy's stall). stall_off caps the saving, or vetoes the prediction, once it rests on STALL_OFF_AFTER
    steps."""
    from evalsuite.engine.worth import EXPLORE_EVERY, STALL_OFF_AFTER

    engine = FakeEngine()
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.6
    answers = decode_steps(s, engine, 2 * EXPLORE_EVERY, stall_put_off=[0.0] + [3.0] * 8)
    put_off = [i + 1 for i, online in enumerate(answers) if not online]
    assert put_off == [EXPLORE_EVERY // 2, EXPLORE_EVERY + EXPLORE_EVERY // 2]  # the measuring ones only
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.6
    answers = decode_steps(s, engine, (STALL_OFF_AFTER + 2) * EXPLORE_EVERY, stall_put_off=0.0)
    assert not any(answers[(STALL_OFF_AFTER + 1) * EXPLORE_EVERY:])  # nothing, every time: put off


def test_a_layer_that_must_stall_with_its_prediction_put_off_is_not_put_off_to_measure_it():
    """Where a copy outlasts a layer's compute (the SD card), the layer's expected demand misses stall it at least
    their copies less all the compute they could overlap: 2 misses of a 1 s copy against 1 s layers stall 1 s or
    more, over twice what a 0.1 s prediction must save, so after a first put-off step that happened to stall nothing
    the layer is sure to pay from the start and no step is put off to measure stall_off (each such step costs a
    copy's stall) before the one-in-EXPLORE_EVERY² one. At half the miss rate nothing bounds it: stall_off is
    measured, and after a first step that stalled nothing, again EXPLORE_EVERY asks later."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    put_off = {}
    for miss in (1.0, 0.5):
        engine = FakeEngine()
        engine.miss_rate = lambda layer, miss=miss: miss
        s = PrefetchScheduler(engine, budget=2)
        s.layer_s, s.predict_s = 1.0, 0.1
        answers = decode_steps(s, engine, 3 * EXPLORE_EVERY, stall_put_off=[0.0] + [3.0] * 8)
        put_off[miss] = [i + 1 for i, online in enumerate(answers) if not online]
    assert put_off == {1.0: [], 0.5: [EXPLORE_EVERY // 2, EXPLORE_EVERY + EXPLORE_EVERY // 2]}


def test_the_stall_with_a_prediction_put_off_is_measured_often_only_while_it_could_turn_the_verdict():
    """A layer whose prediction pays is put off one step in EXPLORE_EVERY to measure stall_off, until that
    stall is known to be over twice what the prediction must save; then one in EXPLORE_EVERY²."""
    from evalsuite.engine.worth import EXPLORE_EVERY

    engine = FakeEngine()
    engine.miss_rate = lambda layer: 1.0
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s, s.predict_s = 10.0, 0.6
    answers = decode_steps(s, engine, EXPLORE_EVERY ** 2 + EXPLORE_EVERY, stall_put_off=3.0)
    put_off = [i + 1 for i, online in enumerate(answers) if not online]  # which worth_predicting call it was
    assert put_off == [EXPLORE_EVERY // 2, EXPLORE_EVERY ** 2 - EXPLORE_EVERY // 2]
    s = PrefetchScheduler(engine, budget=2, smoothing=0.0)  # (layer time held at 10 s: both land in time)
    s.layer_s, s.predict_s = 10.0, 0.6
    # both candidates right: pays (each saves half the step's 1 s stall), but under twice 0.6 s
    answers = decode_steps(s, engine, 3 * EXPLORE_EVERY, stall_put_off=1.0, chosen={3, 5})
    assert [i + 1 for i, online in enumerate(answers) if not online] == [EXPLORE_EVERY * k + EXPLORE_EVERY // 2
                                                                        for k in range(3)]
