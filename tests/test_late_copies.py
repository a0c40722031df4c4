"""Exactness with copies that land late: a slot is read only after its copy landed.

LateCopies poisons a chunk with NaN when it is issued and writes the data from another thread a
little later, like an asynchronous device copy. Any read of a slot before its copy landed then
changes the output, so these tests prove the engine's ordering (transfer bookkeeping, victim
choice, `_ready_views`) on a CPU. The last tests remove one wait and expect the check to fail.
"""
import copy
import importlib
import threading

import pytest
import torch

import evalsuite
from evalsuite.engine.cache.slots import ExpertCache
from evalsuite.engine.link.copy_backends import LateCopies
from evalsuite.engine.link.worker import Transfer, TransferWorker

from .helpers import batch, reference_model
from .test_exactness import run
from .test_modes import artifact_for

tiers_module = importlib.import_module("evalsuite.engine.placement.offloading")  # where engines build their link
DELAY_S = 0.001  # per chunk, on the late thread


@pytest.fixture(params=[None, 8192], ids=["whole", "chunked"])
def late_copies(request, monkeypatch):
    """Every transfer worker built in the test copies through LateCopies (whole experts, or 8 KiB chunks)."""
    chunk_bytes = request.param

    def late_worker(store, device, link=None, timeout_s=60.0):
        return TransferWorker(store, device, link, timeout_s, chunk_bytes=chunk_bytes, copies=LateCopies(DELAY_S))

    monkeypatch.setattr(tiers_module, "TransferWorker", late_worker)


MODES = {
    "on-demand": dict(mode="on-demand"),
    "router-preserving-gate": dict(mode="router-preserving", predictor="gate"),
    "router-preserving-quasi": dict(mode="router-preserving", predictor="quasi"),
    "router-preserving-oracle": dict(mode="router-preserving", predictor="oracle"),
}


def options(model_type: str, name: str) -> dict:
    chosen = dict(MODES[name], cache_capacity=0.5)
    if chosen.get("predictor") == "quasi":
        chosen["artifact"] = artifact_for(model_type)
    return chosen


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_exact_modes_are_bit_identical_with_late_copies(late_copies, model_type, mode):
    reference = reference_model(model_type)
    ids, mask = batch(4)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="resident"):  # the resident reference, through the engine
        expected = run(model, ids, mask)
    assert torch.equal(expected[0], run(reference, ids, mask)[0])
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, **options(model_type, mode)) as engine:
        assert isinstance(engine.transfers.copies, LateCopies)
        got = run(model, ids, mask)
        stats = engine.stats()
    assert stats["misses"] > 0
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def landed_at_use(model_type: str, mode: str):
    """Run a generation, checking at every use that the slot holds the stored expert.
    Returns (uses whose slot did not hold it, prefetched experts used)."""
    model = copy.deepcopy(reference_model(model_type))
    stale = []
    with evalsuite.offload(model, **options(model_type, mode)) as engine:
        ready = engine._ready_views

        def checked(key, counters):
            views = ready(key, counters)
            if not torch.equal(engine.cache.slots[engine.cache.slot_of[key]], engine.store.read(key)):
                stale.append(key)
            return views

        engine._ready_views = checked
        run(model, *batch(4))
        return stale, engine.stats()["prefetch_used"]


def test_every_use_reads_a_landed_copy(late_copies):
    stale, prefetch_hits = landed_at_use("qwen3_moe", "router-preserving-oracle")
    assert stale == [] and prefetch_hits > 0


# ---- teeth: with one wait removed, the same checks fail --------------------------------------

def drop_when_issued(self, key) -> bool:
    """The bookkeeping bug: forget a copy once it is issued, before it has landed."""
    transfer = self.transfers.get(key)
    if transfer is not None and transfer.issued.is_set():
        del self.transfers[key]
        transfer = None
    return transfer is None


def scanned_then_used(monkeypatch):
    """Prefetch four experts over a deep, slow late link, run a victim scan that meets them in
    flight (they are protected, so it only looks), then use them: which slots held stale data?"""
    monkeypatch.setattr(tiers_module, "TransferWorker", lambda store, device, link=None, timeout_s=60.0:
                        TransferWorker(store, device, link, timeout_s, copies=LateCopies(0.05, depth=64)))
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, cache_capacity=4) as engine:
        layer = engine.layers[0].index
        keys = [(layer, e) for e in range(4)]
        assert engine.prefetch(layer, [e for _, e in keys]) == 4
        for key in keys:  # issued, not landed: the copies land 50 ms apart
            assert engine.cache.transfers[key].issued.wait(5) and not engine.cache.transfers[key].done.is_set()
        engine.cache.can_place(layer, protect=set(keys))
        counters = engine.record.counters[layer]
        stale = []
        for key in keys:
            engine._ready_views(key, counters)
            if not torch.equal(engine.cache.slots[engine.cache.slot_of[key]], engine.store.read(key)):
                stale.append(key)
    return stale


def test_a_victim_scan_never_forgets_a_copy_in_flight(monkeypatch):
    assert scanned_then_used(monkeypatch) == []


def test_forgetting_issued_copies_is_caught(monkeypatch):
    monkeypatch.setattr(ExpertCache, "settled", drop_when_issued)
    assert scanned_then_used(monkeypatch), "a copy forgotten before it landed went unnoticed"


class HeldCopies(LateCopies):
    """LateCopies that land nothing until `hold` is set: a read that does not wait never finds its copy
    landed, however slowly a loaded machine runs the compute thread."""

    def __init__(self, hold: threading.Event):
        self.hold = hold
        super().__init__(DELAY_S)

    def _land(self) -> None:
        self.hold.wait()
        super()._land()


@pytest.mark.parametrize("chunk_bytes", [None, 8192], ids=["whole", "chunked"])
def test_a_missing_wait_breaks_exactness(chunk_bytes, monkeypatch):
    reference = reference_model("qwen3_moe")
    ids, mask = batch(4)
    expected = run(reference, ids, mask)[0]
    hold = threading.Event()

    def held_worker(store, device, link=None, timeout_s=60.0):
        return TransferWorker(store, device, link, timeout_s, chunk_bytes=chunk_bytes, copies=HeldCopies(hold))

    monkeypatch.setattr(tiers_module, "TransferWorker", held_worker)
    monkeypatch.setattr(Transfer, "wait", lambda self, timeout: 0.0)  # `_ready_views` reads at once
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, cache_capacity="all"), torch.no_grad():
        try:
            got = model(input_ids=ids, attention_mask=mask).logits
        finally:
            hold.set()  # the copies land, so the engine can close
    assert not torch.equal(got, expected), "a read before the copy landed went unnoticed"
