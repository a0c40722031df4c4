"""The worth test (evalsuite.engine.prediction.worth): a decode prediction is made online only where its candidates'
expected saving, weighed by how often each rank's is missing (q) and right (pm), exceeds what making it online
costs beyond putting it off; verdicts stand until their precisions change, and are explored now and then."""
from types import SimpleNamespace

import pytest

from evalsuite.engine.prediction.scheduler import PrefetchScheduler

from .scheduler_fakes import FakeEngine, candidates


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


def test_a_prediction_put_off_counts_its_missing_candidates_as_a_scheduled_one_would():
    """pm and q must not rest on the few predictions made online where most are put off (a large cache, a fast
    link): one put off is scored when its request ends against the experts the cache held when it was put off
    (`resident`, bits), and counts exactly as the same prediction scheduled against that cache would."""
    def held(experts):
        return SimpleNamespace(resident=lambda key: key[1] in experts, victim_regret=lambda: 0.0,
                               spare=lambda layer: 0)

    scheduled_engine, put_off_engine = FakeEngine(), FakeEngine()
    scheduled, put_off = PrefetchScheduler(scheduled_engine, budget=2), PrefetchScheduler(put_off_engine, budget=2)
    for order, cached, chosen in [([3, 5], {3}, {3, 5}), ([4, 5], {5}, {1, 2}), ([4, 6], set(), {4, 1}),
                                  ([2, 3], {2, 3}, {2, 3})]:
        scheduled_engine.cache = held(cached)
        made = candidates(order)
        scheduled.schedule(1, made, h=1)
        scheduled.observe(7, made, chosen)
        put_off.observe(7, candidates(order), chosen, resident=sum(1 << e for e in cached))
    assert put_off.missing_seen == scheduled.missing_seen == {7: [2, 2]}
    assert put_off.missing_picked == scheduled.missing_picked == {7: [1, 1]}
    assert put_off.missing_scored == scheduled.missing_scored == {7: 4}
    assert put_off.missing_recent == scheduled.missing_recent
    assert put_off.missing_precision(7) == scheduled.missing_precision(7)
    # a prediction neither scheduled nor put off with what the cache held (nothing known of what was missing)
    # adds to each rank's precision only
    put_off.observe(7, candidates([4, 6]), {4})
    assert put_off.missing_seen == {7: [2, 2]} and put_off.missing_scored == {7: 4} and put_off.seen == {7: 5}


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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
