"""Controlled-recall predictors: an instrument for "what recall does a task need before speculation is free?".

`recall-R` proposes, at every layer a decode token speculates, the router's own top-K with a seeded share of it
replaced, so that recall@K over the run is R: each token loses floor(K(1-R)) of its experts or one more, the one
more drawn at random but likelier the more the run owes, so the whole run misses its target by less than one
expert. It reads the layer's own routing, so it predicts nothing ahead: it can only be executed (mode
speculative), never prefetched. `recall-1.0` executes the router's own choice in its own order, so it gives the
unmodified model's tokens exactly.

Names: recall-R[-uniform|-near][-all|-early|-middle|-late]
  uniform   (default) a replaced slot is drawn uniformly among the K selected experts, its replacement
            uniformly among the experts the router did not select
  near      the lowest-ranked selected experts give way to the highest-ranked unselected ones: the router's
            next-ranked experts, the near-misses a real predictor makes
  early, middle, late   errors only in that third of the speculated layers (R holds there, 1.0 elsewhere);
            all (default): every speculated layer
"""
from __future__ import annotations

import math
import re

import torch

from ..engine.prediction import ranked_scores
from .predictors import Predictor

NAME = re.compile(r"recall-(?P<recall>0(?:\.\d+)?|1(?:\.0+)?)(?:-(?P<errors>uniform|near))?"
                  r"(?:-(?P<layers>all|early|middle|late))?")
SHOWN = "recall-R[-near][-early|-middle|-late]"
ERRORS = ("uniform", "near")
RANGES = ("all", "early", "middle", "late")


def parse_recall_name(name: str) -> tuple[float, str, str] | None:
    """(recall, error model, layer range) of a controlled-recall predictor's name, else None."""
    match = NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    return float(match["recall"]), match["errors"] or "uniform", match["layers"] or "all"


def recall_name(recall: float, errors: str = "uniform", layers: str = "all") -> str:
    """The name parse_recall_name reads back: recall-0.8, recall-0.8-near-late."""
    level = f"{recall:g}" if f"{recall:g}".count(".") else f"{recall:g}.0"
    return f"recall-{level}" + ("" if errors == "uniform" else f"-{errors}") + ("" if layers == "all" else f"-{layers}")


def in_range(pos: int, sparse_layers: int, layers: str) -> bool:
    """Whether speculated position `pos` (1 .. sparse_layers-1: the first sparse layer never speculates) falls in
    the `layers` third of them, by the depth of its middle among them (two layers: early and late)."""
    if layers == "all":
        return True
    depth = (pos - 0.5) / (sparse_layers - 1)
    return min(int(depth * 3), 2) == RANGES.index(layers) - 1


class ControlledRecallPredictor(Predictor):
    """recall-R: the layer's own routing with a dithered, seeded share of it replaced (see the module doc)."""

    stateless = False  # the errors follow the run's debt of experts owed, not the token's states alone
    at_target = True  # proposes a layer's experts from that layer's own routing (proposed; PredictionDriver.on_router)

    def __init__(self, layers, family, name: str, seed: int = 0):
        super().__init__(layers, family, None)
        parsed = parse_recall_name(name)
        if parsed is None:
            raise ValueError(f"predictor={name!r} is not a controlled-recall name: {SHOWN}, e.g. recall-0.8")
        self.name, (self.recall, self.errors, self.range) = name, parsed
        if not any(in_range(pos, len(layers), self.range) for pos in range(1, len(layers))):
            raise ValueError(f"predictor {name!r}: none of this model's {len(layers) - 1} speculated layers is in the "
                             f"{self.range} third; use another range, or none")
        self.generator = torch.Generator().manual_seed(seed)
        self.owed = 0.0  # experts owed to the target: (1 - R) x slots so far minus those replaced
        self.replaced = self.slots = 0  # over the predictor's life (what the test of the dithering reads)

    def scores(self, state, h):
        raise ValueError(f"{self.name} reads each layer's own routing: it can only be executed (mode speculative)")

    def next_token_scores(self, x):
        return None

    def proposed(self, pos: int, router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sparse layer `pos`'s router chose `ids` [T, K] from `logits`: the [T, E] scores of what to execute."""
        experts = self.layers[pos].num_experts
        if self.recall >= 1 or not in_range(pos, len(self.layers), self.range):
            return ranked_scores(ids, experts)
        k = ids.shape[1]
        chosen = ids.tolist()
        ranking = None
        if self.errors == "near":  # every expert of every row, best first by the router's own selection rule
            ranking = self.family.selection_scores(router, logits).argsort(dim=-1, descending=True).tolist()
        share = k * (1 - self.recall)  # experts to replace per token, on average
        fewest = math.floor(share)
        draws = torch.rand(len(chosen), generator=self.generator).tolist()
        for row, (selected, u) in enumerate(zip(chosen, draws)):
            # floor(share) or one more, the one more more likely the more is owed: the run's total stays within one
            # expert of its target, and no token loses more of its choice than the level implies
            n = min(k, fewest + (u < share - fewest + self.owed))
            self.owed += share - n
            self.slots += k
            self.replaced += n
            if n:
                chosen[row] = self._replace(selected, n, experts, None if ranking is None else ranking[row])
        return ranked_scores(torch.tensor(chosen, device=ids.device), experts)

    def _replace(self, selected: list[int], n: int, experts: int, ranking: list[int] | None) -> list[int]:
        """`selected` with `n` of its experts replaced by experts it lacks, each in the slot it took."""
        taken = set(selected)
        if ranking is not None:  # near: the lowest-ranked selected give way to the best unselected
            order = {e: i for i, e in enumerate(ranking)}
            slots = sorted(range(len(selected)), key=lambda s: order[selected[s]])[-n:]
            spares = [e for e in ranking if e not in taken][:n]
        else:
            slots = torch.randperm(len(selected), generator=self.generator)[:n].tolist()
            unselected = [e for e in range(experts) if e not in taken]
            spares = [unselected[i] for i in torch.randperm(len(unselected), generator=self.generator)[:n].tolist()]
        out = list(selected)
        for slot, spare in zip(slots, spares):
            out[slot] = spare
        return out

