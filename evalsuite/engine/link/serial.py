"""The expert link as a schedule: one serial link, worked out lazily, in any clock.

The simulator (evalsuite.perf.replay) runs it in simulated time, as the transfer worker
(evalsuite.engine.link.worker) serves copies; an emulated link on the CPU (evalsuite.engine.link.lazy)
runs it in wall-clock time, with no thread of its own.

One copy moves at a time, in chunks of `chunk_s` seconds of link time. After every chunk the
link serves the first demand copy, else the first prefetch, so a demand copy submitted while a
prefetch moves waits at most one chunk, and the prefetch later resumes where it stopped.
`cancel` drops a queued copy or stops a moving one at its next chunk boundary; `promote` moves
a prefetch to the end of the demand queue. A copy's latency is folded into its chunks.

The schedule is worked out lazily: between two calls nothing changes which copy is served
except a copy landing, so `advance(now)` only settles copies landing (or yielding the link at a
chunk boundary) up to `now`. Calls must come in non-decreasing simulated time, except
`finish`, which runs the link ahead until a copy lands (the caller waits for it meanwhile).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

_EPS = 1e-12  # seconds: float slack when a copy's remaining time reaches zero


class Copy:
    """One expert's copy. ExpertCache reads `done.is_set()` and `error`, as of a Transfer."""

    def __init__(self, key, seconds: float, prefetch: bool):
        self.key, self.prefetch = key, prefetch
        self.left = seconds  # link time still to move
        self.moved = 0.0  # link time moved so far
        self.landed_at: float | None = None
        self.cancelled = False
        self.untouched = True
        self.error = None
        self.done = self

    def is_set(self) -> bool:
        return self.landed_at is not None


class SerialLink:
    def __init__(self, transfer_s: float, chunk_s: float, on_land: Callable[[Copy], None] | None = None):
        """`on_land(copy)` is called as the schedule lands each copy, in landing order."""
        if chunk_s <= 0:
            raise ValueError(f"chunk_s={chunk_s} must be positive")
        self.transfer_s, self.chunk_s, self.on_land = transfer_s, chunk_s, on_land
        self.demand: deque = deque()  # the moving copy stays at the head of its queue
        self.prefetch: deque = deque()
        self.time = 0.0  # the schedule is settled up to here
        self.moving: Copy | None = None  # on the link at `time`
        self.since = 0.0  # when `moving` began its current run
        self.stop_at: float | None = None  # where `moving` yields the link; None: it runs to its end
        self.busy_s = 0.0  # link time moved, cancelled copies' included
        self.landed = 0
        self.unfinished = 0  # submitted, not landed and not stopped

    # ---- what the engine calls -------------------------------------------------------------
    def submit(self, key, now: float, prefetch: bool) -> Copy:
        self.advance(now)
        copy = Copy(key, self.transfer_s, prefetch)
        (self.prefetch if prefetch else self.demand).append(copy)
        self.unfinished += 1
        self._reconsider(now)
        return copy

    def cancel(self, copy: Copy, now: float) -> bool:
        """True if `copy` will never land (queued: dropped; moving: stopped at its chunk boundary);
        `copy.untouched` then says whether none of it ever moved (its slot was never written)."""
        self.advance(now)
        if copy.landed_at is not None:
            return False
        copy.untouched = copy.moved == 0 and copy is not self.moving
        copy.cancelled = True
        self._queue_of(copy).remove(copy)
        if copy is not self.moving:
            self.unfinished -= 1
        self._reconsider(now)
        return True

    def promote(self, copy: Copy, now: float) -> bool:
        """Give a prefetch still in flight demand priority; True if it did."""
        self.advance(now)
        if not copy.prefetch or copy.landed_at is not None or copy.cancelled:
            return False
        self.prefetch.remove(copy)
        copy.prefetch = False
        self.demand.append(copy)
        self._reconsider(now)
        return True

    def prefetches_queued(self, now: float) -> int:
        """Prefetches queued or moving (TransferWorker.prefetches_queued)."""
        self.advance(now)
        return len(self.prefetch)

    def pending(self, now: float) -> int:
        """Copies submitted and not yet done (a cancelled one moving its last chunk included)."""
        self.advance(now)
        return self.unfinished

    def seconds_per_transfer(self) -> float | None:
        """Link time per landed copy (None before the first), as TransferWorker measures it."""
        return self.transfer_s if self.landed else None

    def advance(self, now: float) -> None:
        """Settle the schedule up to `now`."""
        while True:
            if self.moving is None and not self._start():
                break
            end = self._run_end()
            if end > now:
                break
            self._settle(end)
        self.time = max(self.time, now)

    def finish(self, copy: Copy) -> float:
        """Run the link until `copy` lands; its landing time."""
        while copy.landed_at is None:
            if self.moving is None and not self._start():
                raise RuntimeError(f"copy of {copy.key} is neither queued nor moving")
            self._settle(self._run_end())
        return copy.landed_at

    # ---- the schedule ----------------------------------------------------------------------
    def _head(self) -> Copy | None:
        return self.demand[0] if self.demand else self.prefetch[0] if self.prefetch else None

    def _queue_of(self, copy: Copy) -> deque:
        return self.prefetch if copy.prefetch else self.demand

    def _start(self) -> bool:
        self.moving, self.since, self.stop_at = self._head(), self.time, None
        return self.moving is not None

    def _run_end(self) -> float:
        end = self.since + self.moving.left
        return end if self.stop_at is None else min(end, self.stop_at)

    def _reconsider(self, now: float) -> None:
        """After a change of the queues: the moving copy yields at its next chunk boundary unless it
        is still the one to serve."""
        if self.moving is None:
            return
        if self.moving is self._head() and not self.moving.cancelled:
            self.stop_at = None
        elif self.stop_at is None:
            self.stop_at = self._next_boundary(now)

    def _next_boundary(self, now: float) -> float:
        """The end of the chunk `moving` is in at `now`; a run moves at least one chunk."""
        copy, chunk = self.moving, self.chunk_s
        at = copy.moved + (now - self.since)
        boundary = max(math.ceil(at / chunk - 1e-9) * chunk, copy.moved + chunk)
        return self.since + min(boundary, copy.moved + copy.left) - copy.moved

    def _settle(self, end: float) -> None:
        copy, ran = self.moving, end - self.since
        copy.left -= ran
        copy.moved += ran
        self.busy_s += ran
        self.time, self.moving, self.stop_at = end, None, None
        if copy.cancelled:
            self.unfinished -= 1
        elif copy.left <= _EPS or end + copy.left <= end:
            # (the second: what is left is below the clock's resolution at `end`, above _EPS on a wall clock
            # read as seconds since boot from 2**13 s, 2.3 hours, on: a run towards it would end where it
            # started, and `finish` would wait for that copy for ever)
            copy.left, copy.landed_at = 0.0, end
            self._queue_of(copy).remove(copy)
            self.unfinished -= 1
            self.landed += 1
            if self.on_land is not None:
                self.on_land(copy)
        # else it yielded the link at a chunk boundary and stays at the head of its queue
