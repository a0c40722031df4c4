"""Execution modes with expert prediction, run at every sparse layer's router (a forward hook on the router
where the mode replaces its output, else from the engine's experts implementation: PredictionDriver).

router-preserving  the prediction only starts transfers; the native router decides what runs
                   (output bit-identical to resident for every predictor).
Every sparse layer is predicted: at a decode token's last sparse layer the predictor also scores
the next token's first sparse layer (`Predictor.next_token_scores`), prefetched like any other.

speculative        from the second sparse layer on, decode tokens execute the predicted experts,
                   weighted by the layer's own routing formula applied to its router's logits
                   for the predicted set (Speculating Experts, arXiv:2603.19289). Prefill routes
                   natively: evalsuite's choice (the paper says nothing of prefill), so a task that
                   only prefills (loglikelihood) cannot change. The native router still runs as a
                   shadow that scores recall and never touches the output.
hybrid             speculative, with the estimator predicting the high-drift layers and the
                   quasi-hidden-state predictor elsewhere (that paper's Hybrid-PF); layers listed in
                   `preserve_layers` run router-preserving instead.

Recall@k (SpecPrefetch): |top-k(predicted) ∩ top-K(native router)| / K per decode token, per within-token
target layer (anchor l -> l+h); averaged within a sample (a batch row of a request), then across samples; exact@K
beside it. The prediction for the next token's first sparse layer is scored on its own (recall_next_token@K), never
in recall@k. Definitions: evalsuite.engine.metrics.
"""
from __future__ import annotations

import time

import torch

from evalsuite.engine.pass_state.layer_state import LayerState
from evalsuite.engine.prediction.registry import experts_in
from evalsuite.engine.modes import MODES
from evalsuite.engine.prediction.prompt_precision import forward_rows
from evalsuite.engine.prediction.put_off import PutOffPrediction, PutOffToken
from evalsuite.engine.prediction.request_recall import score_request
from evalsuite.engine.prediction.scheduler import ranked
from evalsuite.engine.pass_state.input_taps import tap_input


PUT_OFF_TIMED_EVERY = 4  # what putting a prediction off costs is timed for the first and one in this many


class PredictionDriver:
    """Hooks on every sparse layer: score the last prediction, speculate, predict, prefetch."""

    def __init__(self, engine, predictor, mode: str, horizon: int, recall_ks, preserve_layers, scheduler):
        self.engine, self.predictor, self.mode, self.horizon = engine, predictor, mode, horizon
        self.recall_ks, self.scheduler = tuple(recall_ks), scheduler
        self.top_k = engine.layers[0].top_k  # K of recall@K, exact@K and recall_next_token@K
        self.preserve = set(preserve_layers)
        self.residual: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}  # target position -> predicted scores
        self.deferred: tuple | None = None  # (target position, scores) waiting for release_prefetch
        self.current: dict = {}  # layer -> [(prediction, native ids, rows, token kinds)] per decode step of the request
        self.rows: torch.Tensor | None = None  # the request's rows still in the batch (keep_rows), None: all
        self.put_off = 0  # predictions left for after their request (PutOffPrediction)
        self.quiet: PutOffToken | None = None  # the running decode token, where none of its predictions is asked for
        self.quiet_tokens = 0  # decode tokens that were quiet (PutOffToken)
        # what of the test for putting a prediction off (_predict) holds for the engine's life (its cache may be
        # rebuilt, on the same policy)
        self.may_wait = (scheduler is not None and predictor.stateless and engine.cache is not None
                         and engine.cache.policy != "predicted")
        # a prefill's rows are predictions scored: the scheduler learns from them and the trace keeps them
        # (evalsuite.engine.prediction.prompt_precision), where the predictor's scores are its inputs' alone
        self.prompt_rows = False  # whether the running prefill's rows are scored
        self.prompt_first = None  # the running prefill's first sparse layer's routing (_score_prompt_first)
        self.speculating = MODES[mode].speculates
        # a controlled-recall instrument (evalsuite.predict.controlled) proposes each speculating layer's experts from
        # that layer's own routing, at its router, and predicts nothing ahead (EngineConfig admits it where it speculates)
        self.at_target = getattr(predictor, "at_target", False)
        self.may_put_off_tokens = self.may_wait and not self.speculating  # (see _start_quiet)
        if scheduler is not None:
            scheduler.quiet_possible = self.may_put_off_tokens  # (what an online prediction rules out: online_cost_s)
        # a predictor that knows its ranking without a tensor call may give it (predictor.ranked(scores, budget))
        self.rank = getattr(predictor, "ranked", ranked)
        self.layer_of = [layer.index for layer in engine.layers]  # position -> decoder layer index
        last = len(engine.layers) - 1  # what each position predicts: h layers on, the last the next token's first
        self.target_of = [pos + horizon if pos + horizon <= last else (0 if pos == last else None)
                          for pos in range(last + 1)]
        self.target_layer_of = [None if target is None else self.layer_of[target] for target in self.target_of]
        self.source_of = [None] * (last + 1)  # position -> the position whose prediction is for it
        for pos, target in enumerate(self.target_of):
            if target is not None:
                self.source_of[target] = pos
        self.pos_of = {layer: pos for pos, layer in enumerate(self.layer_of)}
        # the layer predicted across the token boundary (recall_next_token@K); every other target is within a token
        self.next_token_layer = self.layer_of[0] if self.target_of[last] == 0 else None
        self.predicted_per_token = sum(target is not None for target in self.target_of)  # in a decode token
        # position -> the LayerState fields its prediction reads (the next token's first layer's: x), None: none made
        self.reads_of = [None if target is None else predictor.reads if target else ("x",)
                         for target in self.target_of]
        # what a quiet token keeps of each sparse layer besides its ids (recall's native routing): (x, residual,
        # weights), each where the prediction made from it reads it (a tensor kept to its request's end is one more
        # object for the garbage collector to walk until then)
        self.quiet_keeps = [tuple(field in (reads or ()) for field in ("x", "residual", "weights"))
                            for reads in self.reads_of]
        # A mode that executes its predictions must change the router's output, so it hooks the router. For the
        # others the engine's experts implementation calls on_router, with the router's input and choice it gets
        # anyway: a module hook costs every call of its module, and where predictions are put off that cost is
        # much of the rest (docs/performance.md, "What the per-layer path costs").
        self.at_router = self.speculating
        self.hooks = []
        for pos, layer in enumerate(engine.layers):
            if "residual" in predictor.reads:  # only when read, and by a tap, for the same reason
                self.hooks.append(tap_input(layer.norm, self._residual_reader(pos)))
            if self.at_router:
                self.hooks.append(layer.router.register_forward_hook(self._router_hook(pos)))

    def _residual_reader(self, pos):
        residual = self.residual

        def read(x):  # kept as the layer got it: the predictor reshapes what it reads (a reshape costs a dispatch)
            residual[pos] = x
        return read

    def _router_hook(self, pos):
        def hook(module, args, output):
            x = args[0]  # [T, H] already in most families: a reshape would still cost a dispatch
            return self.on_router(pos, module, x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), *output)
        return hook

    def speculates(self, pos: int) -> bool:
        return (self.speculating and pos > 0 and self.engine.forward.decoding
                and self.layer_of[pos] not in self.preserve)

    def on_router(self, pos, router, x, logits, weights, ids):
        """Sparse layer `pos`'s router chose `ids` (weights `weights`) from `logits` for router input `x`:
        score the prediction made for it, speculate, settle its prefetches, predict the layer it leads to.
        Returns the routing to run instead (a speculating layer), or None. Runs at every sparse layer of
        every token: work that is not always needed stays behind a test.
        For modes that execute no prediction (`at_router` False) the engine's experts implementation calls it
        with no `router` and `logits`: `x` is then the experts' input as [T, H] (every family passes its experts
        the very tensor its router read), `ids` and `weights` the router's choice."""
        quiet = self.quiet
        if quiet is not None:
            if pos:  # a quiet token's layer keeps what its prediction will read, and nothing more (PutOffToken)
                quiet.keep(x, self.residual.get(pos), ids, weights,
                           self.engine.cache.resident_bits.get(self.target_layer_of[pos]))
                return None
            self.quiet = None
            if quiet.complete():  # its last layer's prediction is for this token's first, as a normal token's
                self.pending[0] = quiet.made_at(len(self.layer_of) - 1)
        engine, forward = self.engine, self.engine.forward
        if forward.looking_ahead:  # the oracle's look-ahead pass only records the true routing
            self.predictor.trace[pos] = ids
            return None
        # what the scheduler weighs a prediction by, made or put off, is the driver's whole work at the layer from
        # here: recording the last prediction and timing the layer happen only because predictions are made
        begun = time.perf_counter()
        decoding, scheduler = forward.decoding, self.scheduler
        if pos == 0:  # the last token's prediction for this layer stands; a prefill starts clean
            if decoding and self.may_put_off_tokens and self._start_quiet(x, ids, weights):
                return None
            self.predictor.on_token(decoding)
            first = self.pending.get(0) if decoding else None
            self.pending = {} if first is None else {0: first}
            self.deferred = None
            if scheduler is not None and not decoding:
                scheduler.new_request()
            self.prompt_rows = (not decoding and self.predictor.stateless
                                and ((scheduler is not None and engine.cache is not None) or engine.tracer is not None))
            self.prompt_first = ids if self.prompt_rows else None
        predicted = self.pending.pop(pos, None)  # (scores, ranked candidates) or a PutOffPrediction, made one layer earlier
        if self.at_target:  # an instrument that proposes from this layer's own routing, where the layer speculates
            predicted = None
            if self.speculates(pos):
                scores = self.predictor.proposed(pos, router, logits, ids)
                predicted = (scores, self.rank(scores, engine.budget))
        layer = self.layer_of[pos]
        chosen = None
        if scheduler is not None:
            if decoding:  # (the router decided at `begun`)
                scheduler.layer_at(pos, begun, engine.stalled_s, engine.missed)
                if type(predicted) is tuple:
                    chosen = experts_in(ids)
                    scheduler.observe(layer, predicted[1], chosen)
            else:
                scheduler.layer_started(pos, False)
        replaced = None
        if predicted is not None:
            # recall@k over decode tokens only, scored once the request ends, by token kind too (with the kinds of
            # the forward pass kept here: off the decode step's path)
            if decoding:
                self.current.setdefault(layer, []).append((predicted, ids, self.rows, forward.kinds))
            elif self.prompt_rows:
                self._learn_prompt(layer, predicted[0], ids)
            if self.speculating and self.speculates(pos):
                ids = predicted[0].topk(ids.shape[1], dim=-1).indices.to(ids.device)
                weights = engine.family.route_weights(router, logits, ids)
                replaced = (logits, weights, ids)
                chosen = None
        if scheduler is not None and layer in engine.prefetches_to_settle:
            # the router decided: wrong guesses leave the link, right ones go first. What that costs is the
            # prefetches' (Engine.prefetch_cost_s), not the prediction's made here: it is left out of its timing
            settling = time.perf_counter()
            engine.settle_prefetches(layer, experts_in(ids) if chosen is None else chosen)
            begun += time.perf_counter() - settling
        target = self.target_of[pos]
        if target is None or self.at_target:  # (an at-target instrument predicts nothing ahead)
            return replaced
        if target > 0:
            score = self._score_ahead
        elif decoding:  # the next token's first sparse layer
            score = self._score_next
        else:
            if self.prompt_first is not None:
                self._score_prompt_first(x)
            return replaced
        residual = self.residual.get(pos)
        # Whether the prediction serves only prefetching and the record (recall, the scheduler's precision, the
        # trace), so it may be scored after the request: a decode step of a stateless predictor, a layer that will
        # not execute it, and a cache that does not read it (may_wait). It is put off when the scheduler finds that
        # no prefetch for it could pay for making it now, on this link (PutOffPrediction).
        if (self.may_wait and decoding
                and not (self.speculating and self.speculates(target))
                and not scheduler.worth_predicting(target, self.horizon if target else 1)):
            later = PutOffPrediction(score, self.reads_of[pos], engine.budget, pos, x, residual, ids, weights,
                          resident=engine.cache.resident_bits[self.target_layer_of[pos]])
            self.pending[target] = later
            self.put_off += 1
            if engine.tracer is not None:
                engine.tracer.predicted(self.layer_of[target], later)  # ranked when the trace is read
            if self.put_off % PUT_OFF_TIMED_EVERY == 1:  # (a moving average: a sample of them serves it)
                scheduler.put_off_took(time.perf_counter() - begun)
        else:
            self._predict(target, begun, score, LayerState(pos, x, residual, ids, weights))
        return replaced

    def _learn_prompt(self, layer: int, scores: torch.Tensor, ids: torch.Tensor, shifted: bool = False) -> None:
        """The prefill's per-row prediction `scores` for `layer`, routed `ids` (`shifted`: each row's are for the next
        row's): the scheduler learns from them, and the trace keeps them (evalsuite.engine.prediction.prompt_precision)."""
        rows = forward_rows(self.engine.forward, scores, ids, self.engine.budget, shifted)
        if rows is None:
            return
        if self.scheduler is not None and self.engine.cache is not None:
            self.scheduler.learn_prompt(layer, rows)
        if self.engine.tracer is not None:
            self.engine.tracer.prompt(layer, rows)

    def _score_prompt_first(self, x: torch.Tensor) -> None:
        """The prefill's last sparse layer (router input `x`): each row predicts the next row's first sparse layer, as
        a decode token predicts the next token's; learn from that against the layer's routing."""
        first, self.prompt_first = self.prompt_first, None
        with torch.no_grad():
            scores = self.predictor.next_token_scores(x)
        if scores is not None:
            self._learn_prompt(self.layer_of[0], scores, first, shifted=True)

    def _start_quiet(self, x, ids, weights) -> bool:
        """At a decode token's first sparse layer (router input `x`, its choice `ids`, `weights`): make the token
        a quiet one (PutOffToken) where the scheduler's verdicts to put off stand for every layer (put_off_all) and
        nothing of the last token's prediction is in flight or still to score here (made online). Its layers then
        only keep their inputs; its recall, precision and trace are made from them when the request ends."""
        engine, first = self.engine, self.pending.get(0)
        if (type(first) is tuple or self.rows is not None or engine.prefetches_to_settle
                or not self.scheduler.put_off_all()):
            return False
        self.predictor.on_token(True)
        self.pending, self.deferred = {}, None
        quiet = self.quiet = PutOffToken(self, first, engine.forward.kinds)
        self.quiet_tokens += 1
        self.put_off += self.predicted_per_token
        quiet.keep(x, self.residual.get(0), ids, weights, engine.cache.resident_bits.get(self.target_layer_of[0]))
        # its steps of the record, in order with the others' (end_request), and of the trace (ranked when read:
        # PutOffToken.ranked_for, the token itself standing for each of its predictions)
        for pos, layer in enumerate(self.layer_of):
            if (first if pos == 0 else self.source_of[pos]) is not None:
                self.current.setdefault(layer, []).append(quiet)
        if engine.tracer is not None:
            for pos, target in enumerate(self.target_of):
                if target is not None:
                    engine.tracer.predicted(self.layer_of[target], quiet)
        return True

    def _score_ahead(self, state: LayerState) -> torch.Tensor | None:
        return self.predictor.scores(state, self.horizon)

    def _score_next(self, state: LayerState) -> torch.Tensor | None:
        """The next token's first sparse layer, from this token's last (`state`)."""
        return self.predictor.next_token_scores(state.x)

    def _predict(self, target: int, begun: float, score, state: LayerState) -> None:
        """Predict sparse layer `target` now (`score(state)`) and have its prefetches sent once this layer's own
        demand loads are queued. `begun`: when the driver's work at this layer started (time.perf_counter), what
        the scheduler is told the prediction took is timed from (as a put-off one's)."""
        engine, scheduler = self.engine, self.scheduler
        if torch.is_grad_enabled():  # (no context manager to enter at every layer when the caller has none)
            with torch.no_grad():
                scores = score(state)
        else:
            scores = score(state)
        if scores is None:
            return
        prediction = (scores, self.rank(scores, engine.budget))
        self.pending[target] = prediction
        if engine.tracer is not None:
            engine.tracer.predicted(self.layer_of[target], prediction[1])
        if scheduler is None:
            return
        # what the scheduler weighs is a decode step's prediction (a prefill's scores many rows at once)
        spent = time.perf_counter() - begun if engine.forward.decoding else None
        if engine.cache is not None:
            # submitted once this layer's own demand loads are queued (release_prefetch), which also reports
            # the prediction's cost: a prefetch already on the link would delay them
            self.deferred = (target, prediction, spent)
        elif spent is not None:
            scheduler.prediction_took(spent)

    def release_prefetch(self) -> None:
        """Start the prefetches of the last prediction (the engine calls this after demand loads).
        A layer that will speculate executes exactly the predicted top-k of each row: that whole
        set (the union over rows, whatever the budget) goes at once at demand priority, behind
        this layer's own loads, with no window test; other layers go through the scheduler."""
        if self.deferred is not None:
            target, (scores, candidates), spent = self.deferred
            self.deferred = None
            if self.speculates(target):
                top_k = self.engine.layers[target].top_k
                if scores.shape[0] == 1 and len(candidates) == top_k:
                    # one row, a budget of top-k: the ranking was this very topk call (ranked), so its set is what
                    # the layer will execute, with no tensor call (topk, unique and a host read cost ~20 us)
                    chosen = sorted(candidates)
                else:
                    chosen = scores.topk(min(top_k, scores.shape[1]), dim=-1).indices.unique().tolist()
                self.engine.prefetch(self.engine.layers[target].index, chosen, demand=True)
                if spent is not None:
                    self.scheduler.prediction_took(spent)
            else:
                # what scheduling costs the compute thread is the prediction's too; issuing the prefetches is
                # not (Engine.prefetch_cost_s, which the scheduler weighs separately)
                begun, issuing = time.perf_counter(), self.engine.prefetch_work_s
                self.scheduler.schedule(target, candidates, self.horizon if target > 0 else 1)
                if spent is not None:
                    self.scheduler.prediction_took(spent + time.perf_counter() - begun
                                                   - (self.engine.prefetch_work_s - issuing))

    def keep_rows(self, index: torch.Tensor) -> None:
        """Between decode steps, the batch keeps only its rows `index` (positions in it): the predictions
        carried to the next step follow them, and recall stays with the request's own rows."""
        if (any(isinstance(p, PutOffPrediction) for p in self.pending.values()) or self.deferred is not None
                or self.quiet is not None):
            raise RuntimeError("keep_rows: a prediction put off or a prefetch not yet sent spans the step")
        kept = {target: scores[index.to(scores.device)] for target, (scores, _) in self.pending.items()}
        self.pending = {target: (scores, ranked(scores, self.engine.budget)) for target, scores in kept.items()}
        self.rows = index if self.rows is None else self.rows[index]

    def forget(self) -> None:
        """Drop what prediction carried over (pending predictions, a deferred prefetch, the scheduler's
        layer timing and verdicts), as a fresh engine would start; the scheduler's per-rank precision is kept."""
        self.pending.clear()
        self.deferred, self.quiet = None, None
        if self.scheduler is not None:
            self.scheduler.forget()

    def end_request(self) -> None:
        """Close the running request: each of its rows becomes one sample in the engine's record, with
        its recall@k, exact@K and recall_next_token@K per layer averaged over its decode steps (scored here, once,
        not per step). Predictions left for later are made now, and the scheduler learns from them."""
        scheduler, budget = self.scheduler, self.engine.budget

        def learn(layer, scores, native, resident):
            scheduler.observe(layer, ranked(scores, budget), experts_in(native), resident)
        score_request(self.engine.record, self.current, self.pos_of, self.recall_ks, self.top_k,
                      self.next_token_layer, None if scheduler is None else learn)
        self.current, self.rows, self.quiet = {}, None, None

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
