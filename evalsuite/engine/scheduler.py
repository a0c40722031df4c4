"""Window-aware prefetch scheduling (seed B): start only the transfers that can land in time.

Candidates are ranked by the predictor's confidence (its probability mass summed over the
tokens in flight); resident and in-flight experts are skipped; a transfer is submitted only if,
behind what the link already has queued, it can finish before the target layer starts
(measured seconds per expert transfer vs measured time per sparse layer x horizon). At most
`budget` candidates are considered per prediction.
"""
from __future__ import annotations

import time

import torch


class PrefetchScheduler:
    def __init__(self, engine, budget: int, window: bool = True, smoothing: float = 0.2):
        self.engine, self.budget, self.window, self.smoothing = engine, budget, window, smoothing
        self.layer_s: float | None = None  # measured time from one sparse layer to the next
        self._last: tuple[int, float] | None = None

    def layer_started(self, pos: int) -> None:
        now = time.perf_counter()
        if self._last is not None and self._last[0] == pos - 1:
            self.layer_s = self._ema(self.layer_s, now - self._last[1])
        self._last = (pos, now)

    def _ema(self, old, new):
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def schedule(self, target_pos: int, scores: torch.Tensor, h: int) -> int:
        """Prefetch the most likely experts of sparse layer `target_pos`; returns transfers started."""
        engine = self.engine
        layer = engine.layers[target_pos].index
        confidence = torch.softmax(scores.float(), dim=-1).sum(dim=0)
        ranked = confidence.argsort(descending=True)[: self.budget].tolist()
        per_transfer = engine.transfers.seconds_per_transfer()
        deadline = None if (not self.window or self.layer_s is None or per_transfer is None) else self.layer_s * h
        queued = engine.transfers.pending()
        wanted = []
        for e in ranked:
            if engine.cache.resident((layer, e)):
                continue
            if deadline is not None and (queued + len(wanted) + 1) * per_transfer > deadline:
                break  # would land after the layer starts: leave the link to demand loads
            wanted.append(e)
        return engine.prefetch(layer, wanted)  # in one call, so no candidate evicts another
