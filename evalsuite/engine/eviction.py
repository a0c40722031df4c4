"""Eviction orders of the expert cache, one class per `cache_policy`.

Each keeps the used (confirmed) experts of one pool and yields them in eviction order, lazily,
from the cheap end: `add` (placed by a demand load), `remove`, `touch` (used), `serving` (a
demand load of that layer is being served), `candidates()` (eviction order), iteration (all),
and `memento(key)` / `restore(key, memento)`: put an evicted expert back at the eviction end
it was taken from (a cancelled prefetch gives back the victim whose slot it never wrote).
"""
from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict


class Recency:
    """lru: the least recently used expert first."""

    def __init__(self, layers):
        self.keys: OrderedDict = OrderedDict()  # least recent first

    def add(self, key) -> None:
        self.keys[key] = None

    def remove(self, key) -> None:
        del self.keys[key]

    def touch(self, key) -> None:
        self.keys.move_to_end(key)

    def serving(self, layer) -> None:
        pass

    def memento(self, key):
        return None

    def restore(self, key, memento) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key, last=False)

    def candidates(self):
        return iter(self.keys)

    def __iter__(self):
        return iter(self.keys)


class Frequency:
    """lfu: the expert used fewest times first (counts kept across evictions), least recent among equals.

    One bucket per use count, each in recency order (a key enters a bucket only when placed or
    used, so always at its most recent end), and the counts that have a bucket, sorted."""

    def __init__(self, layers):
        self.uses: dict = {}  # key -> times used
        self.buckets: dict = {}  # count -> OrderedDict of resident keys, least recent first
        self.counts: list = []  # counts with a non-empty bucket, ascending

    def add(self, key) -> None:
        count = self.uses.get(key, 0)
        if count not in self.buckets:
            self.buckets[count] = OrderedDict()
            bisect.insort(self.counts, count)
        self.buckets[count][key] = None

    def remove(self, key) -> None:
        count = self.uses.get(key, 0)
        bucket = self.buckets[count]
        del bucket[key]
        if not bucket:
            del self.buckets[count]
            del self.counts[bisect.bisect_left(self.counts, count)]

    def touch(self, key) -> None:
        self.remove(key)
        self.uses[key] = self.uses.get(key, 0) + 1
        self.add(key)

    def serving(self, layer) -> None:
        pass

    def memento(self, key):
        return None  # its use count is kept across evictions

    def restore(self, key, memento) -> None:
        self.add(key)
        self.buckets[self.uses.get(key, 0)].move_to_end(key, last=False)

    def candidates(self):
        for count in self.counts:
            yield from self.buckets[count]

    def __iter__(self):
        return self.candidates()


class LayerDistance:
    """least-stale: decoding visits the sparse layers in a cycle, once per token, so staleness is
    counted in visits of an expert's own layer: the visits of that layer since the expert was last
    used (0: used at its layer's latest visit). The stalest expert goes first. Among equally stale
    ones, the one whose layer is needed furthest ahead: when layer p is served, layer q runs next
    (q - p) mod L layers later, so p's own experts go first, then p-1's, ..., p+1's last; then the
    least recently used. The layer served is the one of the latest demand load or use."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.by_layer = {layer: OrderedDict() for layer in self.layers}  # key -> visit of its last use, oldest first
        self.visits = dict.fromkeys(self.layers, 0)  # visits of each layer so far
        self.current = None  # the layer being served

    def add(self, key) -> None:
        self.by_layer[key[0]][key] = self.visits[key[0]]

    def remove(self, key) -> None:
        del self.by_layer[key[0]][key]

    def touch(self, key) -> None:
        self.serving(key[0])
        keys = self.by_layer[key[0]]
        keys[key] = self.visits[key[0]]
        keys.move_to_end(key)

    def serving(self, layer) -> None:
        if layer != self.current:  # a new visit of `layer`
            self.current = layer
            self.visits[layer] += 1

    def memento(self, key):
        return self.by_layer[key[0]][key]  # the visit of its last use

    def restore(self, key, memento) -> None:
        keys = self.by_layer[key[0]]
        keys[key] = memento
        keys.move_to_end(key, last=False)

    def stream(self, layer, ahead: int):
        """(-staleness, layers until needed, order, key) of `layer`'s experts, eviction order first."""
        visits = self.visits[layer]
        return ((last - visits, ahead, i, key) for i, (key, last) in enumerate(self.by_layer[layer].items()))

    def candidates(self):
        count, here, visits, position = len(self.layers), self.position.get(self.current, 0), self.visits, self.position
        special, best, layers = self.special(), None, []
        for layer, keys in self.by_layer.items():  # the best of the layers' first entries: usually the victim
            if keys:
                ahead = (here - position[layer]) % count
                layers.append((layer, ahead))
                if layer in special:
                    first = next(self.stream(layer, ahead))
                else:
                    for key, last in keys.items():
                        first = (last - visits[layer], ahead, 0, key)
                        break
                if best is None or first < best:
                    best = first
        if best is None:
            return
        yield best[3]
        for *_, key in heapq.merge(*(self.stream(layer, ahead) for layer, ahead in layers)):
            yield key

    def special(self) -> dict:
        """Layers whose `stream` differs from the plain one."""
        return {}

    def __iter__(self):
        for keys in self.by_layer.values():
            yield from keys


class Predicted(LayerDistance):
    """predicted: least-stale, with the predictor's view of the coming layers applied ahead of
    time. For a layer the predictor has candidates for (`ExpertCache.predict`), an expert it does
    not name is counted as if that layer's coming visit had already passed without it (one visit
    staler), and the experts it names as used there (staleness 0), lowest score evicted first.
    Layers without a prediction are ordered as in least-stale, so with none this is least-stale."""

    def __init__(self, layers):
        super().__init__(layers)
        self.predictions: dict = {}  # layer -> {expert: score}

    def special(self) -> dict:
        return self.predictions

    def stream(self, layer, ahead: int):
        scores = self.predictions.get(layer)
        if scores is None:
            return super().stream(layer, ahead)
        return self._predicted_stream(layer, ahead, scores)

    def _predicted_stream(self, layer, ahead, scores):
        visits, keys = self.visits[layer], self.by_layer[layer]
        for i, (key, last) in enumerate(keys.items()):
            if key[1] not in scores:
                yield (last - visits - 1, ahead, i, key)
        named = sorted((scores[key[1]], i, key) for i, key in enumerate(keys) if key[1] in scores)
        for rank, (_, _, key) in enumerate(named):  # sorted only once the search gets this far
            yield (0, ahead, rank, key)


ORDERS = {"lru": Recency, "lfu": Frequency, "least-stale": LayerDistance, "predicted": Predicted}
POLICIES = tuple(ORDERS)
