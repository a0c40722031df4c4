"""The engine's decode loop replayed in simulated time, with the engine's own cache and scheduler.

What runs is evalsuite.engine's: ExpertCache (pools, pinning, the eviction policies, unused
prefetches at the eviction end) and PrefetchScheduler (per-rank online precision, the
expected-saving rule, decode-only layer time without stalls), driven by this simulated clock
instead of the wall clock. What this file models is the control flow around them, step for step
as Engine.weights_in_order / prefetch / settle_prefetches and PredictionDriver.on_router /
release_prefetch run it, over a SerialLink (evalsuite.engine.link.serial) instead of the transfer
worker. The replay is the engine object the scheduler talks to: `layers`, `cache`,
`transfers`, `prefetch`.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from ..engine.cache.slots import ExpertCache
from ..engine.cache.fetching import absent_share, count_use, fading_keep, rate_of
from ..engine.metrics import Counters, summarise
from ..engine.modes import MODES, Mode
from ..engine.prediction.scheduler import PrefetchScheduler
from ..engine.prediction.shadows import routing_trace
from ..engine.link.serial import SerialLink

# The simulator's one mode beyond the engine's, its idealised case: router-preserving where every
# layer's prediction is the native routing and is never put off (with no predictor cost: prediction's
# ceiling, what the engine's trace-oracle prefetches).
PERFECT_PREFETCH = Mode("perfect-prefetch", offloads=True, predicts=True, speculates=False, exact=True)
SIMULATED_MODES: dict[str, Mode] = {**MODES, PERFECT_PREFETCH.name: PERFECT_PREFETCH}


def speculates(mode: str, pos: int) -> bool:
    """Whether sparse layer `pos` of a decode step executes its prediction (from the second one on)."""
    return SIMULATED_MODES[mode].speculates and pos > 0


def executed_experts(mode: str, pos: int, routing, top_k: int) -> list[int]:
    """The experts a layer runs: the predicted top-k where it speculates, else the native ones."""
    if speculates(mode, pos) and routing.predicted:
        return sorted(routing.predicted[:top_k])
    return list(routing.native)


class _LinkView:
    """The TransferWorker calls PrefetchScheduler makes, answered by the simulated link at the
    replay's time. The link names its chunk's time (`chunk_s`), as an emulated link does."""

    def __init__(self, replay: "Replay"):
        self.replay = replay
        self.chunk_s = replay.link.chunk_s

    def pending(self) -> int:
        return self.replay.link.pending(self.replay.t)

    def prefetches_queued(self) -> int:
        return self.replay.link.prefetches_queued(self.replay.t)

    def seconds_per_transfer(self) -> float | None:
        return self.replay.link.seconds_per_transfer()


class Replay:
    """One replay. Its counters are the engine's (evalsuite.engine.metrics.Counters): `decode` over decode
    steps, `prefill` over the requests' prefills, which run layer by layer like decode steps (their
    experts in order, and where the trace holds them in meta["prefill_predicted"], their predictions'
    prefetches) outside the timed decode. `tpots`: per request, its decode seconds per step."""

    def __init__(self, trace, costs, capacity: int, mode: str, budget: int, window: bool, policy: str,
                 per_layer: bool = False):
        self.trace, self.costs, self.mode = trace, costs, mode
        self.offloading, self.predicting = SIMULATED_MODES[mode].offloads, SIMULATED_MODES[mode].predicts
        self.perfect = mode == PERFECT_PREFETCH.name
        self.layers = [SimpleNamespace(index=layer, top_k=trace.top_k) for layer in trace.layers]
        self.cache = ExpertCache(trace.layers, capacity, 1, torch.float32, "meta", policy, per_layer)
        self.link = SerialLink(costs.transfer_s, costs.chunk_s)
        self.transfers = _LinkView(self)
        self.budget = budget
        # compute-thread seconds per prefetch, as Engine.prefetch_cost_s (measured by the engine where known)
        self.prefetch_cost_s = costs.miss_s if costs.prefetch_s is None else costs.prefetch_s
        self.demand_cost_s = costs.miss_s  # what a demand load costs it (_spend below), so what a right prefetch spares
        self.scheduler = PrefetchScheduler(self, budget, window) if self.predicting else None
        if self.scheduler is not None:  # where the driver would make a token quiet (_quiet)
            self.scheduler.quiet_possible = (not self.perfect and policy != "predicted"
                                           and not SIMULATED_MODES[mode].speculates)
        self.t = self.excluded = 0.0  # the clock; time between requests (a prefill) left out of TPOT
        self.compute = self.waited = self.predict = 0.0
        self.missed = 0  # demand loads over the replay (the engine's `missed`)
        self.decode, self.prefill = Counters(), Counters()
        self.counters = self.decode  # the ones being counted into
        self.tpots: list[float] = []
        self.prefilling = False
        self.prefetched: set = set()  # prefetched experts not yet used (the engine's _prefetched)
        self.prefetches_to_settle: dict = {}  # sparse layer -> {its prefetches since its router last settled them}
        self._layer_uses: dict = {}  # layer -> [decode uses, those that would have missed], fading (miss_rate)
        self._tally_keep = fading_keep(trace.top_k)
        self.pending: dict[int, list] = {}  # target position -> ranked prediction, until that layer routes
        self.deferred: tuple | None = None  # (target position, ranked) until this layer's loads are queued
        # (layer, ranked, native, the layer's experts resident then) of predictions left for the request's end
        self.put_off: list[tuple] = []
        self.put_offs = 0  # predictions put off so far (PredictionDriver.put_off)
        self.quiet_steps = 0  # decode steps whose predictions were all put off unasked (driver.quiet_tokens)

    # ---- requests: a prefill, then decode steps ---------------------------------------------
    def run(self) -> None:
        steps, prefills = self.trace.steps, list(self.trace.prefills)
        if not prefills or prefills[0][0] > 0:  # steps recorded before any prefill (a trace without them)
            prefills.insert(0, (0, None))
        predicted = self.trace.meta.get("prefill_predicted") or []
        predicted = [None] * (len(prefills) - len(predicted)) + list(predicted)  # aligned with the prefills
        prompts = ([None] * len(prefills) + list(self.trace.prompts))[len(self.trace.prompts):]  # aligned the same way
        ends = [start for start, _ in prefills[1:]] + [len(steps)]
        for (start, prefill), ranked, prompt, end in zip(prefills, predicted, prompts, ends):
            self._new_request(prefill, ranked, prompt)
            begun = self.t
            for index in range(start, end):
                self._step(steps[index], steps[index + 1] if index + 1 < end else None)
            for layer, ranked_, native, resident in self.put_off:  # as PredictionDriver.end_request scores them
                self.scheduler.observe(layer, ranked_[: self.budget], native, resident)
            self.put_off = []
            if end > start:
                self.tpots.append((self.t - begun) / (end - start))

    def _step(self, step, following) -> None:
        self._spend(self.costs.predictor_step_s if self.predicting else 0.0, "predict")
        if self._quiet():
            for pos, routing in enumerate(step):
                self._quiet_layer(pos, routing, step, following)
        else:
            for pos, routing in enumerate(step):
                self._layer(pos, routing, step, following)
        self._spend(self.costs.step_s)

    def _quiet(self) -> bool:
        """Whether this decode step is a quiet one, as PredictionDriver._start_quiet decides (every verdict to
        put off stands, nothing of the last step's prediction in flight or made online). It costs what putting
        one prediction off does: its first layer's start, 16-17 us in place on tiny-qwen3-moe against 17 us for
        one put off; the ~2 us its other layers each spend keeping their inputs are left out."""
        if (not self.predicting or not self.scheduler.quiet_possible or 0 in self.pending or self.prefetches_to_settle
                or not self.scheduler.put_off_all()):
            return False
        self.pending, self.deferred = {}, None
        self.quiet_steps += 1
        self._spend(self.costs.put_off_s, "predict")
        return True

    def _quiet_layer(self, pos: int, routing, step, following) -> None:
        """A quiet step's layer: its native experts run, its prediction is left for the request's end."""
        self._spend(self.costs.dense_s)
        target, ahead = self._next_of(pos, step, following)
        if ahead is not None and ahead.predicted:
            layer = self.trace.layers[target]
            self.put_off.append((layer, ahead.predicted, set(ahead.native), self.cache.resident_bits[layer]))
            self.put_offs += 1
        self._weights_in_order(self.trace.layers[pos], sorted(routing.native))

    def _new_request(self, prefill, predicted, prompt=None) -> None:
        """A new request: prediction starts clean; its prefill runs outside the timed decode, and the
        link finishes what the prefill started before the first decode step. Where the trace holds its rows
        scored (`prompt`), the scheduler learns from each layer's where the engine's did: at the layer's router,
        and the first layer's at the last one's."""
        self.pending, self.deferred = {}, None
        if self.scheduler is not None:
            self.scheduler.new_request()
        if prefill is None:
            return
        begun = self.t
        self.prefilling, self.counters = True, self.prefill
        learns = self.scheduler is not None and prompt is not None and not self.perfect  # (the trace's predictor's)
        for pos, (layer, experts) in enumerate(zip(self.trace.layers, prefill)):
            self._spend(self.costs.dense_s)
            if learns and pos > 0 and layer in prompt:
                self.scheduler.learn_prompt(layer, prompt[layer])
            if self.scheduler is not None:
                self._settle_prefetches(layer, set(experts))
            if learns and pos == len(prefill) - 1 and self.trace.layers[0] in prompt:
                self.scheduler.learn_prompt(self.trace.layers[0], prompt[self.trace.layers[0]])
            following = predicted[pos + 1] if predicted and pos + 1 < len(prefill) else None
            if self.predicting and following:  # the prompt's prediction for the next layer (shadow traces)
                self.deferred = (pos + 1, list(following[: self.budget]))
            self._weights_in_order(layer, sorted(experts))
        self.prefilling, self.counters = False, self.decode
        self.t = max([self.t] + [self.link.finish(c) for c in list(self.cache.transfers.values())
                                 if not c.done.is_set() and not c.cancelled])
        self.link.advance(self.t)
        self.excluded += self.t - begun

    def _layer(self, pos: int, routing, step, following) -> None:
        layer = self.trace.layers[pos]
        self._spend(self.costs.dense_s)  # up to the router
        predicted = self.pending.pop(pos, None)
        if self.scheduler is not None:
            self.scheduler.layer_at(pos, self.t, self.waited, self.missed)
            if predicted is not None:
                self.scheduler.observe(layer, predicted, set(routing.native))
        executed = (executed_experts(self.mode, pos, routing, self.trace.top_k) if predicted is not None
                    else list(routing.native))  # nothing predicted for this layer: the router's choice runs
        if self.scheduler is not None:  # the router decided: wrong guesses leave the link, right ones go first
            self._settle_prefetches(layer, set(executed))
        if self.predicting:
            self._predict(pos, step, following)
        self._weights_in_order(layer, sorted(executed))

    @staticmethod
    def _next_of(pos: int, step, following) -> tuple:
        """What sparse layer `pos` of `step` predicts: (its target position, that layer's routing), the next
        step's first layer from the last (None at a request's last step)."""
        return (pos + 1, step[pos + 1]) if pos + 1 < len(step) else (0, following and following[0])

    def _predict(self, pos: int, step, following) -> None:
        target, routing = self._next_of(pos, step, following)
        if routing is None:  # the request's last token: nothing comes next
            return
        ranked = list(routing.native) if self.perfect else routing.predicted
        if not ranked:  # the trace holds no prediction for it (none was made)
            return
        if not self._speculates(target) and not self.perfect and self.cache.policy != "predicted" \
                and not self.scheduler.worth_predicting(target, 1):
            # PredictionDriver leaves it for after the request (prediction.PutOffPrediction): no prefetch now, and the
            # scheduler learns its precision when the request ends; putting it off costs what the engine timed
            layer = self.trace.layers[target]
            self.put_off.append((layer, ranked, set(routing.native), self.cache.resident_bits[layer]))
            self.put_offs += 1
            self._spend(self.costs.put_off_s, "predict")
            self.scheduler.put_off_took(self.costs.put_off_s)
            return
        self._spend(self.costs.predictor_s, "predict")
        call = self.costs.predict_call_s
        self.scheduler.prediction_took(self.costs.predictor_s if call is None else call)
        self.pending[target] = ranked[: self.budget]
        self.deferred = (target, self.pending[target])

    def _speculates(self, pos: int) -> bool:
        return not self.prefilling and speculates(self.mode, pos)  # a prefill routes natively

    # ---- Engine.weights_in_order -------------------------------------------------------------
    def _weights_in_order(self, layer: int, needed: list[int]) -> None:
        self.counters.expert_uses += len(needed)
        if not self.offloading:
            self.counters.hits += len(needed)
            self._spend(len(needed) * self.costs.expert_s)
            return
        if self.cache.policy == "predicted":
            self.cache.predict({self.trace.layers[pos]: {e: float(len(r) - i) for i, e in enumerate(r)}
                                for pos, r in self.pending.items()})
        waiting = deque((layer, e) for e in needed)
        protect, held = set(waiting), deque()
        while waiting or held:
            self.link.advance(self.t)
            while waiting and (self.cache.resident(waiting[0]) or self.cache.can_place(layer, protect)):
                key = waiting.popleft()
                self._acquire(key, protect)
                held.append(key)
            if self.deferred is not None:  # this layer's demand loads are queued: prefetch behind them
                self._release_prefetch()
            if not held:  # every slot it could take is still being filled: wait for the oldest copy
                in_flight = self.cache.in_flight(layer)
                if not in_flight:
                    raise RuntimeError(f"layer {layer}: no cache slot can be freed: every slot is pinned")
                self._wait(in_flight[0][1])
                continue
            key = held.popleft()
            self._ready(key)
            self._spend(self.costs.expert_s + self.costs.lookup_s)
            self.cache.unpin(key)

    def miss_rate(self, layer: int) -> float:
        """Engine.miss_rate: recent decode uses that would have missed without prefetching, from a prior of one use
        missing as often as the layer's experts are absent from the cache."""
        absent = absent_share(self.cache.resident_bits[layer], self.trace.experts)
        return rate_of(self._layer_uses.get(layer, (0.0, 0.0)), absent)

    def _acquire(self, key, protect) -> None:
        if not self.prefilling:  # a prefetched expert's use would have missed
            tally = self._layer_uses.setdefault(key[0], [0.0, 0.0])
            count_use(tally, not self.cache.resident(key) or key in self.prefetched, self._tally_keep)
        if self.cache.resident(key):
            self.counters.hits += 1
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.counters.prefetch_used += 1
        else:
            self.counters.misses += 1
            self.missed += 1
            _, evicted = self.cache.place(key, protect)
            self._evicted(evicted)
            self._submit(key, prefetch=False)
        self.cache.pin(key)

    def _ready(self, key) -> None:
        copy = self.cache.transfers.get(key)
        if copy is not None:
            self.link.promote(copy, self.t)  # the compute waits for it: it goes before other prefetches
            self._wait(copy)

    def _wait(self, copy) -> None:
        self.link.advance(self.t)
        if copy.done.is_set():
            return
        ready = self.link.finish(copy) + self.costs.handoff_s
        self.waited += ready - self.t
        self.counters.stall_s += ready - self.t
        if self.counters is self.decode:
            self.counters.decode_stall_s += ready - self.t
        self.t = ready

    # ---- prefetching: Engine.prefetch, settle_prefetches, PredictionDriver.release_prefetch -------
    def _release_prefetch(self) -> None:
        target, ranked = self.deferred
        self.deferred = None
        if self._speculates(target):  # it executes exactly these: all at once, at demand priority
            self.prefetch(self.trace.layers[target], sorted(set(ranked[: self.trace.top_k])), demand=True)
        else:
            self.scheduler.schedule(target, ranked, 1)

    def prefetch(self, layer: int, experts, demand: bool = False, keep=()) -> int:
        """Engine.prefetch: what the scheduler (or a speculating layer) sends."""
        self.link.advance(self.t)
        keep = {(layer, int(e)) for e in [*experts, *keep]}
        started = 0
        for e in experts:
            key = (layer, int(e))
            if self.cache.resident(key) or not self.cache.can_place(layer, exclude=keep, prefetch=True):
                continue
            _, evicted = self.cache.place(key, exclude=keep, prefetch=True)
            self._evicted(evicted)
            self._submit(key, prefetch=not demand)
            self.prefetched.add(key)
            self.prefetches_to_settle.setdefault(layer, {})[key] = None
            self.counters.prefetches += 1
            started += 1
        return started

    def _settle_prefetches(self, layer: int, confirmed: set) -> None:
        self.link.advance(self.t)
        pinned, wrong = {}, []
        for key in self.prefetches_to_settle.pop(layer, {}):
            copy = self.cache.transfers.get(key)
            if key not in self.prefetched or copy is None or copy.done.is_set():
                continue  # used, evicted, or landed: a landed one stays at the eviction end, maybe used later
            if key[1] in confirmed:
                self.link.promote(copy, self.t)
            elif self.cache.pins.get(key):
                pinned[key] = None
            else:
                wrong.append((key, copy))
        for key, copy in reversed(wrong):  # newest first, as the engine (Engine.settle_prefetches says why)
            if self.link.cancel(copy, self.t):
                if self.cache.withdraw(key, copy.untouched) is not None:
                    self.counters.victims_restored += 1
                self.prefetched.discard(key)
                self.counters.prefetch_cancelled += 1
        if pinned:
            self.prefetches_to_settle[layer] = pinned

    def _evicted(self, key) -> None:
        if key in self.prefetched:  # a prefetch that was never used
            self.prefetched.discard(key)
            self.counters.prefetch_wasted += 1

    def _submit(self, key, prefetch: bool) -> None:
        # the compute thread places the copy (choosing and evicting a victim) before the link can start it, as
        # Engine._acquire and prefetch do: starting the link first would hide that time behind the copy, and
        # replayed on-demand on ufs4 at 10 % stalled 0.01 ms a token where the engine measured 0.44 (now 0.30)
        self._spend(self.costs.miss_s)
        self.cache.transfers[key] = self.link.submit(key, self.t, prefetch)
        self.counters.bytes_transferred += self.trace.meta.get("expert_bytes", 0)

    def _spend(self, seconds: float, kind: str = "compute") -> None:
        self.t += seconds
        if kind == "predict":
            self.predict += seconds
        else:
            self.compute += seconds


def replayed_stats(trace, costs, capacity: int, mode: str, policy: str = "lru", per_layer: bool = False,
                   budget: int | None = None, window: bool = True) -> dict:
    """The engine's stats for `mode` over the trace's requests, replayed (see Replay): the counters over
    prefills and decode steps together as the engine counts them (evalsuite.engine.metrics), decode
    stall per token, and TPOT per sequence in simulated time from `costs`."""
    budget = budget or trace.meta.get("budget") or trace.top_k
    replay = Replay(trace, costs, capacity, mode, budget, window, policy, per_layer)
    replay.run()
    total = Counters().add(replay.prefill).add(replay.decode)
    tokens = len(trace.steps) + len(trace.prefills)
    return {**total.as_dict(), "sequences": len(trace.prefills), "tokens": tokens,
            "bytes_per_token": total.bytes_transferred / tokens if tokens else None,
            "stall_ms_per_token": replay.decode.stall_s * 1e3 / max(len(trace.steps), 1),
            "tpot_ms": summarise(replay.tpots), "replayed": True}


def replayed_sequences(sequences, predictor, layers, experts, top_k, meta, costs, capacity, mode, policy="lru",
                       per_layer=False) -> dict:
    """replayed_stats over the trace of shadow-recorded sequences (evalsuite.engine.prediction.shadows.routing_trace),
    built here: the replay process's whole job."""
    trace = routing_trace(sequences, predictor, layers, experts, top_k, meta)
    return replayed_stats(trace, costs, capacity, mode, policy, per_layer)
