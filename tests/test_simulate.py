"""The decode simulator: exact answers on traces small enough to work out by hand."""
import math

import pytest

from evalsuite.perf.simulate import Costs, gap_closed, overlap_bound, simulate
from evalsuite.perf.synthetic import synthetic_trace
from evalsuite.engine.trace import LayerRouting, RoutingTrace

COSTS = Costs(dense_s=1.0, expert_s=0.5, step_s=2.0, transfer_s=3.0)


def trace_of(steps, experts=16, top_k=2, predicted=None):
    """steps: per step, per layer, the native experts; predicted: same shape (None for layer 0)."""
    out = RoutingTrace(list(range(len(steps[0]))), experts, top_k)
    for s, step in enumerate(steps):
        out.steps.append([LayerRouting(list(native), list(native),
                                       None if predicted is None else predicted[s][pos])
                          for pos, native in enumerate(step)])
    return out


def test_resident_is_the_sum_of_compute():
    trace = trace_of([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    p = simulate(trace, COSTS, capacity=4, mode="resident")
    assert p.tpot_s == pytest.approx(2 * (1.0 + 2 * 0.5) + 2.0)
    assert p.exposed_transfer_s == 0 and p.hit_rate == 1.0 and p.transfers_per_token == 0


def test_on_demand_waits_for_each_copy_and_overlaps_the_next():
    # One layer, two misses queued together: expert 0 lands at 1+3, computes 0.5 while expert 1
    # is still on the link (lands at 1+6), which then computes 0.5: layer ends at 7.5, step at 9.5.
    trace = trace_of([[[0, 1]]])
    p = simulate(trace, COSTS, capacity=2, mode="on-demand")
    assert p.tpot_s == pytest.approx(9.5)
    assert p.exposed_transfer_s == pytest.approx(3.0 + 2.5)
    assert p.transfers_per_token == 2 and p.hit_rate == 0.0


def test_starting_a_copy_takes_compute_time_before_the_link_starts_it():
    # dense 1 s, then 1 s placing the copy (miss_s) before the link starts it: it lands at 2 + 3, so the
    # compute waits 3 s, computes 0.5 and the step ends at 5.5 + 2 (started first, it would wait 2 s)
    costs = Costs(dense_s=1.0, expert_s=0.5, step_s=2.0, transfer_s=3.0, miss_s=1.0)
    p = simulate(trace_of([[[0]]], top_k=1), costs, capacity=2, mode="on-demand")
    assert p.exposed_transfer_s == pytest.approx(3.0)
    assert p.tpot_s == pytest.approx(7.5)


def test_cached_experts_are_hits_and_cost_no_transfer():
    trace = trace_of([[[0, 1]], [[0, 1]]])
    p = simulate(trace, COSTS, capacity=2, mode="on-demand")
    assert p.hit_rate == 0.5 and p.transfers_per_token == 1.0
    assert p.tpot_s == pytest.approx((9.5 + 1.0 + 1.0 + 2.0) / 2)


def test_lru_evicts_the_least_recently_used():
    # capacity 2, top-1: 0, 1, 0, 2 (evicts 1), 1 (miss again), 0 (evicted by 1? no: 2 was newer)
    trace = trace_of([[[0]], [[1]], [[0]], [[2]], [[1]], [[0]]], top_k=1)
    p = simulate(trace, COSTS, capacity=2, mode="on-demand")
    # misses: 0, 1, 2, 1, 0 -> hits only at step 3
    assert p.transfers_per_token == pytest.approx(5 / 6)


@pytest.mark.parametrize("miss_s", [0.0, 0.5])
def test_perfect_prefetch_reaches_the_bound_within_the_pipeline_start_when_copies_fit_compute(miss_s):
    # every layer's two misses take 6 s of link, its compute 12 s: perfect prediction hides them
    # all but the very first layer's (nothing predicts the first token's first layer). Starting a
    # copy costs the compute thread `miss_s` whoever starts it: the bound counts it (2 s a step here)
    slow_compute = Costs(dense_s=10.0, expert_s=1.0, step_s=0.0, transfer_s=3.0, chunk_s=1.0, miss_s=miss_s)
    steps = [[[2 * s % 16, (2 * s + 1) % 16], [(2 * s + 8) % 16, (2 * s + 9) % 16]] for s in range(6)]
    trace = trace_of(steps)
    perfect = simulate(trace, slow_compute, capacity=8, mode="perfect-prefetch")
    bound = overlap_bound(trace, slow_compute, capacity=8)
    pipeline_start = 2 * 3.0 / len(steps)  # the first layer's copies, once per trace
    assert bound <= perfect.tpot_s <= bound + pipeline_start
    on_demand = simulate(trace, slow_compute, capacity=8, mode="on-demand")
    assert gap_closed(on_demand.tpot_s, perfect.tpot_s, bound) > 0.8


def test_the_first_layer_is_prefetched_from_the_previous_token():
    # one sparse layer: its prediction for the next token goes on the link behind this token's loads
    trace = trace_of([[[0, 1]], [[2, 3]]], predicted=[[None], [[2, 3]]])
    on_demand = simulate(trace, COSTS, capacity=4, mode="on-demand")
    preserving = simulate(trace, COSTS, capacity=4, mode="router-preserving")
    # step 0 ends at 9.5 with 2 landed at 10 and 3 moving until 13; step 1 routes at 10.5, 2
    # computes at once, 3 at 13: 13.5, +2: 15.5; on demand step 1 waits until 13.5 and 16.5: 19
    assert preserving.tpot_s == pytest.approx(15.5 / 2)
    assert on_demand.tpot_s == pytest.approx(19.0 / 2)


def test_a_wrong_prefetch_is_cancelled_at_its_router_and_gives_its_slot_back():
    costs = Costs(dense_s=0.0, expert_s=0.0, step_s=0.0, transfer_s=1.0, chunk_s=0.01)
    trace = trace_of([[[0], [1]], [[0], [1]]], top_k=1, predicted=[[None, [5]], [None, [1]]])
    p = simulate(trace, costs, capacity=2, mode="router-preserving", window=False)
    # t=0: demand 0 lands at 1, prefetch 5 starts there; layer 1 routes at 1 and picks 1: 5 stops
    # after one chunk (1.01) and 1 lands at 2.01. 5's slot is free again, so 1 evicts nothing
    # and step 1 hits both.
    assert p.tpot_s == pytest.approx(2.01 / 2)
    assert p.cancelled_per_token == 0.5 and p.hit_rate == 0.5


def test_a_copy_landing_late_still_saves_the_part_done():
    # layer 0 always hits; layer 1's next expert takes 1 s of link and only 0.6 s of compute
    # separate the prediction from layer 1's router: the copy cannot land in time, but the rule
    # sends it (it saves 0.6 s of its 1 s) and the router promotes it, so each step waits 0.4 s
    costs = Costs(dense_s=0.5, expert_s=0.1, step_s=0.0, transfer_s=1.0, chunk_s=0.1)
    steps = [[[0], [8 + s % 8]] for s in range(8)]
    trace = trace_of(steps, top_k=1, predicted=[[None if s == 0 else [0], [8 + s % 8]] for s in range(8)])
    preserving = simulate(trace, costs, capacity=4, mode="router-preserving")
    on_demand = simulate(trace, costs, capacity=4, mode="on-demand")
    # step 0 also waits 1 s for layer 0's first copy; no prediction is put off to measure what the layer stalls
    # without one (the scheduler's stall_off): a 1 s copy against 0.6 s of compute is known to stall
    assert preserving.exposed_transfer_s == pytest.approx((1.0 + 8 * 0.4) / 8)
    assert on_demand.exposed_transfer_s == pytest.approx((1.0 + 8 * 1.0) / 8)


def test_an_unused_prefetch_is_evicted_before_any_used_expert():
    costs = Costs(dense_s=5.0, expert_s=0.5, step_s=0.0, transfer_s=1.0)
    # step 0 prefetches 2 for layer 1 (wrong, landed before its router: it stays, unused);
    # step 1's expert 3 then evicts it, not expert 0, which step 2 uses again
    trace = trace_of([[[0], [1]], [[3], [1]], [[0], [1]]], top_k=1, predicted=[[None, [2]], [None, [1]], [None, [1]]])
    p = simulate(trace, costs, capacity=3, mode="router-preserving")
    assert p.hit_rate == pytest.approx(3 / 6)


def test_the_eviction_policy_is_the_engines():
    # four layers cycled through a cache of six: LRU evicts each layer's experts just before
    # they come round again; least-stale keeps the layers about to run
    trace = trace_of([[[0, 1], [2, 3], [4, 5], [6, 7]]] * 6)
    lru = simulate(trace, COSTS, capacity=6, mode="on-demand")
    least_stale = simulate(trace, COSTS, capacity=6, mode="on-demand", policy="least-stale")
    assert lru.hit_rate == 0.0 and least_stale.hit_rate > 0.3
    # 'predicted' is least-stale wherever no prediction is pending, as in on-demand
    assert simulate(trace, COSTS, capacity=6, mode="on-demand", policy="predicted").hit_rate == least_stale.hit_rate
    assert overlap_bound(trace, COSTS, 6, policy="least-stale") < overlap_bound(trace, COSTS, 6)


@pytest.mark.parametrize("costs", [Costs(dense_s=1.0, expert_s=0.1, step_s=1.0, transfer_s=2.0),
                                   Costs(dense_s=1.0, expert_s=0.2, step_s=1.0, transfer_s=0.7),
                                   Costs(dense_s=2.0, expert_s=0.5, step_s=1.0, transfer_s=0.5)],
                         ids=["link-bound", "balanced", "compute-bound"])
@pytest.mark.parametrize("capacity", [16, 64])
def test_speculation_with_a_perfect_predictor_sends_everything_at_once(costs, capacity):
    trace = synthetic_trace(experts=32, top_k=4, layers=6, steps=24, reuse=0.4, recall=1.0, seed=0)
    on_demand = simulate(trace, costs, capacity, "on-demand").tpot_s
    speculative = simulate(trace, costs, capacity, "speculative").tpot_s
    bound = overlap_bound(trace, costs, capacity)
    assert speculative <= on_demand
    # every layer but the first executes what was sent a layer ahead, with no window test (the
    # first goes through the scheduler's rule, which sends nothing once the link is behind)
    assert gap_closed(on_demand, speculative, bound, min_gap=0.0) >= 0.8


def test_speculation_executes_the_prediction_from_the_second_layer():
    trace = trace_of([[[0, 1], [2, 3]]], predicted=[[None, [4, 5]]])
    p = simulate(trace, COSTS, capacity=4, mode="speculative")
    assert p.hit_rate == pytest.approx(0.5)  # 4 and 5 were prefetched, so they hit
    preserving = simulate(trace, COSTS, capacity=4, mode="router-preserving")
    assert preserving.hit_rate == 0.0 and preserving.transfers_per_token == 6  # 4, 5 fetched for nothing


def test_overlap_bound_takes_the_larger_of_compute_and_transfer_per_layer():
    trace = trace_of([[[0, 1], [2, 3]], [[0, 1], [4, 5]]])
    bound = overlap_bound(trace, COSTS, capacity=8)
    # step 1: both layers miss twice: max(2, 6) each; step 2: layer 0 hits: max(2, 0), layer 1: 6
    assert bound == pytest.approx(((6 + 6 + 2) + (2 + 6 + 2)) / 2)
    assert gap_closed(10.0, 8.0, 6.0) == pytest.approx(0.5)
    assert gap_closed(10.0, 8.0, 10.0) is None


def test_bad_arguments_are_refused():
    trace = trace_of([[[0, 1]]])
    with pytest.raises(ValueError, match="below top-k"):
        simulate(trace, COSTS, capacity=1, mode="on-demand")
    with pytest.raises(ValueError, match="unknown mode"):
        simulate(trace, COSTS, capacity=4, mode="turbo")


def test_predicted_reuse_is_the_share_of_a_layers_prediction_also_predicted_a_step_earlier():
    trace = trace_of([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]],
                     predicted=[[None, [2, 5]], [[0, 4], [2, 6]], [[0, 1], [6, 2]]])
    # layer 1: {2,5} -> {2,6} shares 1 of 2, {2,6} -> {6,2} 2 of 2; layer 0: {0,4} -> {0,1} 1 of 2
    assert trace.predicted_reuse() == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert trace_of([[[0, 1]], [[0, 1]]]).predicted_reuse() is None


@pytest.mark.parametrize("predicted_reuse", [None, 0.36, 0.5])
def test_synthetic_traces_carry_the_asked_predicted_reuse_with_the_same_recall_and_routing(predicted_reuse):
    trace = synthetic_trace(experts=64, top_k=4, layers=6, steps=400, reuse=0.4, recall=0.7, seed=1,
                            predicted_reuse=predicted_reuse)
    assert trace.recall() == pytest.approx(0.7, abs=0.02)
    assert trace.reuse() == pytest.approx(0.4 + 0.6 * 4 / 64, abs=0.02)
    # by default the predicted set is as sticky as the routing
    expected = trace.reuse() if predicted_reuse is None else predicted_reuse
    assert trace.predicted_reuse() == pytest.approx(expected, abs=0.02)
    assert all(len(set(r.native)) == 4 for step in trace.steps for r in step)
    assert all(len(set(r.predicted)) == 4 for step in trace.steps for r in step if r.predicted)
    assert not math.isnan(simulate(trace, COSTS, capacity=40, mode="speculative").tpot_s)
    # the routing is the seed's alone, so every prediction is replayed against the same one
    plain = synthetic_trace(experts=64, top_k=4, layers=6, steps=400, reuse=0.4, recall=0.7, seed=1)
    assert [[r.native for r in step] for step in trace.steps] == [[r.native for r in step] for step in plain.steps]


def test_a_predicted_reuse_out_of_reach_is_met_as_closely_as_the_model_allows():
    trace = synthetic_trace(experts=64, top_k=4, layers=6, steps=400, reuse=0.4, recall=0.7, seed=2,
                            predicted_reuse=0.9)
    reached = trace.meta["predicted_reuse_reached"]
    assert trace.meta["stickiness"] == 1.0 and reached < 0.9
    # it can be no stickier than its hits (the routing's kept experts) and all its wrong guesses
    assert reached < trace.reuse() + 0.3
    assert trace.predicted_reuse() == pytest.approx(reached, abs=0.02)


def test_a_stickier_prediction_makes_speculation_copy_less():
    kwargs = dict(experts=64, top_k=4, layers=6, steps=200, reuse=0.4, recall=0.7, seed=3)
    loose, sticky = (synthetic_trace(**kwargs, predicted_reuse=r) for r in (0.32, 0.5))
    copies = [simulate(t, COSTS, 96, "speculative").transfers_per_token for t in (loose, sticky)]
    assert copies[1] < 0.9 * copies[0]
    assert simulate(loose, COSTS, 96, "on-demand").tpot_s == simulate(sticky, COSTS, 96, "on-demand").tpot_s


def test_a_prefill_leaves_its_experts_in_the_cache():
    trace = trace_of([[[0, 1]]])
    cold = simulate(trace, COSTS, capacity=4, mode="on-demand")
    trace.prefills = [(0, [[0, 1, 2]])]
    warm = simulate(trace, COSTS, capacity=4, mode="on-demand")
    assert cold.transfers_per_token == 2 and warm.transfers_per_token == 0 and warm.hit_rate == 1.0
    trace.prefills = [(0, [[0, 1, 2, 3, 4, 5]])]  # 0 and 1 were evicted by later prefill experts
    assert simulate(trace, COSTS, capacity=4, mode="on-demand").transfers_per_token == 2


def test_the_bound_takes_a_prefill_layer_that_uses_more_experts_than_the_cache_holds():
    trace = trace_of([[[0, 1]], [[0, 1]]])
    trace.prefills = [(0, [list(range(6))])]  # the prompt's tokens ran six experts in the layer
    costs = Costs(dense_s=1.0, expert_s=0.0, step_s=0.0, transfer_s=10.0)
    # a cache of four: the prefill leaves experts 2..5, so the first step misses both, the second hits both
    assert overlap_bound(trace, costs, capacity=4) == pytest.approx((20.0 + 1.0) / 2)
