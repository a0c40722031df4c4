"""Routing traces: which experts each sparse layer chose, ran and was predicted to need.

`offload(model, ..., trace=True)` records one `LayerRouting` per sparse layer per decode
step of batch-1 requests (prefill and batched steps are not recorded: the simulator projects
decode TPOT, and batch-1 decode is what offloading engines optimise). A trace is plain JSON,
so any run's routing can be replayed by `evalsuite simulate` against other hardware.

native     the layer's own router's top-k (what a router-preserving run executes)
executed   the experts the layer actually ran (differs from native under speculation)
predicted  the prediction made for this layer, ranked by confidence (the prefetch
           candidates): one sparse layer earlier, or for the first sparse layer at the previous
           decode step's last one (across the token boundary); None where none was made (a
           request's first decode step at the first sparse layer, a run without a predictor)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evalsuite.engine.pass_state.forward_pass import ForwardPass
from evalsuite.engine.metrics import ranked_recall
from evalsuite.engine.prediction.prompt_precision import PromptRows

VERSION = 2  # 2: the first sparse layer's prediction is stored with the step it is for


@dataclass
class LayerRouting:
    native: list[int]
    executed: list[int] | None = None
    predicted: list[int] | None = None


@dataclass
class RoutingTrace:
    layers: list[int]  # sparse layer indices, in order
    experts: int  # routed experts per layer
    top_k: int
    steps: list[list[LayerRouting]] = field(default_factory=list)  # decode steps x sparse layers
    meta: dict = field(default_factory=dict)
    # per request: (index of its first decode step, experts its prefill ran per sparse layer);
    # the prefill leaves those experts in the cache, which the simulator must know
    prefills: list = field(default_factory=list)
    # per request (where recorded), its prefill's rows scored per sparse layer, {layer: PromptRows}: what the
    # scheduler learns of the predictor's precision before decoding (evalsuite.engine.prediction.prompt_precision)
    prompts: list = field(default_factory=list)

    def save(self, path) -> None:
        data = {"version": VERSION, "layers": self.layers, "experts": self.experts, "top_k": self.top_k,
                "meta": self.meta, "steps": [[asdict(r) for r in step] for step in self.steps],
                "prefills": self.prefills,
                "prompts": [None if p is None else {str(l): r.to_json() for l, r in p.items()} for p in self.prompts]}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        try:
            data = json.loads(Path(path).read_text())
            steps = [[LayerRouting(**r) for r in step] for step in data["steps"]]
            trace = cls(data["layers"], int(data["experts"]), int(data["top_k"]), steps, data.get("meta", {}),
                        [(int(start), [list(e) for e in per_layer]) for start, per_layer in data.get("prefills", [])])
            trace.prompts = [None if p is None else {int(l): PromptRows.from_json(r) for l, r in p.items()}
                             for p in data.get("prompts", [])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a routing trace ({exc}); record one with "
                             "`evalsuite bench --traces DIR` or offload(..., trace=True)") from exc
        if data.get("version", 1) < 2:
            trace._first_layer_one_step_later()
        return trace

    def _first_layer_one_step_later(self) -> None:
        """Version 1 stored the first sparse layer's cross-token prediction on the step that made
        it; it is for the next step of the same request."""
        starts = {start for start, _ in self.prefills}
        for index in range(len(self.steps) - 1, -1, -1):
            earlier = self.steps[index - 1][0].predicted if index > 0 and index not in starts else None
            self.steps[index][0].predicted = earlier

    def recall(self) -> float | None:
        """Mean recall@top-k (evalsuite.engine.metrics' per-prediction formula) over every prediction the trace
        holds, the first sparse layer's cross-token ones included, pooled over steps: what the simulator fits a
        synthetic trace to. Not the reported recall@K (within-token anchors only, per sample, then across
        samples: EngineRecord.summary)."""
        made = [r for step in self.steps for r in step if r.predicted]
        values = ranked_recall([r.predicted for r in made], [r.native for r in made], self.top_k)
        return sum(values) / len(values) if values else None

    def predicted_reuse(self) -> float | None:
        """Mean share of a layer's predicted top-k that the same layer's prediction also held one
        step earlier, over the consecutive steps that both have one: the reuse of the set that
        speculative execution runs."""
        k = self.top_k
        values = [len(set(now.predicted[:k]) & set(before.predicted[:k])) / k
                  for prev, step in zip(self.steps, self.steps[1:]) for before, now in zip(prev, step)
                  if before.predicted and now.predicted]
        return sum(values) / len(values) if values else None

    def reuse(self) -> float | None:
        """Mean share of a layer's native experts that the same layer also chose one step earlier."""
        values = [len(set(now.native) & set(before.native)) / len(now.native)
                  for prev, step in zip(self.steps, self.steps[1:]) for before, now in zip(prev, step)]
        return sum(values) / len(values) if values else None


class TraceRecorder:
    """Collects a RoutingTrace from the engine's hooks (`attach`) and the prediction driver's calls."""

    def __init__(self, layers, experts: int, top_k: int, meta: dict):
        self.trace = RoutingTrace(list(layers), experts, top_k, meta=meta)
        self._step: dict[int, LayerRouting] | None = None
        self._prefill: dict[int, list[int]] | None = None
        self._prompt: dict[int, PromptRows] = {}  # the running prefill's rows scored per sparse layer
        self._next: dict[int, list[int]] = {}  # predictions made for the next decode step's layers

    @classmethod
    def attach(cls, engine) -> tuple[TraceRecorder, list]:
        """A recorder of `engine`'s routing, and a hook on each of its routers that records the native choice
        (attached before any hook that changes the routing, it sees the router's own)."""
        first = engine.layers[0]
        meta = {"mode": engine.mode, "model": engine.model.config._name_or_path, "family": engine.family.__name__,
                "expert_bytes": engine.layout.nbytes, "budget": engine.budget}
        recorder = cls([layer.index for layer in engine.layers], first.num_experts, first.top_k, meta)

        def native_of(index: int):
            def hook(module, args, output):
                if not engine.forward.looking_ahead:
                    recorder.native(index, output[2].detach().clone())  # the model may reuse its tensor
            return hook
        return recorder, [layer.router.register_forward_hook(native_of(layer.index)) for layer in engine.layers]

    def forward_started(self, forward: ForwardPass) -> None:
        """A new forward pass (evalsuite.engine.pass_state.forward_pass.ForwardPass): only batch-1 ones are recorded."""
        self._flush()
        self._step = {} if forward.decoding and forward.rows == 1 else None
        self._prefill = {} if not forward.decoding and forward.rows == 1 else None
        if self._step is not None:
            self._step.update({layer: LayerRouting([], None, ranked) for layer, ranked in self._next.items()})
        self._next = {}

    def native(self, layer: int, ids) -> None:
        """`ids`: the router's choice, a tensor read only when the trace is (no host read per layer)."""
        if self._step is not None:
            self._routing(layer).native = ids

    def executed(self, layer: int, ids) -> None:
        if self._step is not None:
            self._routing(layer).executed = list(ids)
        elif self._prefill is not None:
            self._prefill[layer] = list(ids)

    def predicted(self, layer: int, ranked) -> None:
        """`ranked`: the candidates; or, to be ranked once the trace is read, a function giving them
        (engine.put_off.PutOffPrediction) or a put-off token with `ranked_for(layer)` (engine.put_off.PutOffToken)."""
        if self._step is None:
            return
        if type(ranked) is list or not (callable(ranked) or hasattr(ranked, "ranked_for")):
            ranked = list(ranked)
        routing = self._step.get(layer)
        if routing is None:  # (_routing written out: this runs at every layer)
            self._step[layer] = LayerRouting([], None, ranked)
        elif type(routing.native) is not list or routing.native:
            # it routed already (its choice is the router's tensor, or a list once read): this is for the next token
            self._next[layer] = ranked
        else:
            routing.predicted = ranked

    def prompt(self, layer: int, rows: PromptRows) -> None:
        """The running prefill's rows scored for `layer` (evalsuite.engine.prediction.prompt_precision)."""
        if self._prefill is not None:
            self._prompt[layer] = rows

    def _routing(self, layer: int) -> LayerRouting:
        """The running step's record of `layer`, made at its first use (these run at every layer: a record
        made as a default argument, and dropped, cost each call a dataclass)."""
        routing = self._step.get(layer)
        if routing is None:
            routing = self._step[layer] = LayerRouting([])
        return routing

    def _flush(self) -> None:
        if self._step and len(self._step) == len(self.trace.layers):
            self.trace.steps.append([self._step[l] for l in self.trace.layers])
        if self._prefill and len(self._prefill) == len(self.trace.layers):
            self.trace.prefills.append((len(self.trace.steps), [self._prefill[l] for l in self.trace.layers]))
            self.trace.prompts.append(self._prompt or None)
        self._step = self._prefill = None
        self._prompt = {}

    def result(self) -> RoutingTrace:
        self._flush()
        for step in self.trace.steps:
            for layer, routing in zip(self.trace.layers, step):
                if not isinstance(routing.native, list):  # the router's tensor, read once here
                    routing.native = sorted(set(routing.native.flatten().tolist()))
                predicted = routing.predicted  # a prediction made after its request (engine.put_off)
                if callable(predicted):
                    routing.predicted = list(predicted())
                elif hasattr(predicted, "ranked_for"):
                    routing.predicted = list(predicted.ranked_for(layer))
        return self.trace
