"""The simulated link: chunked, preemptible, cancellable, as the engine's transfer worker serves copies."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evalsuite.engine.link.serial import SerialLink


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


class _Bounded(SerialLink):
    """A link that raises where one that makes no progress would loop for ever."""

    def _settle(self, end):
        self.runs = getattr(self, "runs", 0) + 1
        if self.runs > 10_000:
            raise RuntimeError("the link settles runs that move nothing")
        super()._settle(end)


OPERATIONS = st.lists(st.tuples(st.sampled_from(["demand", "prefetch", "cancel", "promote", "finish"]),
                                st.floats(0, 2e-3), st.integers(0, 1 << 16)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(boot_s=st.sampled_from([0.0, 3e4, 1e6]), transfer_s=st.floats(1e-4, 5e-3), chunk_s=st.floats(1e-4, 1e-3),
       ops=OPERATIONS)
def test_every_copy_waited_on_lands_on_a_clock_read_hours_after_boot(boot_s, transfer_s, chunk_s, ops):
    """The emulated link reads perf_counter, seconds since boot. Hours in, a float second's resolution (3.6e-12 s at
    3e4 s, 1.2e-10 s at 1e6 s) exceeds any fixed slack, so what a run leaves of a copy can be too small for any run
    to move: such a copy must land, not be waited on for ever."""
    link, now, copies = _Bounded(transfer_s, chunk_s), boot_s, []
    for op, wait, pick in ops:
        now += wait
        live = [c for c in copies if c.landed_at is None and not c.cancelled]
        if op in ("demand", "prefetch"):
            copies.append(link.submit(len(copies), now, prefetch=op == "prefetch"))
        elif live and op == "cancel" and live[pick % len(live)].prefetch:
            link.cancel(live[pick % len(live)], now)
        elif live and op == "promote":
            link.promote(live[pick % len(live)], now)
        elif live and op == "finish":
            now = max(now, link.finish(live[pick % len(live)]))
    for copy in copies:
        if not copy.cancelled:
            now = max(now, link.finish(copy))
    # (a cancelled copy still moving stops at its chunk's end)
    assert link.pending(now + chunk_s) == 0 and link.landed == sum(not c.cancelled for c in copies)


def test_a_copy_whose_run_rounds_short_still_lands():
    """At 1e6 s, (start + 1.2907 ms) − start falls short of 1.2907 ms by more than 1e-12 s: a case the test above found."""
    link = _Bounded(transfer_s=0.0012907134942555332, chunk_s=1e-3)
    copy = link.submit("a", 1e6, prefetch=False)
    assert link.finish(copy) == pytest.approx(1e6 + 0.0012907134942555332, abs=1e-9)
