"""The emulated link without a thread: the link's schedule in wall-clock time, data written when a copy
lands, demand preempting prefetches, cancel and promote, failures as errors, and exact modes through it."""
import copy
import time

import pytest
import torch

import evalsuite
from evalsuite.engine.link import lazy as lazy_link
from evalsuite.engine.link.lazy import LazyLink
from evalsuite.engine.link.profiles import LinkProfile
from evalsuite.engine.link.worker import TransferCancelled, TransferError, TransferWorker

from .helpers import batch, reference_model, use_link_kind
from .test_exactness import run

SLOW = LinkProfile("slow", 0.1e9, 0.0)  # 100 KB per ms
SLOWER = LinkProfile("slower", 0.01e9, 0.0)  # 10 KB per ms: wide margins for a busy machine's pauses
ROW = 25_000  # floats: 100 KB, 1 ms of SLOW, 10 ms of SLOWER


class RowStore:
    def __init__(self, rows, fail=()):
        self.rows, self.fail = rows, set(fail)

    def copy_into(self, key, dst):
        if key in self.fail:
            raise OSError(f"read error on {key}")
        dst.copy_(self.rows[key])


def rows(n):
    return {k: torch.full((ROW,), float(k + 1)) for k in range(n)}


def test_a_copy_lands_after_its_link_time_and_only_then_is_in_its_slot():
    link = LazyLink(RowStore(rows(3)), SLOWER)
    dst = torch.zeros(3, ROW)
    start = time.perf_counter()
    transfers = [link.submit(k, dst[k]) for k in range(3)]
    assert not transfers[2].done.is_set() and torch.equal(dst[2], torch.zeros(ROW))  # nothing written yet
    transfers[2].wait(10)
    assert time.perf_counter() - start >= 3 * SLOWER.seconds(ROW * 4)  # one copy at a time
    assert all(t.done.is_set() and torch.equal(dst[k], rows(3)[k]) for k, t in enumerate(transfers))
    assert link.pending() == 0 and link.busy_s == pytest.approx(30e-3)
    assert link.seconds_per_transfer() == pytest.approx(10e-3)  # the link's figure, kept


def test_a_wait_spins_and_sleeps_only_what_exceeds_the_spin_time(monkeypatch):
    """A waiting thread keeps its core (a slept one comes back to slower compute on these VMs), except
    for the part of a long wait beyond SPIN_S."""
    slept, sleep = [], time.sleep
    monkeypatch.setattr(lazy_link.time, "sleep", lambda s: (slept.append(s), sleep(s)))
    link = LazyLink(RowStore(rows(1)), SLOWER)  # a 10 ms copy: a tiny expert's on the SD card is 3.2 ms
    link.submit(0, torch.zeros(ROW)).wait(10)
    assert slept == []
    monkeypatch.setattr(lazy_link, "SPIN_S", 0.004)
    link = LazyLink(RowStore(rows(1)), SLOWER)
    start = time.perf_counter()
    link.submit(0, torch.zeros(ROW)).wait(10)
    assert time.perf_counter() - start >= 10e-3
    assert slept and sum(slept) <= 10e-3 - 0.004 + 1e-4  # the last 4 ms were spun


def test_a_demand_load_preempts_a_moving_prefetch_at_the_next_chunk():
    link = LazyLink(RowStore(rows(2)), SLOWER, chunk_bytes=10_000)  # 1 ms chunks of 10 ms copies
    dst = torch.zeros(2, ROW)
    prefetch = link.submit(0, dst[0], prefetch=True)
    time.sleep(2e-3)
    demand = link.submit(1, dst[1])
    asked = time.perf_counter()  # after the submit: a pause of this thread before it cannot loosen the bound
    demand.wait(10)
    # the demand's copy starts at the prefetch's next chunk boundary, not when the prefetch ends (~8 ms later)
    assert demand.copy.landed_at - asked <= 1e-3 + 10e-3 + 1e-4
    prefetch.wait(10)  # it resumes afterwards, where it stopped
    assert prefetch.copy.landed_at > demand.copy.landed_at and torch.equal(dst[0], rows(2)[0])


def test_promote_puts_a_prefetch_before_the_others():
    link = LazyLink(RowStore(rows(3)), SLOW)
    dst = torch.zeros(3, ROW)
    first, second, third = (link.submit(k, dst[k], prefetch=True) for k in range(3))
    assert link.promote(third) and not link.promote(third)
    second.wait(10)
    assert first.copy.landed_at < third.copy.landed_at < second.copy.landed_at


def test_a_cancelled_copy_never_writes_its_slot():
    link = LazyLink(RowStore(rows(3)), SLOWER, chunk_bytes=10_000)
    dst = torch.full((3, ROW), -1.0)
    moving, queued = link.submit(0, dst[0], prefetch=True), link.submit(1, dst[1], prefetch=True)
    time.sleep(2e-3)
    assert not moving.untouched and queued.untouched
    assert link.cancel(queued) and link.cancel(moving)
    later = link.submit(2, dst[2])
    later.wait(10)
    assert torch.equal(dst[:2], torch.full((2, ROW), -1.0))  # what the slots held before
    assert moving.done.is_set() and queued.done.is_set() and not moving.landed()
    with pytest.raises(TransferCancelled):
        queued.wait(1)
    assert not link.cancel(later)  # landed: nothing to take back
    assert 0 < moving.copy.moved < 10e-3 and queued.copy.moved == 0  # stopped at a chunk boundary


def test_a_failed_read_and_a_copy_that_cannot_land_in_time_are_errors():
    link = LazyLink(RowStore(rows(2), fail={0}), SLOW)
    dst = torch.zeros(2, ROW)
    broken = link.submit(0, dst[0])
    with pytest.raises(TransferError, match="read error"):
        broken.wait(10)
    assert broken.done.is_set() and not broken.landed()
    with pytest.raises(TransferError, match="transfer_timeout_s"):
        link.submit(1, dst[1]).wait(1e-4)


def test_the_engine_serves_an_emulated_link_on_the_cpu_without_a_thread_when_experts_are_small(monkeypatch):
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, cache_capacity=0.5, link="ufs4") as engine:
        assert isinstance(engine.transfers, LazyLink)
    with evalsuite.offload(model, cache_capacity=0.5) as engine:  # a real link: copies as fast as they go
        assert isinstance(engine.transfers, TransferWorker)
    use_link_kind(monkeypatch, "worker")
    with evalsuite.offload(model, cache_capacity=0.5, link="ufs4") as engine:
        assert isinstance(engine.transfers, TransferWorker)


EXACT = {"on-demand": dict(mode="on-demand"),
         "router-preserving-gate": dict(mode="router-preserving", predictor="gate"),
         "router-preserving-oracle": dict(mode="router-preserving", predictor="oracle")}


@pytest.mark.parametrize("mode", sorted(EXACT))
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_exact_modes_through_the_lazy_link_are_bit_identical(model_type, mode):
    reference = reference_model(model_type)
    ids, mask = batch(4)
    expected = run(reference, ids, mask)
    model = copy.deepcopy(reference)
    # 20 MB/s: copies of 1-3 ms, long enough that prefetches are in flight when their layer runs
    with evalsuite.offload(model, cache_capacity=0.5, link="0.02GB/s", **EXACT[mode]) as engine:
        assert isinstance(engine.transfers, LazyLink)
        got = run(model, ids, mask)
        s = engine.stats()
    assert s["misses"] > 0 and (mode == "on-demand" or s["prefetches"] > 0)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_lazy_link_that_never_wrote_a_slot_would_be_caught(monkeypatch):
    # teeth for the test above: skip the write at landing, and the output changes
    monkeypatch.setattr(LazyLink, "_write", lambda self, copy: setattr(copy.transfer, "written", True))
    reference = reference_model("qwen3_moe")
    ids, mask = batch(4)
    expected = run(reference, ids, mask)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, cache_capacity=0.5, link="0.02GB/s", mode="on-demand"):
        got = run(model, ids, mask)
    assert not torch.equal(got[0], expected[0])


@pytest.mark.parametrize("make", [lambda store: LazyLink(store, SLOWER),
                                  lambda store: TransferWorker(store, torch.device("cpu"), SLOWER)],
                         ids=["lazy", "worker"])
def test_both_links_are_the_link_the_cache_talks_to(make):
    """The engine builds one of two links; both are a `Link`, their copies `LinkTransfer`s, and every method the
    protocol names behaves alike: a demand copy lands in its slot, a cancelled prefetch leaves its slot untouched."""
    from evalsuite.engine.link import Link, LinkTransfer

    link = make(RowStore(rows(3)))
    try:
        assert isinstance(link, Link)
        dst = torch.zeros(3, ROW)
        wanted = link.submit(0, dst[0])
        queued = [link.submit(k, dst[k], prefetch=True) for k in (1, 2)]
        assert all(isinstance(t, LinkTransfer) for t in [wanted, *queued])
        assert link.cancel(queued[1]) and queued[1].untouched
        link.promote(queued[0])
        wanted.wait(10)
        queued[0].wait(10)
        assert torch.equal(dst[0], rows(3)[0]) and torch.equal(dst[1], rows(3)[1]) and not dst[2].any()
        assert link.pending() == 0 and link.prefetches_queued() == 0 and link.seconds_per_transfer() > 0
    finally:
        link.close()
