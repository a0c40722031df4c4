"""Link profiles and the transfer worker: ordering, chunks, preemption, cancel and promote,
emulated time, late copies, failures surface as errors."""
import copy
import threading
import time

import pytest
import torch

import evalsuite
from evalsuite.engine.link.copy_backends import HostCopies, LateCopies
from evalsuite.engine.placement.store import HostStore
from evalsuite.engine.link.profiles import LINKS, LinkProfile, parse_link
from evalsuite.engine.link.worker import TransferCancelled, TransferWorker, TransferError

from .helpers import reference_model


class DictStore:
    def __init__(self, rows, fail=(), block: threading.Event | None = None):
        self.rows, self.fail, self.block = rows, set(fail), block

    def copy_into(self, key, dst):
        if self.block is not None:
            self.block.wait()
        if key in self.fail:
            raise OSError(f"read error on {key}")
        dst.copy_(self.rows[key])


def test_profiles_and_custom_links():
    assert parse_link(None) is None and parse_link("native") is None
    assert parse_link("pcie4") is LINKS["pcie4"]
    link = parse_link("8GB/s+20us")
    assert link.bandwidth == 8e9 and link.latency == pytest.approx(20e-6)
    assert link.seconds(8_000_000) == pytest.approx(1e-3 + 20e-6)
    assert {"pcie3", "pcie4", "pcie5", "nvlink-c2c", "ufs4", "ufs3", "sdcard"} <= set(LINKS)


@pytest.mark.parametrize("spec", ["pcie9", "fast", "0GB/s", "-3GB/s", 12])
def test_bad_link_is_rejected(spec):
    with pytest.raises(ValueError, match="unknown link"):
        parse_link(spec)


def test_copies_land_and_emulated_link_holds_each_transfer():
    rows = {k: torch.full((250_000,), float(k)) for k in range(3)}  # 1 MB each
    worker = TransferWorker(DictStore(rows), torch.device("cpu"), LinkProfile("slow", 0.1e9, 0.0))
    dst = torch.zeros(3, 250_000)
    start = time.perf_counter()
    transfers = [worker.submit(k, dst[k]) for k in range(3)]
    for t in transfers:
        t.wait(timeout=10)
    elapsed = time.perf_counter() - start
    worker.close()
    assert all(torch.equal(dst[k], rows[k]) for k in range(3))
    assert elapsed >= 3 * 0.01  # a serial 0.1 GB/s link needs 10 ms per megabyte


def test_failed_transfer_raises_at_wait():
    worker = TransferWorker(DictStore({0: torch.ones(4)}, fail={0}), torch.device("cpu"))
    transfer = worker.submit(0, torch.zeros(4))
    with pytest.raises(TransferError, match="read error"):
        transfer.wait(timeout=5)
    worker.close()


def test_hanging_transfer_times_out():
    gate = threading.Event()
    worker = TransferWorker(DictStore({0: torch.ones(4)}, block=gate), torch.device("cpu"), timeout_s=1)
    transfer = worker.submit(0, torch.zeros(4))
    with pytest.raises(TransferError, match="did not finish within 0.2 s"):
        transfer.wait(timeout=0.2)
    gate.set()
    transfer.wait(timeout=5)
    worker.close()


def test_demand_loads_overtake_queued_prefetches():
    gate, served = threading.Event(), []

    class Recording(DictStore):
        def copy_into(self, key, dst):
            super().copy_into(key, dst)
            served.append(key)

    rows = {k: torch.ones(4) for k in "xpd"}
    worker = TransferWorker(Recording(rows, block=gate), torch.device("cpu"))
    first = worker.submit("x", torch.zeros(4))  # occupies the worker until the gate opens
    prefetch = worker.submit("p", torch.zeros(4), prefetch=True)
    demand = worker.submit("d", torch.zeros(4))
    gate.set()
    for t in (first, prefetch, demand):
        t.wait(timeout=5)
    worker.close()
    assert served == ["x", "d", "p"]


# ---- chunks, preemption, cancel, promote ---------------------------------------------------
# A 0.1 GB/s link: a 10 MB prefetch holds it ~100 ms, a chunk (its default size) ~1 ms.
SLOW = LinkProfile("slow", 0.1e9, 0.0)
BIG, SMALL = 2_500_000, 25_000  # float32 elements: 10 MB and 100 kB


class RowStore(HostStore):
    """A host store of the given rows (rows are stable, so transfers move in chunks)."""

    def __init__(self, rows, gate: threading.Event | None = None):
        self.rows, self.gate, self.read_order = rows, gate, []

    def read(self, key):
        self.read_order.append(key)
        if self.gate is not None:
            self.gate.wait()
        return self.rows[key]

    def copy_into(self, key, dst):
        dst.copy_(self.rows[key])


class CountingCopies(HostCopies):
    """Host copies that count the elements moved."""

    def __init__(self):
        self.moved = 0

    def copy(self, dst, src):
        self.moved += dst.numel()
        return super().copy(dst, src)


def slow_link(rows, **kwargs):
    copies = CountingCopies()
    return TransferWorker(RowStore(rows), torch.device("cpu"), SLOW, copies=copies, **kwargs), copies


def test_a_demand_load_preempts_an_in_flight_prefetch_which_resumes():
    rows = {"p": torch.rand(BIG), "d": torch.rand(SMALL)}
    worker, copies = slow_link(rows)
    dst = {k: torch.zeros_like(v) for k, v in rows.items()}
    prefetch = worker.submit("p", dst["p"], prefetch=True)
    time.sleep(0.01)  # the prefetch is moving
    start = time.perf_counter()
    demand = worker.submit("d", dst["d"])
    demand.wait(timeout=10)
    demand_s = time.perf_counter() - start
    assert not prefetch.done.is_set()
    prefetch.wait(timeout=10)
    worker.close()
    assert demand_s < 0.04  # ~1 ms behind the prefetch's chunk + 1 ms of its own, not ~90 ms
    assert torch.equal(dst["p"], rows["p"]) and torch.equal(dst["d"], rows["d"])
    assert copies.moved == BIG + SMALL  # resumed where it stopped, never restarted
    assert worker.pending() == 0 and worker.busy_s >= 0.1  # both moved in full


def test_a_cancelled_prefetch_never_lands_and_never_writes_later():
    rows = {"p": torch.rand(BIG), "q": torch.rand(SMALL)}
    worker, copies = slow_link(rows)
    dst = torch.zeros(BIG)
    moving = worker.submit("p", dst, prefetch=True)
    queued = worker.submit("q", torch.zeros(SMALL), prefetch=True)
    time.sleep(0.02)
    assert worker.cancel(queued) and worker.cancel(moving)
    assert moving.done.wait(1) and queued.done.is_set() and not moving.landed()
    dst.fill_(-1.0)  # the caller gave the slot to someone else
    time.sleep(0.15)  # longer than the whole copy would have taken
    worker.close()
    assert torch.equal(dst, torch.full((BIG,), -1.0))
    with pytest.raises(TransferCancelled, match="cancelled"):
        moving.wait(timeout=1)
    assert copies.moved == BIG  # an emulated link copies the data in one go when it starts, none of the queued one
    assert 0 < moving.moved < BIG // 2  # the link's time stopped at the chunk moving when it was cancelled
    assert moving.moved % (worker.chunk_bytes // 4) == 0  # at a chunk boundary (float32 elements)
    moved_s = moving.moved * 4 / SLOW.bandwidth
    assert 0.9 * moved_s <= worker.busy_s < moved_s + 0.05  # the link's time counts only those chunks
    assert worker.pending() == 0 and worker.seconds_per_transfer() is None


def test_an_emulated_link_moves_a_transfer_nothing_preempts_in_one_copy_and_one_wake_up():
    """The worker sleeps through a transfer's chunks rather than waking per chunk (each wake-up takes
    the GIL from the compute thread): a 10 MB transfer on the slow link is ~100 chunks, one hold."""
    rows = {"p": torch.rand(BIG), "q": torch.rand(SMALL)}
    worker, copies = slow_link(rows)
    moves, move = [], worker._move
    worker._move = lambda transfer: (moves.append(transfer.key), move(transfer))
    moving = worker.submit("p", torch.zeros(BIG), prefetch=True)
    time.sleep(0.01)
    queued = worker.submit("q", torch.zeros(SMALL), prefetch=True)  # behind it: no reason to wake
    moving.wait(timeout=10)
    queued.wait(timeout=10)
    worker.close()
    assert moves == ["p", "q"] and copies.moved == BIG + SMALL
    assert 0.1 <= worker.busy_s < 0.2  # still the link's time for every chunk


def test_cancel_after_every_chunk_was_issued_changes_nothing():
    rows = {"d": torch.rand(SMALL)}
    worker, _ = slow_link(rows)
    dst = torch.zeros(SMALL)
    transfer = worker.submit("d", dst)
    transfer.wait(timeout=10)
    assert not worker.cancel(transfer) and transfer.landed()
    worker.close()
    assert torch.equal(dst, rows["d"])


def test_a_promoted_prefetch_overtakes_other_prefetches():
    gate = threading.Event()
    rows = {k: torch.rand(SMALL) for k in ("x", "p1", "p2", "p3")}
    store = RowStore(rows, gate=gate)
    worker = TransferWorker(store, torch.device("cpu"))
    first = worker.submit("x", torch.zeros(SMALL))  # occupies the worker until the gate opens
    prefetches = {k: worker.submit(k, torch.zeros(SMALL), prefetch=True) for k in ("p1", "p2", "p3")}
    assert worker.promote(prefetches["p3"]) and not worker.promote(first)
    gate.set()
    for t in (first, *prefetches.values()):
        t.wait(timeout=5)
    worker.close()
    assert store.read_order == ["x", "p3", "p1", "p2"]


def test_seconds_per_transfer_is_the_link_time_per_copy_moved():
    rows = {k: torch.rand(SMALL * 4) for k in range(3)}  # 400 kB: 4 ms each on the slow link
    worker, _ = slow_link(rows)
    for k in rows:
        worker.submit(k, torch.zeros(SMALL * 4)).wait(timeout=10)
    worker.close()
    assert 0.004 <= worker.seconds_per_transfer() < 0.03 and worker.pending() == 0


def test_a_cancelled_chunks_overshoot_is_not_taken_off_the_next_copys_link_time(monkeypatch):
    # the worker's clock times a chunk from the previous chunk's end: a cancelled prefetch whose last sleep
    # overshoots (a loaded machine) must not make the copy after it look faster than the link
    rows = {k: torch.rand(250_000) for k in range(2)}  # 1 MB: 10 ms on the link, in 1 ms chunks
    link = LinkProfile("slow", 0.1e9, 0.0)
    worker = TransferWorker(DictStore(rows), torch.device("cpu"), link)
    dst = torch.zeros(2, 250_000)
    real_sleep, prefetch = time.sleep, None

    def sleep(seconds):
        real_sleep(seconds + (0.02 if prefetch is not None and worker._moving is prefetch else 0.0))

    monkeypatch.setattr(time, "sleep", sleep)
    prefetch = worker.submit(0, dst[0], prefetch=True)
    while prefetch.untouched:  # the link starts on it
        real_sleep(1e-4)
    assert worker.cancel(prefetch)
    worker.submit(1, dst[1]).wait(timeout=5)
    worker.close()
    assert torch.equal(dst[1], rows[1])
    assert worker.seconds_per_transfer() >= link.seconds(1_000_000)


def test_chunk_size_follows_the_link_and_is_checked():
    assert TransferWorker(RowStore({}), torch.device("cpu"), SLOW).chunk_bytes == 100_000  # 1 ms
    with pytest.raises(ValueError, match="chunk_bytes=0 must be a positive"):
        TransferWorker(RowStore({}), torch.device("cpu"), chunk_bytes=0)


# ---- late copies --------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_late_copies_land_after_submit_and_wait_orders_the_read(chunk_bytes):
    rows = {0: torch.rand(10_000)}
    worker = TransferWorker(RowStore(rows), torch.device("cpu"), chunk_bytes=chunk_bytes,
                            copies=LateCopies(delay_s=0.05))
    dst = torch.zeros(10_000)
    transfer = worker.submit(0, dst)
    assert transfer.issued.wait(1) and not transfer.done.is_set()
    assert torch.isnan(dst).any()  # issued, not landed: the slot holds nothing usable yet
    transfer.wait(timeout=5)
    assert torch.equal(dst, rows[0])
    assert transfer.done.wait(1) and transfer.landed()
    worker.close()


def test_wait_landed_blocks_until_every_chunk_landed():
    rows = {0: torch.rand(10_000)}
    worker = TransferWorker(RowStore(rows), torch.device("cpu"), chunk_bytes=4096, copies=LateCopies(delay_s=0.05))
    transfer = worker.submit(0, torch.zeros(10_000))
    with pytest.raises(TransferError, match="did not finish within 0.01 s"):
        transfer.wait_landed(timeout=0.01)  # three chunks, 50 ms each
    assert transfer.wait_landed(timeout=5) > 0 and transfer.done.is_set()
    cancelled = worker.submit(0, torch.zeros(10_000), prefetch=True)
    worker.cancel(cancelled)
    with pytest.raises(TransferCancelled):
        cancelled.wait_landed(timeout=5)
    worker.close()


# ---- the engine's use of the link ---------------------------------------------------------

def test_a_used_prefetch_goes_before_the_prefetches_queued_ahead_of_it():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, cache_capacity=8, link="0.001GB/s") as engine:  # ~25 ms per expert
        layer = engine.layers[0].index
        assert engine.prefetch(layer, [0, 1, 2, 3]) == 4
        transfers = [engine.cache.transfers[(layer, e)] for e in range(4)]
        engine._ready_views((layer, 3), engine.record.counters[layer])  # the compute needs expert 3 now
        assert transfers[3].landed()
        assert not transfers[1].done.is_set() and not transfers[2].done.is_set()  # overtaken
        for transfer in transfers:
            transfer.wait_landed(5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device checks the side-stream copies")
def test_cuda_chunks_land_before_the_compute_stream_reads():
    src = torch.rand(4_000_000).pin_memory()  # 16 MB: 16 chunks of 1 MiB, at most two in flight
    worker = TransferWorker(RowStore({0: src}), torch.device("cuda"), chunk_bytes=2**20)
    dst = torch.zeros(4_000_000, device="cuda")
    transfer = worker.submit(0, dst)
    transfer.wait(timeout=10)  # the compute stream waits on the copy's event; the host goes on
    copied = dst.clone()  # queued on the compute stream, after that wait
    transfer.wait_landed(timeout=10)
    worker.close()
    assert torch.equal(copied.cpu(), src)
    assert worker.seconds_per_transfer() > 0  # timed by CUDA events around each chunk
