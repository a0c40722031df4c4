"""The link: how an expert's bytes get from the store into a device cache slot.

profiles.py       what a link is (bandwidth, latency) and the named profiles the engine emulates
worker.py         TransferWorker: one thread owns the link and moves copies in chunks (real or emulated)
copy_backends.py  how the worker moves one chunk (a host copy, a CUDA side stream, a late copy for tests)
lazy.py           LazyLink: an emulated link served on the compute thread, for small experts on a CPU
serial.py         SerialLink: the schedule of one serial link in its own time (LazyLink's and the replay's)

Both links the engine builds (`placement.offloading.move_experts_out`) are a `Link`; their transfers are a
`LinkTransfer`. The engine's cache talks to nothing else.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from evalsuite.engine.link.profiles import LINKS, LinkProfile, default_chunk_bytes, parse_link

__all__ = ["LinkTransfer", "LINKS", "Link", "LinkProfile", "default_chunk_bytes", "parse_link"]


@runtime_checkable
class LinkTransfer(Protocol):
    """One expert's copy into one slot."""

    key: tuple  # (sparse layer, expert)
    nbytes: int
    done: object  # `.is_set()`: landed, failed, or cancelled with none of it still moving

    untouched: bool  # no byte of it has reached the slot: the slot holds what it held

    def landed(self) -> bool: ...

    def wait(self, timeout: float) -> float: ...  # make the slot usable on the compute side; seconds waited

    def wait_landed(self, timeout: float) -> float: ...  # block the host until no byte of it is still moving


@runtime_checkable
class Link(Protocol):
    """Copies experts from a store into cache slots, demand loads before prefetches."""

    store: object  # what it reads from (placement.store)

    def submit(self, key, dst: torch.Tensor, prefetch: bool = False) -> LinkTransfer: ...

    def cancel(self, transfer: LinkTransfer) -> bool: ...  # a prefetch no longer wanted; True if it stopped

    def promote(self, transfer: LinkTransfer) -> bool: ...  # a prefetch now needed goes ahead of the other prefetches

    def pending(self) -> int: ...

    def prefetches_queued(self) -> int: ...

    def seconds_per_transfer(self) -> float | None: ...  # link time per landed copy (the scheduler's price)

    def handoff_seconds(self) -> float | None: ...

    def close(self) -> None: ...
