"""The device expert cache: a fixed number of flat slots, an eviction policy, pinning.

All slots are rows of one device tensor allocated once, so the memory the cache holds is
exactly capacity x expert bytes. Slots are grouped into pools: one global pool, or one pool
per sparse layer. An expert in use (pinned) or still being copied is never evicted. A
prefetched expert is a guess: it waits at the eviction end until a use confirms it.
"""
from __future__ import annotations

import operator
import os
import re
from collections import OrderedDict, deque

import torch

from evalsuite.engine.cache.eviction import ORDERS, POLICIES  # noqa: F401  (POLICIES: the option parsers read it here)

_BYTES = re.compile(r"^\s*([\d.]+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
REGRET_PRIOR = 2  # losses victim_regret counts before any, none regretted: it starts at no cost, as before it existed


def size_in_bytes(text: str, bare_bytes: bool = False) -> int | None:
    """'512MiB', '2GB', '100 KiB' -> bytes; a bare number only where `bare_bytes` (it is bytes then); else None."""
    m = _BYTES.match(text)
    if not m or (m.group(2) is None and not bare_bytes):
        return None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


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
    elif isinstance(capacity, str) and (nbytes := size_in_bytes(capacity)) is not None:
        count = nbytes // expert_bytes
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
    """Slots shared by some layers, and the order in which their experts are evicted: experts
    prefetched but not yet used first (oldest first: an unconfirmed guess is worth least), then
    the used ones in the policy's order. Finding a victim walks that order from its cheap end and
    stops at the first expert that may go, so it costs O(1 + experts it must skip): those pinned,
    in flight or protected, never the whole cache."""

    def __init__(self, slots: list[int], policy: str, layers):
        self.free = list(reversed(slots))
        self.unconfirmed: OrderedDict = OrderedDict()  # prefetched, not yet used; oldest first
        self.order = ORDERS[policy](layers)
        self.resident = 0
        # placements come in runs (a layer's demand loads, a prediction's prefetches): runs so far and what the
        # current one places, (layer, prefetch), the clock of ExpertCache.victim_regret
        self.runs, self.run_kind = 0, None
        self.watching: deque = deque()  # (last run, victim key) of the victims watched, in order (victim_regret)

    def keys(self):
        """Every resident key, in no particular order."""
        yield from self.unconfirmed
        yield from self.order

    def add(self, key, prefetch: bool) -> None:
        if prefetch:
            self.unconfirmed[key] = None
        else:
            self.order.add(key)
        self.resident += 1

    def discard(self, key) -> None:
        if key in self.unconfirmed:
            del self.unconfirmed[key]
        else:
            self.order.remove(key)
        self.resident -= 1

    def evict(self, key):
        """Take `key` out of the eviction order; returns what `restore` needs to put it back."""
        memento = None if key in self.unconfirmed else self.order.memento(key)
        self.discard(key)
        return memento

    def restore(self, key, memento) -> None:
        self.order.restore(key, memento)
        self.resident += 1

    def use(self, key) -> None:
        if key in self.unconfirmed:  # a use confirms a prefetch: from now on it ages like any expert
            del self.unconfirmed[key]
            self.order.add(key)
        self.order.touch(key)

    def victim(self, evictable, protect=()) -> object | None:
        """The first key in eviction order that may go and is not protected; else the first that may go."""
        fallback = None
        for keys in (self.unconfirmed, self.order.candidates()):
            for key in keys:
                if not evictable(key):
                    continue
                if key not in protect:
                    return key
                if fallback is None:
                    fallback = key
        return fallback


class ExpertCache:
    """Maps (layer, expert) to a device slot; knows which slots are pinned or in flight.

    policy  'lru', 'lfu', 'least-stale' or 'predicted' (defined in .eviction); in every
            policy an expert prefetched and not yet used is evicted before any used one.
    """

    def __init__(self, layer_ids, capacity: int, numel: int, dtype, device, policy="lru", per_layer=False):
        if policy not in POLICIES:
            raise ValueError(f"cache_policy={policy!r}: use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.slots = torch.empty(capacity, numel, dtype=dtype, device=device)
        if self.slots.device.type == "cpu":
            # Host memory is backed page by page at its first write: left to the copies, each first fetch into a
            # slot paid its page faults as link time (a Qwen3-30B-A3B expert: 8.4 ms into a fresh slot, 1.5 ms
            # into a used one), which a device's cache, allocated whole, never pays. Back it all now.
            self.slots.zero_()
        layer_ids = list(layer_ids)
        if per_layer:
            share = capacity // len(layer_ids)
            self.pools = {l: Pool(list(range(i * share, (i + 1) * share)), policy, [l])
                          for i, l in enumerate(layer_ids)}
        else:
            pool = Pool(list(range(capacity)), policy, layer_ids)
            self.pools = {l: pool for l in layer_ids}
        self.slot_of: dict = {}  # key -> slot index
        # layer -> its resident experts (slot_of's keys) as bits, 1 << expert: what a prediction put off is later
        # scored against (the candidates it would have found missing), read at the cost of one lookup
        self.resident_bits: dict = dict.fromkeys(layer_ids, 0)
        self.pins: dict = {}  # key -> pin count
        self.transfers: dict = {}  # key -> Transfer not yet known to have landed, in submission order
        self.victims: dict = {}  # prefetched key -> (the used expert it evicted, its memento), until settled
        # the used experts prefetches evicted, until the run of placements after their prefetch's has passed, and how
        # many of them their pool then placed, and of those, placed by a demand load in that run (victim_regret)
        self.watched: dict = {}  # victim key -> the last run of its pool in which asking for it is a regret
        self.victims_lost, self.victims_regretted = 0, 0
        self._version = 0  # changes whenever a victim choice could change
        self._plan: tuple | None = None  # the victim `can_place` found, for the `place` that follows

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def slots_per_layer(self, layer: int) -> int:
        pool = self.pools[layer]
        return len(pool.free) + pool.resident

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

    def in_flight(self, layer: int) -> list:
        """(key, transfer) of the unpinned experts of `layer`'s pool still being copied, oldest first."""
        pool = self.pools[layer]
        return [(key, t) for key, t in self.transfers.items()
                if self.pools[key[0]] is pool and not self.pins.get(key) and not t.done.is_set()]

    def forget(self, key) -> None:
        """Give `key`'s slot back to its pool (after a failed copy); pins are left to their owners."""
        pool = self.pools[key[0]]
        pool.free.append(self.slot_of.pop(key))
        self.resident_bits[key[0]] &= ~(1 << key[1])
        pool.discard(key)
        self.transfers.pop(key, None)
        self.victims.pop(key, None)
        self._version += 1

    def withdraw(self, key, untouched: bool):
        """A prefetch of `key` was cancelled: its slot goes back. If no chunk of it reached the slot
        (`untouched`) and the used expert it evicted is still not resident elsewhere, that expert
        gets its slot back, at the eviction end it was taken from. Returns the expert given back."""
        victim, memento = self.victims.pop(key, (None, None))
        if not untouched or victim is None or victim in self.slot_of:
            self.forget(key)
            return None
        self.watched.pop(victim, None)  # given back: it costs nothing
        pool = self.pools[key[0]]
        slot = self.slot_of.pop(key)
        pool.discard(key)
        self.transfers.pop(key, None)
        self.slot_of[victim] = slot
        self.resident_bits[key[0]] &= ~(1 << key[1])
        self.resident_bits[victim[0]] |= 1 << victim[1]
        pool.restore(victim, memento)
        self._version += 1
        return victim

    def victim_regret(self) -> float:
        """Of the used experts prefetches evicted (not given back by a cancelled one), the share a demand load asked
        for in the first run of its pool's placements after their prefetch's (placements come in runs: one layer's
        demand loads, one prediction's prefetches): a prefetch, right or wrong, that takes a used expert's slot
        costs that miss. Left in place, the victim was first in eviction order, so that run's first placement
        would have evicted it unless the run was its own layer's demand loads and the router had picked it (a
        demand load never evicts an expert its layer uses); any later and it would have gone anyway. Counted
        from zero (REGRET_PRIOR victims, none regretted), each once placed again or its window has passed. It is
        high where one token's experts fill the cache (a victim is then often an expert the layer about to run
        picks again) and low where the cache holds many tokens' experts."""
        return self.victims_regretted / (self.victims_lost + REGRET_PRIOR)

    def _watch(self, pool: Pool, key, prefetch: bool) -> None:
        """victim_regret's bookkeeping as `key` is placed: a new run of the pool's placements starts where the layer
        placing changes, or from prefetches to demand loads or back, and closes the windows of the victims watched
        before the last one; `key` may be a victim watched, placed again."""
        kind = (key[0], prefetch)
        if pool.run_kind != kind:
            pool.runs += 1
            pool.run_kind = kind
            watching = pool.watching
            while watching and watching[0][0] < pool.runs:
                last, victim = watching.popleft()
                if self.watched.get(victim) == last:  # not placed again in time, nor given back
                    del self.watched[victim]
                    self.victims_lost += 1
        if self.watched.pop(key, None) is not None:  # within its window (else its window closed above)
            self.victims_lost += 1
            self.victims_regretted += not prefetch  # brought back by a prefetch: not a miss

    def spare(self, layer: int) -> int:
        """Slots a prefetch for `layer` may take without evicting a used expert: free ones and unconfirmed guesses."""
        pool = self.pools[layer]
        return len(pool.free) + len(pool.unconfirmed)

    def predict(self, predictions: dict) -> None:
        """The predictor's scores for the coming layers, {layer: {expert: score}} (higher: more
        likely used); replaces the previous ones. Only the 'predicted' policy reads them."""
        if self.policy == "predicted":
            for pool in {id(p): p for p in self.pools.values()}.values():
                pool.order.predictions = predictions
            self._version += 1

    def _evictable(self, key, exclude=()) -> bool:
        return key not in exclude and not self.pins.get(key) and self.settled(key)

    def _victim(self, pool: Pool, layer: int, protect, exclude, prefetch: bool):
        if not prefetch:  # a demand load says which layer is being served (least-stale's reference)
            pool.order.serving(layer)
        objects, values = (pool, protect, exclude), (layer, prefetch, self._version)
        if self._plan is not None and self._plan[1] == values and all(map(operator.is_, objects, self._plan[0])):
            return self._plan[2]  # nothing changed since `can_place` found it
        victim = pool.victim(lambda k: self._evictable(k, exclude), protect)
        # kept only when found: an expert that may go stays so until the version changes, while
        # "none may go" ends silently when a copy lands
        self._plan = (objects, values, victim) if victim is not None else None
        return victim

    def can_place(self, layer: int, protect=(), exclude=(), prefetch=False) -> bool:
        """Whether a slot is free or can be freed; `protect` keys are evicted last, `exclude` keys
        never. The victim found is kept for the `place` that follows with the same arguments."""
        pool = self.pools[layer]
        return bool(pool.free) or self._victim(pool, layer, protect, exclude, prefetch) is not None

    def place(self, key, protect=(), exclude=(), prefetch=False) -> tuple[int, object | None]:
        """Give `key` a slot (evicting if needed); returns (slot, evicted key or None). A prefetched
        key waits at the eviction end until `pin` confirms it."""
        pool = self.pools[key[0]]
        self._watch(pool, key, prefetch)
        evicted = None
        if not pool.free:
            evicted = self._victim(pool, key[0], protect, exclude, prefetch)
            if evicted is None:
                raise RuntimeError(f"no evictable slot for expert {key}: every slot is pinned or in flight")
            was_guess = evicted in pool.unconfirmed
            memento = pool.evict(evicted)
            self.victims.pop(evicted, None)
            pool.free.append(self.slot_of.pop(evicted))
            self.resident_bits[evicted[0]] &= ~(1 << evicted[1])
            if prefetch and not was_guess:  # a used expert: given back if this prefetch never writes its slot
                self.victims[key] = (evicted, memento)
                self.watched[evicted] = pool.runs + 1  # a regret if asked for by the next run (victim_regret)
                pool.watching.append((pool.runs + 1, evicted))
        elif not prefetch:
            pool.order.serving(key[0])
        slot = pool.free.pop()
        self.slot_of[key] = slot
        self.resident_bits[key[0]] |= 1 << key[1]
        pool.add(key, prefetch)  # `pin` counts the use
        self._version += 1
        return slot, evicted

    def pin(self, key) -> None:
        self.victims.pop(key, None)  # a prefetch confirmed by its use: what it evicted stays evicted
        self.pins[key] = self.pins.get(key, 0) + 1
        self.pools[key[0]].use(key)
        self._version += 1

    def unpin(self, key) -> None:
        if self.pins[key] == 1:
            del self.pins[key]
            self._version += 1  # it may be evicted again
        else:
            self.pins[key] -= 1
