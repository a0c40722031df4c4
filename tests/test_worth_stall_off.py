"""The worth test's cap (evalsuite.engine.prediction.worth): a prediction saves at most what its layer stalls with it put
off (stall_off), measured on put-off steps, once it rests on STALL_OFF_AFTER of them."""
import pytest

from evalsuite.engine.prediction.scheduler import PrefetchScheduler

from .scheduler_fakes import FakeEngine, candidates


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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY, STALL_OFF_AFTER

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
    from evalsuite.engine.prediction.worth import EXPLORE_EVERY

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
