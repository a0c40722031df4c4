"""Benchmark: how much slower this CPU computes right after the compute thread waited for a copy.

The bench's speed factor times the sparse layers' attention (SpeedProbe), which is the first work a
decode step does after the previous layer's waits. This times a small piece of decode-like work (eight
[1, 128] x [128, 128] linears, a tiny model's attention at batch 1) right after each kind of wait, the
kinds interleaved round by round, and prints the median, its interquartile range and the ratio to no wait.

    python bench/after_wait.py [--rounds 400] [--wait-ms 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--wait-ms", type=float, default=3.0, help="a tiny expert's SD-card copy is 3.2 ms")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wait = args.wait_ms / 1e3
    weights = [torch.randn(128, 128) for _ in range(8)]
    x = torch.randn(1, 128)
    store, slots = torch.randn(64, 49152), torch.empty(16, 49152)  # 196 KB experts, as tiny-qwen3-moe's

    def work() -> float:
        start = time.perf_counter()
        y = x
        for w in weights:
            y = F.linear(y, w)
        return time.perf_counter() - start

    waits = {
        "no wait": lambda i: None,
        f"spun {args.wait_ms:g} ms": lambda i: spin(wait),
        f"slept {args.wait_ms:g} ms": lambda i: time.sleep(wait),
        "one expert copied": lambda i: slots[i % 16].copy_(store[i % 64]),
        f"spun {args.wait_ms / 10:g} ms": lambda i: spin(wait / 10),
    }
    for _ in range(50):  # warm-up
        work()
    seconds = {name: [] for name in waits}
    for i in range(args.rounds):
        for name, wait_for in waits.items():
            wait_for(i)
            seconds[name].append(work())
    base = statistics.median(seconds["no wait"])
    print(f"{'before the work':<20} {'median us':>10} {'IQR us':>14} {'/ no wait':>10}")
    for name, s in seconds.items():
        q1, med, q3 = np.percentile(s, [25, 50, 75]) * 1e6
        print(f"{name:<20} {med:>10.1f} {q1:>6.1f}-{q3:<7.1f} {med / 1e6 / base:>10.2f}")


if __name__ == "__main__":
    main()
