"""One definition of every metric evalsuite reports.

expert use     one expert executed by one sparse layer in one forward pass, however many tokens
               it serves (a decode step of batch 1 with top-k routing makes k uses per layer).
hit            an expert use whose expert was already in the device cache, or on its way there
               from a prefetch (no new transfer).
miss           an expert use that started a transfer; hits + misses = uses.
prefetch       a transfer started ahead of need; bytes transferred = (misses + prefetches) x
               expert bytes (what was asked of the link: a cancelled prefetch counts whole).
prefetch precision  prefetched experts later used while resident / prefetches; a prefetched
               expert evicted before any use is a wasted transfer. Cancelled prefetches stay
               in the denominator (they were issued and took link time), not in wasted.
prefetch cancelled  a prefetch whose copy was still queued or moving when its layer's router
               chose experts without it: the copy was dropped or stopped at a chunk boundary
               and its slot given back (prefetched-but-landed experts are never cancelled).
victims restored  cancelled prefetches whose copy had not started: the used expert they had
               evicted got its slot (and its place in the eviction order) back.
recall@k       the SpecPrefetch recall: |top-k(predicted) ∩ top-K(native router)| / K for one prediction
               (recall_of_top, which token_recall and ranked_recall call), K the router's top-k. Scored per
               DECODE token (prefill excluded) and per anchor layer l -> target l+h (h the horizon, 1 by
               default) WITHIN the token; averaged within a sample over its decode tokens x anchor layers
               (per target layer over the sample's decode tokens, then over its target layers: every decode
               token has one prediction per target layer), then across samples. k runs over `recall_ks`: the
               reference's k in {3, 6, 8} at K = 6 kept as fractions of K, {K/2, K, 4K/3} rounded to the
               nearest integer (halves up), at least 1, at most the number of experts, de-duplicated (K = 2:
               1, 2, 3; K = 4: 2, 4, 5; K = 6: 3, 6, 8; K = 8: 4, 8, 11); or the engine's `recall_k` with K
               always among them. recall@K is the headline.
exact@K        per decode token and within-token target layer, 1 where top-K(predicted) == top-K(native) as
               sets (the whole top-K set predicted), else 0; averaged as recall@k.
recall_next_token@K  the prediction a decode token's last sparse layer makes for the NEXT token's first
               sparse layer (across the token boundary, which SpecPrefetch does not predict): scored as
               recall@K, averaged the same way, reported on its own and never in recall@k's mean.
divergence     per sample, against the resident run's greedy generation: the first generated
               position whose token differs (None if none) and the share of positions with
               identical tokens (over the longer of the two generations).
hit rate       hits / uses.
stall          wall time the compute waited for expert transfers to land (`stall_s`; `decode_stall_s`: the
               part of it in decode steps).
stall per token  the part of TPOT spent waiting: a request's decode stall over its decode steps, weighted
               by its sequences as TPOT is (a batch's wait delays each of its rows); the prefill's stall
               is in TTFT.
TTFT           time to first token: wall time of a request's first forward pass (the prefill).
TPOT           time per output token of one sequence: (end of the last forward - end of the first)
               / (n - 1) for a request whose generation ran n forward passes (each gives every
               sequence of its batch one token); requests with n = 1 have none. Summaries count
               each sequence of a batched request once (a batch of 4 is 4 samples of its TPOT)
               and give median, mean, and the 10th and 90th percentiles (the spread).
token kind     "image" for positions holding the model's image or video token, "text" for the
               rest (vision-language models only). Hit rate by kind: over (token, routed
               expert) pairs of that kind, the share whose expert was a hit at that layer in
               that forward pass (prefill and decode). Recall@k and exact@K by kind: the definitions
               above (decode tokens, within-token target layers, within a sample then across samples) over
               the sample's decode tokens of that kind; image tokens exist only in prefill, so a
               vision-language model's image kind has none (None) and its text kind equals the headline.
per sample     each row of a request (one sequence of a batch) is one sample: its own recall@k, exact@K and
               recall_next_token@K per target layer (over its decode tokens) and the mean over its layers
               (a sample with no decode token has none and is left out); the request's hit rate and
               TPOT; the request's bytes transferred shared equally among its rows (an expert a batch
               fetches serves every row of it). With batch size 1 a sample's numbers are its request's.
Request-level values are summarised across requests by mean and median.

Where they are reported: a summary's "recall" {k: ...}, "exact" {K: ...} and "recall_next_token" {K: ...}, each
{"mean": across samples, "layers": {target layer: mean over samples}, "samples"}, and "top_k" (K); lm-eval's
`recall@k,engine`, `exact@K,engine`, `recall_next_token@K,engine` (by kind `text_recall@k,engine`, ...); the
results database's engine_metrics rows (recall_at_k at each k; exact_at_k and recall_next_token on the rows of
k = top_k).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

RECALL, EXACT, NEXT_TOKEN = "recall", "exact", "recall_next_token"
SCORES = (RECALL, EXACT, NEXT_TOKEN)  # what a prediction is scored by (the module docstring), in report order
NAN = float("nan")


@dataclass
class Counters:
    """Engine counters of one sparse layer (or the sum of all)."""

    expert_uses: int = 0
    hits: int = 0
    misses: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    victims_restored: int = 0
    bytes_transferred: int = 0
    stall_s: float = 0.0
    decode_stall_s: float = 0.0  # the part of stall_s in decode steps

    def add(self, other: "Counters") -> "Counters":
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def since(self, before: "Counters") -> "Counters":
        """What was counted after `before` (an earlier copy of these counters) was taken."""
        return Counters(**{name: getattr(self, name) - getattr(before, name) for name in self.__dataclass_fields__})

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["hit_rate"] = hit_rate(self.hits, self.expert_uses)
        out["prefetch_precision"] = self.prefetch_used / self.prefetches if self.prefetches else None
        return out


@dataclass
class RequestRecord:
    """One request (one prefill, then one forward pass per decode step): when its forward passes ended, the
    engine's counters over it, and the recall@k of each of its rows."""

    start: float
    rows: int = 1  # sequences in the batch
    ends: list[float] = field(default_factory=list)
    counters_before: Counters = field(default_factory=Counters)  # the record's totals when it began
    counters: Counters | None = None  # its own; None while it is the record's running request
    # metric ("recall", "exact", "recall_next_token") -> k -> target layer -> per row (NaN: none for that row)
    scores: dict[str, dict[int, dict[int, list[float]]]] = field(default_factory=dict)
    labels: list | None = None  # what each row is, as the caller names it (label_last_request)

    @property
    def recall(self) -> dict[int, dict[int, list[float]]]:
        """recall@k: k -> target layer -> per row."""
        return self.scores.setdefault(RECALL, {})

    @property
    def tokens(self) -> int:
        return self.rows * len(self.ends)

    @property
    def ttft_s(self) -> float:
        return self.ends[0] - self.start

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.ends)


@dataclass
class KindCounts:
    """Hits and recall split by token kind (see the module docstring)."""

    hits: dict = field(default_factory=dict)  # kind -> [hits, uses]
    scores: dict = field(default_factory=dict)  # kind -> metric -> k -> layer -> per sample (as EngineRecord.scores)

    def add_hits(self, kind: str, hits: int, uses: int) -> None:
        total = self.hits.setdefault(kind, [0, 0])
        total[0] += hits
        total[1] += uses

    def add_scores(self, kind: str, per_row: dict) -> None:
        """One request's rows, scored over their decode tokens of `kind`: metric -> k -> layer -> per row."""
        add_samples(self.scores.setdefault(kind, {}), per_row)

    def merge(self, other: "KindCounts") -> "KindCounts":
        for kind, (h, u) in other.hits.items():
            self.add_hits(kind, h, u)
        for kind, scores in other.scores.items():
            merge_scores(self.scores.setdefault(kind, {}), scores)
        return self

    def summary(self) -> dict | None:
        kinds = set(self.hits) | set(self.scores)
        if not kinds:
            return None
        keys = sorted({(metric, k) for scores in self.scores.values() for metric, ks in scores.items() for k in ks},
                      key=lambda key: (SCORES.index(key[0]), key[1]))
        out = {}
        for kind in sorted(kinds):
            h, u = self.hits.get(kind, (0, 0))
            row = {"hit_rate": hit_rate(h, u), "tokens_x_experts": u}
            scores = self.scores.get(kind, {})
            for metric, k in keys:
                layers = scores.get(metric, {}).get(k)
                row[f"{metric}@{k}"] = recall_summary(layers)["mean"] if layers else None
            out[kind] = row
        return out


@dataclass
class EngineRecord:
    """Everything the engine measured over some requests; records merge by concatenation."""

    counters: dict[int, Counters] = field(default_factory=dict)  # sparse layer -> counters
    requests: list[RequestRecord] = field(default_factory=list)
    # metric ("recall", "exact", "recall_next_token") -> k -> target layer -> per sample, aligned across layers
    # (sample i of every layer is the same sample; NaN where it had no prediction there)
    scores: dict[str, dict[int, dict[int, list[float]]]] = field(default_factory=dict)
    kinds: KindCounts = field(default_factory=KindCounts)
    top_k: int | None = None  # the router's top-k (K): recall@K and exact@K are the headline

    @property
    def recall(self) -> dict[int, dict[int, list[float]]]:
        """recall@k: k -> target layer -> per sample."""
        return self.scores.setdefault(RECALL, {})

    def merge(self, other: "EngineRecord") -> "EngineRecord":
        self.close_request()  # its counters are taken from this record's totals, which now grow
        other.close_request()
        for layer, c in other.counters.items():
            self.counters.setdefault(layer, Counters()).add(c)
        self.requests += other.requests
        merge_scores(self.scores, other.scores)
        self.kinds.merge(other.kinds)
        self.top_k = self.top_k if self.top_k is not None else other.top_k
        return self

    def totals(self) -> Counters:
        total = Counters()
        for c in self.counters.values():
            total.add(c)
        return total

    def start_request(self, start: float, rows: int) -> None:
        """A new request begins (its prefill); the one before it ends."""
        totals = self.totals()
        self.close_request(totals)
        self.requests.append(RequestRecord(start, rows, counters_before=totals))

    def close_request(self, totals: Counters | None = None) -> None:
        """The running request's own counters: what the record counted since it began."""
        if self.requests and self.requests[-1].counters is None:
            self.requests[-1].counters = (totals or self.totals()).since(self.requests[-1].counters_before)

    def counters_of(self, request: RequestRecord) -> Counters:
        """A request's own counters (the running one's: so far)."""
        return request.counters or self.totals().since(request.counters_before)

    def add_scores(self, per_row: dict) -> None:
        """The request that just ended, scored per row over its decode steps: metric -> k -> target layer -> per
        row (evalsuite.engine.prediction.request_recall). Its rows become samples; a row with no value anywhere is none."""
        if self.requests:
            request = self.requests[-1].scores
            for metric, ks in per_row.items():
                for k, layers in ks.items():
                    request.setdefault(metric, {}).setdefault(k, {}).update(layers)
        add_samples(self.scores, per_row)

    def label_last_request(self, labels: list) -> None:
        """Name the rows of the latest request (a caller's own ids, one per row), for `per_row`. Labels that do
        not match its rows in number are ignored: its rows then stay unnamed."""
        if self.requests and len(labels) == self.requests[-1].rows:
            self.requests[-1].labels = list(labels)

    def per_row(self) -> list[tuple[object, dict]]:
        """(label, metrics) for every row of every labelled request; see 'per sample' in the module docstring."""
        out = []
        for request in self.requests:
            if request.labels is None:
                continue
            counters = self.counters_of(request)
            shared = {"hit_rate": hit_rate(counters.hits, counters.expert_uses),
                      "bytes_transferred": counters.bytes_transferred / request.rows,
                      "tpot_ms": None if request.tpot_s is None else request.tpot_s * 1e3}
            for row, label in enumerate(request.labels):
                own = {metric: {k: row_recall({layer: values[row] for layer, values in layers.items()})
                                for k, layers in sorted(request.scores.get(metric, {}).items())} or None
                       for metric in SCORES}
                out.append((label, {**own, "top_k": self.top_k, **shared}))
        return out

    def _decode_stall_per_token(self, timed: list[RequestRecord]) -> float | None:
        """ms of decode stall per decode step of a sequence (see 'stall per token'); None without decode steps."""
        steps = sum(r.rows * (len(r.ends) - 1) for r in timed)
        stall = sum(r.rows * self.counters_of(r).decode_stall_s for r in timed)
        return stall * 1e3 / steps if steps else None

    def summary(self, precision_by_construction: bool = False) -> dict:
        """Totals, per-layer counters, timing and recall. `precision_by_construction`: the engine ran a mode whose
        speculating decode layers prefetch exactly the experts they then execute (speculative, hybrid), so its
        prefetch precision is 1.0 by construction, says nothing about the predictor, and is left out (None)."""
        total = self.totals()
        timed = [r for r in self.requests if r.ends]
        tokens = sum(r.tokens for r in timed)
        layers = {layer: c.as_dict() for layer, c in sorted(self.counters.items())}
        if precision_by_construction:
            for counters in layers.values():
                counters["prefetch_precision"] = None
        return {
            **total.as_dict(),
            **({"prefetch_precision": None} if precision_by_construction else {}),
            "requests": len(timed),
            "sequences": sum(r.rows for r in timed),
            "tokens": tokens,
            "bytes_per_token": total.bytes_transferred / tokens if tokens else None,
            "stall_ms_per_token": self._decode_stall_per_token(timed),
            # per sequence: a batched request's time counts once for each of its rows
            "ttft_ms": summarise(r.ttft_s for r in timed for _ in range(r.rows)),
            "tpot_ms": summarise(r.tpot_s for r in timed for _ in range(r.rows)),
            "layers": layers,
            **scores_summary(self.scores),
            "top_k": self.top_k,
            "by_token_kind": self.kinds.summary(),
        }


def recall_ks(top_k: int, experts: int, asked=None) -> tuple[int, ...]:
    """The k recall@k is measured at (see recall@k in the module docstring): `asked` (the engine's recall_k) with
    K = `top_k` added, else the reference's {K/2, K, 4K/3} rounded to the nearest integer (halves up), at least 1;
    at most `experts`, de-duplicated, ascending."""
    if asked:
        wanted = [*asked, top_k]
    else:  # round half up of K/2 and 4K/3, in integers: (2a + b) // 2b rounds a / b
        wanted = [(top_k + 1) // 2, top_k, (8 * top_k + 3) // 6]
    return tuple(sorted({min(max(1, int(k)), experts) for k in wanted}))


def _nan(value) -> bool:
    return value != value


def add_samples(table: dict, per_row: dict) -> None:
    """Add one request's rows as samples to `table` (metric -> k -> layer -> per sample): `per_row` holds, per
    metric and k, layer -> one value per row (NaN: that row had none there). A row with no value at any layer (no
    decode token scored) is no sample; the others are added to every layer of their metric and k, NaN where they
    have none, so sample i of every layer stays the same sample."""
    for metric, ks in per_row.items():
        for k, layers in ks.items():
            rows = max((len(values) for values in layers.values()), default=0)
            kept = [r for r in range(rows) if any(r < len(v) and not _nan(v[r]) for v in layers.values())]
            if kept:
                new = {layer: [values[r] if r < len(values) else NAN for r in kept] for layer, values in layers.items()}
                _extend(table.setdefault(metric, {}).setdefault(k, {}), new, len(kept))


def merge_scores(table: dict, other: dict) -> None:
    """Add `other`'s samples (metric -> k -> layer -> per sample) to `table`'s, keeping each aligned."""
    for metric, ks in other.items():
        for k, layers in ks.items():
            rows = max((len(values) for values in layers.values()), default=0)
            if rows:
                _extend(table.setdefault(metric, {}).setdefault(k, {}), layers, rows)


def _extend(per_layer: dict, new: dict, rows: int) -> None:
    """`rows` more samples in `per_layer` (layer -> per sample): `new`'s values, NaN at a layer it lacks; a layer
    only `new` has gets NaN for the samples before."""
    before = max((len(values) for values in per_layer.values()), default=0)
    for layer in [*per_layer, *(layer for layer in new if layer not in per_layer)]:
        values = per_layer.setdefault(layer, [])
        values.extend([NAN] * (before - len(values)))
        add = new.get(layer, ())
        values.extend(add)
        values.extend([NAN] * (rows - len(add)))



def sample_means(per_layer_samples: dict[int, list[float]]) -> list[float]:
    """Each sample's mean over the target layers it has a value at (the lists are aligned by sample); samples with
    none are left out."""
    lists = list(per_layer_samples.values())
    means = []
    for i in range(max((len(v) for v in lists), default=0)):
        values = [v[i] for v in lists if i < len(v) and not _nan(v[i])]
        if values:
            means.append(sum(values) / len(values))
    return means


def recall_summary(per_layer_samples: dict[int, list[float]]) -> dict:
    """One score (recall@k, exact@K, recall_next_token@K) from its per-sample values per target layer (aligned by
    sample): "mean", over samples of each sample's mean over its layers (the headline: within a sample, then
    across samples); "layers", per target layer the mean over samples; "samples", how many have a value. A NaN is
    a sample that had no prediction at that layer (a row that left its batch before one was made): it is left
    out."""
    known = {layer: [x for x in v if not _nan(x)] for layer, v in sorted(per_layer_samples.items())}
    per_layer = {layer: sum(v) / len(v) for layer, v in known.items() if v}
    means = sample_means(per_layer_samples)
    return {"mean": sum(means) / len(means) if means else None, "layers": per_layer, "samples": len(means)}


def scores_summary(scores: dict) -> dict:
    """The summary of every score of `scores` (metric -> k -> layer -> per sample): {"recall": {k: recall_summary}
    or None, "exact": ..., "recall_next_token": ...}, k ascending."""
    return {metric: {k: recall_summary(layers) for k, layers in sorted(scores.get(metric, {}).items())} or None
            for metric in SCORES}


def row_recall(per_layer: dict[int, float]) -> dict:
    """One sample's recall at each target layer and the mean over its layers (a NaN layer, where the sample had
    no prediction, left out)."""
    per_layer = {layer: value for layer, value in per_layer.items() if not _nan(value)}
    return {"mean": sum(per_layer.values()) / len(per_layer) if per_layer else None,
            "layers": dict(sorted(per_layer.items()))}


def hit_rate(hits: int, uses: int) -> float | None:
    return hits / uses if uses else None


def tpot(ends: list[float]) -> float | None:
    """Time per output token from the end times of a request's forward passes."""
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None


def summarise(values) -> dict:
    """Mean, median, and the 10th and 90th percentiles (the spread) of the values that exist, in ms."""
    values = [v * 1e3 for v in values if v is not None]
    if not values:
        return {"mean": None, "median": None, "p10": None, "p90": None, "n": 0}
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    median = statistics.median(values)
    # the two formulas round differently: around equal values p10 came out one ulp above the median
    return {"mean": statistics.fmean(values), "median": median, "p10": min(deciles[0], median),
            "p90": max(deciles[-1], median), "n": len(values)}


def token_divergence(generated: list[int], reference: list[int]) -> dict:
    """First differing generated position (None if none) and the share of identical positions."""
    n = max(len(generated), len(reference))
    same = [i < len(generated) and i < len(reference) and generated[i] == reference[i] for i in range(n)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {"first_divergence": first, "identical_share": sum(same) / n if n else 1.0}


def recall_of_top(top: torch.Tensor, native_ids: torch.Tensor) -> torch.Tensor:
    """Recall@k per token (SpecPrefetch), the one definition: |top ∩ native top-K| / K, for the
    predicted top-k ids `top` [T, k] (an id below 0 matches nothing) and the router's `native_ids` [T, K]."""
    top = top.to(native_ids.device)
    return (top.unsqueeze(-1) == native_ids.unsqueeze(1)).any(dim=1).sum(dim=-1).float() / native_ids.shape[1]


def exact_of_recall(recall_at_top_k: torch.Tensor) -> torch.Tensor:
    """exact@K per token from its recall@K (K = the router's top-k): 1.0 where top-K(predicted) == top-K(native)
    as sets, which is where every one of the K native experts is among the predicted K (K / K is exactly 1.0)."""
    return (recall_at_top_k == 1.0).to(recall_at_top_k.dtype)


def token_recall(predicted: torch.Tensor, native_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Recall@k per token of predicted scores [T, E]: their top-k against the router's top-K."""
    return recall_of_top(predicted.topk(min(k, predicted.shape[1]), dim=-1).indices, native_ids)


def ranked_recall(ranked: list[list[int]], native: list[list[int]], k: int) -> list[float]:
    """Recall@k of each ranked prediction (a list of expert ids, best first, as a routing trace
    holds them) against the native experts of the same token; a list shorter than k counts what it has."""
    if not ranked:
        return []
    top = torch.tensor([list(ids[:k]) + [-1] * (k - len(ids[:k])) for ids in ranked], dtype=torch.long)
    return recall_of_top(top, torch.tensor(native, dtype=torch.long)).tolist()
