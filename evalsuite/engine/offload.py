"""`offload()`: wire the store, cache and transfer worker into a transformers MoE model.

The model keeps running through its own `forward`/`generate`; the engine registers an experts
implementation with transformers (`ExpertsInterface`) that asks the cache for each expert a
layer needs, waits only for copies not yet done, and computes in the eager kernel's order.
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from evalsuite.engine import arch, placement
from evalsuite.engine.cache import ExpertCache
from evalsuite.engine.cache.fetching import ExpertFetching, fading_keep
from evalsuite.engine.config import EngineConfig
from evalsuite.engine.kernel import run_experts
from evalsuite.engine.link import parse_link
from evalsuite.engine.link.worker import TransferError
from evalsuite.engine.metrics import Counters, EngineRecord, recall_ks
from evalsuite.engine.modes import MODES
from evalsuite.engine.pass_state.forward_pass import ForwardPass
from evalsuite.engine.pass_state.token_kinds import image_token_ids
from evalsuite.engine.placement.offloading import move_experts_out, put_experts_back
from evalsuite.engine.placement.store import Checkpoint, ExpertLayout
from evalsuite.engine.prediction import PREDICTORS, artifact_beside, experts_in
from evalsuite.engine.prediction.driver import PredictionDriver
from evalsuite.engine.prediction.row_groups import RowGroups
from evalsuite.engine.prediction.scheduler import PrefetchScheduler
from evalsuite.engine.prediction.shadows import ShadowPredictions

IMPLEMENTATION = "evalsuite"


def _engine_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    engine, layer, pos = experts._evalsuite
    driver = engine.driver
    if driver is not None and not driver.at_router:  # the router's input and choice: see PredictionDriver.on_router
        driver.on_router(pos, None, hidden_states, None, top_k_weights, top_k_index)
    if engine.cache is None:  # resident: the model's own kernel computes, the engine only counts
        # a decode step's few rows are read in one host call: torch.unique costs a decode layer ~15 us more
        needed = sorted(experts_in(top_k_index)) if engine.forward.decoding else torch.unique(top_k_index).tolist()
        engine.count_resident(layer, needed)
        out = engine.own_kernel(experts, hidden_states, top_k_index, top_k_weights)
    else:
        out = run_experts(experts, hidden_states, top_k_index, top_k_weights,
                          lambda needed: engine.weights_in_order(layer, experts, needed))
    forward = engine.forward
    if forward.kinds is not None and not forward.looking_ahead:
        forward.kinds.count_hits(engine.record.kinds, top_k_index, forward.layer_hits)
    return out


ExpertsInterface.register(IMPLEMENTATION, _engine_experts_forward)


def offload(model, mode: str | EngineConfig = "on-demand", *, artifact=None, **options) -> "Engine":
    """Patch a loaded transformers MoE model in place and return its engine handle.

    `mode` is a mode's name or a whole EngineConfig; `options` are EngineConfig's fields (the table in
    docs/eval.md: `python -m evalsuite.engine.config`), applied on top. `artifact`: a calibration artifact
    already loaded (evalsuite.predict.calibrate), instead of `predictor_path`. The model may sit anywhere,
    experts on the meta device included (evalsuite.engine.load_offloaded builds it so). Bad options raise
    ValueError before the model is touched.
    """
    config = mode.replace(**options) if isinstance(mode, EngineConfig) else EngineConfig(mode=mode, **options)
    return Engine(model, config, artifact)


class Engine(ExpertFetching):
    """The handle `offload` returns: stats(), reset_stats(), take_record(), prefetch(), close()."""

    def __init__(self, model, config: EngineConfig, artifact=None):
        if getattr(model, "_evalsuite_engine", None) is not None:
            raise ValueError("this model is already offloaded: close() its engine first")
        self.config = c = config
        self.model, self.mode = model, c.mode
        self.family = arch.family_of(model)
        self.layers = arch.sparse_layers(model)
        # the experts as the model holds them, and as the store, the link and the cache hold them (packed codes
        # at expert_bits 8 or 4: placement/quantised.py)
        self.dense_layout = ExpertLayout.of(self.layers[0].experts)
        if any(ExpertLayout.of(layer.experts) != self.dense_layout for layer in self.layers):
            raise arch.UnsupportedModelError("sparse layers with different expert shapes are not supported")
        self.layout = self.dense_layout
        if c.expert_bits != 16:  # checked against the experts' widths before the model is touched
            from evalsuite.engine.placement.quantised import layout_for
            self.layout = layout_for(self.dense_layout, c.expert_bits, c.expert_group_size)
        self.unloaded = placement.experts_unloaded(self.layers, self.dense_layout)  # built without its experts
        self.device = (torch.device(c.device) if c.device is not None
                       else placement.home_device(model, self.layers, self.dense_layout))
        self.timeout_s = c.transfer_timeout_s
        self.link = parse_link(c.link)
        self.record = self._fresh_record()
        self.cache = self.store = self.transfers = self.driver = self.predictor = None
        self._dense_experts = None  # a quantised reference's own weights, put back by close()
        self.artifact_path = None  # the calibration artifact the predictor read, where it reads one
        self.forward = ForwardPass(decoding=False, rows=1)  # the pass running now (evalsuite.engine.pass_state)
        self._prefetched: set = set()  # prefetched experts not yet used
        # sparse layer -> {its prefetches sent since its router last settled them}: a layer in it has something for
        # settle_prefetches to do (the prediction driver looks at every layer, without a call)
        self.prefetches_to_settle: dict = {}
        self.stalled_s = 0.0  # seconds the compute thread waited for copies, over the engine's life
        self.missed = 0  # demand loads started, over the engine's life (the scheduler's stall per miss)
        self._decode_tally: dict = {}  # sparse layer -> [decode uses, those that would have missed], fading (miss_rate)
        self._tally_keep = fading_keep(self.layers[0].top_k)  # what an older use still weighs
        self._experts_in = {layer.index: layer.num_experts for layer in self.layers}  # (miss_rate's prior)
        self.prefetch_work_s, self._prefetch_n = 0.0, 0  # compute-thread seconds issuing, cancelling, promoting
        self.prefetch_cost_s: float | None = None  # compute-thread seconds per prefetch (see _prefetch_work)
        self.demand_work_s, self._demand_n = 0.0, 0  # compute-thread seconds starting demand loads, and how many
        self.demand_cost_s: float | None = None  # per demand load: what a right prefetch spares (scheduler cost(r))
        self._shared: dict = {}  # the predictions the cache has: position -> (scores, confidence)
        predictor = c.predictor or MODES[c.mode].predictor  # resident takes one only when given: it measures recall
        top_k = self.layers[0].top_k
        budget = c.prefetch_budget or top_k
        if budget < top_k:
            raise ValueError(f"prefetch_budget={budget} is below top-k={top_k}")
        if predictor is not None:
            self.predictor = self._build_predictor(predictor, artifact, c.horizon)
        if c.row_predictors:
            self.predictor = RowGroups([self._build_predictor(name, artifact, c.horizon)
                                        for name in c.row_predictors], lambda: self.forward.rows)
        shadow_predictors = {name: self._build_predictor(name, artifact, 1) for name in c.shadows}
        if c.offloads:  # the last step that can fail on bad input, the first that changes the model
            self.store, self.cache, self.transfers, self._dense_experts = move_experts_out(self, c)
        else:
            if self.unloaded:  # the reference computes with every expert: read them all in, close() drops them
                placement.load_experts(self.layers, self.dense_layout, self.family,
                                       Checkpoint(c.checkpoint or model.config._name_or_path,
                                                  self.dense_layout.dtype), self.device)
            model.to(self.device)
            if self.layout is not self.dense_layout:  # the reference at these bits: the dequantised weights
                self._dense_experts = placement.quantise_experts(self.layers, self.layout)
        self.budget, self.tracer, self._hooks = budget, None, []
        ids = image_token_ids(model)
        self.image_ids = torch.tensor(ids) if ids else None  # metrics by token kind
        if c.trace:  # its router hooks go first, so they see the native routing
            from evalsuite.engine.trace import TraceRecorder

            self.tracer, hooks = TraceRecorder.attach(self)
            self._hooks += hooks
        self.shadows = None
        ks = recall_ks(top_k, self.layers[0].num_experts, c.recall_k)  # recall@k's k (evalsuite.engine.metrics)
        if shadow_predictors:  # their hooks see the native routing before the driver's, what ran after them
            self.shadows = ShadowPredictions(self, shadow_predictors, ks, budget, list(c.row_predictors) or None)
        if predictor is not None:
            scheduler = PrefetchScheduler(self, budget, c.window) if MODES[c.mode].predicts and c.offloads else None
            self.driver = PredictionDriver(self, self.predictor, c.mode, c.horizon, ks, c.preserve_layers, scheduler)
        if self.shadows is not None:
            self.shadows.attach_after()
        self._previous_impl = model.config._experts_implementation
        for pos, layer in enumerate(self.layers):
            layer.experts._evalsuite = (self, layer.index, pos)
        model.set_experts_implementation(IMPLEMENTATION)
        self._hooks += [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                        model.register_forward_hook(self._after_forward)]
        model._evalsuite_engine = self

    # ---- construction -------------------------------------------------------------------
    def _build_predictor(self, name, artifact, horizon):
        c, kind = self.config, PREDICTORS[name]  # EngineConfig knows the registered names
        path = c.predictor_path
        if path is None and artifact is None and kind.needs_artifact:  # the checkpoint's own, if it ships one
            path = artifact_beside(getattr(self.model, "name_or_path", None))
        if kind.needs_artifact:
            self.artifact_path = path
        if path is not None:
            artifact = kind.load(path, self.model, self.layers)
        return kind.build(name, self.layers, self.family, artifact, horizon, c.drift_layers, c.drift_threshold,
                          self.device, seed=c.recall_seed)

    def routing_trace(self):
        """The RoutingTrace recorded so far (offload(..., trace=True))."""
        if self.tracer is None:
            raise ValueError("this engine records no trace: offload(..., trace=True)")
        if self.predictor is not None:
            self.tracer.trace.meta["predictor"] = self.predictor.name
        return self.tracer.result()

    # ---- the hot path ---------------------------------------------------------------------
    def own_kernel(self, experts, *args):
        """The experts implementation the model had before the engine took over (eager, grouped_mm, ...)."""
        if self._previous_impl in (None, "eager"):
            return type(experts).forward.__wrapped__(experts, *args)  # the class's own loop
        return ALL_EXPERTS_FUNCTIONS.get_interface(self._previous_impl, None)(experts, *args)

    def count_resident(self, layer: int, needed: list[int]) -> None:
        """Every expert a resident layer uses is a hit (nothing moves)."""
        if self.forward.looking_ahead:  # the oracle's look-ahead counts nothing
            return
        if self.tracer is not None:
            self.tracer.executed(layer, needed)
        counters = self.record.counters[layer]
        counters.expert_uses += len(needed)
        counters.hits += len(needed)
        self.forward.layer_hits.clear()
        if self.forward.kinds is not None:
            self.forward.layer_hits.update(dict.fromkeys(needed, True))

    # ---- per-request timing ---------------------------------------------------------------
    def _before_forward(self, module, args, kwargs):
        # transformers 5 generate passes `cache=`; direct calls use `past_key_values=`.
        kv_arg = "cache" if "cache" in kwargs else "past_key_values"
        kv_cache = kwargs.get(kv_arg)  # the attention's key/value cache (self.cache is the expert cache)
        decoding = kv_cache is not None and kv_cache.get_seq_length() > 0
        self.forward = ForwardPass.of_call(args, kwargs, decoding, self.image_ids)
        if not decoding:  # a new request: its prefill
            if self.driver is not None:
                self.driver.end_request()
            self.record.start_request(time.perf_counter(), self.forward.rows)
        if self.tracer is not None:
            self.tracer.forward_started(self.forward)
        if self.shadows is not None:
            self.shadows.forward_started(self.forward)
        if self.predictor is not None and self.predictor.name == "oracle":
            self._look_ahead(module, args, kwargs, kv_arg, kv_cache)

    def _look_ahead(self, module, args, kwargs, kv_arg, kv_cache):
        """Run this forward pass once without side effects, recording the true routing."""
        look_ahead_kwargs = dict(kwargs)
        if kv_cache is not None:
            look_ahead_kwargs[kv_arg] = copy.deepcopy(kv_cache)
        real = self.forward
        self.forward = dataclasses.replace(real, looking_ahead=True, layer_hits={})
        try:
            with torch.no_grad():
                module.forward(*args, **look_ahead_kwargs)
        finally:
            self.forward = real

    def _after_forward(self, module, args, output):
        if self.device.type == "cuda":  # the forward's end: its kernels done; copies still in flight need not be
            torch.cuda.current_stream(self.device).synchronize()
        if self.record.requests:
            self.record.requests[-1].ends.append(time.perf_counter())

    # ---- the handle -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters in total and per layer, TTFT / TPOT summaries, recall, and the cache's size."""
        if self.driver is not None:
            self.driver.end_request()
        summary = self.record.summary(precision_by_construction=MODES[self.mode].speculates)
        return {**summary, **self.describe(), "device_expert_bytes": self.device_expert_bytes()}

    def describe(self) -> dict:
        """The engine's configuration, as results tables want it."""
        return {"mode": self.mode, "predictor": self.predictor.name if self.predictor is not None else None,
                "predictor_artifact": self.artifact_path,
                "expert_bytes": self.layout.nbytes, "expert_bits": self.config.expert_bits,
                "expert_group_size": getattr(self.layout, "group_size", None),
                "cache_experts": self.cache.slots.shape[0] if self.cache is not None else None,
                "link": self.link.name if self.link is not None else None}

    def clear_cache(self) -> None:
        """Start cold, as a new engine would: let copies in flight land, empty the expert cache, and drop
        what prediction carried over (pending predictions and prefetches, the scheduler's layer timing and verdicts)
        and what was read off the cache it empties (the miss rate, the share of candidates missing)."""
        if self.driver is not None:
            self.driver.forget()
        self._decode_tally.clear()
        if self.cache is None:
            return
        for transfer in list(self.cache.transfers.values()):
            try:  # a host wait: the slot is handed to a new cache, so no copy may still be writing it
                transfer.wait_landed(self.timeout_s)
            except TransferError:
                pass  # a failed copy leaves nothing to keep: its slot is emptied with the rest
        self._prefetched.clear()
        self.prefetches_to_settle.clear()
        # a new, empty cache over the same slot memory (built on the meta device: nothing is allocated)
        slots = self.cache.slots
        self.cache = ExpertCache([l.index for l in self.layers], slots.shape[0], self.layout.numel,
                                 self.layout.dtype, "meta", self.config.cache_policy,
                                 self.config.cache_pools == "per-layer")
        self.cache.slots = slots

    def keep_rows(self, rows: list[int]) -> None:
        """Between two decode steps of the running request, its batch keeps only `rows` (positions in the batch,
        ascending): rows whose generation has ended leave it, so later steps compute only the others. Only an
        engine that moves no experts (resident, or `keep_experts`) and records no trace: a cache, a link and a
        trace time and count per step, batch and all."""
        if self.cache is not None or self.tracer is not None:
            raise ValueError("keep_rows: only an engine that keeps every expert and records no trace lets rows "
                             "leave a batch")
        index = torch.tensor(rows, dtype=torch.long)
        if self.driver is not None:
            self.driver.keep_rows(index)
        if self.shadows is not None:
            self.shadows.keep_rows(index)

    def take_record(self) -> EngineRecord:
        """What was measured since the last take or reset; starts a fresh record."""
        if self.driver is not None:
            self.driver.end_request()
        record, self.record = self.record, self._fresh_record()
        return record

    def take_shadows(self):
        """The shadow predictors' record since the last take (offload(..., shadows=...)): their scores
        (predictor -> metric -> k -> layer -> per sample, as EngineRecord.scores) and one SequenceRouting per
        sequence."""
        if self.shadows is None:
            raise ValueError("this engine scores no shadow predictors: offload(..., shadows=('gate', ...))")
        return self.shadows.take()

    def _fresh_record(self) -> EngineRecord:
        return EngineRecord(counters={layer.index: Counters() for layer in self.layers}, top_k=self.layers[0].top_k)

    def device_expert_bytes(self) -> int:
        """Bytes of expert weights allocated on the device (cache slots + model parameters)."""
        params = sum(getattr(l.experts, name).nbytes for l in self.layers for name, _, _ in self.dense_layout.fields)
        return params + (self.cache.nbytes if self.cache is not None else 0)

    def reset_stats(self) -> None:
        if self.driver is not None:
            self.driver.current = {}
        if self.shadows is not None:
            self.shadows.take()
        self.record = self._fresh_record()

    def close(self) -> None:
        """Stop transfers, put the experts back into the model and restore its kernel. A model built
        without its experts gets them back on the meta device (not read whole into memory)."""
        if getattr(self.model, "_evalsuite_engine", None) is not self:
            return
        if self.transfers is not None:
            self.transfers.close()
            if not self.unloaded:  # one built without experts leaves without
                put_experts_back(self.layers, self.dense_layout, self.layout, self.store, self.device,
                                 self._dense_experts)
            self.store.close()
            # drop the big buffers now: engine, driver and scheduler refer to each other, so
            # the garbage collector would free them only some time later
            self.cache = self.store = self.transfers.store = None
        elif self._dense_experts is not None:
            placement.restore_experts(self.layers, self._dense_experts)
        self._dense_experts = None
        if self.unloaded:
            placement.drop_experts(self.layers, self.dense_layout)
        for hook in self._hooks:
            hook.remove()
        if self.driver is not None:
            self.driver.close()
        if self.shadows is not None:
            self.shadows.close()
        for layer in self.layers:
            del layer.experts._evalsuite
        self.model.set_experts_implementation(self._previous_impl)
        self.model._evalsuite_engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
