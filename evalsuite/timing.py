"""One timing protocol for every TPOT the suite reports (evalsuite eval, bench, sweeps).

pin        torch computes on a fixed number of threads (1 by default): on a CPU, the default of
           one thread per core lets the link's worker and other work steal compute, and made TPOT
           vary 5x between runs of the same mode.
machine    what the timing was measured on: host, processor, cores, torch and device; stored with
           every run (part of its configuration: timings from two machines are two runs).
warm_up    one short generation before the measured ones, its timings discarded (allocator,
           caches, lazy initialisation).
spread     TPOT is reported as the median over sequences with its 10th-90th percentile range
           (evalsuite.engine.metrics.summarise).
busy       a CPU timing taken while the machine had less than a free core per compute thread
           (load average above cores - threads) is flagged, not printed bare: it measures the
           other work as much as the engine.
probe      a fixed piece of compute, timed before and after every measured task: a shared virtual
           machine changes speed with no load of its own to show for it, and runs timed one after
           another then differ by that. The table flags TPOTs whose probes differ by more than DRIFT:
           their order measures the machine, not the modes; under it, it still says by how much they
           differed (`spread`), the floor under which modes do not differ. A probe is the median of
           PROBE_REPEATS pieces: work sharing the core slows most pieces, as it slows every decode
           token, where the fastest piece alone would pass it by. A decode step slows with the probe, so
           a flag is the machine's, not the probe's; `ORDER` says under the table how the modes compared
           (timed in turn, or replayed from one cost measurement).
heap       timed decoding runs with the objects alive when it starts (the libraries, the model, the
           engine) frozen out of the garbage collector (`frozen_heap`), as serving engines freeze their
           start-up heap: a collection then walks what the timed work allocated, not the process. Without
           it, a collection of the oldest generation walks every object of the process (a fraction of a
           second, inside one decode token): a pause that lands on whichever mode happens to allocate when
           it comes due.
"""
from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from contextlib import contextmanager

import torch

WARM_UP_TOKENS = 8
DRIFT = 1.2  # probes further apart than this (max / min) make TPOTs timed between them incomparable
PROBE_REPEATS = 9  # pieces of work per probe (~14 ms each on the 2-core development machine)


def pin(threads: int) -> int:
    """Compute on `threads` torch threads from now on; returns them."""
    if threads < 1:
        raise ValueError(f"--threads {threads}: compute needs at least one thread")
    torch.set_num_threads(threads)
    return threads


def machine(device: str = "cpu") -> dict:
    """What a timing was measured on (the same on every run of this machine and device)."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return {"host": platform.node(), "cores": os.cpu_count(), "device": dev.type, "device_name": name,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def busy(device: str = "cpu") -> float | None:
    """The load average when a CPU timing cannot be trusted (fewer free cores than compute threads), else None."""
    if torch.device(device).type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    return load if load > (os.cpu_count() or 1) - torch.get_num_threads() + 0.5 else None


def probe(device: str = "cpu") -> float | None:
    """Milliseconds of a fixed piece of work (matrix products and a Python loop, like a decode step's mix)
    on the pinned threads: the median of PROBE_REPEATS pieces timed one after another, so one interruption
    does not count, while work sharing the core (which slows every decode token) slows most pieces and does.
    None off the CPU, where the timing is the device's and a CPU probe would not measure it (as `busy`)."""
    if torch.device(device).type != "cpu":
        return None
    a = torch.ones(96, 96)
    pieces = []
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        for _ in range(200):
            a = torch.tanh(a @ a * 1e-2)
        sum(range(100000))
        pieces.append(time.perf_counter() - started)
    return statistics.median(pieces) * 1e3


def spread(probes: list[float]) -> float | None:
    """max / min of the probes (None without any: off the CPU)."""
    probes = [p for p in probes if p]
    return max(probes) / min(probes) if probes else None


ORDER = {  # how a plan compares its modes' TPOTs (evalsuite eval --plan): the line under the table
    "measure": "each mode timed over all its tasks in turn (in --modes order, resident first), not interleaved: "
               "its TPOTs differ from another mode's by the machine's speed between them too; "
               "evalsuite bench interleaves modes, --plan replay times them from one cost measurement",
    "replay": "~ rows replayed from one cost measurement per model (--plan replay): their modes compare at one "
              "machine speed, whatever order they ran in",
}


def order_line(rows) -> str | None:
    """The one line under a table of TPOTs that says how its modes were compared: timed one after another
    (measured rows), replayed from one cost measurement (rows with `replayed`), or each for its rows. None
    without a TPOT."""
    timed = [r for r in rows if r.get("tpot_ms") is not None]
    plans = [plan for plan in ORDER if any(bool(r.get("replayed")) == (plan == "replay") for r in timed)]
    return "modes compared: " + "; ".join(ORDER[plan] for plan in plans) if plans else None


@contextmanager
def frozen_heap():
    """Within it, every object alive on entry is out of the garbage collector's reach (gc.freeze), and back in
    reach after (gc.unfreeze: both are list splices, not walks). Where the caller froze a heap already, it leaves
    that as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def warm_up(model, tokenizer, engine=None, rows: int = 1) -> None:
    """One short greedy generation (of `rows` rows) whose timings are discarded."""
    ids = tokenizer("1 + 1 =", return_tensors="pt")["input_ids"].repeat(rows, 1).to(model.device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=WARM_UP_TOKENS,
                       min_new_tokens=WARM_UP_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    if engine is not None:
        engine.reset_stats()
        engine.clear_cache()
