"""Property tests: the expert cache, the engine's residency logic and the prefetch scheduler.

Random operation sequences, policies, pools and capacities; the invariants are the ones the
engine's correctness rests on: never more than capacity resident, never evict an expert in use
or in flight, every executed expert resident, one copy per expert at a time, counters that add up.
"""
import copy
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evalsuite
from evalsuite.engine import arch
from evalsuite.engine.cache.slots import POLICIES, ExpertCache, capacity_in_experts
from evalsuite.engine.prediction.scheduler import PrefetchScheduler, ranked

from .helpers import reference_model

QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- capacity_in_experts

@QUICK
@given(total=st.integers(1, 4096), expert_bytes=st.integers(1, 1 << 20),
       spec=st.one_of(st.integers(1, 10_000), st.floats(1e-6, 1.0), st.sampled_from(["all", None]),
                      st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 1 << 16),
                                st.sampled_from(["B", "KB", "KiB", "MB", "MiB", "GiB"]))))
def test_capacity_never_exceeds_the_experts_there_are(total, expert_bytes, spec):
    count = capacity_in_experts(spec, total, expert_bytes)
    assert isinstance(count, int) and 0 <= count <= total
    if isinstance(spec, int) or isinstance(spec, float):
        assert count >= 1  # counts and fractions always hold at least one expert


@QUICK
@given(spec=st.one_of(st.integers(-100, 0), st.floats(1.0001, 1e6), st.floats(-1e6, 0.0), st.booleans(),
                      st.text(alphabet="xyz ", min_size=1, max_size=5)))
def test_bad_capacities_are_refused(spec):
    with pytest.raises(ValueError, match="cache_capacity"):
        capacity_in_experts(spec, 64, 128)


# ---------------------------------------------------------------- ExpertCache on its own

class PendingCopy:
    """A stand-in for a Transfer: in flight until `land()`."""

    def __init__(self):
        self.done = threading.Event()

    def land(self):
        self.done.set()


LAYERS = (0, 1, 2)
KEYS = st.tuples(st.sampled_from(LAYERS), st.integers(0, 5))
OPERATIONS = st.lists(st.tuples(st.sampled_from(["place", "prefetch", "pin", "unpin", "copy", "land"]), KEYS,
                                st.sets(KEYS, max_size=3)), min_size=1, max_size=60)


def check_cache(cache, capacity, per_layer):
    resident = cache.slot_of
    assert len(resident) <= capacity
    assert len(set(resident.values())) == len(resident)  # one expert per slot
    assert all(0 <= slot < capacity for slot in resident.values())
    for layer in LAYERS:
        pool = cache.pools[layer]
        keys = list(pool.keys())
        assert len(keys) == len(set(keys)) == pool.resident and set(keys) <= set(resident)
        assert len(keys) + len(pool.free) == (capacity // len(LAYERS) if per_layer else capacity)
        if per_layer:
            assert all(key[0] == layer for key in keys)
    assert set(cache.pins) <= set(resident)  # a pinned expert is resident
    assert set(cache.transfers) <= set(resident)  # so is one being copied


@QUICK
@given(capacity=st.integers(3, 9), policy=st.sampled_from(POLICIES), per_layer=st.booleans(), ops=OPERATIONS)
def test_cache_invariants_under_random_operations(capacity, policy, per_layer, ops):
    cache = ExpertCache(LAYERS, capacity, numel=2, dtype=torch.float32, device="cpu", policy=policy,
                        per_layer=per_layer)
    copies: dict = {}
    for op, key, protect in ops:
        if op in ("place", "prefetch") and not cache.resident(key):
            busy = {k for k in cache.slot_of if cache.pins.get(k) or not cache.settled(k)}
            prefetch = op == "prefetch"
            if cache.can_place(key[0], protect, prefetch=prefetch):
                _, evicted = cache.place(key, protect, prefetch=prefetch)
                assert evicted is None or evicted not in busy  # never an expert in use or in flight
                assert evicted is None or not cache.resident(evicted)
            else:
                with pytest.raises(RuntimeError):
                    cache.place(key, protect, prefetch=prefetch)
        elif op == "pin" and cache.resident(key):
            cache.pin(key)
        elif op == "unpin" and cache.pins.get(key):
            cache.unpin(key)
        elif op == "copy" and cache.resident(key) and cache.settled(key):
            copies[key] = cache.transfers[key] = PendingCopy()
        elif op == "land" and key in copies:
            copies.pop(key).land()
        check_cache(cache, capacity, per_layer)


# ---------------------------------------------------------------- the engine on tiny models

def _inside(view, slot) -> bool:
    start = slot.data_ptr()
    return start <= view.data_ptr() < start + slot.numel() * slot.element_size()


class Watch:
    """Wraps one engine's hot path and checks residency as each expert executes."""

    def __init__(self, engine, monkeypatch):
        self.engine, self.executed, self.violations = engine, 0, []
        self.latest: dict = {}  # key -> its most recent transfer
        ready, submit, place = engine._ready_views, engine.transfers.submit, engine.cache.place

        def ready_views(key, counters):
            views = ready(key, counters)  # waits for the copy; the expert computes right after
            cache = engine.cache
            if not cache.resident(key) or not cache.pins.get(key):
                self.violations.append(f"{key} executed without being resident and pinned")
            elif not _inside(views["gate_up_proj"], cache.slots[cache.slot_of[key]]):
                self.violations.append(f"{key} computed from memory outside its slot")
            transfer = cache.transfers.get(key)
            if transfer is not None and not transfer.done.is_set():
                self.violations.append(f"{key} executed before its copy landed")
            if len(cache.slot_of) > cache.slots.shape[0]:
                self.violations.append("more experts resident than slots")
            self.executed += 1
            return views

        def submitted(key, dst, prefetch=False):
            previous = self.latest.get(key)
            if previous is not None and not previous.done.is_set():
                self.violations.append(f"{key} copied twice at once")
            self.latest[key] = transfer = submit(key, dst, prefetch)
            return transfer

        def placed(key, protect=(), exclude=(), prefetch=False):
            cache = engine.cache
            busy = {k for k in cache.slot_of if cache.pins.get(k) or not cache.settled(k)}
            slot, evicted = place(key, protect, exclude, prefetch)
            if evicted in busy:
                self.violations.append(f"evicted {evicted} while in use or in flight")
            return slot, evicted

        monkeypatch.setattr(engine, "_ready_views", ready_views)
        monkeypatch.setattr(engine.transfers, "submit", submitted)
        monkeypatch.setattr(engine.cache, "place", placed)


STEPS = st.lists(st.one_of(
    st.tuples(st.just("prefetch"), st.integers(0, 2), st.lists(st.integers(0, 7), max_size=8)),
    st.tuples(st.just("forward"), st.integers(1, 3), st.integers(2, 6)),
    st.tuples(st.just("generate"), st.integers(1, 2), st.integers(1, 3)),
), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(model_type=st.sampled_from(["qwen3_moe", "olmoe", "deepseek_v3"]),
       mode=st.sampled_from(["on-demand", "router-preserving"]),
       capacity=st.integers(2, 24), policy=st.sampled_from(POLICIES),
       pools=st.sampled_from(["global", "per-layer"]), link=st.sampled_from([None, "0.2GB/s"]),
       steps=STEPS, seed=st.integers(0, 1000))
def test_engine_residency_and_counters(monkeypatch, model_type, mode, capacity, policy, pools, link, steps, seed):
    model = copy.deepcopy(reference_model(model_type, "float32"))
    layers = len(arch.sparse_layers(model))
    per_pool = capacity // layers if pools == "per-layer" else capacity
    options = dict(mode=mode, cache_capacity=capacity, cache_policy=policy, cache_pools=pools, link=link)
    if mode == "router-preserving":
        options["predictor"] = "gate"  # a random model has no calibration artifact
    if per_pool < 2:  # below top-k: refused up front, nothing touched
        with pytest.raises(ValueError, match="below top-k"):
            evalsuite.offload(model, **options)
        return
    generator = torch.Generator().manual_seed(seed)
    with monkeypatch.context() as patch, evalsuite.offload(model, **options) as engine, torch.no_grad():
        watch = Watch(engine, patch)
        for step in steps:
            if step[0] == "prefetch":
                layer = engine.layers[min(step[1], layers - 1)].index
                wanted = {(layer, e) for e in step[2]}
                started = engine.prefetch(layer, step[2])
                assert started <= len(wanted)  # stricter: test_prefetch_keeps_the_experts_it_was_asked_for
            else:
                ids = torch.randint(3, 128, (step[1], step[2]), generator=generator)
                if step[0] == "forward":
                    model(input_ids=ids)
                else:
                    model.generate(ids, max_new_tokens=step[2], do_sample=False, pad_token_id=0)
        s = engine.stats()
    assert watch.violations == []
    assert watch.executed == s["expert_uses"]
    assert s["hits"] + s["misses"] == s["expert_uses"]
    assert s["bytes_transferred"] == (s["misses"] + s["prefetches"]) * s["expert_bytes"]
    for name in ("expert_uses", "hits", "misses", "prefetches", "bytes_transferred"):
        assert sum(layer[name] for layer in s["layers"].values()) == s[name]


def test_prefetch_keeps_the_experts_it_was_asked_for():
    # Two slots hold experts 0 and 1; a prefetch of [2, 0] should evict 1 (not asked for) and
    # keep 0. Evicting 0 for 2 and then copying 0 back wastes a transfer and the slot of 1.
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    with evalsuite.offload(model, cache_capacity=2) as engine:
        assert engine.prefetch(0, [0, 1]) == 2
        for key in [(0, 0), (0, 1)]:
            engine.cache.transfers[key].wait(5)
        started = engine.prefetch(0, [2, 0])
        resident = {key for key in engine.cache.slot_of}
    assert resident == {(0, 0), (0, 2)}
    assert started == 1


# ---------------------------------------------------------------- the prefetch scheduler

class SchedulerStub:
    """The parts of an engine the scheduler reads, with a log of what it asked to prefetch."""

    def __init__(self, resident, per_transfer, queued):
        self.layers = [type("Layer", (), {"index": i, "top_k": 2})() for i in range(3)]
        self.cache = type("Cache", (), {"resident": staticmethod(lambda key: key in resident),
                                        "victim_regret": staticmethod(lambda: 0.0), "spare": staticmethod(lambda layer: 0)})()
        self.transfers = type("Link", (), {"seconds_per_transfer": staticmethod(lambda: per_transfer),
                                           "prefetches_queued": staticmethod(lambda: queued), "chunk_bytes": 64,
                                           "chunk_s": None})()
        self.layout = type("Layout", (), {"nbytes": 4096})()
        self.prefetch_cost_s = None
        self.demand_cost_s = None  # unmeasured: a right prefetch spares what it costs
        self.requested: list = []

    def prefetch(self, layer, experts, keep=()):
        self.requested += [(layer, e) for e in experts]
        return len(experts)


@QUICK
@given(budget=st.integers(1, 8), target=st.integers(0, 2), horizon=st.sampled_from([1, 2]),
       tokens=st.integers(1, 4), resident=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 7))),
       per_transfer=st.one_of(st.none(), st.floats(1e-5, 1e-2)), layer_s=st.one_of(st.none(), st.floats(1e-5, 1e-2)),
       queued=st.integers(0, 4), window=st.booleans(), seed=st.integers(0, 1000))
def test_scheduler_respects_budget_and_residency(budget, target, horizon, tokens, resident, per_transfer, layer_s,
                                                 queued, window, seed):
    engine = SchedulerStub(resident, per_transfer, queued)
    scheduler = PrefetchScheduler(engine, budget, window)
    scheduler.layer_s = layer_s
    scores = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(seed))
    started = scheduler.schedule(target, ranked(scores, budget), horizon)
    assert started == len(engine.requested) <= budget
    assert len(set(engine.requested)) == len(engine.requested)
    assert not set(engine.requested) & resident
    if started and window and per_transfer is not None and layer_s is not None:
        assert (queued + started - 1) * per_transfer < layer_s * horizon  # each one starts before its layer
