"""Predictions put off until their request ends (see PredictionDriver.on_router): made from the
inputs the predictor would have read, kept as the model left them, for recall, the scheduler's
precision and the trace only; no prefetch comes of them.

PutOffPrediction  one prediction put off at a layer whose verdict was asked there.
PutOffToken       a decode token none of whose predictions is asked for ("quiet"): every sparse layer's verdict
                  to put off stands (PrefetchScheduler.put_off_all), so at each layer the driver keeps only the
                  inputs its prediction reads (PredictionDriver.quiet_keeps) and the ids, and the token's
                  PutOffPredictions are made from them when the request ends: keeping inputs costs the hot path
                  far less than the bookkeeping of a prediction put off layer by layer.
"""
from __future__ import annotations

import torch

from evalsuite.engine.pass_state.layer_state import LayerState
from evalsuite.engine.prediction.scheduler import ranked


class PutOffPrediction:
    """A prediction put off until its request ends: the predictor's call `score(state)` on the LayerState of
    sparse layer `pos` (router input `x`, `residual`, `ids`, `weights`), made once when first asked for.
    `reads`: the fields it reads. Called, it gives the `budget` ranked candidates (what the trace reads). It
    keeps the fields, and builds their LayerState only when scored: one object per prediction put off is less
    for the hot path to make and for the garbage collector to walk until the request ends. `resident`: the
    target layer's experts the cache held when it was put off (ExpertCache.resident_bits; None: unknown), from
    which the scheduler learns which candidates it would have found missing (PrefetchScheduler.observe).

    The model's forward pass never writes its activations in place, so a prediction keeps the tensors it
    will read rather than copies (a copy costs the hot path more than the whole put-off bookkeeping), with
    their version counters when kept (`versions`, taken now where not given): one written in place since would
    make it score another state, and is refused. Every field's counter is taken (four reads cost the hot path
    less than choosing); only those read are compared."""

    __slots__ = ("_score", "_reads", "_scores", "budget", "_pos", "x", "residual", "ids", "weights", "_versions",
                 "resident")

    def __init__(self, score, reads, budget: int, pos: int, x, residual, ids, weights, versions=None,
                 resident: int | None = None):
        self._score, self._reads, self._scores, self.budget = score, reads, None, budget
        self._pos, self.x, self.residual, self.ids, self.weights = pos, x, residual, ids, weights
        self._versions = versions or versions_of(x, residual, ids, weights)
        self.resident = resident

    def scores(self) -> torch.Tensor:
        if self._scores is None:
            for name, version in zip(("x", "residual", "ids", "weights"), self._versions):
                if name in self._reads and getattr(self, name)._version != version:
                    raise RuntimeError("a prediction put off reads a tensor the model changed in place after its "
                                       "layer ran; run with window=False (every prediction made on the spot)")
            with torch.no_grad():
                self._scores = self._score(LayerState(self._pos, self.x, self.residual, self.ids, self.weights))
            self._score = self.x = self.residual = self.ids = self.weights = None
        return self._scores

    def __call__(self) -> list[int]:
        return ranked(self.scores(), self.budget)


def versions_of(x, residual, ids, weights) -> tuple:
    return x._version, None if residual is None else residual._version, ids._version, weights._version


class PutOffToken:
    """A decode token whose every prediction is put off, unasked. `inputs`: what each sparse layer gave the driver,
    appended as the token runs, FIELDS entries a layer: x, residual, ids, weights, their version counters, and what
    the cache holds of the layer it predicts (one flat list: a tuple a layer and one of its versions were two
    objects more a layer for the garbage collector to count and walk until the request ends); `first`: the
    prediction for its first sparse layer (made at the last token's last, a PutOffPrediction), or None. `driver` says what
    each position predicts (`target_of`) and how (its `_score_ahead`, `_score_next`, `reads_of`, the
    engine's budget). The token's PutOffPredictions are made from `inputs` when first asked for (`prediction_for`); the trace
    asks for them by the layer predicted (`ranked_for`). `kinds`: where its forward pass's image and text tokens
    are (TokenKinds; None for a text model), for recall by kind."""

    __slots__ = ("inputs", "first", "kinds", "_driver", "_made", "_keeps")
    FIELDS = 9

    def __init__(self, driver, first: PutOffPrediction | None, kinds=None):
        self.inputs: list = []
        self.first, self.kinds, self._driver, self._made = first, kinds, driver, {}
        self._keeps = driver.quiet_keeps  # per position, whether (x, residual, weights) are read

    def keep(self, x, residual, ids, weights, resident: int | None) -> None:
        """The next sparse layer's inputs, those its prediction reads (driver.quiet_keeps; the others None) and the
        ids, with their version counters now, and the resident experts of the layer it predicts (see PutOffPrediction)."""
        keeps_x, keeps_residual, keeps_weights = self._keeps[len(self.inputs) // self.FIELDS]
        x = x if keeps_x else None
        residual = residual if keeps_residual else None
        weights = weights if keeps_weights else None
        # (versions_of written out: this runs at every layer of a quiet token, and the call cost 0.5 of its 2.4 us)
        self.inputs.extend((x, residual, ids, weights, None if x is None else x._version,
                            None if residual is None else residual._version, ids._version,
                            None if weights is None else weights._version, resident))

    def ran(self, pos: int) -> bool:
        """Whether sparse layer `pos` ran and kept its inputs (a forward pass cut short leaves the rest)."""
        return len(self.inputs) > pos * self.FIELDS

    def complete(self) -> bool:
        """Whether every sparse layer of the token ran."""
        return len(self.inputs) == len(self._driver.target_of) * self.FIELDS

    def made_at(self, pos: int) -> PutOffPrediction:
        """The prediction sparse layer `pos` of this token put off (for the layer `target_of[pos]`)."""
        later = self._made.get(pos)
        if later is None:
            driver, at = self._driver, pos * self.FIELDS
            x, residual, ids, weights, *versions, resident = self.inputs[at:at + self.FIELDS]
            score = driver._score_ahead if driver.target_of[pos] else driver._score_next
            later = self._made[pos] = PutOffPrediction(score, driver.reads_of[pos], driver.engine.budget, pos, x, residual, ids,
                                            weights, tuple(versions), resident)
        return later

    def prediction_for(self, pos: int) -> PutOffPrediction | None:
        """The prediction for this token's sparse layer `pos`, None where none was made."""
        if pos == 0:
            return self.first
        source = self._driver.source_of[pos]
        return None if source is None else self.made_at(source)

    def ranked_for(self, layer: int) -> list[int]:
        """The ranked candidates of the prediction this token put off for decoder layer `layer` (what the trace
        reads: the token's own layers but its first, and the next token's first)."""
        driver = self._driver
        return self.made_at(driver.source_of[driver.pos_of[layer]])()

    def ids(self, pos: int) -> torch.Tensor:
        return self.inputs[pos * self.FIELDS + 2]
