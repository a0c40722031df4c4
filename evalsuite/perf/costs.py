"""What this machine's decode costs, measured for the simulator and the overlap bound: layer
clocks on a resident engine, the offloading path's bookkeeping, each predicting case's own cost,
starting a transfer, waking a waiter, and the engine's overhead over the unmodified model."""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import NamedTuple

import torch

from ..engine import offload
from ..engine.arch import sparse_layers
from ..engine.modes import MODES
from .decode import bench_store, greedy
from .simulate import Costs


class SpeedProbe:
    """Median decode-step time of the sparse layers' attention: work no mode changes, so its time
    tells how fast this machine ran during one generation (on CPU; its speed here drifts by up to
    2x within seconds). Only an attention with less than AFTER_WAIT_S of waiting for copies since the one
    before is timed: the work right after a wait runs up to 3x slower here whatever the machine's speed
    (bench/after_wait.py), and attention follows the previous layer's waits, so timing those would read a
    run that waits often as a slow machine. (A wait for a copy that has landed takes microseconds.)"""

    AFTER_WAIT_S = 1e-4

    def __init__(self, engine):
        self.engine, self.seconds, self.hooks, self._t = engine, [], [], 0.0
        # the engine's total wait at this attention's start, and at the last one's end (at first: now)
        self._stall = self._stall_at_stop = getattr(engine, "stalled_s", 0.0)
        if engine.device.type != "cpu":  # timing CUDA kernels would need a sync that breaks overlap
            return
        for layer in engine.layers:
            attention = getattr(layer.decoder_layer, "self_attn", None)
            if attention is not None:
                self.hooks += [attention.register_forward_pre_hook(self._start),
                               attention.register_forward_hook(self._stop)]

    def _start(self, module, args):
        self._stall = getattr(self.engine, "stalled_s", 0.0)
        self._t = time.perf_counter()

    def _stop(self, module, args, output):
        seconds = time.perf_counter() - self._t
        if self.engine.forward.decoding and self._stall - self._stall_at_stop < self.AFTER_WAIT_S:
            self.seconds.append(seconds)
        self._stall_at_stop = getattr(self.engine, "stalled_s", 0.0)

    def median(self) -> float | None:
        for h in self.hooks:
            h.remove()
        return statistics.median(self.seconds) if self.seconds else None


def scaled(costs: Costs, factor: float) -> Costs:
    """Costs with every compute-thread cost multiplied by `factor` (the link's are left as they are)."""
    fields = ("dense_s", "expert_s", "step_s", "predictor_s", "predictor_step_s", "lookup_s", "miss_s",
              "predict_call_s", "prefetch_s", "put_off_s")
    return replace(costs, **{f: getattr(costs, f) * factor for f in fields if getattr(costs, f) is not None})


class LayerClock:
    """Per decode step: time in each sparse layer and in its routed experts."""

    def __init__(self, engine):
        self.engine, self.hooks = engine, []
        self.layer_s: list[float] = []
        self.experts_s: list[float] = []
        self.experts_run: list[int] = []
        for layer in engine.layers:
            block = layer.decoder_layer
            self.hooks += [block.register_forward_pre_hook(self._start("layer")),
                           block.register_forward_hook(self._stop("layer", self.layer_s)),
                           layer.experts.register_forward_pre_hook(self._start("experts")),
                           layer.experts.register_forward_hook(self._stop("experts", self.experts_s, layer))]
        self._t: dict[str, float] = {}

    def _now(self) -> float:
        if self.engine.device.type == "cuda":  # kernels are asynchronous: time what ran
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def _start(self, what):
        def hook(module, args):
            self._t[what] = self._now()
        return hook

    def _stop(self, what, into, layer=None):
        def hook(module, args, output):
            now = self._now()
            if self.engine.forward.decoding:
                into.append(now - self._t[what])
                if layer is not None:
                    self.experts_run.append(layer.top_k)
        return hook

    def per_use(self) -> float:
        """Seconds in the routed experts per expert use, over the decode steps clocked."""
        return sum(self.experts_s) / sum(self.experts_run)

    def close(self):
        for h in self.hooks:
            h.remove()


class DriverClock:
    """Compute-thread seconds the prediction driver spends per decode prediction made, timed around all of its
    work at a sparse layer (scoring the last prediction, speculating, predicting, scheduling its prefetches).

    This is what one prediction made on the spot costs, read directly: the difference of two warm TPOTs
    carries both runs' noise, and on a 2-core machine it read anywhere from 0 to several times this figure
    (docs/performance.md). Not inside: the dispatch of a module hook the driver registers (the router
    hook of a speculating mode) or of its residual tap, a few microseconds per layer at most."""

    def __init__(self, engine):
        driver = engine.driver
        self.driver, self.seconds, self.predictions = driver, 0.0, 0
        predict = driver._predict

        def timed(method):
            def call(*args):
                begun = time.perf_counter()
                out = method(*args)
                if engine.forward.decoding:  # (the engine makes a new ForwardPass per call)
                    self.seconds += time.perf_counter() - begun
                return out
            return call

        def counted_predict(target, *args):  # made: its (scores, ranked) pending after; put off: a PutOffPrediction
            predict(target, *args)
            self.predictions += engine.forward.decoding and type(driver.pending.get(target)) is tuple

        # the driver's hooks and the engine call these through the instance, so the wrappers see every call
        driver.on_router, driver.release_prefetch = timed(driver.on_router), timed(driver.release_prefetch)
        driver._predict = counted_predict

    def per_prediction(self) -> float | None:
        return self.seconds / self.predictions if self.predictions else None

    def close(self) -> None:
        del self.driver.on_router, self.driver.release_prefetch, self.driver._predict  # the class's methods again


def measure_costs(model, ids, tokens: int, repeats: int, predicting=(), artifact=None) -> tuple[Costs, dict, float]:
    """This machine's Costs (link time left 0) and each case's prediction cost, medians of interleaved repeats.

    Layer clocks on a resident engine give the dense part of a sparse layer, one expert, and
    the rest of a step. Engines whose cache holds every expert and is already warm then
    isolate the offloading path's bookkeeping per expert use (the routed experts' layer-clocked time per
    use, warm on-demand's at the resident run's speed, minus resident's: `_per_use_overhead`)
    and each predicting case's own cost, with no transfer in any (`predicting`: (label, mode,
    predictor, its artifact) of each case): per prediction, the driver's work timed around it
    (DriverClock: prediction, scheduling, speculative substitution); for the oracle, whose
    look-ahead pass runs outside the driver, warm case minus warm on-demand per step. A cold
    engine with the smallest cache and no link emulation, where nearly every use misses, gives
    what starting one transfer costs the compute thread (its TPOT minus the same repeat's warm
    on-demand TPOT and minus the time it waited, per transfer). Returns (Costs, {case label:
    {"per_prediction", "call" (the scheduler's own timing of a prediction: a part of
    per_prediction) and "step_extra" (warm case minus warm on-demand per prediction, a noisy check
    on per_prediction)}, or {"per_step"}: seconds}, the speed probe's attention seconds: the
    reference for scaled()).
    """
    dense, expert, step, per_use, per_miss, attention = [], [], [], [], [], []
    warm = {label: [] for label in ["on-demand", *(case[0] for case in predicting)]}
    calls: dict[str, list[float]] = {}  # label -> the scheduler's own time per prediction, per repeat
    driver: dict[str, list[float]] = {}  # label -> the driver's time per prediction (DriverClock), per repeat
    for _ in range(repeats):
        with offload(model, mode="resident") as engine:
            clock, probe = LayerClock(engine), SpeedProbe(engine)
            greedy(model, ids, tokens)
            s = engine.stats()
            clock.close()
            attention.append(probe.median())
        steps = len(clock.layer_s) // len(engine.layers)
        resident_tpot = s["tpot_ms"]["median"] / 1e3
        dense.append((sum(clock.layer_s) - sum(clock.experts_s)) / len(clock.layer_s))
        expert.append(clock.per_use())
        step.append(resident_tpot - sum(clock.layer_s) / steps)
        on_demand = _warm_tpot(model, ids, tokens, "on-demand", None, artifact, clocked=True)
        warm["on-demand"].append(on_demand.tpot_s)
        per_use.append(_per_use_overhead(on_demand, expert[-1], attention[-1]))
        for label, mode, predictor, own in predicting:
            run = _warm_tpot(model, ids, tokens, mode, predictor, own)
            warm[label].append(run.tpot_s)
            if run.call_s is not None:
                calls.setdefault(label, []).append(run.call_s)
            if run.per_prediction_s is not None:
                driver.setdefault(label, []).append(run.per_prediction_s)
        per_miss.append(_miss_seconds(model, ids, tokens, on_demand.tpot_s))
    med = statistics.median
    layers = sparse_layers(model)
    costs = Costs(dense_s=med(dense), expert_s=med(expert), step_s=max(0.0, med(step)), transfer_s=0.0,
                  lookup_s=max(0.0, med(per_use)), miss_s=med(per_miss))
    case_costs = {}
    for label, _, predictor, _ in predicting:
        extra = max(0.0, med(warm[label]) - med(warm["on-demand"]))
        if predictor == "oracle":
            case_costs[label] = {"per_step": extra}
            continue
        call = med(calls[label]) if label in calls else 0.0
        # one prediction per sparse layer per decode step (the last one predicts the next token's first); the
        # driver's time includes the scheduler's call, but the call's figure is smoothed towards the last
        # predictions and the driver's is their mean, so the larger one is kept
        direct = med(driver[label]) if label in driver else call
        case_costs[label] = {"per_prediction": max(direct, call), "call": call, "step_extra": extra / len(layers)}
    return costs, case_costs, (med(attention) if None not in attention else None)


def _miss_seconds(model, ids, tokens, warm_tpot) -> float:
    """Compute-thread seconds per transfer started, from decode steps of a cache of top-k slots: their TPOT minus
    `warm_tpot` (an on-demand engine whose cache holds every expert: the same kernel and bookkeeping per expert
    use, no copy) minus the time they waited, per copy. Against resident, each copy would also carry the per-use
    bookkeeping the replay charges apart (lookup_s), as every use of this cache is a copy."""
    top_k = sparse_layers(model)[0].top_k

    def counters(new_tokens):
        with offload(model, mode="on-demand", cache_capacity=top_k) as engine:
            greedy(model, ids, new_tokens)
            return engine.stats()

    full, prefill = counters(tokens), counters(1)  # the difference is the decode steps
    misses = (full["misses"] - prefill["misses"]) / (tokens - 1)
    stall = (full["stall_s"] - prefill["stall_s"]) / (tokens - 1)
    overhead = full["tpot_ms"]["median"] / 1e3 - warm_tpot - stall
    return max(0.0, overhead / misses) if misses > 0 else 0.0


class Warm(NamedTuple):
    """What one warm engine (its cache holding every expert) measured over one request."""

    tpot_s: float  # median TPOT
    call_s: float | None = None  # its scheduler's own time per prediction (None: the mode does not predict)
    per_prediction_s: float | None = None  # its driver's time per prediction (DriverClock)
    per_use_s: float | None = None  # its routed experts' time per expert use (LayerClock)
    attention_s: float | None = None  # how fast the machine ran meanwhile (SpeedProbe)


def _per_use_overhead(warm: Warm, resident_per_use_s: float, resident_attention_s: float | None) -> float:
    """The offloading path's time per expert use over resident's: both layer-clocked around the routed experts,
    the warm run's at the resident run's machine speed. The difference of the two whole TPOTs per use carried
    both runs' compute and the machine's drift between them: at Qwen3-30B-A3B shapes (8 sparse layers, 64 uses a
    token) it read 0.30 ms a use, ±0.63 over eight repeats, this 0.05 ±0.11; on tiny-qwen3-moe 23 ±76 µs, this 23
    ±6 µs (docs/performance.md, "`evalsuite bench`")."""
    speed = resident_attention_s / warm.attention_s if resident_attention_s and warm.attention_s else 1.0
    return warm.per_use_s * speed - resident_per_use_s


def _warm_tpot(model, ids, tokens, mode, predictor, artifact, clocked: bool = False) -> Warm:
    """A warm engine whose cache holds every expert, over one request (Warm); `clocked`: and over one more, its
    routed experts layer-clocked (per_use_s, attention_s), apart from the timed one, whose TPOT the clocks' hooks
    (a synchronisation each on CUDA) would otherwise raise."""
    store = bench_store(model)  # a model without its experts: the cache then holds the only copy
    # window=False: every prediction is made when the engine meets it. With the scheduler's window, a cache
    # that already holds every expert leaves most of them for after the request (no prefetch could pay), and the
    # difference to on-demand would time those put off, not the predictions the replay and the simulator charge
    # (with every expert cached, nothing is sent either way)
    window = {"window": False} if MODES[mode].predicts else {}
    with offload(model, mode=mode, predictor=predictor, artifact=artifact, cache_capacity="all",
                 store=store, **window) as engine:
        greedy(model, ids, tokens)  # fills the cache
        engine.reset_stats()
        clock = DriverClock(engine) if engine.driver is not None else None
        greedy(model, ids, tokens)
        scheduler = engine.driver.scheduler if engine.driver is not None else None
        if clock is not None:
            clock.close()
        warm = Warm(engine.stats()["tpot_ms"]["median"] / 1e3, scheduler.predict_s if scheduler is not None else None,
                    clock.per_prediction() if clock is not None else None)
        if not clocked:
            return warm
        layers, probe = LayerClock(engine), SpeedProbe(engine)
        greedy(model, ids, tokens)
        layers.close()
        return warm._replace(per_use_s=layers.per_use(), attention_s=probe.median())


def handoff_seconds(device: str, repeats: int = 50) -> float:
    """Median time from submitting a copy of a small tensor to the waiting thread resuming: the
    fixed cost of every wait on the transfer worker, whatever the link."""
    from ..engine.link.worker import TransferWorker

    class _Store:
        def copy_into(self, key, dst):
            dst.copy_(src)

    src = torch.ones(1024, device=device)
    dst = torch.empty_like(src)
    worker = TransferWorker(_Store(), torch.device(device))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.submit(0, dst).wait(10.0)
        times.append(time.perf_counter() - t0)
    worker.close()
    return statistics.median(times)


def engine_overhead(model, ids, tokens: int, repeats: int, kernel: str = "grouped_mm") -> dict:
    """Tokens/s of the resident engine over the unmodified model, both computing experts with `kernel`
    (transformers' default): what the engine's hooks and counters cost. (The offloading modes run
    the eager kernel's order, the price of exactness; their cost shows in their own TPOT.)"""
    own_impl = model.config._experts_implementation
    plain, engine = [], []
    model.set_experts_implementation(kernel)
    try:
        for _ in range(repeats):  # interleaved
            t0 = time.perf_counter()
            greedy(model, ids, tokens)
            plain.append(tokens / (time.perf_counter() - t0))
            with offload(model, mode="resident"):
                t0 = time.perf_counter()
                greedy(model, ids, tokens)
                engine.append(tokens / (time.perf_counter() - t0))
    finally:
        model.set_experts_implementation(own_impl)
    p, e = statistics.median(plain), statistics.median(engine)
    return {"kernel": kernel, "unmodified_tokens_per_s": p, "engine_tokens_per_s": e, "ratio": e / p}


def link_costs(model, ids, tokens: int, link) -> tuple[float | None, float | None]:
    """What the link costs as the engine itself times it, from decode steps of router-preserving prefetch
    (gate, every prediction sent) on `link` (a profile, a bandwidth, or None: real copies) with a small cache:
    (link seconds per transfer, compute-thread seconds per prefetch issued), None where nothing was timed.

    An emulated link's nominal figure leaves out what this machine adds to every copy (the worker's wake-ups,
    sleep overshoots): ufs4's 0.147 ms per tiny expert measures 0.17-0.29 ms here. And the cost of issuing a
    prefetch, as a difference of two TPOTs (miss_s), can come out at 0. The prefetch scheduler's decisions,
    which a replay repeats, turn on both."""
    layers = sparse_layers(model)
    capacity = layers[0].top_k * max(2, len(layers))  # a layer's experts and the next layer's prefetches fit
    with offload(model, mode="router-preserving", predictor="gate", cache_capacity=capacity, link=link,
                 window=False) as engine:
        greedy(model, ids, tokens)
        return engine.transfers.seconds_per_transfer(), engine.prefetch_cost_s
