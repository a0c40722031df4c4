"""What `evalsuite bench` measures of this machine's costs (evalsuite.perf.costs): a prediction's, the
bookkeeping per expert use, starting a copy, the link's timing, and the compute's speed."""
import copy

import pytest
import torch

import evalsuite
from evalsuite.engine.arch import sparse_layers

from .helpers import LINK_KINDS, reference_model, use_link_kind


def test_the_cost_of_a_prediction_is_measured_on_predictions_made_now(monkeypatch):
    # with every expert cached, the scheduler's window would leave most predictions for after the request, and
    # their cost (what the replay and the simulator charge per prediction made) would not be in the decode time
    from evalsuite.perf import costs as costs_module

    engines, offload = [], costs_module.offload

    def recording(*args, **kwargs):
        engine = offload(*args, **kwargs)
        engines.append(engine)
        return engine

    monkeypatch.setattr(costs_module, "offload", recording)
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    costs_module._warm_tpot(model, ids, 6, "router-preserving", "gate", None)
    (engine,) = engines
    assert engine.driver.put_off == 0 and engine.record.counters  # every decode prediction was made on the spot
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity="all") as windowed:
        for _ in range(2):
            model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert windowed.driver.put_off > 0  # what the window does with such a cache


def test_a_prediction_costs_at_least_the_call_the_engine_times():
    from evalsuite.perf.costs import measure_costs

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    _, cases, _ = measure_costs(model, ids, 5, 1, predicting=[("gate", "router-preserving", "gate", None)])
    assert cases["gate"]["call"] > 0 and cases["gate"]["per_prediction"] >= cases["gate"]["call"]


def test_a_prediction_costs_what_the_driver_spends_on_it_not_a_difference_of_two_tpots(monkeypatch):
    """A difference of two warm TPOTs carries both runs' noise; what a prediction costs is the driver's own work
    timed around it. The difference stays beside it as a check, shared by a prediction at every sparse layer
    (the last one predicts the next token's first)."""
    from evalsuite.perf import costs as costs_module

    def warm(model, ids, tokens, mode, predictor, artifact, clocked=False):  # on-demand 10 ms a step, gate 2 more
        return costs_module.Warm(0.010, per_use_s=1e-4) if predictor is None else costs_module.Warm(0.012, 1e-4, 3e-4)

    monkeypatch.setattr(costs_module, "_warm_tpot", warm)
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    layers = len(sparse_layers(model))
    _, cases, _ = costs_module.measure_costs(model, ids, 3, 1, predicting=[("gate", "router-preserving", "gate", None)])
    assert cases["gate"]["per_prediction"] == pytest.approx(0.0003)
    assert cases["gate"]["step_extra"] == pytest.approx(0.002 / layers)


def test_the_bookkeeping_per_use_is_the_experts_clocked_time_at_one_machine_speed(monkeypatch):
    """Not the difference of two whole TPOTs: a warm run the machine slowed to a second a step would have read as
    bookkeeping at every use. The experts' clocked time per use, the warm run's at the resident run's speed."""
    from evalsuite.perf import costs as costs_module

    warm = costs_module.Warm
    assert costs_module._per_use_overhead(warm(0.5, per_use_s=2.2e-3, attention_s=2e-3), 1e-3, 1e-3) == \
        pytest.approx(0.1e-3)  # at half speed: 1.1 ms a use at the resident run's
    assert costs_module._per_use_overhead(warm(0.5, per_use_s=1.2e-3), 1e-3, None) == pytest.approx(0.2e-3)  # no probe
    monkeypatch.setattr(costs_module, "_warm_tpot", lambda *args, **kwargs: warm(1.0, per_use_s=0.0))
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    costs, _, _ = costs_module.measure_costs(model, ids, 4, 1)
    assert costs.lookup_s == 0.0


def test_the_cost_of_starting_a_copy_is_measured_against_warm_on_demand_whatever_the_cases(monkeypatch):
    """A cold engine's TPOT minus a warm on-demand engine's (same kernel, no copy), minus its stall, per copy: not
    minus another case's warm TPOT, such as the oracle's with its look-ahead pass, which would leave it at 0."""
    from evalsuite.perf import costs as costs_module

    def warm(model, ids, tokens, mode, predictor, artifact, clocked=False):  # on-demand free, the oracle 1 s a step
        return costs_module.Warm(0.0, per_use_s=0.0) if predictor is None else costs_module.Warm(1.0)

    monkeypatch.setattr(costs_module, "_warm_tpot", warm)
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    costs, _, _ = costs_module.measure_costs(model, ids, 4, 1,
                                             predicting=[("oracle prefetch", "router-preserving", "oracle", None)])
    assert costs.miss_s > 0  # every compute-thread second of the cold engine's step, shared by its copies


@pytest.mark.parametrize("mode", ["router-preserving", "speculative"])
def test_the_driver_clock_times_one_prediction_per_sparse_layer_of_every_decode_step(mode):
    from evalsuite.perf.costs import DriverClock

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    tokens, layers = 5, len(sparse_layers(model))
    with evalsuite.offload(model, mode=mode, predictor="gate", cache_capacity="all", window=False) as engine:
        clock = DriverClock(engine)
        model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        clock.close()
        assert clock.predictions == (tokens - 1) * layers  # decode steps only: the prefill's are not timed
        assert clock.seconds > 0 and clock.per_prediction() == clock.seconds / clock.predictions
        assert "on_router" not in vars(engine.driver) and "release_prefetch" not in vars(engine.driver)
        model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        assert clock.predictions == (tokens - 1) * layers  # closed: no longer counting


def test_the_driver_clock_counts_the_predictions_made_not_those_put_off():
    from evalsuite.perf.costs import DriverClock

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    tokens, layers = 8, len(sparse_layers(model))
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity="all") as engine:
        for _ in range(2):  # a warm cache: nothing to prefetch, so the window puts most predictions off
            model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        before, clock = engine.driver.put_off, DriverClock(engine)
        model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        clock.close()
        put_off = engine.driver.put_off - before
        assert put_off > 0 and clock.predictions == (tokens - 1) * layers - put_off


@pytest.mark.parametrize("kind", LINK_KINDS)
def test_the_link_a_replay_reads_is_timed_by_the_engine_not_taken_from_its_figure(kind, monkeypatch):
    # the worker's wake-ups and sleep overshoots make every emulated copy longer than the link's figure (the
    # lazy link keeps the figure), and issuing a prefetch costs the compute thread something; the replayed
    # scheduler decides on both
    use_link_kind(monkeypatch, kind)
    from evalsuite.engine.link.profiles import parse_link
    from evalsuite.perf.costs import link_costs

    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with evalsuite.offload(model, mode="on-demand") as engine:
        nominal = parse_link("sdcard").seconds(engine.layout.nbytes)
    transfer_s, prefetch_s = link_costs(model, ids, 4, "sdcard")
    if kind == "worker":
        assert nominal < transfer_s < 2 * nominal
    else:
        assert transfer_s == pytest.approx(nominal, rel=1e-9)
    assert 0 < prefetch_s < nominal


def test_the_speed_probe_times_only_attention_with_no_wait_since_the_last():
    """The work right after a wait for a copy runs slower on a CPU whatever its speed: an attention that follows a
    wait (the engine's total stall moved by AFTER_WAIT_S or more since the attention before) is not timed, one
    after a wait for a copy already landed (microseconds) is; a prefill's is never."""
    from types import SimpleNamespace

    from evalsuite.perf.costs import SpeedProbe

    attentions = [torch.nn.Identity() for _ in range(3)]
    engine = SimpleNamespace(device=torch.device("cpu"), stalled_s=0.0, forward=SimpleNamespace(decoding=False),
                             layers=[SimpleNamespace(decoder_layer=SimpleNamespace(self_attn=a)) for a in attentions])
    probe = SpeedProbe(engine)
    x = torch.zeros(1)
    for a in attentions:  # a prefill that waited before each layer
        engine.stalled_s += 1.0
        a(x)
    engine.forward.decoding = True
    waits = [True, False, False, True, False, True]  # before each decode attention, 2 steps of 3 layers
    for a, wait in zip(attentions * 2, waits):
        engine.stalled_s += 1.0 if wait else 2e-6
        a(x)
    assert len(probe.seconds) == waits.count(False) == 3
    assert probe.median() is not None and not attentions[0]._forward_hooks  # median() removes the hooks
