"""Link profiles and the transfer worker: ordering, emulated time, failures surface as errors."""
import threading
import time

import pytest
import torch

from evalsuite.engine.transfer import LINKS, Link, TransferEngine, TransferError, parse_link


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
    engine = TransferEngine(DictStore(rows), torch.device("cpu"), Link("slow", 0.1e9, 0.0))
    dst = torch.zeros(3, 250_000)
    start = time.perf_counter()
    transfers = [engine.submit(k, dst[k]) for k in range(3)]
    for t in transfers:
        t.wait(timeout=10)
    elapsed = time.perf_counter() - start
    engine.close()
    assert all(torch.equal(dst[k], rows[k]) for k in range(3))
    assert elapsed >= 3 * 0.01  # a serial 0.1 GB/s link needs 10 ms per megabyte


def test_failed_transfer_raises_at_wait():
    engine = TransferEngine(DictStore({0: torch.ones(4)}, fail={0}), torch.device("cpu"))
    transfer = engine.submit(0, torch.zeros(4))
    with pytest.raises(TransferError, match="read error"):
        transfer.wait(timeout=5)
    engine.close()


def test_hanging_transfer_times_out():
    gate = threading.Event()
    engine = TransferEngine(DictStore({0: torch.ones(4)}, block=gate), torch.device("cpu"), timeout_s=1)
    transfer = engine.submit(0, torch.zeros(4))
    with pytest.raises(TransferError, match="did not finish within 0.2 s"):
        transfer.wait(timeout=0.2)
    gate.set()
    transfer.wait(timeout=5)
    engine.close()


def test_demand_loads_overtake_queued_prefetches():
    gate, served = threading.Event(), []

    class Recording(DictStore):
        def copy_into(self, key, dst):
            super().copy_into(key, dst)
            served.append(key)

    rows = {k: torch.ones(4) for k in "xpd"}
    engine = TransferEngine(Recording(rows, block=gate), torch.device("cpu"))
    first = engine.submit("x", torch.zeros(4))  # occupies the worker until the gate opens
    prefetch = engine.submit("p", torch.zeros(4), prefetch=True)
    demand = engine.submit("d", torch.zeros(4))
    gate.set()
    for t in (first, prefetch, demand):
        t.wait(timeout=5)
    engine.close()
    assert served == ["x", "d", "p"]
