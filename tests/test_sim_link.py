"""The simulated link: chunked, preemptible, cancellable, as the engine's transfer worker serves copies."""
import pytest

from evalsuite.engine.serial_link import SerialLink


def test_a_demand_load_behind_a_long_prefetch_waits_at_most_one_chunk():
    link = SerialLink(transfer_s=1.0, chunk_s=0.01)
    prefetch = link.submit("p", 0.0, prefetch=True)
    demand = link.submit("d", 0.205, prefetch=False)  # 20.5 chunks into the prefetch
    assert link.finish(demand) == pytest.approx(0.21 + 1.0)  # the prefetch yields at 0.21
    assert link.finish(prefetch) == pytest.approx(2.0)  # and resumes where it stopped
    assert link.busy_s == pytest.approx(2.0)


def test_demand_goes_first_then_prefetches_in_order():
    link = SerialLink(transfer_s=1.0, chunk_s=1.0)
    first, second = link.submit("a", 0.0, prefetch=True), link.submit("b", 0.0, prefetch=True)
    demand = link.submit("c", 0.5, prefetch=False)
    assert [link.finish(c) for c in (demand, first, second)] == [2.0, 1.0, 3.0]


def test_cancel_drops_a_queued_copy_and_stops_a_moving_one_at_its_chunk_boundary():
    link = SerialLink(transfer_s=1.0, chunk_s=0.1)
    moving, queued = link.submit("a", 0.0, prefetch=True), link.submit("b", 0.0, prefetch=True)
    assert link.pending(0.35) == 2
    assert link.cancel(queued, 0.35) and link.cancel(moving, 0.35)
    assert link.pending(0.35) == 1  # the moving one still finishes its chunk
    later = link.submit("c", 0.35, prefetch=False)
    assert link.finish(later) == pytest.approx(0.4 + 1.0)
    assert moving.landed_at is None and queued.landed_at is None and link.pending(1.4) == 0
    assert not link.cancel(later, 1.5)  # landed: nothing to take back


def test_promote_puts_a_prefetch_ahead_of_the_other_prefetches():
    link = SerialLink(transfer_s=1.0, chunk_s=1.0)
    first, second = link.submit("a", 0.0, prefetch=True), link.submit("b", 0.0, prefetch=True)
    third = link.submit("c", 0.0, prefetch=True)
    assert link.promote(third, 0.5) and not link.promote(third, 0.5)
    assert [link.finish(c) for c in (first, third, second)] == [1.0, 2.0, 3.0]
