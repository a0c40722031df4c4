"""Synthetic routing traces: a real model's shape with the statistics of a recorded run.

Recorded traces (`offload(..., trace=True)`) are the engine's: evalsuite.engine.trace.
"""
from __future__ import annotations

import random

from ..engine.trace import VERSION, LayerRouting, RoutingTrace, TraceRecorder  # noqa: F401  (re-exported for perf)


def synthetic_trace(experts: int, top_k: int, layers: int, steps: int, reuse: float, recall: float,
                    seed: int = 0) -> RoutingTrace:
    """A trace for a model no run has recorded, with given temporal reuse and predictor recall.

    Each layer keeps each of its previous step's experts with probability `reuse` and draws the
    rest uniformly; the prediction contains each native expert with probability `recall`
    and fills up with wrong guesses, which repeat the layer's previous wrong guesses with
    probability `reuse` (a predictor's mistakes are as sticky as the routing) and are drawn
    uniformly otherwise. Every layer is predicted but the first step's first one, as the engine
    does (the first sparse layer across the token boundary). Use the reuse and recall measured on a recorded trace
    (RoutingTrace.reuse / .recall) to carry a run's statistics to real shapes.
    """
    rng = random.Random(seed)
    previous = [rng.sample(range(experts), top_k) for _ in range(layers)]
    wrong_before: list[list[int]] = [[] for _ in range(layers)]
    trace = RoutingTrace(list(range(layers)), experts, top_k,
                         meta={"synthetic": True, "reuse": reuse, "recall": recall, "seed": seed})
    for _ in range(steps):
        step = []
        for pos in range(layers):
            kept = [e for e in previous[pos] if rng.random() < reuse]
            rest = [e for e in range(experts) if e not in kept]
            native = sorted(kept + rng.sample(rest, top_k - len(kept)))
            predicted = None
            if pos > 0 or trace.steps:  # the first layer is predicted from the previous step
                hit = [e for e in native if rng.random() < recall]
                sticky = [e for e in wrong_before[pos] if e not in native and rng.random() < reuse]
                wrong = sticky[: top_k - len(hit)]
                others = [e for e in range(experts) if e not in native and e not in wrong]
                wrong += rng.sample(others, top_k - len(hit) - len(wrong))
                predicted, wrong_before[pos] = hit + wrong, wrong
            step.append(LayerRouting(native, None, predicted))
            previous[pos] = native
        trace.steps.append(step)
    return trace
