"""The decode simulator: exact answers on traces small enough to work out by hand."""
import math

import pytest

from evalsuite.perf.simulate import Costs, gap_closed, overlap_bound, simulate
from evalsuite.perf.trace import LayerRouting, RoutingTrace, synthetic_trace

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


def test_a_perfect_prefetch_hides_transfers_behind_compute():
    slow_compute = Costs(dense_s=10.0, expert_s=1.0, step_s=0.0, transfer_s=1.0)
    steps = [[[2 * s % 16, (2 * s + 1) % 16], [(2 * s + 8) % 16, (2 * s + 9) % 16]] for s in range(6)]
    trace = trace_of(steps, predicted=[[None, step[1]] for step in steps])
    on_demand = simulate(trace, slow_compute, capacity=8, mode="on-demand")
    preserving = simulate(trace, slow_compute, capacity=8, mode="router-preserving")
    oracle = simulate(trace, slow_compute, capacity=8, mode="oracle")
    resident = simulate(trace, slow_compute, capacity=8, mode="resident")
    # layer 1's experts are prefetched during layer 0; only layer 0 (never predicted) waits
    assert preserving.tpot_s == pytest.approx(oracle.tpot_s)
    assert preserving.exposed_transfer_s == pytest.approx(on_demand.exposed_transfer_s / 2)
    assert resident.tpot_s < preserving.tpot_s < on_demand.tpot_s


def test_a_demand_load_overtakes_queued_prefetches():
    # Layer 0 prefetches 4 wrong experts for layer 1 (window off); layer 1's demand loads must
    # wait only for the copy already on the link, not the whole queue.
    costs = Costs(dense_s=0.0, expert_s=0.0, step_s=0.0, transfer_s=1.0)
    trace = trace_of([[[0], [1]]], top_k=1, predicted=[[None, [5, 6, 7, 8]]])
    p = simulate(trace, costs, capacity=8, mode="router-preserving", budget=4, window=False)
    # t=0: layer 0's demand for 0 starts (lands 1), then prefetches 5, 6, 7, 8 queue behind it;
    # at t=1 expert 0 computes and prefetch 5 starts; layer 1's demand for 1 (t=1) overtakes
    # 6, 7 and 8 but waits for 5 on the link: lands at 3.
    assert p.tpot_s == pytest.approx(3.0)


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


def test_synthetic_traces_have_the_asked_reuse_and_recall():
    trace = synthetic_trace(experts=64, top_k=4, layers=6, steps=400, reuse=0.4, recall=0.7, seed=1)
    assert trace.recall() == pytest.approx(0.7, abs=0.03)
    # kept experts plus chance re-draws of the others
    assert trace.reuse() == pytest.approx(0.4 + 0.6 * 4 / 64, abs=0.03)
    assert all(len(r.native) == 4 and len(set(r.native)) == 4 for step in trace.steps for r in step)
    assert not math.isnan(simulate(trace, COSTS, capacity=40, mode="speculative").tpot_s)


def test_a_prefill_leaves_its_experts_in_the_cache():
    trace = trace_of([[[0, 1]]])
    cold = simulate(trace, COSTS, capacity=4, mode="on-demand")
    trace.prefills = [(0, [[0, 1, 2]])]
    warm = simulate(trace, COSTS, capacity=4, mode="on-demand")
    assert cold.transfers_per_token == 2 and warm.transfers_per_token == 0 and warm.hit_rate == 1.0
    trace.prefills = [(0, [[0, 1, 2, 3, 4, 5]])]  # 0 and 1 were evicted by later prefill experts
    assert simulate(trace, COSTS, capacity=4, mode="on-demand").transfers_per_token == 2
