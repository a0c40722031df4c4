"""The device expert cache: a fixed number of flat slots, an eviction policy, pinning.

All slots are rows of one device tensor allocated once, so the memory the cache holds is
exactly capacity x expert bytes. Slots are grouped into pools: one global pool, or one pool
per sparse layer. An expert in use (pinned) or still being copied is never evicted.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict

import torch

POLICIES = ("lru", "lfu")
_BYTES = re.compile(r"^\s*([\d.]+)\s*(B|KB|MB|GB|KiB|MiB|GiB)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def capacity_in_experts(capacity, total_experts: int, expert_bytes: int) -> int:
    """An int is a count of experts, a float in (0, 1] a fraction of all experts, a string with a
    unit ('512MiB') a byte budget, 'all' every expert."""
    if capacity == "all" or capacity is None:
        return total_experts
    if isinstance(capacity, bool):
        raise ValueError(f"cache_capacity={capacity!r} is not a capacity")
    if isinstance(capacity, int):
        if capacity < 1:
            raise ValueError(f"cache_capacity={capacity} must hold at least one expert")
        count = capacity
    elif isinstance(capacity, float):
        if not 0 < capacity <= 1:
            raise ValueError(f"cache_capacity={capacity} as a fraction must lie in (0, 1]")
        count = max(1, round(capacity * total_experts))
    elif isinstance(capacity, str) and (m := _BYTES.match(capacity)):
        count = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) // expert_bytes
    else:
        raise ValueError(f"cache_capacity={capacity!r}: give a count of experts (int), a fraction "
                         "of all experts (float in (0, 1]), a size such as '512MiB', or 'all'")
    return min(count, total_experts)


def free_bytes(device: torch.device) -> int:
    """Memory the cache could still take on `device` (CUDA: free device memory; CPU: available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(capacity: int, expert_bytes: int, device: torch.device, reserve: float = 0.1,
               other_bytes: int = 0) -> None:
    """Refuse a cache that would not fit, naming the largest capacity that would (keeping `reserve`
    of the free memory for activations). `other_bytes` is what else the device will gain (weights
    still to move there) or, negative, lose (expert weights the cache replaces)."""
    free = int(free_bytes(device) * (1 - reserve)) - other_bytes
    if capacity * expert_bytes > free:
        raise ValueError(f"a cache of {capacity} experts ({capacity * expert_bytes / 2**30:.2f} GiB) does not fit "
                         f"the memory free on {device}; the largest that fits is "
                         f"cache_capacity={max(0, free) // expert_bytes}")


class Pool:
    """Slots shared by some layers, with LRU or LFU eviction among unpinned, settled slots."""

    def __init__(self, slots: list[int], policy: str):
        self.free = list(reversed(slots))
        self.policy = policy
        self.recency: OrderedDict = OrderedDict()  # resident key -> None, least recent first
        self.uses: dict = {}  # key -> times used (LFU keeps counts across evictions)

    def touch(self, key) -> None:
        self.recency[key] = None
        self.recency.move_to_end(key)
        self.uses[key] = self.uses.get(key, 0) + 1

    def victim(self, evictable, protect=()) -> object | None:
        """The resident key to evict: unprotected ones first, then by policy."""
        candidates = [k for k in self.recency if evictable(k)]
        if not candidates:
            return None
        preferred = [k for k in candidates if k not in protect] or candidates
        if self.policy == "lru":
            return preferred[0]
        order = {k: i for i, k in enumerate(self.recency)}
        return min(preferred, key=lambda k: (self.uses.get(k, 0), order[k]))


class ExpertCache:
    """Maps (layer, expert) to a device slot; knows which slots are pinned or in flight."""

    def __init__(self, layer_ids, capacity: int, numel: int, dtype, device, policy="lru", per_layer=False):
        if policy not in POLICIES:
            raise ValueError(f"cache_policy={policy!r}: use one of {', '.join(POLICIES)}")
        self.slots = torch.empty(capacity, numel, dtype=dtype, device=device)
        layer_ids = list(layer_ids)
        if per_layer:
            share = capacity // len(layer_ids)
            self.pools = {l: Pool(list(range(i * share, (i + 1) * share)), policy) for i, l in enumerate(layer_ids)}
        else:
            pool = Pool(list(range(capacity)), policy)
            self.pools = {l: pool for l in layer_ids}
        self.slot_of: dict = {}  # key -> slot index
        self.pins: dict = {}  # key -> pin count
        self.transfers: dict = {}  # key -> Transfer not yet known to have landed

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def slots_per_layer(self, layer: int) -> int:
        pool = self.pools[layer]
        return len(pool.free) + len(pool.recency)

    def resident(self, key) -> bool:
        return key in self.slot_of

    def settled(self, key) -> bool:
        transfer = self.transfers.get(key)
        if transfer is not None and transfer.done.is_set():
            del self.transfers[key]
            transfer = None
        return transfer is None

    def failed(self, key) -> bool:
        """Whether the copy that was to fill `key`'s slot ended in an error."""
        transfer = self.transfers.get(key)
        return transfer is not None and transfer.done.is_set() and transfer.error is not None

    def forget(self, key) -> None:
        """Give `key`'s slot back to its pool (after a failed copy); pins are left to their owners."""
        pool = self.pools[key[0]]
        pool.free.append(self.slot_of.pop(key))
        pool.recency.pop(key, None)
        self.transfers.pop(key, None)

    def _evictable(self, key, exclude=()) -> bool:
        return key not in exclude and not self.pins.get(key) and self.settled(key)

    def can_place(self, layer: int, protect=(), exclude=()) -> bool:
        """Whether a slot is free or can be freed; `protect` keys are evicted last, `exclude` keys never."""
        pool = self.pools[layer]
        return bool(pool.free) or pool.victim(lambda k: self._evictable(k, exclude), protect) is not None

    def place(self, key, protect=(), exclude=()) -> tuple[int, object | None]:
        """Give `key` a slot (evicting if needed); returns (slot, evicted key or None)."""
        pool = self.pools[key[0]]
        evicted = None
        if not pool.free:
            evicted = pool.victim(lambda k: self._evictable(k, exclude), protect)
            if evicted is None:
                raise RuntimeError(f"no evictable slot for expert {key}: every slot is pinned")
            del pool.recency[evicted]
            pool.free.append(self.slot_of.pop(evicted))
        slot = pool.free.pop()
        self.slot_of[key] = slot
        pool.recency[key] = None  # most recent; `pin` counts the use
        return slot, evicted

    def pin(self, key) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1
        self.pools[key[0]].touch(key)

    def unpin(self, key) -> None:
        if self.pins[key] == 1:
            del self.pins[key]
        else:
            self.pins[key] -= 1
