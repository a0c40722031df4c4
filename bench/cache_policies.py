"""The expert cache's eviction policies: bookkeeping time per miss, and hit rate on real routing.

(a) Time the cache spends choosing a victim and placing an expert, per miss, at 64 and 1,536
    slots (1,536 is Qwen3-30B-A3B's cache at 25 %): random top-8 routing over 48 sparse layers
    of 128 experts, replayed through `ExpertCache` with the engine's call sequence.
(b) Hit rate of every policy and of Belady's optimum at capacities 0.1 / 0.25 / 0.5 on the
    decode routing of the shipped tiny models (recorded with `offload(..., trace=True)`, gate
    predictor), replayed through `ExpertCache` itself: each request's prefill warms the cache,
    its decode steps are counted.
Usage: python bench/cache_policies.py [--tokens 48] [--prompts 6]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

torch.set_num_threads(1)

import evalsuite  # noqa: E402
from evalsuite.engine.cache.slots import POLICIES, ExpertCache  # noqa: E402
from evalsuite.generate import load_model  # noqa: E402

MODELS = ("models/tiny-qwen3-moe", "models/tiny-glm4-moe")
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Question: 12 + 7 = ? Answer:",
           "Once upon a time, a small robot", "List three colours:", "import numpy as np\nx ="]


def make_cache(layers, capacity: int, policy: str) -> ExpertCache:
    return ExpertCache(layers, capacity, numel=1, dtype=torch.float32, device="cpu", policy=policy)


def access(cache: ExpertCache, layer: int, needed, timed: list | None = None) -> int:
    """One layer's expert uses, as the engine makes them; returns the hits."""
    keys = [(layer, e) for e in needed]
    protect, hits = set(keys), 0
    for key in keys:
        if cache.resident(key):
            hits += 1
        else:
            start = time.perf_counter()
            assert cache.can_place(layer, protect)
            cache.place(key, protect)
            if timed is not None:
                timed.append(time.perf_counter() - start)
        cache.pin(key)
    for key in keys:
        cache.unpin(key)
    return hits


def bookkeeping_us(policy: str, slots: int, layers=48, experts=128, top_k=8, misses=1000) -> float:
    """Median microseconds per miss over `misses` misses of random routing, after a warm-up."""
    rng = random.Random(0)
    cache, timed = make_cache(range(layers), slots, policy), []
    for _ in range(slots // top_k + 2 * layers):  # fill the cache and run two steps
        access(cache, rng.randrange(layers), rng.sample(range(experts), top_k))
    while len(timed) < misses:
        for layer in range(layers):
            access(cache, layer, sorted(rng.sample(range(experts), top_k)), timed)
    timed.sort()
    return timed[len(timed) // 2] * 1e6


def record_trace(path: str, prompts: int, tokens: int):
    model, tokenizer = load_model(path)
    with evalsuite.offload(model, mode="resident", predictor="gate", trace=True) as engine, torch.no_grad():
        for text in PROMPTS[:prompts]:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            model.generate(ids, max_new_tokens=tokens, do_sample=False)
        return engine.routing_trace()


def requests(trace):
    """(prefill experts per layer, decode steps) per request."""
    starts = [start for start, _ in trace.prefills] + [len(trace.steps)]
    return [(per_layer, trace.steps[start:end]) for (start, per_layer), end in zip(trace.prefills, starts[1:])]


def replay(trace, capacity: int, policy: str) -> float:
    """Decode hit rate of `policy` on `trace`, through ExpertCache."""
    cache, hits, uses = make_cache(trace.layers, capacity, policy), 0, 0
    predicts = hasattr(cache, "predict")
    for prefill, steps in requests(trace):
        for layer, experts in zip(trace.layers, prefill):  # one by one: a prefill may need more than fit
            for e in experts:
                access(cache, layer, [e])
        for step in steps:
            for pos, routing in enumerate(step):
                coming = step[pos + 1] if pos + 1 < len(step) else None
                if predicts:  # the prediction made at this layer for the next one, best first
                    ranked = coming.predicted if coming is not None and coming.predicted else []
                    cache.predict({trace.layers[pos + 1]: {e: -rank for rank, e in enumerate(ranked)}}
                                  if ranked else {})
                hits += access(cache, trace.layers[pos], routing.native)
                uses += len(routing.native)
    return hits / uses


def belady(trace, capacity: int) -> float:
    """Decode hit rate of the optimal offline policy (evict the expert needed furthest ahead)."""
    sequence, counted = [], []
    for prefill, steps in requests(trace):
        for layer, experts in zip(trace.layers, prefill):
            for e in experts:
                sequence.append([(layer, e)]), counted.append(False)
        for step in steps:
            for layer, routing in zip(trace.layers, step):
                sequence.append([(layer, e) for e in routing.native]), counted.append(True)
    next_use, upcoming = [], {}
    for i in range(len(sequence) - 1, -1, -1):  # for each group, when each key is used next after it
        next_use.append({key: upcoming.get(key, float("inf")) for key in sequence[i]})
        for key in sequence[i]:
            upcoming[key] = i
    next_use.reverse()
    resident, hits, uses = {}, 0, 0  # key -> its next use
    for i, keys in enumerate(sequence):
        for key in keys:
            if key in resident:
                hits += counted[i]
            elif len(resident) >= capacity:
                victim = max((k for k in resident if k not in keys), key=resident.get)
                del resident[victim]
            resident[key] = next_use[i][key]
        uses += counted[i] * len(keys)
    return hits / uses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    print("(a) bookkeeping per miss, µs (median; 48 layers x 128 experts, top-8, random routing)")
    print(f"{'policy':<12}{'64 slots':>10}{'1536 slots':>12}")
    for policy in POLICIES:
        print(f"{policy:<12}{bookkeeping_us(policy, 64):>10.1f}{bookkeeping_us(policy, 1536):>12.1f}")
    print("\n(b) decode hit rate, replayed through ExpertCache (Belady: the offline optimum)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in MODELS:
        trace = record_trace(os.path.join(root, name), args.prompts, args.tokens)
        total = len(trace.layers) * trace.experts
        print(f"{os.path.basename(name)}: {len(trace.steps)} decode steps, {total} experts, top-{trace.top_k}")
        print(f"{'capacity':<10}" + "".join(f"{p:>13}" for p in POLICIES) + f"{'belady':>13}")
        for fraction in (0.1, 0.25, 0.5):
            capacity = max(trace.top_k, round(fraction * total))
            rates = [replay(trace, capacity, p) for p in POLICIES] + [belady(trace, capacity)]
            print(f"{fraction:<10}" + "".join(f"{r:>13.3f}" for r in rates))


if __name__ == "__main__":
    main()
