"""An emulated link with no thread of its own: the link's schedule in wall-clock time, worked out
on the compute thread whenever it asks (evalsuite.engine.link.serial), for host slots.

It answers the engine as the transfer worker does (submit, cancel, promote, `done`, `wait`) and
serves the same schedule: chunks of about 1 ms of link time, demand loads first, a demand load
preempting a moving prefetch at the next chunk boundary, the latency folded into the chunks.
A copy's data is written into its slot when the schedule lands it, by whichever call of the
compute thread finds it landed: a cancelled copy never writes its slot. A thread that waits for
a copy spins until the copy's landing time (sleeping only the part of a wait beyond SPIN_S): the
link's time is then its figure, not the wake-up of a sleep (which overshoots), and the compute
after a wait loses less speed: a thread that sleeps gives its core back, and on a virtual machine
the compute after it runs slower (docs/performance.md, "The link"). CUDA's host thread, waiting on
the device, spins as well by default (cudaDeviceScheduleAuto, with fewer contexts than cores).

Why without a thread: every wake-up of a worker thread takes the GIL from the compute thread.
On an emulated fast link a tiny model's expert copy is shorter than those hand-offs: a copy through
the worker takes longer than its link time, and the compute thread pays to start one
(docs/performance.md, "The link"). A real link's
copy engine costs the compute thread none of that. The engine uses this link for an emulated
link on the CPU when one expert is at most INLINE_MAX_BYTES, where a memory copy on the compute
thread costs less than a hand-off; a larger expert keeps the worker, which copies beside the
compute. One thread (the compute thread) drives the link.
"""
from __future__ import annotations

import statistics
import time

import torch

from evalsuite.engine.link.serial import Copy, SerialLink
from evalsuite.engine.link import Link, LinkTransfer
from evalsuite.engine.link.profiles import LinkProfile, default_chunk_bytes
from evalsuite.engine.link.worker import TransferCancelled, TransferError

INLINE_MAX_BYTES = 2**20  # an expert this small copies in less time than a thread hand-off
SPIN_S = 0.02  # a wait is spun, not slept, for its last 20 ms (a tiny expert's SD-card copy is 3.2 ms)


class _Landed:
    """`LazyTransfer.done`: set once the copy landed (its data is in the slot), failed, or was
    cancelled and has left the link; asking settles the link's schedule up to now."""

    def __init__(self, transfer: "LazyTransfer"):
        self.transfer = transfer

    def is_set(self) -> bool:
        t = self.transfer
        t.link._advance()
        if t.copy.cancelled:
            return t.copy is not t.link.schedule.moving
        return t.written or t.error is not None


class LazyTransfer(LinkTransfer):
    """One copy of one expert into one slot, as evalsuite.engine.link.worker.Transfer."""

    def __init__(self, key, dst: torch.Tensor, copy: Copy, link: "LazyLink"):
        self.key, self.dst, self.copy, self.link = key, dst, copy, link
        self.nbytes = dst.numel() * dst.element_size()
        self.error: BaseException | None = None
        self.written = False  # the data is in the slot
        self.done = _Landed(self)

    @property
    def prefetch(self) -> bool:
        return self.copy.prefetch

    @property
    def untouched(self) -> bool:
        """No link time of it has moved: the slot still holds what it held before (it always does
        here, as only a landed copy writes; the answer is the link model's, as the worker gives it)."""
        if self.copy.cancelled:
            return self.copy.untouched  # as of the cancel
        self.link._advance()
        return self.copy.moved == 0 and self.copy is not self.link.schedule.moving

    def landed(self) -> bool:
        self.link._advance()
        return self.written and self.error is None

    def wait(self, timeout: float) -> float:
        """Block until the copy landed; returns the seconds waited. Raises TransferCancelled if it was
        cancelled, TransferError if its data could not be read or it lands later than `timeout`."""
        start = time.perf_counter()
        self.link._finish(self, timeout)
        if self.copy.cancelled:
            raise TransferCancelled(f"transfer of expert {self.key} was cancelled")
        if self.error is not None:
            raise TransferError(f"transfer of expert {self.key} failed: {self.error}") from self.error
        return time.perf_counter() - start

    wait_landed = wait  # the slot is written only when the copy lands: no other write can follow


class LazyLink(Link):
    """An emulated `link` serving copies from `store` into host slots, on the caller's thread.

    submit(key, dst, prefetch)  queue a copy; returns its LazyTransfer
    cancel(transfer)            True if it will never land (queued: dropped; moving: stopped at its
                                chunk boundary), False if it already landed
    promote(transfer)           give a queued or moving prefetch demand priority; True if it did
    """

    def __init__(self, store, link: LinkProfile, timeout_s: float = 60.0, chunk_bytes: int | None = None):
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive number of bytes")
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.chunk_bytes = chunk_bytes or default_chunk_bytes(link)
        self.chunk_s = self.chunk_bytes / link.bandwidth  # link time of one chunk
        self.schedule: SerialLink | None = None  # made at the first copy, which tells the copy's size
        self.handoffs: list[float] = []  # per blocked wait: from the landing time to the waiter running
        self._nbytes = None

    def _schedule_for(self, nbytes: int) -> SerialLink:
        if self.schedule is None:
            self._nbytes = nbytes
            self.schedule = SerialLink(self.link.seconds(nbytes), self.chunk_bytes / self.link.bandwidth,
                                       on_land=self._write)
        elif nbytes != self._nbytes:
            raise ValueError(f"a copy of {nbytes} bytes on a link serving copies of {self._nbytes}: every "
                             "expert of one engine has the same size")
        return self.schedule

    def submit(self, key, dst: torch.Tensor, prefetch: bool = False) -> LazyTransfer:
        schedule = self._schedule_for(dst.numel() * dst.element_size())
        copy = schedule.submit(key, time.perf_counter(), prefetch)
        transfer = LazyTransfer(key, dst, copy, self)
        copy.transfer = transfer  # what _write fills when the schedule lands it
        return transfer

    def cancel(self, transfer: LazyTransfer) -> bool:
        if transfer.copy.cancelled or transfer.error is not None:
            return True
        if not self.schedule.cancel(transfer.copy, time.perf_counter()):
            return False
        transfer.error = TransferCancelled(f"transfer of expert {transfer.key} was cancelled")
        return True

    def promote(self, transfer: LazyTransfer) -> bool:
        return self.schedule.promote(transfer.copy, time.perf_counter())

    def pending(self) -> int:
        """Transfers submitted and not yet finished."""
        return 0 if self.schedule is None else self.schedule.pending(time.perf_counter())

    def prefetches_queued(self) -> int:
        """Prefetches queued or moving (TransferWorker.prefetches_queued)."""
        return 0 if self.schedule is None else self.schedule.prefetches_queued(time.perf_counter())

    def seconds_per_transfer(self) -> float | None:
        """Link time per landed transfer (None before the first): the link's own figure, which this
        link keeps exactly."""
        return None if self.schedule is None else self.schedule.seconds_per_transfer()

    def handoff_seconds(self) -> float | None:
        """Median time from a copy landing to its blocked waiter running (None if none waited)."""
        return statistics.median(self.handoffs) if self.handoffs else None

    @property
    def busy_s(self) -> float:
        """Link time of every chunk moved so far, cancelled transfers' included."""
        if self.schedule is None:
            return 0.0
        self._advance()
        return self.schedule.busy_s

    def close(self) -> None:
        """Land every copy still queued (its data written), as the worker finishes them."""
        if self.schedule is not None:
            self.schedule.advance(float("inf"))

    # ---- the schedule, on the caller's clock -----------------------------------------------------
    def _advance(self) -> None:
        if self.schedule is not None:
            self.schedule.advance(time.perf_counter())

    def _finish(self, transfer: LazyTransfer, timeout: float) -> None:
        """Return once `transfer` landed (spinning until its landing time, after sleeping any part of
        the wait beyond SPIN_S), failed, or was cancelled. The schedule is run ahead to the landing at
        once: the caller only waits meanwhile, so nothing can change it (a wait that times out leaves
        it ahead of the clock, with the copies before this one landed early; the engine fails the
        request then)."""
        self._advance()
        copy = transfer.copy
        if copy.landed_at is not None or copy.cancelled:
            return
        lands_at = self.schedule.finish(copy)
        if lands_at - time.perf_counter() > timeout:
            raise TransferError(f"transfer of expert {transfer.key} would land after {timeout:g} s "
                                "(raise transfer_timeout_s if the link is this slow)")
        while (left := lands_at - time.perf_counter()) > SPIN_S:
            time.sleep(left - SPIN_S)
        while time.perf_counter() < lands_at:
            pass
        self.handoffs.append(time.perf_counter() - lands_at)

    def _write(self, copy: Copy) -> None:
        """The schedule landed `copy`: its data goes into its slot now."""
        transfer = copy.transfer
        try:
            self.store.copy_into(transfer.key, transfer.dst)
            transfer.written = True
        except BaseException as exc:  # handed to the waiter, as the worker does
            transfer.error = exc
