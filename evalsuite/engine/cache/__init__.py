"""The device's expert cache: slots, who holds them, what to evict, and how a layer's experts reach them.

slots.py     ExpertCache: the slot pool(s), pins, copies in flight, and the capacity rules
eviction.py  the eviction orders, one class per `cache_policy`
fetching.py  ExpertFetching: a layer's experts in the kernel's order as they land (`weights_in_order`), prefetches,
             and settling prefetches at the router (cancel the unpicked, promote the picked)
"""
from evalsuite.engine.cache.eviction import POLICIES
from evalsuite.engine.cache.slots import ExpertCache, capacity_in_experts, check_fits

__all__ = ["POLICIES", "ExpertCache", "capacity_in_experts", "check_fits"]
