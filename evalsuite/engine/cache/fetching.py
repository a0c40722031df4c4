"""How a sparse layer's experts reach their cache slots: demand loads in the eager kernel's order,
prefetches ahead of need, and settling those at the router (cancel the unpicked, promote the picked).

`ExpertFetching` holds the Engine's methods for this (the Engine is the one class that mixes it in):
they read the engine's cache, transfers, record and driver, and the pass running now (`forward`).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from evalsuite.engine.metrics import Counters
from evalsuite.engine.link.worker import TransferError

# a layer's miss rate rests on about its last MISS_RATE_MEMORY decode steps' uses (each older use weighs
# 1 - 1/(MISS_RATE_MEMORY·top-k) less): a request's first decode tokens miss far more than its later ones (the
# cache turns from the prompt's experts to the decode's), and a rate over every use kept the scheduler expecting
# missing candidates long after (a VL model on the SD card at 25 %: 0.35 at the ninth token, whose eight tokens
# before had missed none)
MISS_RATE_MEMORY = 8


def fading_keep(top_k: int) -> float:
    """What an older decode use weighs in a miss-rate tally, one use on (MISS_RATE_MEMORY steps of top-k uses)."""
    return 1.0 - 1.0 / (MISS_RATE_MEMORY * top_k)


def count_use(tally: list[float], missed: bool, keep: float) -> None:
    """One decode use more in a layer's [uses, would have missed] tally, the older ones weighing `keep` less."""
    tally[0] = tally[0] * keep + 1.0
    tally[1] = tally[1] * keep + missed


def rate_of(tally, absent: float) -> float:
    """The tally's miss rate, from a prior of one use that missed `absent` of the time (ExpertFetching.miss_rate)."""
    return (tally[1] + absent) / (tally[0] + 1)


def absent_share(bits: int, experts: int) -> float:
    """The share of a layer's `experts` the cache does not hold (`bits`: ExpertCache.resident_bits of the layer)."""
    return 1.0 - bits.bit_count() / experts


class ExpertFetching:
    """Engine methods: weights_in_order (the hot path), prefetch, settle_prefetches, and their helpers."""

    def weights_in_order(self, layer: int, experts, needed: list[int]):
        """Yield (expert, weight views) for `needed` in order, fetching ahead as slots allow."""
        counters, forward = self.record.counters[layer], self.forward
        if self.tracer is not None and not forward.looking_ahead:
            self.tracer.executed(layer, needed)
        forward.layer_hits.clear()
        if forward.looking_ahead:  # the oracle's look-ahead: compute from the store, count nothing
            for e in needed:
                yield e, self._stored_views(experts, layer, e)
            return
        if self.driver is not None and self.cache.policy == "predicted":
            self._share_predictions()
        waiting = deque((layer, e) for e in needed)
        protect = set(waiting)
        held: deque = deque()
        try:
            while waiting or held:
                while waiting and (self.cache.resident(waiting[0]) or self.cache.can_place(layer, protect)):
                    key = waiting.popleft()
                    self._acquire(key, protect, counters)
                    held.append(key)
                if self.driver is not None:  # this layer's demand loads are queued: prefetch behind them
                    self.driver.release_prefetch()
                if not held:  # every slot it could take is still being filled: wait for one
                    self._await_slot(layer, waiting[0], counters)
                    continue
                key = held[0]  # stays held (and pinned) until computed, even if the wait raises
                yield key[1], self._ready_views(key, counters)
                held.popleft()
                self.cache.unpin(key)
        finally:  # an exception mid-layer must not leave slots pinned
            for key in held:
                self.cache.unpin(key)

    def _stored_views(self, experts, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return self.layout.views(self.store.read((layer, expert)).to(self.device))

    def prefetch(self, layer: int, experts, demand: bool = False, keep=()) -> int:
        """Start copying `experts` of sparse layer `layer` now, ahead of need; returns how many
        transfers started. Resident experts are skipped; a slot is taken only if one can be
        freed without touching pinned or in-flight experts. A prefetched expert waits at the
        cache's eviction end until a use confirms it. Prefetching never changes outputs.
        `demand`: the copies queue with demand loads (experts that will certainly execute).
        `keep`: more experts of this layer not to evict (the prediction's resident candidates)."""
        if self.cache is None:
            return 0
        begun = time.perf_counter()
        counters, started = self.record.counters[layer], 0
        keep = {(layer, int(e)) for e in [*experts, *keep]}  # never evict one candidate for another
        for e in experts:
            key = (layer, int(e))
            if self.cache.resident(key) or not self.cache.can_place(layer, exclude=keep, prefetch=True):
                continue
            slot, evicted = self.cache.place(key, exclude=keep, prefetch=True)
            self._evicted(evicted)
            self._submit(key, slot, counters, prefetch=not demand)
            self._prefetched.add(key)
            self.prefetches_to_settle.setdefault(layer, {})[key] = None
            counters.prefetches += 1
            started += 1
        self._prefetch_work(time.perf_counter() - begun, started)
        return started

    def _prefetch_work(self, seconds: float, prefetches: int) -> None:
        """Compute-thread time spent issuing, cancelling and promoting prefetches, per prefetch
        issued (`prefetch_cost_s`, what the scheduler weighs a wrong guess by besides link time)."""
        self.prefetch_work_s += seconds
        self._prefetch_n += prefetches
        if self._prefetch_n:
            self.prefetch_cost_s = self.prefetch_work_s / self._prefetch_n

    def miss_rate(self, layer: int) -> float:
        """Share of sparse layer `layer`'s recent decode expert uses that would have missed without prefetching
        (older uses fade: MISS_RATE_MEMORY): misses, and hits on experts a prefetch brought, from a prior of one
        use that missed as often as the layer's experts are absent from the cache as it stands (with no decode use
        yet, that share: without a prior, a first decode token's few hits read 0 and put the layer's predictions
        off for tokens to come; a prior of a miss read 1 where the prefill had filled the cache, and kept a new
        engine's first tokens predicting online for nothing). Decode only: a prefill starts on a cold cache, and
        its misses would keep the rate high long after the cache warmed."""
        absent = absent_share(self.cache.resident_bits[layer], self._experts_in[layer])
        return rate_of(self._decode_tally.get(layer, (0.0, 0.0)), absent)

    def settle_prefetches(self, layer: int, confirmed) -> int:
        """Sparse layer `layer`'s router chose `confirmed`: its prefetches the router did not pick
        are cancelled (a queued copy is dropped, a moving one stops at its next chunk; the slot
        goes back to the pool, or, if no chunk of it was written, to the expert it evicted), and the picked ones
        still in flight are promoted to demand priority, ahead of the wrong guesses. Returns
        how many were cancelled. Only the layer's prefetches sent since its router last settled them
        are looked at (promoted in the order they were sent, cancelled newest first): the others
        landed, were promoted (and so ran, and landed) or were cancelled then."""
        prefetches_to_settle = self.prefetches_to_settle.pop(layer, None)
        if self.cache is None or not prefetches_to_settle:
            return 0
        begun = time.perf_counter()
        counters, cancelled, pinned, wrong = self.record.counters[layer], 0, {}, []
        for key in prefetches_to_settle:
            transfer = self.cache.transfers.get(key)
            if key not in self._prefetched or transfer is None or transfer.done.is_set():
                continue  # used, evicted, or landed: a landed one stays at the eviction end, maybe used later
            if key[1] in confirmed:
                self.transfers.promote(transfer)
            elif self.cache.pins.get(key):
                pinned[key] = None  # in use now: looked at again at the layer's next router
            else:
                wrong.append((key, transfer))
        # The newest first: a cancelled copy that is moving hands the link, at its chunk's end, to the next
        # prefetch queued; were that a wrong guess still to be cancelled, it would lose the expert it evicted.
        for key, transfer in reversed(wrong):
            if self.transfers.cancel(transfer):
                if self.cache.withdraw(key, transfer.untouched) is not None:
                    counters.victims_restored += 1
                self._prefetched.discard(key)
                counters.prefetch_cancelled += 1
                cancelled += 1
        if pinned:
            self.prefetches_to_settle[layer] = pinned  # nothing above sends a prefetch, so the layer has no newer ones
        self._prefetch_work(time.perf_counter() - begun, 0)
        return cancelled

    def _submit(self, key, slot: int, counters: Counters, prefetch: bool = False) -> None:
        transfer = self.transfers.submit(key, self.cache.slots[slot], prefetch)
        self.cache.transfers[key] = transfer
        counters.bytes_transferred += transfer.nbytes

    def _acquire(self, key, protect, counters: Counters) -> None:
        counters.expert_uses += 1
        if self.cache.failed(key):  # its copy failed earlier: the slot holds nothing usable
            self.cache.forget(key)
        resident = self.cache.resident(key)
        if self.forward.kinds is not None:  # which experts hit, for hit rate by token kind
            self.forward.layer_hits[key[1]] = resident
        if self.forward.decoding:  # miss_rate's tally: would this use have missed without prefetching?
            tally = self._decode_tally.get(key[0])
            if tally is None:
                tally = self._decode_tally[key[0]] = [0.0, 0.0]
            count_use(tally, not resident or key in self._prefetched, self._tally_keep)
        if resident:
            counters.hits += 1
            if key in self._prefetched:
                self._prefetched.discard(key)
                counters.prefetch_used += 1
        else:
            begun = time.perf_counter()
            counters.misses += 1
            self.missed += 1
            slot, evicted = self.cache.place(key, protect)
            self._evicted(evicted)
            self._submit(key, slot, counters)
            self.demand_work_s += time.perf_counter() - begun
            self._demand_n += 1
            self.demand_cost_s = self.demand_work_s / self._demand_n
        self.cache.pin(key)

    def _stalled(self, counters: Counters, seconds: float) -> None:
        counters.stall_s += seconds
        if self.forward.decoding:
            counters.decode_stall_s += seconds
        self.stalled_s += seconds  # the engine's total, which the prefetch scheduler reads per layer

    def _evicted(self, key) -> None:
        if key in self._prefetched:  # a prefetch that was never used
            self._prefetched.discard(key)
            self.record.counters[key[0]].prefetch_wasted += 1

    def _await_slot(self, layer: int, key, counters: Counters) -> None:
        """No slot `key` could take is free, pinned ones aside: each holds a copy still in flight
        (prefetches for this layer's pool). Wait for the oldest to land; then it can be evicted."""
        in_flight = self.cache.in_flight(layer)
        if not in_flight:
            raise RuntimeError(f"layer {layer}: no cache slot can be freed for {key}: every slot is pinned")
        busy, transfer = in_flight[0]
        try:
            self._stalled(counters, transfer.wait(self.timeout_s))
        except TransferError:
            if not self.cache.failed(busy):  # late, not failed: it may still land, so the slot stays taken
                raise
            self.cache.forget(busy)  # it will never land: its slot is free again
            self._evicted(busy)

    def _share_predictions(self) -> None:
        """cache_policy 'predicted': give the cache the candidates of the predictor's latest
        predictions for the layers still to come (the driver's pending ones): the `budget` experts
        it is most confident in, as the prefetch scheduler ranks them, with their confidence."""
        pending = self.driver.pending  # target position -> (router scores, ranked candidates), until that layer runs
        if pending.keys() == self._shared.keys() and all(pending[p] is s for p, (s, _) in self._shared.items()):
            return
        self._shared = {pos: (made, _candidates(made[0], self.budget)) for pos, made in pending.items()}
        self.cache.predict({self.layers[pos].index: named for pos, (_, named) in self._shared.items()})

    def _ready_views(self, key, counters: Counters) -> dict[str, torch.Tensor]:
        """The expert's weights in its slot, once its copy is usable here (see Transfer.wait)."""
        transfer = self.cache.transfers.get(key)
        if transfer is not None:
            self.transfers.promote(transfer)  # a prefetch the compute now waits for goes before other prefetches
            try:
                self._stalled(counters, transfer.wait(self.timeout_s))
            except TransferError:
                if self.cache.failed(key):  # a timed-out copy may still land; a failed one never will
                    self.cache.forget(key)
                raise
        return self.layout.views(self.cache.slots[self.cache.slot_of[key]])


def _candidates(scores: torch.Tensor, budget: int) -> dict[int, float]:
    """{expert: confidence} of the `budget` most likely experts (confidence: probability summed over tokens)."""
    confidence = torch.softmax(scores.float(), dim=-1).sum(dim=0)
    top = confidence.topk(min(budget, confidence.numel()))
    return dict(zip(top.indices.tolist(), top.values.tolist()))
