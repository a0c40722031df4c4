"""Prefetch scheduling: send a candidate when what it is expected to save exceeds what it costs.
The reasoning behind each term: docs/performance.md, "The prefetch policy".

Candidates are ranked by the predictor's confidence (its probability mass summed over the tokens in flight,
`ranked`, once per prediction); resident and in-flight experts are skipped; at most `budget` are considered.

saved(r)   the part of candidate r's copy done before its layer starts: with q copies queued ahead of it,
           t seconds per transfer and `lead` seconds of compute until its layer, min(t, max(0, lead − q·t)).
           A late copy still saves that part (the router's pick promotes it). Where a demand miss stalls
           less than a copy (`stall_per_miss`, fitted over recent put-off decode steps), that stands in for t.
lead       layer_s·h; for the next token's first sparse layer, the measured wrap time (wrap_s) instead of
           one layer_s.
p(l, r)    online precision of rank r at sparse layer l: the share of past decode predictions whose rank-r
           candidate the router picked, (hits + 1)/(n + 2).
pm(l, r)   the same over rank-r candidates that were missing from the cache when predicted (put-off
           predictions included): only missing ones are sent, and they are the ones predictors get wrong
           most. Shrunk towards p with weight PRIOR_WEIGHT, and towards the prompt rows' share with weight
           PROMPT_WEIGHT where that is lower (send_precision).
q(l, r)    the fading share of recent predictions whose rank-r candidate was missing (MISSING_MEMORY), from
           a prior read at the layer's decode miss rate (Engine.miss_rate).
cost(r)    a wrong prefetch still moving when the router decides delays the demand loads by half a chunk on
           average; a prefetch that evicts a used expert loses v·s (v: the share of such victims asked for
           again, ExpertCache.victim_regret; s: what a hit saves); every prefetch costs the compute thread
           c (`prefetch_cost_s`), and a right one spares the demand load it replaces, d (`demand_cost_s`):
           (1 − pm)·(chunk/2 + v·s) + pm·v·s + c − pm·d.
rule       send a missing r when pm·(saved(r) − v·s) > (1 − pm)·(chunk/2 + v·s) + c − pm·d (v·s only past
           the spare slots); with `window=False`, send the top `budget` regardless.
worth      whether a prediction is made now or after its request: evalsuite.engine.prediction.worth.
layer_s    measured on decode only, without stalls: router to router, minus the stall recorded between;
           kept across requests (a new engine's first decode token sends the top `budget`).
"""
from __future__ import annotations

import time

import torch

from evalsuite.engine.prediction.prompt_precision import PromptOutcomes, PromptRows
from evalsuite.engine.prediction.worth import WorthTest

PRIOR_WEIGHT = 2.0  # observations the missing candidates' precision starts from (at the rank's precision)
PROMPT_WEIGHT = 4.0  # decode predictions a layer's prompt rows count as, all together (send_precision)
MISSING_MEMORY = 8  # predictions of a layer q mostly rests on (each older one weighs 1 - 1/8 less)
MISS_MEMORY = 256  # put-off decode steps the stall per miss is fitted over (older ones fade)
MISS_FIT_AFTER = 16  # put-off decode steps it needs before it stands in for a copy's time


def ranked(scores: torch.Tensor, budget: int) -> list[int]:
    """The `budget` experts the prediction is most confident in, most confident first (confidence: the
    router probability summed over the rows; with one row, the order of its scores)."""
    if scores.shape[0] == 1:  # (its row taken after the tensor calls: indexing first would be one more)
        return scores.topk(min(budget, scores.shape[1])).indices.tolist()[0]
    confidence = torch.softmax(scores.float(), dim=-1).sum(dim=0)
    return confidence.topk(min(budget, confidence.numel())).indices.tolist()


class PrefetchScheduler(WorthTest):
    def __init__(self, engine, budget: int, window: bool = True, smoothing: float = 0.2):
        self.engine, self.budget, self.window, self.smoothing = engine, budget, window, smoothing
        self.layer_s: float | None = None  # decode time from one sparse layer's router to the next, stalls out
        self.wrap_s: float | None = None  # the same, from a token's last sparse layer to the next token's first
        self._last: tuple[int, float, float] | None = None  # (position, time, stall total) at the last router
        self.picked: dict[int, list[int]] = {}  # sparse layer -> per rank, predictions the router confirmed
        self.seen: dict[int, int] = {}  # sparse layer -> predictions scored
        self._precision: dict[int, list[float]] = {}  # sparse layer -> precision(), until the next observe
        # the candidates missing from the cache when a prediction was scheduled, scored at its layer's router:
        self._scheduled: dict[int, tuple] = {}  # sparse layer -> (its candidates list, [(rank, expert) missing])
        self.missing_seen: dict[int, list[int]] = {}  # sparse layer -> per rank, missing candidates scored
        self.missing_picked: dict[int, list[int]] = {}  # sparse layer -> per rank, those the router picked
        self.missing_scored: dict[int, int] = {}  # sparse layer -> predictions scored for what was missing
        # sparse layer -> [predictions, of them the prior's, per rank missing], all fading alike (q)
        self.missing_recent: dict[int, list[float]] = {}
        self._missing: dict[int, list[float]] = {}  # sparse layer -> missing_precision(), until the next observe
        self.prompt: dict[int, PromptOutcomes] = {}  # sparse layer -> its prompts' rows scored, summed (learn_prompt)
        self._send: dict[int, list[float]] = {}  # sparse layer -> send_precision(), until the next observe
        self.predict_s: float | None = None  # compute-thread seconds of one prediction made online (smoothed)
        self.put_off_s: float | None = None  # compute-thread seconds of one put off (smoothed)
        self._asked: dict[int, int] = {}  # sparse layer -> worth_predicting calls
        self._verdict: dict[int, tuple] = {}  # sparse layer -> (_pays's verdict, whether sure), until the next observe
        self._off_left: dict[int, int] = {}  # sparse layer -> asks a verdict to put off still stands for (_judge)
        self.stall_off: dict[int, float] = {}  # sparse layer -> decode stall of its step when its prediction was put off
        self._stall_off_n: dict[int, int] = {}  # sparse layer -> steps stall_off has seen
        self._put_off_for: dict[int, bool] = {}  # position -> whether this step's prediction for it was put off
        self._verdict_off: dict[int, bool] = {}  # sparse layer -> whether its last verdict (_judge) is to put off
        self.quiet_possible = False  # whether the driver makes a token quiet where every verdict stands (put_off_all)
        # moving means of (m, s, m², m·s) over put-off decode steps, m demand misses and s stall: s's slope in m
        # is what one more miss stalls (stall_per_miss)
        self._miss_fit, self._miss_fit_n = [0.0, 0.0, 0.0, 0.0], 0
        # a chunk's link time: the link's own figure where it knows one (an emulated link, whose copies' latency is
        # no part of a chunk: a third of an SD-card copy), else its share of a copy's measured time
        self._chunk_s = engine.transfers.chunk_s
        self._chunk_share = None if self._chunk_s is not None else min(
            1.0, engine.transfers.chunk_bytes / engine.layout.nbytes)  # (asked of a real link only)
        self._index = [layer.index for layer in engine.layers]  # position -> decoder layer index
        self._top_k = [layer.top_k for layer in engine.layers]  # position -> experts a token uses there
        self._top_k_of = {layer.index: layer.top_k for layer in engine.layers}  # the same by decoder layer index
        self._layers = list(self._top_k_of)  # the sparse layers' decoder indices

    def new_request(self) -> None:
        """A request starts (its prefill): the layer timing's chain restarts. What a decode layer takes (layer_s,
        wrap_s) carries over from the requests before, as the precisions do, and so do the verdicts resting on it:
        a request's first decode token is judged like any other (with nothing measured it predicted online at
        every layer, and sent what it predicted)."""
        self._last = None
        self._put_off_for.clear()

    def forget(self) -> None:
        """Start as a new engine would (Engine.clear_cache): no layer time measured, no verdict standing, nothing
        known of what the emptied cache lacks (q); the per-rank precisions, the predictor's, are kept."""
        self.new_request()
        self.layer_s = self.wrap_s = None
        self._off_left.clear()
        self.missing_recent.clear()

    def layer_started(self, pos: int, decoding: bool) -> None:
        """Sparse layer `pos` of the running forward pass routed now (`decoding`: a decode step)."""
        if not decoding:  # prefill layers take far longer than decode ones
            self._last = None
            return
        self.layer_at(pos, time.perf_counter(), self.engine.stalled_s, self.engine.missed)

    def layer_at(self, pos: int, now: float, stalled: float, missed: int) -> None:
        """Decode sparse layer `pos` routed at `now`, with `stalled` seconds of stall and `missed` demand
        loads recorded so far (the engine's clock and counters, or the simulator's)."""
        # (runs at every decode layer: written out, with no builtin or method call on the common path)
        last, self._last = self._last, (pos, now, stalled, missed)
        if last is None:
            return
        before, then, stalled_then, missed_then = last
        if before != pos - 1 and (pos or before != len(self._index) - 1):
            return
        stall = stalled - stalled_then  # waiting for the last layer's experts
        if stall < 0.0:
            stall = 0.0
        gap = now - then - stall
        if gap < 0.0:
            gap = 0.0
        smoothing = self.smoothing  # (the moving averages of _ema, written out)
        if pos:
            old = self.layer_s
            self.layer_s = gap if old is None else (1 - smoothing) * old + smoothing * gap
        else:
            old = self.wrap_s
            self.wrap_s = gap if old is None else (1 - smoothing) * old + smoothing * gap
        if self._put_off_for and self._put_off_for.pop(before, False):
            # the step's prediction for the last layer was put off: what that layer stalled is what on-demand
            # loading stalls there, so the most any prediction for it could save (stall_off: a mean over the
            # first steps, then a moving average, as the cache and the routing drift)
            layer = self._index[before]
            n = self._stall_off_n[layer] = self._stall_off_n.get(layer, 0) + 1
            old = self.stall_off.get(layer, 0.0)
            weight = 1.0 / n
            self.stall_off[layer] = old + (stall - old) * (weight if weight > smoothing else smoothing)
            # the same step's demand misses beside its stall, for the stall one more miss adds (no prefetch of this
            # layer's in flight to wait for: what its misses stall alone)
            m, fit = missed - missed_then, self._miss_fit
            n = self._miss_fit_n = self._miss_fit_n + 1
            weight = 1.0 / n if n < MISS_MEMORY else 1.0 / MISS_MEMORY
            fit[0] += (m - fit[0]) * weight
            fit[1] += (stall - fit[1]) * weight
            fit[2] += (m * m - fit[2]) * weight
            fit[3] += (m * stall - fit[3]) * weight

    def lead_s(self, target_pos: int, h: int) -> float:
        """Compute seconds from the router that predicts sparse layer `target_pos`, h sparse layers ahead,
        to that layer's router (the last layer predicts the next token's first: wrap_s, once measured)."""
        if target_pos >= h or self.wrap_s is None:
            return self.layer_s * h
        return self.layer_s * (h - 1) + self.wrap_s

    def stall_per_miss(self) -> float | None:
        """What one more demand miss stalls a decode step: the least-squares slope of a put-off step's stall on its
        demand misses (over the last ~MISS_MEMORY such steps, all layers together); None before MISS_FIT_AFTER
        steps, or while their misses hardly vary."""
        if self._miss_fit_n < MISS_FIT_AFTER:
            return None
        m, stall, mm, ms = self._miss_fit
        spread = mm - m * m  # the misses' variance
        if spread < 0.1:
            return None
        slope = (ms - m * stall) / spread
        return slope if slope > 0.0 else 0.0

    def _hit_saves(self, t: float, layer: int) -> float:
        """What a right prefetch for `layer` that has landed saves: its copy's time t, or what one more miss stalls
        where that is less (demand copies overlap the compute of the layer's other experts): the fitted slope
        (stall_per_miss), or where the misses hardly vary (every use missing, as at a 10 % cache) the layer's
        stall per expected miss with its prediction put off, stall_off over top-k · miss rate, once stall_off
        rests on STALL_OFF_AFTER steps."""
        per_miss = self.stall_per_miss()
        off = self._stall_cap(layer) if per_miss is None else None
        if off is not None:
            misses = self._top_k_of[layer] * self.engine.miss_rate(layer)
            per_miss = off / misses if misses > 0.0 else None
        return t if per_miss is None or per_miss > t else per_miss

    def _ema(self, old, new):
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def prediction_took(self, seconds: float) -> None:
        """The compute thread spent `seconds` on one prediction made online (the driver's work at the layer that
        made it: recording the last prediction, the worth test, the predictor, ranking, scheduling)."""
        self.predict_s = self._ema(self.predict_s, seconds)

    def put_off_took(self, seconds: float) -> None:
        """The compute thread spent `seconds` putting one prediction off (the driver's work at the layer: recording
        the last prediction, the worth test, keeping its state)."""
        old = self.put_off_s  # (_ema written out: this runs at many layers whose prediction is put off)
        self.put_off_s = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds

    def online_cost_s(self, layer: int | None = None) -> float:
        """What a prediction (for `layer`) made online costs the compute thread beyond putting it off: its own work
        beyond a put-off one's; and where every other layer's verdict is to put off, the quiet token it rules out
        (put_off_all): the token's other layers then put theirs off one by one, at put_off_s each, where a quiet
        token costs about one put-off (its first layer's start)."""
        put_off = self.put_off_s or 0.0
        cost = max(0.0, self.predict_s - put_off)
        verdict_off = self._verdict_off
        if layer is not None and self.quiet_possible and all(
                verdict_off.get(other, False) for other in self._layers if other != layer):
            cost += (len(self._layers) - 1) * put_off
        return cost

    def _costs(self, t: float) -> tuple[float, float, float]:
        """What sending a prefetch costs (see cost(r)): half a chunk of the demand loads' time if it is wrong,
        the compute thread's work on it (c), and the demand load's (d) it spares if it is right."""
        issue = self.engine.prefetch_cost_s or 0.0
        spared = self.engine.demand_cost_s
        chunk = t * self._chunk_share if self._chunk_s is None else min(t, self._chunk_s)
        return chunk / 2, issue, issue if spared is None else spared

    def _victim_loss(self, layer: int, hit_saves: float) -> tuple[int, float]:
        """What a prefetch for `layer` loses beyond the link's time, right or wrong (wrong: once its copy has started,
        else its victim is given back): the used expert whose slot it took, asked for again before it would have
        been evicted anyway at the cache's measured rate (ExpertCache.victim_regret), each such use a miss that
        stalls what a hit saves; and how many prefetches lose none (`spare`: free slots and unconfirmed guesses go
        first)."""
        cache = self.engine.cache
        return cache.spare(layer), cache.victim_regret() * hit_saves

    def observe(self, layer: int, candidates: list[int], chosen: set, resident: int | None = None) -> None:
        """The router of `layer` chose `chosen`: score each rank of the prediction made for it. Its candidates that
        were missing count towards pm and q: a scheduled prediction's, found when scheduled; one put off (made after
        its request, prediction.PutOffPrediction), those not in `resident`, the layer's experts the cache held when it was put
        off (bits: ExpertCache.resident_bits)."""
        picked = self.picked.setdefault(layer, [0] * self.budget)
        for rank, e in enumerate(candidates[: self.budget]):
            picked[rank] += e in chosen
        self.seen[layer] = self.seen.get(layer, 0) + 1
        self._precision.pop(layer, None)
        scheduled = self._scheduled.pop(layer, None)
        if scheduled is not None and scheduled[0] is candidates:  # this very prediction was scheduled
            missing = scheduled[1]
        elif resident is not None:
            missing = [(rank, e) for rank, e in enumerate(candidates[: self.budget]) if not resident >> e & 1]
        else:
            missing = None
        if missing is not None:
            seen = self.missing_seen.setdefault(layer, [0] * self.budget)
            picked = self.missing_picked.setdefault(layer, [0] * self.budget)
            recent = self.missing_recent.get(layer)
            if recent is None:  # from PRIOR_WEIGHT predictions, which fade as the rest do (missing_share)
                recent = self.missing_recent[layer] = [PRIOR_WEIGHT, PRIOR_WEIGHT] + [0.0] * self.budget
            keep = 1.0 - 1.0 / MISSING_MEMORY
            for i, weight in enumerate(recent):
                recent[i] = weight * keep
            recent[0] += 1.0
            for rank, e in missing:
                seen[rank] += 1
                picked[rank] += e in chosen
                recent[rank + 2] += 1.0
            self.missing_scored[layer] = self.missing_scored.get(layer, 0) + 1
        self._missing.pop(layer, None)
        self._send.pop(layer, None)
        self._verdict.pop(layer, None)
        self._off_left.pop(layer, None)

    def learn_prompt(self, layer: int, rows: PromptRows) -> None:
        """A prompt's rows scored for `layer` (evalsuite.engine.prediction.prompt_precision), read for the rows the layer's
        share of the cache holds (its pool's slots over the layers sharing it, over top-k): summed with earlier
        prompts', they may lower the precision the send rule weighs (send_precision)."""
        pool = self.engine.cache.pools[layer]
        sharing = sum(other is pool for other in self.engine.cache.pools.values())
        outcomes = rows.outcomes(max(1, round((len(pool.free) + pool.resident) / sharing / self._top_k_of[layer])))
        if outcomes is None:
            return
        old = self.prompt.get(layer)
        self.prompt[layer] = outcomes if old is None else old + outcomes
        self._send.pop(layer, None)

    def precision(self, layer: int) -> list[float]:
        """Per rank, the smoothed share of past predictions for `layer` the router confirmed."""
        if layer not in self._precision:
            seen, picked = self.seen.get(layer, 0), self.picked.get(layer, [0] * self.budget)
            self._precision[layer] = [(hits + 1) / (seen + 2) for hits in picked]
        return self._precision[layer]

    def missing_precision(self, layer: int) -> list[float]:
        """Per rank, pm: the precision over candidates that were missing when scheduled, shrunk towards p."""
        if layer not in self._missing:
            seen = self.missing_seen.get(layer, [0] * self.budget)
            picked = self.missing_picked.get(layer, [0] * self.budget)
            k = PRIOR_WEIGHT
            self._missing[layer] = [(h + k * p) / (m + k) for h, m, p in zip(picked, seen, self.precision(layer))]
        return self._missing[layer]

    def send_precision(self, layer: int) -> list[float]:
        """Per rank, the pm the send rule weighs: missing_precision, or where the prompts' rows (learn_prompt) show a
        lower share of missing candidates picked (Laplace-smoothed), the decode's counts shrunk towards that share
        at PROMPT_WEIGHT. Only lower: where the prompt raised it, nothing was gained. The worth test weighs
        missing_precision alone: a verdict to put predictions off on the prompt's word would stop the decode's
        scoring that corrects it (a short prompt's few rows can hold a layer's precision far below decode's)."""
        if layer not in self._send:
            decode, prompt = self.missing_precision(layer), self.prompt.get(layer)
            if prompt is None:
                self._send[layer] = decode
            else:
                seen = self.missing_seen.get(layer, [0] * self.budget)
                picked = self.missing_picked.get(layer, [0] * self.budget)
                k, p = PROMPT_WEIGHT, self.precision(layer)
                shares = [(h + 1) / (m + 2) for h, m in zip(prompt.missing_picked, prompt.missing)]
                shares += [1.0] * (self.budget - len(shares))  # (ranks the prompt did not score: the decode's)
                self._send[layer] = [(h + k * share) / (m + k) if share < prior else pm
                                     for h, m, share, prior, pm in zip(picked, seen, shares, p, decode)]
        return self._send[layer]

    def missing_share(self, layer: int) -> list[float]:
        """Per rank, q: how often the candidate was missing when recently scheduled, its prior's predictions each
        missing at the layer's miss rate now (before any, that rate)."""
        recent, miss = self.missing_recent.get(layer), self.engine.miss_rate(layer)
        if recent is None:
            return [miss] * self.budget
        prior = recent[1] * miss
        return [(m + prior) / recent[0] for m in recent[2:]]

    def schedule(self, target_pos: int, candidates: list[int], h: int) -> int:
        """Prefetch the experts of sparse layer `target_pos` worth sending (`candidates`: ranked, see
        `ranked`); returns transfers started."""
        engine = self.engine
        layer = self._index[target_pos]
        ranked_candidates, candidates = candidates, candidates[: self.budget]
        missing = [(rank, e) for rank, e in enumerate(candidates) if not engine.cache.resident((layer, e))]
        self._scheduled[layer] = (ranked_candidates, missing)  # scored when the router of `layer` decides
        if not missing:
            return 0
        t = engine.transfers.seconds_per_transfer()
        if not self.window or self.layer_s is None or t is None:
            return engine.prefetch(layer, [e for _, e in missing], keep=candidates)
        (moving_s, issue_s, spared_s), lead = self._costs(t), self.lead_s(target_pos, h)
        precision, ahead = self.send_precision(layer), engine.transfers.prefetches_queued()
        wanted, hit_saves = [], self._hit_saves(t, layer)
        spare, lost = self._victim_loss(layer, hit_saves)
        for rank, e in missing:
            p = precision[rank]
            saved = min(hit_saves, max(0.0, lead - (ahead + len(wanted)) * t))
            victim = lost if len(wanted) >= spare else 0.0  # (a wrong one's only where its copy starts)
            wrong = moving_s + (victim if saved > 0.0 else 0.0)
            if p * (saved - victim) > (1 - p) * wrong + issue_s - p * spared_s:
                wanted.append(e)
        if not wanted:
            return 0
        return engine.prefetch(layer, wanted, keep=candidates)  # in one call: no candidate evicts another
