"""Project decode TPOT from a routing trace, per-token costs and a cache size.

The simulation replays the engine's decode loop event by event, batch 1:

  per sparse layer   dense part (attention, norms, router, shared experts), then the
                     prediction for the next sparse layer (its cost), then the routed experts:
                     misses are queued as demand transfers, then the window-aware
                     scheduler's prefetches for the next layer, then each expert in ascending
                     id order waits for its copy to land and computes
  per step           the rest (embedding, dense layers, LM head, sampling)
  the link           one transfer at a time; demand before queued prefetches, otherwise FIFO
  the cache          LRU over (layer, expert) slots; experts in use or in flight are never
                     evicted; a prefetch never evicts another expert of the same request

Modes: resident (no transfers), on-demand, router-preserving (predicted experts prefetched,
native ones executed), speculative / hybrid (from the second sparse layer the predicted
top-k are executed), oracle (perfect prediction prefetched). The overlap bound is
Σ over layers of max(layer compute, link time of the layer's on-demand misses): what perfect
prediction could at best reach with that cache.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from .trace import RoutingTrace

MODES = ("resident", "on-demand", "router-preserving", "speculative", "hybrid", "oracle")


@dataclass(frozen=True)
class Costs:
    """Seconds per decode token: what a hardware profile (or a measurement) gives the simulator."""

    dense_s: float  # one sparse layer without its routed experts
    expert_s: float  # one routed expert for one token
    step_s: float  # everything outside the sparse layers
    transfer_s: float  # one expert over the link
    predictor_s: float = 0.0  # one prediction (made at every sparse layer but the last)
    predictor_step_s: float = 0.0  # per step (an oracle's look-ahead pass, when measured)
    handoff_s: float = 0.0  # added to every wait for a copy: waking the waiting thread (measured)
    lookup_s: float = 0.0  # per expert use when offloaded: the cache's bookkeeping (measured)
    miss_s: float = 0.0  # per transfer started: placing, evicting, queueing, on the compute thread (measured)


@dataclass
class Projection:
    mode: str
    tpot_s: float
    compute_s: float  # per token: dense + experts + rest
    exposed_transfer_s: float  # per token: time computation waited for the link
    predictor_s: float  # per token
    hit_rate: float
    transfers_per_token: float

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Link:
    """A single-server link with two priorities, advanced lazily in simulated time."""

    def __init__(self, seconds: float):
        self.seconds, self.free_at = seconds, 0.0
        self.queue: list = []  # (submitted, priority, order, key)
        self.queued: set = set()
        self.finish: dict = {}  # key -> time its latest copy lands, once started
        self.landing: deque = deque()  # landing times of started copies, in order
        self._order = itertools.count()

    def submit(self, key, now: float, prefetch: bool) -> None:
        self.advance(now)
        self.finish.pop(key, None)
        self.queue.append((now, int(prefetch), next(self._order), key))
        self.queued.add(key)

    def _start_next(self) -> None:
        start = max(self.free_at, min(item[0] for item in self.queue))
        item = min((i for i in self.queue if i[0] <= start), key=lambda i: (i[1], i[2]))
        self.queue.remove(item)
        self.queued.discard(item[3])
        self.free_at = start + self.seconds
        self.finish[item[3]] = self.free_at
        self.landing.append(self.free_at)

    def advance(self, now: float) -> None:
        """Start every transfer the link would have started by `now`."""
        while self.queue and max(self.free_at, min(i[0] for i in self.queue)) <= now:
            self._start_next()

    def lands_at(self, key) -> float:
        while key not in self.finish:
            self._start_next()
        return self.finish[key]

    def in_flight(self, key, now: float) -> bool:
        return key in self.queued or self.finish.get(key, -math.inf) > now

    def ready_at(self, key, now: float) -> float:
        """When `key`'s copy is usable: now if it landed (or never moved), else its landing time."""
        return self.lands_at(key) if key in self.queued else max(now, self.finish.get(key, now))

    def pending(self, now: float) -> int:
        """Transfers queued or on the link at `now`."""
        self.advance(now)
        while self.landing and self.landing[0] <= now:
            self.landing.popleft()
        return len(self.queue) + len(self.landing)


class _Cache:
    def __init__(self, capacity: int, link: _Link):
        self.capacity, self.link = capacity, link
        self.lru: OrderedDict = OrderedDict()  # resident keys, least recent first

    def place(self, key, now: float, busy=(), protect=()) -> bool:
        """Make `key` resident (evicting the least recent evictable key); False if none can go."""
        if len(self.lru) >= self.capacity:
            victim = fallback = None
            for k in self.lru:  # least recent first; protected keys only if nothing else can go
                if k in busy or self.link.in_flight(k, now):
                    continue
                if k not in protect:
                    victim = k
                    break
                fallback = fallback or k
            victim = victim or fallback
            if victim is None:
                return False
            del self.lru[victim]
        self.lru[key] = None
        return True

    def touch(self, key) -> None:
        self.lru.move_to_end(key)


def _executed(mode: str, pos: int, routing, top_k: int) -> list[int]:
    if mode in ("speculative", "hybrid") and pos > 0 and routing.predicted:
        return sorted(routing.predicted[:top_k])
    return list(routing.native)


def simulate(trace: RoutingTrace, costs: Costs, capacity: int, mode: str, budget: int | None = None,
             window: bool = True) -> Projection:
    """Projected decode TPOT of `mode` over the trace's steps, with `capacity` expert slots."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if capacity < trace.top_k:
        raise ValueError(f"capacity {capacity} is below top-k={trace.top_k}")
    budget = budget or trace.top_k
    predicting = mode in ("router-preserving", "speculative", "hybrid", "oracle")
    link = _Link(costs.transfer_s)
    cache = _Cache(capacity, link)
    t = compute = waited = predict = 0.0
    uses = hits = transfers = 0
    layer_s = None  # the scheduler's running estimate of router-to-router time
    prefills = dict(trace.prefills)
    for index, step in enumerate(trace.steps):
        if index in prefills and mode != "resident":  # what the request's prefill left in the cache
            _warm(cache, trace.layers, prefills[index])
        t += costs.predictor_step_s if predicting else 0.0
        predict += costs.predictor_step_s if predicting else 0.0
        last_router = None
        for pos, routing in enumerate(step):
            layer = trace.layers[pos]
            t += costs.dense_s
            compute += costs.dense_s
            if last_router is not None:
                layer_s = t - last_router if layer_s is None else 0.8 * layer_s + 0.2 * (t - last_router)
            last_router = t
            prefetch = predicting and pos + 1 < len(step)
            if prefetch:
                t += costs.predictor_s
                predict += costs.predictor_s
            executed = _executed(mode, pos, routing, trace.top_k)
            keys = [(layer, e) for e in executed]
            uses += len(keys)
            if mode == "resident":
                hits += len(keys)
            else:
                for key in keys:
                    if key in cache.lru:
                        hits += 1
                        cache.touch(key)
                    else:
                        if not cache.place(key, t, busy=set(keys), protect=set(keys)):
                            raise RuntimeError(f"no evictable slot for {key}")
                        link.submit(key, t, prefetch=False)
                        transfers += 1
                        t += costs.miss_s
                        compute += costs.miss_s
            if prefetch:  # behind this layer's demand loads, as the engine does
                nxt = step[pos + 1]
                ranked = list(nxt.native) if mode == "oracle" else (nxt.predicted or [])
                started = _prefetch(cache, link, trace.layers[pos + 1], ranked[:budget], t, layer_s, window)
                transfers += started
                t += started * costs.miss_s
                compute += started * costs.miss_s
            for key in keys:
                if mode != "resident":
                    ready = link.ready_at(key, t)
                    if ready > t:
                        ready += costs.handoff_s
                        waited += ready - t
                        t = ready
                spent = costs.expert_s + (costs.lookup_s if mode != "resident" else 0.0)
                t += spent
                compute += spent
        t += costs.step_s
        compute += costs.step_s
    n = max(len(trace.steps), 1)
    return Projection(mode, t / n, compute / n, waited / n, predict / n, hits / uses if uses else math.nan,
                      transfers / n)


def _warm(cache: _Cache, layers, per_layer) -> None:
    """The cache as a prefill leaves it: every layer's experts in order, the latest kept."""
    for layer, experts in zip(layers, per_layer):
        for e in experts:
            key = (layer, e)
            if key in cache.lru:
                cache.touch(key)
            else:
                cache.place(key, math.inf)


def _prefetch(cache: _Cache, link: _Link, layer: int, ranked, now: float, layer_s, window: bool) -> int:
    """The window-aware scheduler: most confident first, skip resident, stop when too late."""
    keep = {(layer, e) for e in ranked}
    queued = link.pending(now)
    started = 0
    for e in ranked:
        key = (layer, e)
        if key in cache.lru:
            continue
        if window and layer_s is not None and (queued + 1) * link.seconds > layer_s:
            break
        if not cache.place(key, now, busy=keep):
            continue
        link.submit(key, now, prefetch=True)
        queued += 1
        started += 1
    return started


def overlap_bound(trace: RoutingTrace, costs: Costs, capacity: int) -> float:
    """Σ_layers max(compute, link time of the on-demand misses) + rest, per token (seconds)."""
    cache = _Cache(capacity, _Link(0.0))
    total = 0.0
    prefills = dict(trace.prefills)
    for index, step in enumerate(trace.steps):
        if index in prefills:
            _warm(cache, trace.layers, prefills[index])
        for pos, routing in enumerate(step):
            keys = [(trace.layers[pos], e) for e in routing.native]
            misses = 0
            for key in keys:
                if key in cache.lru:
                    cache.touch(key)
                else:
                    cache.place(key, math.inf, busy=set(keys))
                    misses += 1
            compute = costs.dense_s + len(keys) * (costs.expert_s + costs.lookup_s)
            total += max(compute, misses * costs.transfer_s)
        total += costs.step_s
    return total / max(len(trace.steps), 1)


def gap_closed(tpot_on_demand: float, tpot_mode: float, tpot_bound: float, min_gap: float = 0.05) -> float | None:
    """Share of the on-demand -> overlap-bound gap a mode closes (1 = at the bound); None when the
    gap is under `min_gap` of on-demand's TPOT, where the share would only magnify noise."""
    gap = tpot_on_demand - tpot_bound
    return (tpot_on_demand - tpot_mode) / gap if gap > min_gap * tpot_on_demand else None
