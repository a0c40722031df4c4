"""Prefetch scheduling: send a candidate when what it is expected to save exceeds what it costs.

Candidates are ranked by the predictor's confidence (its probability mass summed over the tokens
in flight); resident and in-flight experts are skipped; at most `budget` are considered.

saved(r)   the part of candidate r's copy done before its layer starts: the link first finishes
           what it already has queued, then the candidates before r, so r's copy starts at
           q·t (q transfers ahead, t seconds per transfer) and by the layer's start
           (layer_s·h away) it has moved min(t, max(0, layer_s·h − q·t)) of its t seconds. A
           copy that lands late still saves that part: when the router picks it, it is
           promoted and finishes as a demand load.
p(l, r)    online precision of rank r at sparse layer l: of the past decode predictions for l,
           the share whose rank-r candidate the router picked (Laplace-smoothed: (hits+1)/(n+2)).
cost(r)    a wrong prefetch delays demand loads by at most one chunk (a demand load preempts a
           moving prefetch at the next chunk boundary, and the router's decision cancels it):
           (1 − p)·chunk seconds.
rule       send r when p·saved(r) > (1 − p)·chunk seconds; with `window=False`, send the top
           `budget` regardless.

layer_s    measured on decode only, without stalls: the time from one sparse layer's router to
           the next, minus the stall the engine recorded in between; reset per request (a
           request's first decode token has no measurement yet and sends the top `budget`).
"""
from __future__ import annotations

import time

import torch


class PrefetchScheduler:
    def __init__(self, engine, budget: int, window: bool = True, smoothing: float = 0.2):
        self.engine, self.budget, self.window, self.smoothing = engine, budget, window, smoothing
        self.layer_s: float | None = None  # decode time from one sparse layer's router to the next, stalls out
        self._last: tuple[int, float, float] | None = None  # (position, time, stall total) at the last router
        self.picked: dict[int, torch.Tensor] = {}  # sparse layer -> per rank, predictions the router confirmed
        self.seen: dict[int, int] = {}  # sparse layer -> predictions scored

    def new_request(self) -> None:
        self.layer_s = self._last = None

    def layer_started(self, pos: int) -> None:
        if not self.engine.decoding:  # prefill layers take far longer than decode ones
            self._last = None
            return
        self.layer_at(pos, time.perf_counter(), self._stall_total())

    def layer_at(self, pos: int, now: float, stalled: float) -> None:
        """Decode sparse layer `pos` routed at `now`, with `stalled` seconds of stall recorded so far
        (the engine's clock and counters, or the simulator's)."""
        if self._last is not None and self._last[0] == pos - 1:
            self.layer_s = self._ema(self.layer_s, max(0.0, now - self._last[1] - max(0.0, stalled - self._last[2])))
        self._last = (pos, now, stalled)

    def _stall_total(self) -> float:
        return sum(c.stall_s for c in self.engine.record.counters.values())

    def _ema(self, old, new):
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe(self, layer: int, scores: torch.Tensor, chosen: set) -> None:
        """The router of `layer` chose `chosen`: score each rank of the prediction made for it."""
        ranked = _ranked(scores)[: self.budget].tolist()
        hits = torch.tensor([float(e in chosen) for e in ranked] + [0.0] * (self.budget - len(ranked)))
        self.picked[layer] = self.picked.get(layer, torch.zeros(self.budget)) + hits
        self.seen[layer] = self.seen.get(layer, 0) + 1

    def precision(self, layer: int) -> torch.Tensor:
        """Per rank, the smoothed share of past predictions for `layer` the router confirmed."""
        return (self.picked.get(layer, torch.zeros(self.budget)) + 1) / (self.seen.get(layer, 0) + 2)

    def schedule(self, target_pos: int, scores: torch.Tensor, h: int) -> int:
        """Prefetch the experts of sparse layer `target_pos` worth sending; returns transfers started."""
        engine = self.engine
        layer = engine.layers[target_pos].index
        ranked = _ranked(scores)[: self.budget].tolist()
        t = engine.transfers.seconds_per_transfer()
        if not self.window or self.layer_s is None or t is None:
            wanted = [e for e in ranked if not engine.cache.resident((layer, e))]
            return engine.prefetch(layer, wanted)
        chunk_s = t * min(1.0, engine.transfers.chunk_bytes / engine.layout.nbytes)
        precision, ahead = self.precision(layer).tolist(), engine.transfers.pending()
        wanted = []
        for rank, e in enumerate(ranked):
            if engine.cache.resident((layer, e)):
                continue
            p = precision[rank]
            saved = min(t, max(0.0, self.layer_s * h - (ahead + len(wanted)) * t))
            if p * saved > (1 - p) * chunk_s:
                wanted.append(e)
        return engine.prefetch(layer, wanted)  # in one call, so no candidate evicts another


def _ranked(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.float(), dim=-1).sum(dim=0).argsort(descending=True)
