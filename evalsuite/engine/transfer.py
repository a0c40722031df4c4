"""Asynchronous expert copies from a store to device cache slots, over a real or emulated link.

One worker thread owns the link and serves transfers one at a time (a link carries one copy at
a time): demand loads first, then prefetches, each in submission order. On CUDA it issues each copy on a high-priority side stream and records an event, so the
compute stream never makes a synchronous copy. An emulated link holds every transfer for
latency + bytes / bandwidth, so offloaded timing can be studied on a machine without the
hardware (a CPU-only box, or a GPU emulating phone flash).
"""
from __future__ import annotations

import itertools
import queue
import re
import statistics
import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes per second
    latency: float  # seconds added to every transfer

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


# Sustained host->device (or flash->DRAM) read figures; see docs/links.md for sources.
LINKS = {
    "pcie3": Link("pcie3", 12e9, 10e-6),        # PCIe 3.0 x16: 15.75 GB/s raw, ~12 GB/s pinned copies
    "pcie4": Link("pcie4", 25e9, 10e-6),        # PCIe 4.0 x16: 31.5 GB/s raw, ~25 GB/s pinned copies
    "pcie5": Link("pcie5", 50e9, 10e-6),        # PCIe 5.0 x16: 63 GB/s raw, ~50 GB/s pinned copies
    "nvlink-c2c": Link("nvlink-c2c", 450e9, 2e-6),  # GH200 NVLink-C2C: 900 GB/s total, 450 per direction
    "ufs4": Link("ufs4", 4.2e9, 100e-6),        # UFS 4.0 sequential read, up to 4,200 MB/s
    "ufs3": Link("ufs3", 2.1e9, 150e-6),        # UFS 3.1 sequential read, up to 2,100 MB/s
    "sdcard": Link("sdcard", 0.09e9, 1e-3),     # microSD UHS-I: 104 MB/s bus, ~90 MB/s reads
}
_CUSTOM = re.compile(r"^\s*([\d.]+)\s*GB/s\s*(?:\+\s*([\d.]+)\s*us)?\s*$", re.IGNORECASE)


def parse_link(spec) -> Link | None:
    """None / 'native': real copies only. A profile name, 'B GB/s', 'B GB/s + L us', or a Link."""
    if spec is None or isinstance(spec, Link) or spec == "native":
        return None if spec in (None, "native") else spec
    if isinstance(spec, str) and spec in LINKS:
        return LINKS[spec]
    match = _CUSTOM.match(spec) if isinstance(spec, str) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"unknown link {spec!r}: use one of {', '.join(LINKS)}, 'native', "
                         "or a bandwidth such as '8GB/s' or '8GB/s+20us'")
    return Link(spec.strip(), float(match.group(1)) * 1e9, float(match.group(2) or 0) * 1e-6)


class TransferError(RuntimeError):
    """A transfer failed or did not finish in time."""


class Transfer:
    """One copy of one expert into one slot; `wait()` blocks until the data is usable."""

    def __init__(self, key, nbytes: int):
        self.key, self.nbytes = key, nbytes
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cuda_event = None  # recorded on the side stream after the copy
        self.slot_free = None  # recorded on the compute stream at submit time
        self.seconds = 0.0  # time the link was busy with it
        self.submitted_at = time.perf_counter()
        self.done_at = 0.0  # when the worker marked it done
        self.handoffs: list[float] | None = None  # the engine's record of waiter wake-ups

    def ready(self) -> bool:
        return self.done.is_set() and (self.cuda_event is None or self.cuda_event.query())

    def wait(self, timeout: float) -> float:
        """Block until the copy landed; returns the seconds spent waiting."""
        start = time.perf_counter()
        blocked = not self.done.is_set()
        if not self.done.wait(timeout):
            raise TransferError(f"transfer of expert {self.key} did not finish within {timeout:g} s "
                                "(raise transfer_timeout_s if the link is this slow)")
        if self.error is not None:
            raise TransferError(f"transfer of expert {self.key} failed: {self.error}") from self.error
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
        end = time.perf_counter()
        if blocked and self.handoffs is not None:
            self.handoffs.append(end - self.done_at)
        return end - start


class TransferEngine:
    """Serves copy requests in order on a background thread (and a CUDA side stream)."""

    def __init__(self, store, device: torch.device, link: Link | None = None, timeout_s: float = 60.0):
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.busy_s = 0.0
        self.handoffs: list[float] = []  # per blocked wait: from the copy marked done to the waiter running
        self._link_free_at = 0.0  # when the emulated link finishes its last transfer
        self._last_done = 0.0
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._submitted = self._finished = 0
        self._worker = threading.Thread(target=self._serve, name="evalsuite-transfer", daemon=True)
        self._worker.start()

    def submit(self, key, dst: torch.Tensor, prefetch: bool = False) -> Transfer:
        """Queue a copy of expert `key` into `dst`; a prefetch waits behind every demand load."""
        transfer = Transfer(key, dst.numel() * dst.element_size())
        transfer.handoffs = self.handoffs
        if self.stream is not None:
            # The slot may still be read by kernels queued on the compute stream for the expert
            # it held before: the copy must start only after them.
            transfer.slot_free = torch.cuda.Event()
            transfer.slot_free.record(torch.cuda.current_stream(dst.device))
        self._submitted += 1
        self._queue.put((int(prefetch), next(self._order), transfer, dst))
        return transfer

    def pending(self) -> int:
        """Transfers submitted and not yet finished."""
        return self._submitted - self._finished

    def seconds_per_transfer(self) -> float | None:
        """Measured link time per finished transfer (None before the first): from the later of its
        submission and the previous transfer's end to its own end, so the worker's wake-up delays
        and sleep overshoots count as the link's time, as the compute thread sees them."""
        return self.busy_s / self._finished if self._finished else None

    def handoff_seconds(self) -> float | None:
        """Median time from a copy marked done to its blocked waiter running (None if none waited)."""
        return statistics.median(self.handoffs) if self.handoffs else None

    def _serve(self) -> None:
        while (item := self._queue.get())[2] is not None:
            _, _, transfer, dst = item
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(transfer.slot_free)
                        self.store.copy_into(transfer.key, dst)
                        transfer.cuda_event = torch.cuda.Event()
                        transfer.cuda_event.record(self.stream)
                else:
                    self.store.copy_into(transfer.key, dst)
                if self.link is not None:
                    # Back-to-back transfers follow the link's own schedule, so the worker's
                    # wake-up overshoots do not accumulate over a stream of copies.
                    begins = max(self._link_free_at, transfer.submitted_at)
                    self._link_free_at = begins + self.link.seconds(transfer.nbytes)
                    remaining = self._link_free_at - time.perf_counter()
                    if remaining > 0:
                        time.sleep(remaining)
                    self._link_free_at = max(self._link_free_at, time.perf_counter())
            except BaseException as exc:  # handed to the waiter, never lost in the thread
                transfer.error = exc
            transfer.done_at = time.perf_counter()
            transfer.seconds = transfer.done_at - max(self._last_done, transfer.submitted_at)
            self._last_done = transfer.done_at
            self.busy_s += transfer.seconds
            self._finished += 1
            transfer.done.set()

    def close(self) -> None:
        if self._worker.is_alive():
            self._queue.put((2, next(self._order), None, None))
            self._worker.join(timeout=self.timeout_s)
