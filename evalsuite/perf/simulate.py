"""Project decode TPOT from a routing trace, per-token costs and a cache size.

The simulation replays the engine's decode loop event by event, batch 1 (evalsuite.perf.replay),
with the engine's own expert cache and prefetch scheduler over a simulated link
(evalsuite.engine.link.serial):

  per sparse layer   dense part (attention, norms, router, shared experts); at the router the
                     scheduler scores the prediction made for this layer, this layer's
                     unconfirmed prefetches are cancelled and confirmed ones promoted; the
                     prediction for the next sparse layer (its cost; at the last layer, for the
                     next token's first one); the routed experts in ascending id order: misses
                     queued as demand copies, then the prefetches for the next layer behind
                     them, then each expert waits for its copy and computes
  per step           the rest (embedding, dense layers, LM head, sampling)
  the link           one copy at a time in chunks of `chunk_s`; demand first at every chunk
                     boundary, so a demand load waits at most one chunk behind a prefetch
  the cache          evalsuite.engine.cache.slots.ExpertCache with the chosen eviction policy:
                     experts in use or in flight are never evicted, unused prefetches go first
  prefetching        router-preserving layers: PrefetchScheduler's expected-saving rule;
                     speculative / hybrid layers (from the second): the predicted top-k, all
                     at once at demand priority, and those are what executes

Modes: the engine's (evalsuite.engine.modes; resident moves nothing), and perfect-prefetch:
router-preserving with a perfect prediction for every layer, the first one across tokens included
(with predictor costs of zero, what the engine's trace-oracle does). The overlap bound is Σ over
layers of max(layer compute, link time of the layer's on-demand misses): what perfect prediction
could at best reach with that cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.cache.slots import ExpertCache
from ..engine.link.profiles import CHUNK_SECONDS
from .replay import PERFECT_PREFETCH, SIMULATED_MODES, Replay
from ..engine.trace import RoutingTrace

__all__ = ["PERFECT_PREFETCH", "SIMULATED_MODES", "Costs", "Projection", "gap_closed", "overlap_bound", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Seconds per decode token: what a hardware profile (or a measurement) gives the simulator."""

    dense_s: float  # one sparse layer without its routed experts
    expert_s: float  # one routed expert for one token
    step_s: float  # everything outside the sparse layers
    transfer_s: float  # one expert over the link
    predictor_s: float = 0.0  # one prediction (every sparse layer; the last predicts the next token's first)
    predictor_step_s: float = 0.0  # per step (an oracle's look-ahead pass, when measured)
    # what the engine's scheduler times one online prediction at (the worth test, the predictor's call, ranking
    # and scheduling; its worth test weighs it against the expected saving); None: predictor_s
    predict_call_s: float | None = None
    # one prediction put off (the worth test, and keeping what it reads for after the request), as the engine's
    # scheduler times it (PrefetchScheduler.put_off_s); 0: not measured
    put_off_s: float = 0.0
    handoff_s: float = 0.0  # added to every wait for a copy: waking the waiting thread (measured)
    lookup_s: float = 0.0  # per expert use when offloaded: the cache's bookkeeping (measured)
    miss_s: float = 0.0  # per transfer started: placing, evicting, queueing, on the compute thread (measured)
    # per prefetch issued: the compute thread's issuing, cancelling and promoting, as the engine times it
    # (Engine.prefetch_cost_s; its scheduler weighs a wrong guess by it); None: miss_s
    prefetch_s: float | None = None
    chunk_s: float = CHUNK_SECONDS  # link time per chunk: the longest a demand load waits behind a prefetch


@dataclass
class Projection:
    mode: str
    tpot_s: float
    compute_s: float  # per token: dense + experts + rest
    exposed_transfer_s: float  # per token: time computation waited for the link
    predictor_s: float  # per token
    hit_rate: float  # uses found resident, a copy still in flight included (as the engine counts)
    transfers_per_token: float  # copies started (demand and prefetch)
    cancelled_per_token: float = 0.0  # prefetches cancelled at their router

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def simulate(trace: RoutingTrace, costs: Costs, capacity: int, mode: str, budget: int | None = None,
             window: bool = True, policy: str = "lru") -> Projection:
    """Projected decode TPOT of `mode` over the trace's steps, with `capacity` expert slots and
    eviction `policy`; `budget` candidates per prediction (default the trace's, else top-k)."""
    if mode not in SIMULATED_MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(SIMULATED_MODES)}")
    if capacity < trace.top_k:
        raise ValueError(f"capacity {capacity} is below top-k={trace.top_k}")
    budget = budget or trace.meta.get("budget") or trace.top_k
    recorded = [len(r.predicted) for step in trace.steps for r in step if r.predicted]
    budget = min([budget] + recorded)  # a trace knows no candidates beyond those it recorded
    replay = Replay(trace, costs, capacity, mode, budget, window, policy)
    replay.run()
    n = max(len(trace.steps), 1)
    return Projection(mode, (replay.t - replay.excluded) / n, replay.compute / n, replay.waited / n,
                      replay.predict / n, replay.decode.hits / replay.decode.expert_uses
                      if replay.decode.expert_uses else math.nan,
                      (replay.decode.misses + replay.decode.prefetches) / n, replay.decode.prefetch_cancelled / n)


def overlap_bound(trace: RoutingTrace, costs: Costs, capacity: int, policy: str = "lru") -> float:
    """Σ_layers max(compute, link time of the on-demand misses) + rest, per token (seconds). Compute is the
    compute thread's: the layer, its experts' bookkeeping and starting each copy (`miss_s`), which a perfect
    predictor moving the same copies pays as on-demand does; a bound without it no free predictor reaches."""
    cache = ExpertCache(trace.layers, capacity, 1, torch.float32, "meta", policy)
    total = 0.0
    prefills = dict(trace.prefills)
    for index, step in enumerate(trace.steps):
        for layer, experts in zip(trace.layers, prefills.get(index, ())):
            _use(cache, layer, experts)
        for layer, routing in zip(trace.layers, step):
            misses = _use(cache, layer, routing.native)
            compute = costs.dense_s + len(routing.native) * (costs.expert_s + costs.lookup_s) + misses * costs.miss_s
            total += max(compute, misses * costs.transfer_s)
        total += costs.step_s
    return total / max(len(trace.steps), 1)


def _use(cache: ExpertCache, layer: int, experts) -> int:
    """One layer's experts used in order, as the engine computes them (each held only while it computes,
    so a prefill layer may use more experts than the cache holds; no copy is in flight); the misses."""
    keys = [(layer, e) for e in experts]
    misses = 0
    for key in keys:
        if not cache.resident(key):
            cache.place(key, protect=set(keys))
            misses += 1
        cache.pin(key)
        cache.unpin(key)
    return misses


def gap_closed(tpot_on_demand: float, tpot_mode: float, tpot_bound: float, min_gap: float = 0.05) -> float | None:
    """Share of the on-demand -> overlap-bound gap a mode closes (1 = at the bound); None when the
    gap is under `min_gap` of on-demand's TPOT, where the share would only magnify noise."""
    gap = tpot_on_demand - tpot_bound
    return (tpot_on_demand - tpot_mode) / gap if gap > min_gap * tpot_on_demand else None
