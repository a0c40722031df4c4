"""Synthetic routing traces: a model's shape with a recorded run's reuse, recall and predicted reuse.

The routing: each layer keeps each of its previous step's experts with probability `reuse` and
draws the rest uniformly from the others (so the measured reuse, RoutingTrace.reuse, is `reuse`
plus chance re-draws). The prediction has one stickiness σ, which models a predictor that is a
smooth function of the hidden state:

- a native expert that the layer also chose at the previous step keeps its previous hit/miss
  status with probability σ, and is otherwise a hit with probability `recall`; every other
  native expert is a hit with probability `recall`. Recall stays `recall` for any σ.
- the rest of the top-k are wrong guesses: each of the previous step's predictions that is not
  native now (a wrong guess then, or a hit the routing has since left) is repeated with
  probability σ, in its rank order; the slots left are drawn uniformly from the non-native
  experts.

σ is solved so that the predicted set's measured reuse (RoutingTrace.predicted_reuse) is the one
asked, by bisection on a calibration chain with a fixed seed. Without `predicted_reuse` it is the
routing's measured reuse: a predictor whose set is as sticky as the routing, which is what
speculative execution needs to keep on-demand's cache reuse; a trained predictor is usually
stickier (see docs/performance.md). σ = 0 and σ = 1 bound what this model can reach: a target
outside is met as closely as it allows and the trace's meta says so ("predicted_reuse_reached").
"""
from __future__ import annotations

import random
from functools import lru_cache

from ..engine.trace import LayerRouting, RoutingTrace

CALIBRATION_STEPS = 8000  # one chain: its predicted reuse is within about 0.005 of the mean
BISECTIONS = 10  # σ to 0.001


def synthetic_trace(experts: int, top_k: int, layers: int, steps: int, reuse: float, recall: float,
                    seed: int = 0, predicted_reuse: float | None = None) -> RoutingTrace:
    """A trace for a model no run has recorded (the model is described in this module's docstring).

    `reuse` is the probability that a layer keeps an expert from one step to the next; `recall`
    and `predicted_reuse` are the measured shares RoutingTrace.recall / .predicted_reuse of a
    recorded trace. Every layer is predicted but the first step's first one, as the engine does
    (the first sparse layer is predicted across the token boundary). The routing depends on
    `seed` only, not on the prediction's parameters, so traces that differ in recall or predicted
    reuse replay the same routing.
    """
    routing_reuse, lowest, highest = (_chain_reuse(experts, top_k, reuse, recall, s) for s in (None, 0.0, 1.0))
    target = routing_reuse if predicted_reuse is None else predicted_reuse
    sticky = _stickiness(experts, top_k, reuse, recall, target, lowest, highest)
    routing_rng, rng = random.Random(seed), random.Random(f"prediction {seed}")
    chains = [_Chain.start(experts, top_k, recall, routing_rng, rng) for _ in range(layers)]
    meta = {"synthetic": True, "reuse": reuse, "recall": recall, "predicted_reuse": target,
            "stickiness": sticky, "seed": seed}
    if not lowest <= target <= highest:
        meta["predicted_reuse_reached"] = lowest if target < lowest else highest
    trace = RoutingTrace(list(range(layers)), experts, top_k, meta=meta)
    for index in range(steps):
        step = []
        for pos, chain in enumerate(chains):
            chain.advance(reuse, recall, sticky, routing_rng, rng)
            # the first layer is predicted from the previous step, so not at the first one
            step.append(LayerRouting(sorted(chain.native), None,
                                     list(chain.predicted) if pos > 0 or index > 0 else None))
        trace.steps.append(step)
    return trace


class _Chain:
    """One layer's routing and prediction from step to step."""

    def __init__(self, experts: int, top_k: int, native: list[int], hit: dict[int, bool], predicted: list[int]):
        self.experts, self.top_k = experts, top_k
        self.native, self.hit, self.predicted = native, hit, predicted

    @classmethod
    def start(cls, experts, top_k, recall, routing_rng, rng) -> "_Chain":
        native = _draw(routing_rng, experts, top_k, set())
        hit = {e: rng.random() < recall for e in native}
        predicted = [e for e in native if hit[e]]
        return cls(experts, top_k, native, hit, predicted + _draw(rng, experts, top_k - len(predicted), set(native)))

    def advance(self, reuse, recall, sticky, routing_rng, rng) -> None:
        kept = [e for e in self.native if routing_rng.random() < reuse]
        native = kept + _draw(routing_rng, self.experts, self.top_k - len(kept), set(kept))
        hit = {e: self.hit[e] if e in self.hit and rng.random() < sticky else rng.random() < recall
               for e in native}
        hits = [e for e in native if hit[e]]
        slots = self.top_k - len(hits)
        repeated = [e for e in self.predicted if e not in hit and rng.random() < sticky][:slots]
        fresh = _draw(rng, self.experts, slots - len(repeated), set(native) | set(repeated))
        self.native, self.hit, self.predicted = native, hit, hits + repeated + fresh


def _draw(rng: random.Random, experts: int, count: int, taken: set[int]) -> list[int]:
    """`count` distinct experts (as many as there are), uniformly, none of them in `taken`, by
    rejection: a layer's top-k is a small share of its experts."""
    drawn: list[int] = []
    count = min(count, experts - len(taken))  # a prediction of 3 in 4 experts has no 3 wrong ones
    while len(drawn) < count:
        e = rng.randrange(experts)
        if e not in taken:
            taken.add(e)
            drawn.append(e)
    return drawn


@lru_cache(maxsize=256)
def _chain_reuse(experts: int, top_k: int, reuse: float, recall: float, sticky: float | None) -> float:
    """The predicted set's measured reuse on a calibration chain with stickiness `sticky`, or
    (sticky None) the routing's, which does not depend on it."""
    routing_rng, rng = random.Random("calibration routing"), random.Random("calibration prediction")
    chain = _Chain.start(experts, top_k, recall, routing_rng, rng)
    shared = 0
    for _ in range(CALIBRATION_STEPS):
        before = set(chain.native if sticky is None else chain.predicted)
        chain.advance(reuse, recall, 0.0 if sticky is None else sticky, routing_rng, rng)
        shared += len(before & set(chain.native if sticky is None else chain.predicted))
    return shared / (CALIBRATION_STEPS * top_k)


def _stickiness(experts, top_k, reuse, recall, target, lowest, highest) -> float:
    if target <= lowest:
        return 0.0
    if target >= highest:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if _chain_reuse(experts, top_k, reuse, recall, middle) < target else (low, middle)
    return (low + high) / 2
