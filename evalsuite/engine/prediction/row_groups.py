"""Several predictors over one batch, a group of its rows each (offload(..., row_predictors=[...]))."""
from __future__ import annotations

from typing import Callable

import torch

from evalsuite.engine.pass_state.layer_state import LayerState


class RowGroups:
    """Several predictors over one batch (offload(..., row_predictors=[...])): the batch's rows fall in
    len(predictors) equal groups, in order, and group g's tokens are scored by predictors[g] from their
    own states. A speculative decision is per token, so one generation then speculates with every
    predictor, each row as its own run would (only predictors that read a token's own states alone)."""

    def __init__(self, predictors: list, rows: Callable[[], int]):
        self.predictors, self.rows = predictors, rows  # rows(): the running forward pass's batch rows
        self.name = "+".join(p.name for p in predictors)
        self.reads = tuple(dict.fromkeys(r for p in predictors for r in p.reads))
        self.horizons = tuple(h for h in predictors[0].horizons if all(h in p.horizons for p in predictors))
        self.stateless = all(p.stateless for p in predictors)
        self.at_target = all(getattr(p, "at_target", False) for p in predictors)  # (EngineConfig: all or none)

    def _groups(self, t: torch.Tensor | None) -> list:
        """[rows * tokens, ...] -> each group's [rows / groups * tokens, ...] (rows come first)."""
        groups, rows = len(self.predictors), self.rows()
        if rows % groups:
            raise ValueError(f"row_predictors: a batch of {rows} rows does not fall in {groups} equal groups "
                             f"(give every group the same rows: repeat the batch {groups} times)")
        return [None] * groups if t is None else list(t.reshape(groups, -1, *t.shape[1:]))

    def scores(self, state: LayerState, h: int) -> torch.Tensor:
        parts = zip(self.predictors, self._groups(state.x), self._groups(state.residual), self._groups(state.ids),
                    self._groups(state.weights))
        return torch.cat([p.scores(LayerState(state.pos, x, r, i, w), h) for p, x, r, i, w in parts])

    def proposed(self, pos: int, router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each group's at-target proposal (evalsuite.predict.controlled) from its own rows' routing."""
        return torch.cat([p.proposed(pos, router, part_logits, part_ids) for p, part_logits, part_ids
                          in zip(self.predictors, self._groups(logits), self._groups(ids))])

    def next_token_scores(self, x: torch.Tensor) -> torch.Tensor | None:
        scores = [p.next_token_scores(part) for p, part in zip(self.predictors, self._groups(x))]
        return None if any(s is None for s in scores) else torch.cat(scores)

    def on_token(self, decoding: bool) -> None:
        for p in self.predictors:
            p.on_token(decoding)
