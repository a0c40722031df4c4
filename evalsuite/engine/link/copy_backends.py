"""How the transfer worker moves one chunk of an expert: the copy backends.

A backend issues a chunk copy and hands back a handle for it (None: the chunk already landed).
The worker keeps at most `depth` chunks in flight and waits on the oldest handle before issuing
more, so the link can still be taken back at the next chunk boundary. The compute side never
waits on the host for a device copy: `make_ready` orders the compute stream after the copy.

HostCopies  CPU slots: a synchronous copy, landed when it returns.
CudaCopies  device slots: an asynchronous copy on a high-priority side stream, timed by events.
LateCopies  CPU slots, for tests: the chunk is poisoned (NaN) at once and written by another
            thread after a delay, like an asynchronous device copy, so any read of a slot before
            its copy landed changes the output.
"""
from __future__ import annotations

import queue
import threading
import time

import torch


class HostCopies:
    """Synchronous copies into host memory: every chunk has landed when `copy` returns."""

    depth = 1

    def prepare(self, dst: torch.Tensor):
        return None

    def begin(self, token) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src)
        return None

    def copy_from(self, store, key, dst: torch.Tensor):
        store.copy_into(key, dst)
        return None

    def wait(self, handle) -> None:
        pass

    def seconds(self, handle) -> float | None:
        return None  # the worker's own clock measures a synchronous copy

    def make_ready(self, handle, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


class CudaCopies:
    """Asynchronous copies on a side stream; at most two chunks in flight on it."""

    depth = 2

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device, priority=-1)

    def prepare(self, dst: torch.Tensor):
        # The slot may still be read by kernels queued on the compute stream for the expert it
        # held before: the copy must start only after them.
        slot_free = torch.cuda.Event()
        slot_free.record(torch.cuda.current_stream(dst.device))
        return slot_free

    def begin(self, slot_free) -> None:
        self.stream.wait_event(slot_free)

    def _timed(self, move):
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            move()
            end.record(self.stream)
        return start, end

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        return self._timed(lambda: dst.copy_(src, non_blocking=True))

    def copy_from(self, store, key, dst: torch.Tensor):
        return self._timed(lambda: store.copy_into(key, dst))

    def wait(self, handle) -> None:
        handle[1].synchronize()  # on the worker thread, never the compute thread

    def seconds(self, handle) -> float | None:
        start, end = handle
        return start.elapsed_time(end) / 1e3

    def make_ready(self, handle, timeout: float) -> bool:
        # The compute stream waits for the copy on the device; the host goes on queueing work.
        torch.cuda.current_stream(self.stream.device).wait_event(handle[1])
        return True

    def close(self) -> None:
        pass


class LateCopies:
    """CPU copies that land `delay_s` after they are issued, written by a thread of their own;
    `depth` chunks may be in flight (a deep queue keeps many copies issued and not yet landed)."""

    def __init__(self, delay_s: float = 0.002, depth: int = 2):
        self.delay_s, self.depth = delay_s, depth
        self._jobs: queue.Queue = queue.Queue()  # one thread, in issue order, like one copy stream
        self._thread = threading.Thread(target=self._land, name="evalsuite-late-copies", daemon=True)
        self._thread.start()

    def prepare(self, dst: torch.Tensor):
        return None

    def begin(self, token) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        dst.fill_(float("nan"))  # what an unfinished copy leaves is undefined: make it visible
        landed = threading.Event()
        self._jobs.put((dst, src, landed))
        return landed

    def copy_from(self, store, key, dst: torch.Tensor):
        staged = torch.empty_like(dst)
        store.copy_into(key, staged)  # a failing store raises here, at issue
        return self.copy(dst, staged)

    def wait(self, handle) -> None:
        handle.wait()

    def seconds(self, handle) -> float | None:
        return None

    def make_ready(self, handle, timeout: float) -> bool:
        return handle.wait(timeout)

    def _land(self) -> None:
        while (job := self._jobs.get()) is not None:
            dst, src, landed = job
            time.sleep(self.delay_s)
            dst.copy_(src)
            landed.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
