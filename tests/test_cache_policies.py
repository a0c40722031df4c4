"""Eviction policies of the expert cache against a straightforward reference, and the cost of a miss.

The reference keeps one record per resident expert and, on every eviction, sorts all of them by
the policy's definition; the cache must choose the same victim with its incremental structures.
"""
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evalsuite.engine.cache.slots import POLICIES, ExpertCache

LAYERS = (0, 1, 2)


class Reference:
    """Every policy by its definition, scanning everything: unused prefetches first (oldest
    first), then lru: least recent; lfu: fewest uses, then least recent; least-stale: most visits
    of its own layer since its last use, then fewest uses, then the layer needed furthest ahead of
    the one served, then least recent; predicted: least-stale, with a predicted layer's unnamed
    experts one visit staler and its named ones fresh and kept past every other fresh expert,
    lowest score first. Protected keys last, busy ones never."""

    def __init__(self, capacity, policy, per_layer):
        self.policy, self.per_layer, self.clock = policy, per_layer, 0
        self.size = capacity // len(LAYERS) if per_layer else capacity
        self.last, self.uses, self.unconfirmed = {}, {}, {}  # key -> time; key -> count; key -> time
        self.current, self.predictions = {}, {}  # pool -> layer served; layer -> {expert: score}
        self.visits, self.visit = dict.fromkeys(LAYERS, 0), {}  # layer -> visits; key -> visit of last use

    def pool(self, layer):
        return layer if self.per_layer else "all"

    def layers_of(self, pool):
        return [pool] if self.per_layer else list(LAYERS)

    def tick(self):
        self.clock += 1
        return self.clock

    def rank(self, key):
        if key in self.unconfirmed:
            return (0, self.unconfirmed[key])
        if self.policy == "lru":
            return (1, self.last[key])
        if self.policy == "lfu":
            return (1, self.uses.get(key, 0), self.last[key])
        layers = self.layers_of(self.pool(key[0]))
        served = self.current.get(self.pool(key[0]))
        ahead = ((layers.index(served) if served is not None else 0) - layers.index(key[0])) % len(layers)
        stale = self.visits[key[0]] - self.visit[key]
        scores = self.predictions.get(key[0]) if self.policy == "predicted" else None
        uses = self.uses.get(key, 0)
        if scores is None:
            return (1, -stale, uses, ahead, 0, self.last[key])
        if key[1] not in scores:
            return (1, -stale - 1, uses, ahead, 0, self.last[key])
        return (1, 0, float("inf"), ahead, scores[key[1]], self.last[key])

    def victim(self, layer, busy, protect, exclude):
        mine = [k for k in list(self.last) + list(self.unconfirmed) if self.pool(k[0]) == self.pool(layer)]
        if len(mine) < self.size:
            return "free"
        candidates = sorted((k for k in mine if k not in busy and k not in exclude), key=self.rank)
        preferred = [k for k in candidates if k not in protect] or candidates
        return preferred[0] if preferred else None

    def serve(self, layer):
        if self.current.get(self.pool(layer)) != layer:
            self.current[self.pool(layer)] = layer
            self.visits[layer] += 1

    def confirm(self, key):
        self.unconfirmed.pop(key, None)
        self.last[key], self.visit[key] = self.tick(), self.visits[key[0]]

    def place(self, key, victim, prefetch):
        if victim not in ("free", None):
            self.last.pop(victim, None), self.unconfirmed.pop(victim, None)
        if prefetch:
            self.unconfirmed[key] = self.tick()
        else:
            self.confirm(key)

    def use(self, key):
        if key in self.unconfirmed:
            self.confirm(key)
        self.serve(key[0])
        self.confirm(key)
        self.uses[key] = self.uses.get(key, 0) + 1

    def forget(self, key):
        self.last.pop(key, None), self.unconfirmed.pop(key, None)


class PendingCopy:
    def __init__(self):
        self.done, self.error = threading.Event(), None


KEYS = st.tuples(st.sampled_from(LAYERS), st.integers(0, 5))
SCORES = st.dictionaries(st.sampled_from(LAYERS), st.dictionaries(st.integers(0, 5), st.integers(0, 3)), max_size=2)
OPERATIONS = st.lists(st.tuples(st.sampled_from(["place"] * 4 + ["use"] * 3 + ["prefetch", "pin", "unpin", "copy",
                                                                                  "land", "forget", "predict"]),
                                KEYS, st.sets(KEYS, max_size=3), SCORES), min_size=20, max_size=100)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(3, 9), policy=st.sampled_from(POLICIES), per_layer=st.booleans(), ops=OPERATIONS,
       with_prefetches=st.booleans())
def test_victims_match_the_reference(capacity, policy, per_layer, ops, with_prefetches):
    cache = ExpertCache(LAYERS, capacity, numel=1, dtype=torch.float32, device="cpu", policy=policy,
                        per_layer=per_layer)
    reference, copies = Reference(capacity, policy, per_layer), {}
    for op, key, keys, scores in ops:
        if op == "prefetch" and not with_prefetches:
            op = "place"
        if op in ("place", "prefetch") and not cache.resident(key):
            prefetch = op == "prefetch"
            protect, exclude = (set(), keys) if prefetch else (keys, set())
            busy = {k for k in cache.slot_of if cache.pins.get(k) or not cache.settled(k)}
            if not prefetch:
                reference.serve(key[0])
            expected = reference.victim(key[0], busy, protect, exclude)
            assert cache.can_place(key[0], protect, exclude, prefetch) == (expected is not None)
            if expected is None:
                with pytest.raises(RuntimeError, match="no evictable slot"):
                    cache.place(key, protect, exclude, prefetch)
                continue
            _, evicted = cache.place(key, protect, exclude, prefetch)
            assert evicted == (None if expected == "free" else expected)
            reference.place(key, expected, prefetch)
        elif op in ("pin", "use") and cache.resident(key):
            cache.pin(key), reference.use(key)
            if op == "use":
                cache.unpin(key)
        elif op == "unpin" and cache.pins:
            cache.unpin(next(iter(cache.pins)))
        elif op == "copy" and cache.resident(key) and cache.settled(key):
            copies[key] = cache.transfers[key] = PendingCopy()
        elif op == "land" and copies:
            copies.pop(next(iter(copies))).done.set()
        elif op == "forget" and cache.resident(key) and not cache.pins.get(key):
            cache.forget(key), reference.forget(key)
        elif op == "predict":
            cache.predict(scores)
            reference.predictions = scores
        assert set(cache.slot_of) == set(reference.last) | set(reference.unconfirmed)
        assert cache.resident_bits == bits_of(cache.slot_of)


def bits_of(keys) -> dict:
    """ExpertCache.resident_bits of these (layer, expert) keys, counted over again."""
    return {layer: sum(1 << e for l, e in keys if l == layer) for layer in LAYERS}


def make(capacity, policy, layers=LAYERS, per_layer=False):
    return ExpertCache(layers, capacity, numel=1, dtype=torch.float32, device="cpu", policy=policy,
                       per_layer=per_layer)


def use(cache, key):
    if not cache.resident(key):
        cache.place(key)
    cache.pin(key)
    cache.unpin(key)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_unused_prefetch_is_evicted_first_and_a_used_one_ages_normally(policy):
    cache = make(3, policy, layers=(0,))
    use(cache, (0, 1)), use(cache, (0, 2))
    cache.place((0, 3), prefetch=True)  # the most recent placement, but only a guess
    assert cache.place((0, 4))[1] == (0, 3)
    cache.place((0, 5), prefetch=True)
    use(cache, (0, 5))  # confirmed: now the most recently used
    use(cache, (0, 4))
    assert cache.place((0, 6))[1] == (0, 2)  # not (0, 5): its use made it an ordinary expert


def test_least_stale_evicts_the_layer_needed_furthest_ahead():
    cache = make(6, "least-stale", layers=(0, 1, 2, 3))
    for layer in (0, 1, 2, 3):  # one step: layers 0..3 in order, layer 3 served last
        use(cache, (layer, 7))
    use(cache, (0, 8)), use(cache, (1, 8))  # the next step has begun: layer 1 is being served
    # layer 1 now needs 8, 20, 21, 22. Of the rest, layer 2 is needed 1 layer ahead, layer 3 two,
    # layer 0 three, and layer 1's unneeded expert 7 only at the next step: it goes first
    needed = {(1, 8), (1, 20), (1, 21), (1, 22)}
    order = [cache.place((1, e), protect=needed)[1] for e in (20, 21, 22)]
    assert order == [(1, 7), (0, 7), (0, 8)]


def test_least_stale_evicts_the_less_used_of_equally_stale_experts():
    cache = make(3, "least-stale", layers=(0, 1))
    use(cache, (0, 1)), use(cache, (1, 5))
    use(cache, (0, 1)), use(cache, (0, 2)), use(cache, (1, 5))  # layer 1 served; nothing is stale
    # (0, 2) was used once, (0, 1) and (1, 5) twice; by layer distance alone (1, 5) would go
    assert cache.place((1, 6), protect={(1, 6)})[1] == (0, 2)


def test_predicted_keeps_what_the_predictor_expects_for_the_coming_layer():
    cache = make(4, "predicted", layers=(0, 1))
    for e in (1, 2, 3):
        use(cache, (1, e))
    use(cache, (0, 9))
    cache.predict({1: {1: 0.9, 2: 0.1, 3: 0.5}})
    needed = {(0, 10), (0, 11), (0, 12)}
    evicted = [cache.place(key, protect=needed)[1] for key in sorted(needed)]
    # layer 0's unneeded expert is needed furthest ahead; then layer 1's, lowest score first
    assert evicted == [(0, 9), (1, 2), (1, 3)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_miss_looks_at_few_experts_however_large_the_cache(policy, monkeypatch):
    # 1,536 slots (Qwen3-30B-A3B at 25 %): choosing a victim must not visit every resident expert
    cache = make(1536, policy, layers=range(48))
    for e in range(1536):
        use(cache, (e % 48, e // 48))
    looked = []
    evictable = cache._evictable
    monkeypatch.setattr(cache, "_evictable", lambda key, exclude=(): looked.append(key) or evictable(key, exclude))
    needed = {(5, 100 + i) for i in range(8)}
    for key in sorted(needed):
        assert cache.can_place(5, needed)
        cache.place(key, needed)
        cache.pin(key)
    assert len(looked) <= 8 * 2  # about one look per miss, not 1,536


def test_place_reuses_the_victim_can_place_found(monkeypatch):
    cache = make(2, "lru", layers=(0,))
    use(cache, (0, 1)), use(cache, (0, 2))
    pool, calls = cache.pools[0], []
    victim = pool.victim
    monkeypatch.setattr(pool, "victim", lambda *a: calls.append(1) or victim(*a))
    protect = {(0, 3)}
    assert cache.can_place(0, protect)
    assert cache.place((0, 3), protect)[1] == (0, 1)
    assert len(calls) == 1
