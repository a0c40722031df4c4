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
import itertools
import math
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
    ones, the one used fewest times (counts kept across evictions): a popular expert is likelier
    to be used at its layer's next visit. Then the one whose layer is needed furthest ahead: when
    layer p is served, layer q runs next (q - p) mod L layers later, so p's own experts go first,
    then p-1's, ..., p+1's last; then the least recently used. The layer served is the one of the
    latest demand load or use.

    Per layer, one bucket per visit of last use, each sorted by (uses, sequence), and the visits
    that have a bucket, sorted: a layer's first entry is its eviction candidate."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.buckets = {layer: {} for layer in self.layers}  # visit of last use -> sorted [(uses, seq, key, visit)]
        self.last_visits = {layer: [] for layer in self.layers}  # visits with a bucket, ascending
        self.entry: dict = {}  # resident key -> (visit of its last use, uses then, sequence)
        self.uses: dict = {}  # key -> times used
        self.visits = dict.fromkeys(self.layers, 0)  # visits of each layer so far
        self.current = None  # the layer being served
        self.sequence = itertools.count()

    def _insert(self, key, entry) -> None:
        visit, uses, seq = self.entry[key] = entry
        buckets = self.buckets[key[0]]
        if visit not in buckets:
            buckets[visit] = []
            bisect.insort(self.last_visits[key[0]], visit)
        bisect.insort(buckets[visit], (uses, seq, key, visit))

    def add(self, key) -> None:
        self._insert(key, (self.visits[key[0]], self.uses.get(key, 0), next(self.sequence)))

    def remove(self, key) -> None:
        visit, uses, seq = self.entry.pop(key)
        buckets = self.buckets[key[0]]
        bucket = buckets[visit]
        del bucket[bisect.bisect_left(bucket, (uses, seq))]
        if not bucket:
            del buckets[visit]
            visits = self.last_visits[key[0]]
            del visits[bisect.bisect_left(visits, visit)]

    def touch(self, key) -> None:
        self.serving(key[0])
        self.remove(key)
        self.uses[key] = self.uses.get(key, 0) + 1
        self.add(key)

    def serving(self, layer) -> None:
        if layer != self.current:  # a new visit of `layer`
            self.current = layer
            self.visits[layer] += 1

    def memento(self, key):
        return self.entry[key]  # its place: visit of last use, uses, sequence

    def restore(self, key, memento) -> None:
        self._insert(key, memento)

    def entries(self, layer):
        """(uses, sequence, key, visit of last use) of `layer`'s experts, stalest first, then fewest uses."""
        buckets = self.buckets[layer]
        return itertools.chain.from_iterable(buckets[visit] for visit in self.last_visits[layer])

    def stream(self, layer, ahead: int):
        """(-staleness, uses, layers until needed, sequence, key) of `layer`'s experts, eviction order
        first (sorted: within one visit and use count, the sequence ascends)."""
        visits = self.visits[layer]
        return ((last - visits, uses, ahead, seq, key) for uses, seq, key, last in self.entries(layer))

    def candidates(self):
        """The layers' streams merged lazily: each layer's first entry is known without a stream, and a
        layer's stream is made only when the search gets past that entry (usually none is)."""
        count, here, visits, position = len(self.layers), self.position.get(self.current, 0), self.visits, self.position
        special, heads = self.special(), []
        for n, (layer, last_visits) in enumerate(self.last_visits.items()):
            if last_visits:
                ahead = (here - position[layer]) % count
                if layer in special:
                    stream = self.stream(layer, ahead)
                    heads.append((next(stream), n, layer, ahead, stream))
                else:
                    uses, seq, key, last = self.buckets[layer][last_visits[0]][0]
                    heads.append(((last - visits[layer], uses, ahead, seq, key), n, layer, ahead, None))
        if not heads:
            return
        yield min(heads)[0][4]  # usually the victim; the merge below only when it may not go
        heapq.heapify(heads)  # entries never tie: each carries its unique sequence, or rank and layer
        while True:
            _, n, layer, ahead, stream = heads[0]  # the entry just yielded
            if stream is None:  # past this layer's first entry: its stream, from the second on
                stream = self.stream(layer, ahead)
                next(stream)
            following = next(stream, None)
            if following is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, (following, n, layer, ahead, stream))
            if not heads:
                return
            yield heads[0][0][4]

    def special(self) -> dict:
        """Layers whose `stream` differs from the plain one."""
        return {}

    def __iter__(self):
        return iter(self.entry)


class Predicted(LayerDistance):
    """predicted: least-stale, with the predictor's view of the coming layers applied ahead of
    time. For a layer the predictor has candidates for (`ExpertCache.predict`), an expert it does
    not name is counted as if that layer's coming visit had already passed without it (one visit
    staler), and the experts it names as used there: fresh, kept past every other fresh expert,
    lowest score evicted first. Layers without a prediction are ordered as in least-stale, so with
    none this is least-stale."""

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
        visits, named = self.visits[layer], []
        for uses, seq, key, last in self.entries(layer):
            if key[1] in scores:
                named.append((scores[key[1]], seq, key))  # equal scores: least recent first
            else:
                yield (last - visits - 1, uses, ahead, seq, key)
        for rank, (_, _, key) in enumerate(sorted(named)):  # sorted only once the search gets this far
            yield (0, math.inf, ahead, rank, key)


ORDERS = {"lru": Recency, "lfu": Frequency, "least-stale": LayerDistance, "predicted": Predicted}
POLICIES = tuple(ORDERS)
