"""Whether a decode step's prediction is worth making now (online: its prefetches are sent) or after its
request (prediction.PutOffPrediction, put_off.PutOffToken: for recall, precision and the trace only). The worth test
of PrefetchScheduler (evalsuite.engine.prediction.scheduler), which mixes it in; it reads the scheduler's measures
(layer_s, predict_s, put_off_s, stall_off, the per-rank precisions) and the engine's (miss rate, link),
named as in that module's docstring (t, lead, pm, q, cost(r), the send rule).

worth      a prediction is made during decoding only if its candidates' expected saving (the rule's
           margins, each times q) exceeds what making it online costs the compute thread beyond putting
           it off (`online_cost_s`: the driver times both paths from the router of the layer that
           predicts, the online one through scheduling its prefetches, their issuing and the settling of
           the layer's own prefetches left out; and where every other layer's verdict is to put off, the
           quiet token it rules out: the other layers' put-offs one by one, less the one a quiet token costs);
           otherwise (a fast link, a cache that already holds the layer) the driver makes it after the
           request, for recall and precision only (prediction.PutOffPrediction); one in EXPLORE_EVERY is made
           online anyway, so what online predictions measure as the request runs (predict_s; pm and q,
           which a prediction put off adds to only when its request ends) stays current, or
           one in EXPLORE_EVERY² where the verdict is a sure no (the net saving under half the cost, on
           measured precisions, where exploring rarely turns the verdict); and unless no precision could make it pay (`_most_saved`: at most
           min(budget, top-k · the layer's miss rate) candidates are right and missing, each saving at
           most min(t, lead) less what issuing it costs beyond the demand load it spares, and together at
           most stall_off), and where that is below the prediction's cost (a copy shorter than a
           prediction, as on a fast link with tiny experts, or stall_off below it: see below) one in
           EXPLORE_EVERY² is made online, which keeps that cost
           measured (it could fall) at an eighth of the price. The candidates' saving counts at most
           stall_off(l), what layer l's decode steps stalled when its prediction was put off: what
           on-demand loading stalls there, so the most any prediction can save. The rule credits a
           right, missing candidate with up to a whole copy, but a demand copy overlaps the compute of
           the layer's experts before it, so on a fast link the stall is far less than credited. A prediction that pays is put off one in
           EXPLORE_EVERY to measure stall_off, until stall_off is over twice what the prediction must
           save, or a floor under it is (the layer's expected demand misses' copies less a layer's
           compute: on the SD card each put-off step stalls a copy, and the floor spares them); then one
           in EXPLORE_EVERY², the first at ask EXPLORE_EVERY² − EXPLORE_EVERY/2. stall_off caps the
           saving, or vetoes the prediction, only once it rests on STALL_OFF_AFTER steps: a lone step
           that stalled nothing (every expert resident) put SD-card layers off for a dozen steps. A
           verdict stands until the layer's precisions change (an online prediction scored); one to put
           off is not judged again until the layer's next ask that may explore (one in EXPLORE_EVERY), or
           one in EXPLORE_EVERY² where no precision could make it pay even at twice the saving. Every
           ask counts, answered or not, and each layer is asked once a decode token, so verdicts to put
           off end together; while all stand, a token asks nothing (`put_off_all`: the driver's quiet
           token, put_off.PutOffToken, which keeps its layers' inputs and no more).
"""
from __future__ import annotations

EXPLORE_EVERY = 8  # a verdict's other arm is still taken this often: online keeps precision current, put off stall_off
STALL_OFF_AFTER = 3  # put-off steps stall_off must rest on before it caps what a prediction can save


class WorthTest:
    """PrefetchScheduler methods: worth_predicting, put_off_all and their verdicts."""

    def worth_predicting(self, target_pos: int, h: int) -> bool:
        """Whether predicting sparse layer `target_pos` now is worth it (`_judge`); remembers the answer, so the
        stall of that layer's step is known to be one without a prediction."""
        layer = self._index[target_pos]
        left = self._off_left.get(layer)
        if left:  # a verdict to put off stands until the layer's next exploring ask (_judge)
            self._off_left[layer] = left - 1
            self._asked[layer] += 1
            self._put_off_for[target_pos] = True
            return False
        online = self._judge(layer, target_pos, h)
        self._put_off_for[target_pos] = not online
        return online

    def put_off_all(self) -> bool:
        """At a decode token's start: whether every sparse layer's verdict to put off stands (a quiet token: the
        driver asks nothing more of it). If so, each verdict stands one ask less, as if asked, and the token's
        layers go untimed (they neither time a layer nor measure stall_off)."""
        off_left, asked = self._off_left, self._asked
        if len(off_left) < len(self._layers) or not all(off_left.values()):
            return False
        for layer, left in off_left.items():
            off_left[layer] = left - 1
            asked[layer] += 1
        self._put_off_for.clear()
        self._last = None
        return True

    def _judge(self, layer: int, target_pos: int, h: int) -> bool:
        """Whether predicting sparse layer `target_pos` (decoder layer `layer`) now is expected to save more than
        it costs: the summed expected saving of its candidates under the send rule, each counted with how
        often that rank's candidate was missing (q; a resident candidate saves nothing), against what
        making it online costs beyond putting it off, that saving capped at stall_off (see `worth` above).
        Unknown quantities (before the first measurements) say yes. A verdict to put off stands, unjudged, until
        the layer's next ask that may explore, or until its precisions change (judging is not free either)."""
        # every ask counts, answered or not: each layer is asked once a decode token, so their verdicts to put off
        # then end at the same token, and the tokens between are quiet ones (put_off_all)
        asked = self._asked[layer] = self._asked.get(layer, 0) + 1
        self._verdict_off[layer] = False
        if not self.window or self.layer_s is None or self.predict_s is None:
            return True
        t = self.engine.transfers.seconds_per_transfer()
        if t is None:
            return True
        cost, lead = self.online_cost_s(layer), self.lead_s(target_pos, h)
        off = self.stall_off.get(layer)
        most = self._most_saved(target_pos, layer, t, lead)
        if most <= cost:
            # even every candidate missing and right would save less (or the layer stalls less with it put off):
            # precision cannot turn the verdict, only a cheaper prediction can (predict_s, measured on online ones)
            # or a slower link, so it is measured far less often; and judged far less often where it would have to
            # double to pay (what it weighs drifts slowly, and on a fast link the tokens that judge cost the most)
            rarely = EXPLORE_EVERY * EXPLORE_EVERY
            self._verdict_off[layer] = True
            if asked % rarely == 0:
                return True
            every = rarely if 2 * most < cost else EXPLORE_EVERY
            self._off_left[layer] = every - 1 - asked % every
            return False
        # A verdict stands until the precisions it rests on change (observe() drops it: an online prediction
        # scored, such as the exploring one): what else it weighs drifts slowly, and judging anew at every
        # layer of every token cost more than the rest of a put-off prediction (13 of 23 us here).
        verdict = self._verdict.get(layer)
        if verdict is None:
            verdict = self._verdict[layer] = self._pays(layer, t, lead, cost, off)
        pays, sure = verdict
        self._verdict_off[layer] = not pays
        if not pays and asked % EXPLORE_EVERY == 0 and (not sure or asked % (EXPLORE_EVERY * EXPLORE_EVERY) == 0):
            return True  # keep measuring what online predictions show now (pm, q, predict_s): it could turn the verdict
        # (a sure yes is first put off at ask EXPLORE_EVERY² − EXPLORE_EVERY/2, not at the first phase: a request
        # of a few dozen tokens on a fresh engine then puts none off, where each would stall a copy)
        rarely = EXPLORE_EVERY * EXPLORE_EVERY
        if pays and asked % EXPLORE_EVERY == EXPLORE_EVERY // 2 and (
                not sure or asked % rarely == rarely - EXPLORE_EVERY // 2):
            return False  # measure what putting it off stalls (stall_off), often while that could turn the verdict
        if not pays:
            self._off_left[layer] = EXPLORE_EVERY - 1 - asked % EXPLORE_EVERY
        return pays

    def _most_saved(self, target_pos: int, layer: int, t: float, lead: float) -> float:
        """The most any prediction for sparse layer `target_pos` (decoder layer `layer`) could save, whatever its
        precision: max over j ≤ k right, missing candidates of min(stall_off, j·s) − j·(c − d), k = min(budget,
        top-k · miss rate) (right and missing ones are uses the cache lacks), s = min(what a landed one saves,
        lead), c − d what issuing one costs beyond the demand load it spares (stall_off once measured)."""
        _, issue, spared = self._costs(t)
        saves = min(self._hit_saves(t, layer), lead)
        if saves <= 0.0:
            return 0.0
        right = min(float(self.budget), self._top_k[target_pos] * self.engine.miss_rate(layer))
        off = self._stall_cap(layer)
        if off is None or right * saves <= off:
            return right * (saves - issue + spared)
        covered = off / saves  # enough to remove the whole stall: each one more costs c − d (or gains, if c < d)
        return max(off - covered * (issue - spared), off - right * (issue - spared))

    def _stall_cap(self, layer: int) -> float | None:
        """stall_off of `layer` once it rests on STALL_OFF_AFTER put-off steps (a cap on any saving), else None."""
        return self.stall_off.get(layer) if self._stall_off_n.get(layer, 0) >= STALL_OFF_AFTER else None

    def _pays(self, layer: int, t: float, lead: float, cost: float, off: float | None) -> tuple[bool, bool]:
        """The verdict: whether the candidates' expected saving under the send rule, at most what the layer stalls
        with its prediction put off (`off`: stall_off, None before measured; a cap once it rests on
        STALL_OFF_AFTER steps), less what sending them costs, exceeds `cost`; and whether it is sure. A yes is
        sure when stall_off is measured and over twice what it must exceed (a margin its noise does not cross:
        one step stalls anything from nothing to several copies), or when a floor under it is (the put-off steps
        that measure it each cost a copy's stall on the SD card, where the floor needs no measuring); a no, when
        the net saving is under half the cost (it would have to double to pay) and rests on EXPLORE_EVERY
        predictions scored for what was missing (pm and q measured, not their priors)."""
        (moving_s, issue_s, spared_s), hit_saves = self._costs(t), self._hit_saves(t, layer)
        ahead, saving, waste = self.engine.transfers.prefetches_queued(), 0.0, 0.0
        spare, lost = self._victim_loss(layer, hit_saves)
        # what is queued ahead of a candidate is the prefetches already on the link and the candidates before it
        # that are sent, each as often as it is missing (only missing ones are sent: where the first ranks are
        # mostly cached, a later one's copy starts at once, as schedule sends it)
        before = 0.0  # candidates of this prediction sent before the next one, expected
        for p, q in zip(self.missing_precision(layer), self.missing_share(layer)):
            saved = min(hit_saves, max(0.0, lead - (ahead + before) * t))
            victim = lost if before >= spare else 0.0  # (see schedule)
            wrong = moving_s + (victim if saved > 0.0 else 0.0)
            spent = (1 - p) * wrong + issue_s - p * spared_s + p * victim
            if p * saved > spent:  # the candidates it would send
                saving += q * p * saved
                waste += q * spent
                before += q
        # stall_off caps the saving once it rests on STALL_OFF_AFTER steps: one step stalls anything from nothing
        # (every expert resident) to several copies, and a lone zero put the SD card's layers off for a dozen
        # steps (a wrong no costs a copy's stall there; a wrong yes, on a fast link, a prediction's compute)
        cap = self._stall_cap(layer)
        net = (saving if cap is None else min(saving, cap)) - waste
        if net > cost:
            # sure: the layer is known to stall with it put off over twice what it must save, measured, or by a
            # floor that needs no measuring where a copy outlasts a layer's compute (the SD card): its expected
            # demand misses' copies less all the compute they could overlap
            floor = self.engine.miss_rate(layer) * self.budget * t - self.layer_s
            return True, (off is not None and off > 2 * (waste + cost)) or floor > 2 * (waste + cost)
        # sure not: the saving would have to double, on precisions measured (the priors alone say little)
        return False, 2 * net < cost and self.missing_scored.get(layer, 0) >= EXPLORE_EVERY
