"""Eviction policies, pinning and capacity parsing of the device expert cache."""
import os

import pytest
import torch

from evalsuite.engine.cache.slots import ExpertCache, capacity_in_experts


def make(capacity=2, policy="lru", per_layer=False, layers=(0, 1)):
    return ExpertCache(layers, capacity, numel=4, dtype=torch.float32, device="cpu", policy=policy, per_layer=per_layer)


def use(cache, key):
    if not cache.resident(key):
        cache.place(key)
    cache.pin(key)
    cache.unpin(key)


def test_lru_evicts_least_recent():
    cache = make()
    use(cache, (0, 1)), use(cache, (0, 2)), use(cache, (0, 1))
    _, evicted = cache.place((0, 3))
    assert evicted == (0, 2) and cache.resident((0, 1))


def test_lfu_evicts_least_used():
    cache = make(policy="lfu")
    for _ in range(3):
        use(cache, (0, 1))
    use(cache, (0, 2))
    use(cache, (0, 1))
    _, evicted = cache.place((0, 3))
    assert evicted == (0, 2)


def test_pinned_and_in_flight_experts_are_never_evicted():
    class Pending:
        done = type("E", (), {"is_set": staticmethod(lambda: False)})()

    cache = make()
    cache.place((0, 1)); cache.pin((0, 1))
    cache.place((0, 2)); cache.transfers[(0, 2)] = Pending()
    assert not cache.can_place(0)
    with pytest.raises(RuntimeError, match="pinned"):
        cache.place((0, 3))


def test_protected_keys_are_evicted_last():
    cache = make()
    use(cache, (0, 1)), use(cache, (0, 2))
    _, evicted = cache.place((0, 3), protect={(0, 1)})
    assert evicted == (0, 2)


def test_per_layer_pools_do_not_share_slots():
    cache = make(capacity=4, per_layer=True)
    use(cache, (0, 1)), use(cache, (0, 2)), use(cache, (1, 5))
    _, evicted = cache.place((0, 3))
    assert evicted == (0, 1) and cache.resident((1, 5))
    assert cache.slots_per_layer(0) == cache.slots_per_layer(1) == 2


def test_slots_are_one_allocation_of_capacity_rows():
    cache = make(capacity=3)
    assert cache.slots.shape == (3, 4) and cache.nbytes == 3 * 4 * 4


@pytest.mark.parametrize("spec,expected", [(5, 5), (0.25, 16), ("all", 64), (1.0, 64), ("1KiB", 8), ("2KB", 15), (100, 64)])
def test_capacity_forms(spec, expected):
    assert capacity_in_experts(spec, total_experts=64, expert_bytes=128) == expected


@pytest.mark.parametrize("spec", [0.0, 1.5, -2.0, "lots", "12 parsecs", True])
def test_bad_capacity_is_rejected(spec):
    with pytest.raises(ValueError, match="cache_capacity"):
        capacity_in_experts(spec, total_experts=64, expert_bytes=128)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_host_cache_backs_its_slots_when_built():
    """A fetch into a slot must not pay the slot's first-touch page faults (a device cache never does): the
    slots' memory is resident once the cache is built, before any copy."""
    before = _resident_bytes()
    cache = ExpertCache([0, 1], 16, numel=2**20, dtype=torch.float32, device="cpu")  # 64 MiB
    assert _resident_bytes() - before >= 0.9 * cache.slots.numel() * 4


def test_a_prefetch_s_victim_is_regretted_only_if_a_demand_load_asks_for_it_in_the_next_run_of_placements():
    """victim_regret: of the used experts prefetches evicted, right guesses or wrong ones whose copy had started, the
    share a demand load asked for in the first run of placements after the prefetch's (one layer's demand loads,
    one prediction's prefetches): later, that run would have evicted it anyway, first in eviction order as it was.
    A prefetch cancelled before its copy started gives its victim back: no sample."""
    cache = make(capacity=2)
    assert cache.victim_regret() == 0.0 and cache.spare(0) == 2  # free slots first: no used expert to lose
    use(cache, (0, 1)), use(cache, (0, 2))
    assert cache.spare(1) == 0
    cache.place((1, 3), prefetch=True)  # evicts (0, 1), the least recent
    assert cache.spare(1) == 1  # the unconfirmed guess goes before a used expert
    use(cache, (1, 3))  # a right guess: its victim stays evicted
    use(cache, (0, 1))  # the next run asks for it: without the prefetch it would have been a hit
    assert (cache.victims_lost, cache.victims_regretted) == (1, 1) and cache.victim_regret() == 1 / 3
    cache.place((1, 4), prefetch=True)  # evicts (1, 3)
    use(cache, (0, 5))  # the next run: layer 0's demand loads (the unconfirmed guess goes first)
    use(cache, (1, 6))  # a run later: (1, 3) would have gone by now anyway
    use(cache, (1, 3))
    assert (cache.victims_lost, cache.victims_regretted) == (2, 1)
    cache.place((0, 7), prefetch=True)
    assert cache.withdraw((0, 7), untouched=True) is not None  # given back, not lost
    use(cache, (1, 8)), use(cache, (0, 9))
    assert cache.victims_lost == 2 and not cache.watched


def test_the_resident_bits_of_a_layer_follow_its_experts_in_and_out():
    """resident_bits (what a prediction put off is scored against): a layer's resident experts, 1 << expert each,
    through placements, evictions, a copy forgotten and a cancelled prefetch that gives its victim back."""
    cache = make(capacity=2)
    use(cache, (0, 1)), use(cache, (1, 3))
    assert cache.resident_bits == {0: 0b10, 1: 0b1000}
    cache.place((0, 5), prefetch=True)  # evicts (0, 1)
    assert cache.resident_bits == {0: 0b100000, 1: 0b1000}
    cache.withdraw((0, 5), untouched=True)  # cancelled before its copy started: (0, 1) comes back
    assert cache.resident_bits == {0: 0b10, 1: 0b1000}
    use(cache, (1, 0))  # evicts (0, 1), now the least recent
    assert cache.resident_bits == {0: 0, 1: 0b1001}
    cache.forget((1, 3))
    assert cache.resident_bits == {0: 0, 1: 0b1}
