"""Shadow predictors: every requested predictor scored beside one generation, batched.

`offload(model, mode="resident", shadows=("gate", "quasi", ...))` runs each predictor at every
sparse layer as the prediction driver would (one layer ahead; at a decode token's last sparse
layer, for the next token's first one) without acting on it. Per sequence (a row of a batched
request) it keeps what a batch-1 run of that sequence would see:

prefill   the experts each sparse layer ran for the row's own tokens (padding left out), and each
          predictor's ranked candidates for the next sparse layer (its confidence summed over
          those tokens, as `scheduler.ranked` ranks a prompt)
decode    per step and sparse layer the native routing (the router's top-k, before any
          speculation), the experts executed (after it), and each predictor's scores

A batched row goes on after its batch-1 generation would have stopped (lm-eval stops a batch
only when every row has met its stop sequence): `end_request(steps)` says how many decode steps
each row's batch-1 generation made, and only those count. From that record come recall@k and exact@K
per sample and within-token target layer, and recall_next_token@K at the first sparse layer (the
definitions of evalsuite.engine.metrics, averaged as PredictionDriver does), and one `RoutingTrace` per
predictor, which evalsuite.perf.replay replays through the engine's cache and scheduler for any cache,
policy and link.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evalsuite.engine.pass_state.forward_pass import ForwardPass
from evalsuite.engine.pass_state.layer_state import LayerState
from evalsuite.engine.metrics import add_samples
from evalsuite.engine.prediction.request_recall import per_token_scores, row_means, scored_as, step_rows
from evalsuite.engine.prediction.prompt_precision import PromptRows, prompt_rows
from evalsuite.engine.pass_state.input_taps import tap_input
from evalsuite.engine.prediction.registry import ranked_scores
from evalsuite.engine.trace import LayerRouting, RoutingTrace


@dataclass
class SequenceRouting:
    """One sequence's routing and predictions, as its batch-1 run would have met them."""

    prefill: list[list[int]]  # per sparse layer: the experts the prefill ran
    prefill_predicted: dict[str, list[list[int] | None]]  # predictor -> per sparse layer: ranked candidates
    native: list[list[list[int]]] = field(default_factory=list)  # per decode step, per sparse layer
    executed: list[list[list[int]]] = field(default_factory=list)
    predicted: dict[str, list[list[list[int] | None]]] = field(default_factory=dict)  # predictor -> step -> layer
    executed_by: str | None = None  # with row_predictors: the predictor its row group executed
    # predictor -> sparse layer -> the prefill's rows scored (evalsuite.engine.prediction.prompt_precision), for the
    # predictors whose scores are their inputs' alone (a fresh engine's scheduler learns from them)
    prompt: dict[str, dict[int, PromptRows]] = field(default_factory=dict)


class ShadowPredictions:
    """Router hooks that score `predictors` (name -> Predictor) beside the model; see the module doc."""

    def __init__(self, engine, predictors: dict, recall_ks, budget: int, row_groups: list[str] | None = None):
        self.engine, self.predictors, self.recall_ks, self.budget = engine, predictors, tuple(recall_ks), budget
        self.row_groups = row_groups  # with row_predictors: group g's rows count for row_groups[g] alone
        self.depth = max(budget, *self.recall_ks)  # candidates kept per prediction
        self.top_k = engine.layers[0].top_k
        # name -> metric -> k -> layer -> per sample (evalsuite.engine.metrics.EngineRecord.scores)
        self.scores: dict[str, dict] = {n: {} for n in predictors}
        self.sequences: list[SequenceRouting] = []
        self.residual: dict[int, torch.Tensor] = {}
        self._request = None
        self.native_hooks, self.after_hooks = [], []
        reads_residual = any("residual" in p.reads for p in predictors.values())
        for pos, layer in enumerate(engine.layers):
            if reads_residual:
                self.native_hooks.append(tap_input(layer.norm, self._residual_reader(pos)))  # as the driver does
            self.native_hooks.append(layer.router.register_forward_hook(self._native_hook(pos)))

    def attach_after(self) -> None:
        """Hooks that see what a layer executes: registered after the prediction driver's."""
        for pos, layer in enumerate(self.engine.layers):
            self.after_hooks.append(layer.router.register_forward_hook(self._after_hook(pos)))

    # ---- hooks ------------------------------------------------------------------------------
    def _residual_reader(self, pos):
        def read(x):  # kept as the layer got it (LayerState.residual)
            self.residual[pos] = x
        return read

    def _native_hook(self, pos):
        def hook(module, args, output):
            if not self.engine.forward.looking_ahead:
                self._native(pos, output[2])
        return hook

    def _after_hook(self, pos):
        def hook(module, args, output):
            if not self.engine.forward.looking_ahead:
                self._predict(pos, args[0].reshape(-1, args[0].shape[-1]), output)
        return hook

    def forward_started(self, forward: ForwardPass) -> None:
        """A new forward pass (evalsuite.engine.pass_state.forward_pass.ForwardPass): a prefill starts a request."""
        if not forward.decoding:
            self.end_request()
            self._request = _Request(forward.rows, forward.attention_mask, len(self.engine.layers),
                                     list(self.predictors))
        elif self._request is not None:
            self._request.steps.append(_Step(len(self.engine.layers), list(self.predictors), self._request.alive))
        for predictor in self.predictors.values():
            predictor.on_token(forward.decoding)

    def _native(self, pos: int, ids: torch.Tensor) -> None:
        request = self._request
        if request is None:
            return
        if request.steps:
            step = request.steps[-1]
            step.native[pos] = ids.detach().clone()
            for name, scores in request.pending.items():
                step.scores[name][pos] = scores.pop(pos, None)
        else:
            request.prefill[pos] = request.per_row(ids, self.engine.layers[pos].num_experts)
            if pos == 0:
                request.first_ids = ids.detach()
            for name, scores in request.prefill_scores.items():
                if scores.get(pos) is not None:
                    request.learn_prompt(name, self.engine.layers[pos].index, scores.pop(pos), ids, self.budget)

    def _predict(self, pos: int, x: torch.Tensor, output) -> None:
        request = self._request
        if request is None:
            return
        _, weights, ids = output
        decoding = bool(request.steps)
        if decoding:
            request.steps[-1].executed[pos] = ids.detach().clone()
        last = pos == len(self.engine.layers) - 1
        state = LayerState(pos, x, self.residual.get(pos), ids, weights)
        with torch.no_grad():
            for name, predictor in self.predictors.items():
                if getattr(predictor, "at_target", False):  # its proposal for this layer is what its rows executed
                    driver = self.engine.driver
                    if decoding and driver is not None and driver.speculates(pos):
                        request.steps[-1].scores[name][pos] = ranked_scores(ids, self.engine.layers[pos].num_experts)
                    continue
                if last and not decoding:  # a prefill predicts no next token, but its rows score that (as the driver)
                    if predictor.stateless and request.first_ids is not None:
                        scores = predictor.next_token_scores(x)
                        if scores is not None:
                            request.learn_prompt(name, self.engine.layers[0].index, scores, request.first_ids,
                                                 self.budget, shifted=True)
                    continue
                scores = predictor.next_token_scores(x) if last else predictor.scores(state, 1)
                if scores is None:
                    continue
                if decoding:
                    request.pending[name][0 if last else pos + 1] = scores.detach()
                else:
                    request.prefill_ranked[name][pos + 1] = request.ranked_per_row(scores, self.budget)
                    if predictor.stateless:
                        request.prefill_scores[name][pos + 1] = scores.detach()

    def keep_rows(self, index: torch.Tensor) -> None:
        """Between decode steps, the running request's batch keeps only its rows `index` (positions in it): the
        predictions carried to the next step follow them; each sequence keeps its own steps."""
        request = self._request
        if request is None:
            return
        for pending in request.pending.values():
            for pos, scores in pending.items():
                pending[pos] = scores[index.to(scores.device)]
        request.alive = index if request.alive is None else request.alive[index]

    # ---- a request's end ------------------------------------------------------------------------
    def end_request(self, steps: list[int] | None = None) -> None:
        """Close the running request; `steps[r]`: decode steps row r's batch-1 generation made (default: all)."""
        request, self._request = self._request, None
        if request is None or any(p is None for p in request.prefill):
            return
        steps = steps if steps is not None else [len(request.steps)] * request.rows
        kept = [s for s in request.steps if all(n is not None for n in s.native)]
        self._score_recall(request, kept, steps)
        self._keep_routing(request, kept, steps)

    def _score_recall(self, request, kept, steps) -> None:
        """Each row's scores over the decode steps its batch-1 run made (as the driver scores a request: the first
        sparse layer's predictions, made at the previous token's last, apart from the within-token ones)."""
        ends = torch.tensor(steps)
        for name in self.predictors:
            per_row: dict = {}  # metric -> k -> layer -> per row
            for pos, layer in enumerate(self.engine.layers):
                made = [(i, s.scores[name][pos], s.native[pos], s.rows) for i, s in enumerate(kept)
                        if s.scores[name][pos] is not None]
                if not made:
                    continue
                scores = torch.cat([p for _, p, _, _ in made])
                native = torch.cat([n.to(scores.device) for _, _, n, _ in made])
                row = step_rows([(p, n, r) for _, p, n, r in made])
                step = torch.repeat_interleave(torch.tensor([i for i, _, _, _ in made]),
                                               torch.tensor([p.shape[0] for _, p, _, _ in made]))
                counted = step < ends[row]  # within the row's batch-1 run
                for (metric, k), values in per_token_scores(scores, native,
                                                            scored_as(self.recall_ks, self.top_k, pos == 0)).items():
                    per_row.setdefault(metric, {}).setdefault(k, {})[layer.index] = \
                        row_means(values, row, request.rows, counted)
            own = [r for r in range(request.rows) if self._group(r, request.rows) in (None, name)]  # its rows
            for ks in per_row.values():
                for layers in ks.values():
                    for layer, values in layers.items():
                        layers[layer] = [values[r] for r in own]
            add_samples(self.scores[name], per_row)

    def _keep_routing(self, request, kept, steps) -> None:
        prefill = [p.tolist() for p in request.prefill]  # per layer: rows x experts used (bool)
        ranked = {name: [None if r is None else r.tolist() for r in per_layer]
                  for name, per_layer in request.prefill_ranked.items()}
        native = _per_step_lists([s.native for s in kept])
        executed = _per_step_lists([s.executed for s in kept])
        depth = {name: _per_step_lists([s.scores[name] for s in kept], top=self.depth) for name in self.predictors}
        where = [None if s.rows is None else {int(r): j for j, r in enumerate(s.rows)} for s in kept]
        for row in range(request.rows):
            n = min(steps[row], len(kept))
            n = next((i for i in range(n) if where[i] is not None and row not in where[i]), n)
            at = [row if w is None else w[row] for w in where[:n]]  # its position in each step's batch
            sequence = SequenceRouting(
                [[e for e, used in enumerate(layer[row]) if used] for layer in prefill],
                {name: [None if layer is None else layer[row] for layer in per_layer] for name, per_layer in ranked.items()})
            sequence.native = [[layer[j] for layer in step] for j, step in zip(at, native)]
            sequence.executed = [[None if layer is None else layer[j] for layer in step] for j, step in zip(at, executed)]
            sequence.predicted = {name: [[None if layer is None else layer[j] for layer in step]
                                         for j, step in zip(at, d)] for name, d in depth.items()}
            sequence.executed_by = self._group(row, request.rows)
            sequence.prompt = {name: {layer: rows[row] for layer, rows in per_layer.items() if rows[row] is not None}
                               for name, per_layer in request.prompt.items()}
            self.sequences.append(sequence)

    def _group(self, row: int, rows: int) -> str | None:
        """The predictor row `row` of `rows` executed (row_predictors), else None."""
        return None if self.row_groups is None else self.row_groups[row * len(self.row_groups) // rows]

    def take(self) -> tuple[dict, list[SequenceRouting]]:
        """What was recorded since the last take: the scores (name -> metric -> k -> layer -> per sample, as
        EngineRecord.scores) and the sequences."""
        self.end_request()
        taken = (self.scores, self.sequences)
        self.scores, self.sequences = {n: {} for n in self.predictors}, []
        return taken

    def close(self) -> None:
        for hook in self.native_hooks + self.after_hooks:
            hook.remove()


def _per_step_lists(steps: list[list], top: int | None = None) -> list[list]:
    """Per step and layer, a tensor's rows as lists (None stays None); `top`: the indices of each row's `top`
    highest scores instead. Each layer's tensors are joined over the steps and converted in one call (a call per
    step and layer costs more than the work on a request of hundreds of steps)."""
    out = [[None] * len(layers) for layers in steps]
    for pos in range(len(steps[0]) if steps else 0):
        made = [(i, t) for i, layers in enumerate(steps) if (t := layers[pos]) is not None]
        if not made:
            continue
        joined = torch.cat([t for _, t in made])
        if top is not None:
            joined = joined.topk(min(top, joined.shape[1]), dim=-1).indices
        rows, start = joined.tolist(), 0
        for i, t in made:
            out[i][pos] = rows[start:start + t.shape[0]]
            start += t.shape[0]
    return out


class _Step:
    def __init__(self, layers: int, names, rows: torch.Tensor | None = None):
        self.rows = rows  # the request's rows in this step's batch (None: all of them)
        self.native: list = [None] * layers
        self.executed: list = [None] * layers
        self.scores = {name: [None] * layers for name in names}


class _Request:
    def __init__(self, rows: int, attention_mask, layers: int, names):
        self.rows, self.mask = rows, attention_mask
        self.prefill: list = [None] * layers  # per layer: [rows, experts] bool, used by the row's own tokens
        self.prefill_ranked = {name: [None] * layers for name in names}
        self.prefill_scores = {name: {} for name in names}  # predictor -> position -> its prefill scores, until routed
        self.first_ids: torch.Tensor | None = None  # the prefill's first sparse layer's routing
        self.prompt: dict = {name: {} for name in names}  # predictor -> layer -> per row its PromptRows (or None)
        self.pending = {name: {} for name in names}  # predictor -> target position -> scores
        self.steps: list[_Step] = []
        self.alive: torch.Tensor | None = None  # its rows still in the batch (keep_rows), None: all

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        """[rows * T, ...] -> [rows, T, ...]"""
        return t.reshape(self.rows, -1, *t.shape[1:])

    def _real(self, like: torch.Tensor) -> torch.Tensor:
        """[rows, T] 1 where a token is the row's own (not padding)."""
        if self.mask is None:
            return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
        return self.mask[:, -like.shape[1]:].to(like.device).bool()

    def per_row(self, ids: torch.Tensor, experts: int) -> torch.Tensor:
        """The experts each row's own tokens chose: [rows, experts] bool."""
        tokens = self._tokens(ids)  # [rows, T, K]
        real = self._real(tokens)
        used = torch.zeros(self.rows, experts, dtype=torch.bool, device=ids.device)
        rows = torch.arange(self.rows, device=ids.device)[:, None, None].expand_as(tokens)
        used[rows[real], tokens[real]] = True
        return used

    def learn_prompt(self, name: str, layer: int, scores: torch.Tensor, ids: torch.Tensor, budget: int,
                     shifted: bool = False) -> None:
        """Each row's prefill rows scored for `layer` (PredictionDriver._learn_prompt, one sequence at a time)."""
        tokens_ids = self._tokens(ids)
        real = self._real(tokens_ids)
        self.prompt[name][layer] = [prompt_rows(row_scores, row_ids, budget, 1, row_real[None], shifted)
                                    for row_scores, row_ids, row_real in zip(self._tokens(scores), tokens_ids, real)]

    def ranked_per_row(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Per row, the candidates `scheduler.ranked` gives a batch-1 prefill of that row: [rows, budget]."""
        tokens = self._tokens(scores).float()  # [rows, T, E]
        real = self._real(tokens)
        confidence = (torch.softmax(tokens, dim=-1) * real[..., None]).sum(dim=1)
        one = real.sum(dim=1) == 1  # a single token is ranked by its scores (the same order)
        return confidence.topk(min(budget, confidence.shape[1]), dim=-1).indices.where(
            ~one[:, None], tokens.max(dim=1).values.topk(min(budget, tokens.shape[2]), dim=-1).indices)


def routing_trace(sequences: list[SequenceRouting], predictor: str | None, layers: list[int], experts: int,
                  top_k: int, meta: dict) -> RoutingTrace:
    """The sequences as one batch-1 RoutingTrace, with `predictor`'s candidates as the predictions
    (None: no predictions), the prefill's candidates in `meta["prefill_predicted"]`."""
    trace = RoutingTrace(list(layers), experts, top_k, meta={**meta, "predictor": predictor})
    prefill_predicted = []
    for sequence in sequences:
        trace.prefills.append((len(trace.steps), sequence.prefill))
        prefill_predicted.append(sequence.prefill_predicted.get(predictor) if predictor else None)
        trace.prompts.append(sequence.prompt.get(predictor) or None if predictor else None)
        predicted = sequence.predicted.get(predictor) if predictor else None
        for i, native in enumerate(sequence.native):
            trace.steps.append([LayerRouting(sorted(n), sequence.executed[i][pos] and sorted(sequence.executed[i][pos]),
                                             predicted[i][pos] if predicted else None)
                                for pos, n in enumerate(native)])
    trace.meta["prefill_predicted"] = prefill_predicted
    return trace
