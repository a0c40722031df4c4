"""Expert copies from a store to device cache slots, over a real or emulated link, in chunks.

One worker thread owns the link (a link carries one copy at a time) and moves transfers one
chunk (~1 ms of link time) at a time: after every chunk it serves the first demand load, else
the first prefetch, so a demand load preempts an in-flight prefetch at the next chunk boundary
and the prefetch resumes later where it stopped. `cancel` stops a transfer at a chunk boundary,
`promote` gives a prefetch demand priority. An emulated link holds every chunk for its bytes /
bandwidth (plus the latency once per transfer), so offloaded timing can be studied on a machine
without the hardware. It copies a transfer's data in one go when the transfer starts and then
sleeps through its chunks back to back, woken early only when the transfer is to yield the link:
a wake-up per chunk would take the GIL from the compute thread that often (it made a tiny model's
decoding 11-16 % slower while an SD-card link was busy), which a real link's copy engine never does.
An emulated link with small experts on the CPU is served with no thread at all
(evalsuite.engine.link.lazy).

A transfer is *issued* once every chunk is handed to the copy backend (evalsuite.engine.link.copy_backends)
and *landed* once every chunk is in the slot: `done` is set only then (or when it failed or was
cancelled and none of its chunks is still moving). A slot is usable only through `Transfer.wait`,
which on CUDA makes the compute stream wait on the copy's event (no host synchronisation), or
after `done`: nothing else may treat a slot as filled.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque

import torch

from evalsuite.engine.link.copy_backends import CudaCopies, HostCopies
from evalsuite.engine.link import Link, LinkTransfer
from evalsuite.engine.link.profiles import LinkProfile, default_chunk_bytes
from evalsuite.engine.placement.store import HostStore


class TransferError(RuntimeError):
    """A transfer failed, was cancelled, or did not finish in time."""


class TransferCancelled(TransferError):
    """The transfer was cancelled: its slot holds nothing usable."""


class Transfer(LinkTransfer):
    """One copy of one expert into one slot; `wait()` makes the slot usable by the caller."""

    def __init__(self, key, dst: torch.Tensor, prefetch: bool, worker: "TransferWorker"):
        self.key, self.dst, self.prefetch, self.worker = key, dst, prefetch, worker
        self.nbytes = dst.numel() * dst.element_size()
        self.issued = threading.Event()  # every chunk handed to the copy backend, or it failed / was cancelled
        self.over = False  # the same, known to the worker first (under its lock): `done` is set before `issued`
        self.done = threading.Event()  # finished for good: landed, or failed with none of its chunks moving
        self.error: BaseException | None = None
        self.token = None  # the copy backend's note taken at submit (CUDA: the slot is free after it)
        self.source: torch.Tensor | None = None  # the store's row, when the copy moves in chunks
        self.last = None  # the copy backend's handle of the last chunk issued
        self.moved = 0  # elements issued so far
        self.untouched = True  # the worker never started on it: the slot still holds what it held before
        self.out = 0  # chunks issued and not yet known to have landed
        self.submitted_at = time.perf_counter()
        self.issued_at = self.done_at = 0.0
        self.handoffs: list[float] | None = None  # the engine's record of waiter wake-ups

    def landed(self) -> bool:
        return self.done.is_set() and self.error is None

    def wait(self, timeout: float) -> float:
        """Make the slot usable here: block until every chunk is issued, then order this thread's
        reads after the copy (CUDA: the compute stream waits on its event; CPU: until it landed).
        Returns the seconds spent waiting."""
        start = time.perf_counter()
        blocked = not self.issued.is_set()
        if not self.issued.wait(timeout):
            raise self._late(timeout)
        self._raise_error()
        if not self.done.is_set() and self.last is not None:
            left = max(0.0, timeout - (time.perf_counter() - start))
            if not self.worker.copies.make_ready(self.last, left):
                raise self._late(timeout)
        end = time.perf_counter()
        if blocked and self.handoffs is not None:
            self.handoffs.append(end - self.issued_at)
        return end - start

    def wait_landed(self, timeout: float) -> float:
        """Block the host until the copy landed (or failed): for bookkeeping that must know the
        slot is no longer being written, such as giving it to another expert. Returns the seconds
        spent waiting; raises as `wait` does."""
        start = time.perf_counter()
        if not self.done.wait(timeout):
            raise self._late(timeout)
        self._raise_error()
        return time.perf_counter() - start

    def _raise_error(self) -> None:
        if isinstance(self.error, TransferCancelled):
            raise TransferCancelled(f"transfer of expert {self.key} was cancelled")
        if self.error is not None:
            raise TransferError(f"transfer of expert {self.key} failed: {self.error}") from self.error

    def _late(self, timeout: float) -> TransferError:
        return TransferError(f"transfer of expert {self.key} did not finish within {timeout:g} s "
                             "(raise transfer_timeout_s if the link is this slow)")


class TransferWorker(Link):
    """Serves copy requests chunk by chunk on a background thread: demand first, then prefetch.

    submit(key, dst, prefetch)  queue a copy; returns its Transfer
    cancel(transfer)            drop it if queued, stop it at the next chunk boundary if moving;
                                True if it will never land (the caller gives the slot back; if
                                `transfer.untouched`, no chunk reached the slot and what it held
                                before is intact), False if every chunk was already issued
    promote(transfer)           give a queued or moving prefetch demand priority; True if it did
    """

    def __init__(self, store, device: torch.device, link: LinkProfile | None = None, timeout_s: float = 60.0,
                 chunk_bytes: int | None = None, copies=None):
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive number of bytes")
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.copies = copies or (CudaCopies(device) if device.type == "cuda" else HostCopies())
        self.chunk_bytes = chunk_bytes or default_chunk_bytes(link)
        # link time of one chunk where the link is emulated (a copy's latency aside); a real link's is measured
        self.chunk_s = None if link is None else self.chunk_bytes / link.bandwidth
        self.busy_s = 0.0  # link time of every chunk moved, cancelled transfers' included
        self.handoffs: list[float] = []  # per blocked wait: from the copy issued to the waiter running
        self._lock = threading.Condition()
        self._demand: deque = deque()  # Transfers in order; the first is the one moving
        self._prefetch: deque = deque()
        self._in_flight: deque = deque()  # (handle, transfer, wall seconds or None), oldest first
        self._moving = None  # the transfer whose chunk the worker is moving right now
        self._closing = False
        self._link_free_at = 0.0  # when the emulated link finishes its last chunk
        self._last_end = 0.0
        self._submitted = self._finished = self._landed = 0
        self._copies_moved = 0.0  # the copies' worth of data the chunks in busy_s moved
        self._worker = threading.Thread(target=self._serve, name="evalsuite-transfer", daemon=True)
        self._worker.start()

    def submit(self, key, dst: torch.Tensor, prefetch: bool = False) -> Transfer:
        """Queue a copy of expert `key` into `dst`; a prefetch waits behind every demand load."""
        transfer = Transfer(key, dst, prefetch, self)
        transfer.handoffs = self.handoffs
        transfer.token = self.copies.prepare(dst)
        with self._lock:
            self._submitted += 1
            (self._prefetch if prefetch else self._demand).append(transfer)
            self._wake()
        return transfer

    def cancel(self, transfer: Transfer) -> bool:
        with self._lock:
            if transfer.error is not None:
                return True
            if transfer.over:
                return False
            self._dequeue(transfer)
            self._stop(transfer, TransferCancelled(f"transfer of expert {transfer.key} was cancelled"))
            self._wake()
            return True

    def promote(self, transfer: Transfer) -> bool:
        with self._lock:
            if not transfer.prefetch or transfer.over:
                return False
            self._prefetch.remove(transfer)
            transfer.prefetch = False
            self._demand.append(transfer)
            self._wake()
            return True

    def pending(self) -> int:
        """Transfers submitted and not yet finished."""
        return self._submitted - self._finished

    def prefetches_queued(self) -> int:
        """Prefetches not yet fully issued (queued or moving): the link's work a new prefetch waits behind
        that the compute does not wait for (demand loads hold up the compute as long as the prefetch)."""
        return len(self._prefetch)

    def seconds_per_transfer(self) -> float | None:
        """Measured link time per whole copy (None before the first landed): the time of every chunk
        moved, a cancelled transfer's included, over the copies' worth of data they moved. On CUDA
        without emulation a chunk's time is measured by events around its copy; otherwise from the
        later of the transfer's submission and the previous chunk's end to the chunk's end, so the
        worker's wake-up delays and sleep overshoots count as the link's time. (Landed transfers'
        chunks alone would not do: a cancelled chunk's overshoot is taken off the next chunk's
        time, and on a loaded machine sdcard then measured 0.95 of its figure.)"""
        return self.busy_s / self._copies_moved if self._landed else None

    def handoff_seconds(self) -> float | None:
        """Median time from a copy issued to its blocked waiter running (None if none waited)."""
        return statistics.median(self.handoffs) if self.handoffs else None

    # ---- the worker --------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._lock:
                while not (self._demand or self._prefetch or self._in_flight or self._closing):
                    self._lock.wait()
                transfer = self._next()
                if transfer is None and not self._in_flight:
                    return  # closing, and nothing left to move
                if len(self._in_flight) >= self.copies.depth:
                    transfer = None  # the backend holds enough: let the oldest chunk land first
                self._moving = transfer
                if transfer is not None:
                    transfer.untouched = False
            if transfer is None:
                self._land_oldest()
            else:
                self._move(transfer)

    def _move(self, transfer: Transfer) -> None:
        """Move `transfer` on: its next chunk on a real link; on an emulated one, its chunks back to back
        until it is done or something else is to be served (see _hold_link)."""
        first, start, handle, error = transfer.moved == 0, transfer.moved, None, None
        numel = stop = transfer.dst.numel()
        chunk = max(1, self.chunk_bytes // transfer.dst.element_size())
        try:
            if first:
                self.copies.begin(transfer.token)
                if isinstance(self.store, HostStore):  # a stable row: a real link copies it chunk by chunk
                    transfer.source = self.store.read(transfer.key)
            if self.link is not None:
                # The data goes in one copy when the transfer first moves, ahead of the link's time:
                # the slot is usable only once the link time of every chunk has passed (`issued`).
                if first:
                    handle = (self.copies.copy(transfer.dst, transfer.source) if transfer.source is not None
                              else self.copies.copy_from(self.store, transfer.key, transfer.dst))
                stop = self._hold_link(transfer, start, chunk, first)
            elif transfer.source is not None:
                stop = min(numel, start + chunk)
                handle = self.copies.copy(transfer.dst[start:stop], transfer.source[start:stop])
            elif first:  # another store copies the whole expert at once
                handle = self.copies.copy_from(self.store, transfer.key, transfer.dst)
        except BaseException as exc:  # handed to the waiter, never lost in the thread
            error = exc
        now = time.perf_counter()
        wall = now - max(self._last_end, transfer.submitted_at)
        share = (stop - start) / numel if error is None else 0.0  # the copies' worth this run moved
        self._last_end = now
        with self._lock:
            self._moving = None
            transfer.moved = stop
            if handle is not None:
                transfer.out += 1
                transfer.last = handle
                # an asynchronous copy is timed when it lands, unless the emulated link sets its time
                self._in_flight.append((handle, transfer, wall if self.link is not None else None, share))
            if handle is None or self.link is not None:
                self._count(wall, share)
            if error is not None and transfer.error is None:
                self._dequeue(transfer)
                self._stop(transfer, error)
            elif transfer.error is None and stop == transfer.dst.numel():
                self._dequeue(transfer)
                self._issuing_over(transfer)
            self._finish_if_settled(transfer)

    def _hold_link(self, transfer: Transfer, start: int, chunk: int, first: bool) -> int:
        """Hold the emulated link for `transfer`'s elements from `start` on, `chunk` at a time back to back,
        and return where it stopped: at its end, or, once something else is to be served (a demand load
        ahead of a prefetch, a cancel: `_yields`), at the end of the chunk moving then. The worker sleeps
        through the whole run and is woken only for that (`_wake`): a wake-up per chunk would cost the
        compute thread the GIL that often, which a real link's copy engine never does."""
        size, numel = transfer.dst.element_size(), transfer.dst.numel()
        # Back-to-back chunks follow the link's own schedule, not the worker's wake-ups, so sleep
        # overshoots do not accumulate over the ~100 chunks of a slow link's transfer.
        begins = max(self._link_free_at, transfer.submitted_at) + (self.link.latency if first else 0.0)
        def ends(stop: int) -> float:
            return begins + (stop - start) * size / self.link.bandwidth
        stop = numel
        with self._lock:
            while (left := ends(numel) - time.perf_counter()) > 0:
                if self._yields(transfer):
                    chunks = max(0, time.perf_counter() - begins) * self.link.bandwidth / (chunk * size)
                    stop = min(numel, start + (int(chunks) + 1) * chunk)  # the moving chunk finishes
                    break
                self._lock.wait(left)
        self._link_free_at = ends(stop)
        remaining = self._link_free_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return stop

    def _next(self) -> Transfer | None:
        """The transfer the link serves next: the first demand load, else the first prefetch."""
        return self._demand[0] if self._demand else self._prefetch[0] if self._prefetch else None

    def _yields(self, transfer: Transfer) -> bool:
        """Whether the moving `transfer` gives up the link at its next chunk boundary (under the lock)."""
        return transfer.error is not None or self._next() is not transfer

    def _wake(self) -> None:
        """After a change of the queues (under the lock): wake the worker if it waits for work, or if the
        transfer it moves now yields the link."""
        if self._moving is None or self._yields(self._moving):
            self._lock.notify()

    def _land_oldest(self) -> None:
        handle, transfer, wall, share = self._in_flight[0]
        error = None
        try:
            self.copies.wait(handle)
        except BaseException as exc:
            error = exc
        seconds = self.copies.seconds(handle) if wall is None and error is None else None
        with self._lock:
            self._in_flight.popleft()
            transfer.out -= 1
            if wall is None:
                self._count(seconds or 0.0, share)
            if error is not None and transfer.error is None:
                self._dequeue(transfer)
                self._stop(transfer, error)
            self._finish_if_settled(transfer)

    # ---- bookkeeping, under the lock ---------------------------------------------------------
    def _count(self, seconds: float, share: float) -> None:
        self.busy_s += seconds
        self._copies_moved += share

    def _dequeue(self, transfer: Transfer) -> None:
        queue = self._prefetch if transfer.prefetch else self._demand
        if transfer in queue:
            queue.remove(transfer)

    def _stop(self, transfer: Transfer, error: BaseException) -> None:
        transfer.error = error
        self._issuing_over(transfer)

    def _issuing_over(self, transfer: Transfer) -> None:
        # `done` first when nothing of it is still moving, so a waiter woken by `issued` that
        # finds the copy landed also finds it done
        transfer.over, transfer.issued_at = True, time.perf_counter()
        self._finish_if_settled(transfer)
        transfer.issued.set()

    def _finish_if_settled(self, transfer: Transfer) -> None:
        """Mark `transfer` done once it is issued (or stopped) and none of its chunks still moves."""
        if not transfer.over or transfer.out or transfer is self._moving or transfer.done.is_set():
            return
        transfer.done_at = time.perf_counter()
        transfer.source = None
        self._finished += 1
        if transfer.error is None:
            self._landed += 1
        transfer.done.set()

    def close(self) -> None:
        """Finish every queued transfer, then stop the worker and the copy backend."""
        if self._worker.is_alive():
            with self._lock:
                self._closing = True
                self._lock.notify()
            self._worker.join(timeout=self.timeout_s)
        self.copies.close()
