"""What the prefetch scheduler's tests give it in place of an engine, and predictions ranked in a given order."""
from types import SimpleNamespace

import torch

from evalsuite.engine.prediction.scheduler import ranked


class FakeEngine:
    """What the scheduler reads: one sparse layer (index 7) of 8 experts, a 1 s-per-copy link."""

    def __init__(self, prefetches_queued=0):
        self.stalled_s = 0.0  # the engine's stall total
        self.missed = 0  # its demand loads
        self.layers = [SimpleNamespace(index=7, top_k=2), SimpleNamespace(index=7, top_k=2)]
        self.cache = SimpleNamespace(resident=lambda key: False, victim_regret=lambda: 0.0, spare=lambda layer: 0)
        self.transfers = SimpleNamespace(seconds_per_transfer=lambda: 1.0, prefetches_queued=lambda: prefetches_queued,
                                         chunk_bytes=10, chunk_s=None)
        self.layout = SimpleNamespace(nbytes=1000)  # a chunk is 10 ms of the link
        self.prefetch_cost_s = None  # issuing a prefetch costs the compute thread nothing
        self.demand_cost_s = None  # unmeasured: a right prefetch spares what it costs
        self.sent = []

    def prefetch(self, layer, experts, keep=()):
        self.sent.append(list(experts))
        return len(experts)

    def miss_rate(self, layer):
        return 1.0  # its cache holds nothing


def scores_ranking(order, rows=1):
    """Router scores (`rows` tokens) whose confidence ranks the experts in `order`."""
    s = torch.zeros(rows, 8)
    for rank, e in enumerate(order):
        s[:, e] = 10.0 - rank
    return s


def candidates(order):
    return ranked(scores_ranking(order), 2)
