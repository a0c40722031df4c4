"""Benchmark: does the emulated link move N bytes in N/B, and does a prefetch overlap compute?

Part 1 streams expert-sized copies through each emulated link and prints measured time over
the link's nominal time (N/B plus per-transfer latency). A link faster than this machine's own
memory copy cannot be emulated faithfully; the host copy bandwidth is printed next to it.
Part 2 decodes with a Qwen3-MoE-shaped model in on-demand mode, and again with an oracle that
prefetches layer l+1's experts (recorded in a resident run) just before layer l computes. The
prefetch overlaps with layer l's compute, so stall time drops. Runs are interleaved and
repeated; medians are printed. Usage: python bench/transfer_overlap.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import evalsuite
from evalsuite.engine.arch import sparse_layers
from evalsuite.zoo.tiny import tiny_model
from evalsuite.engine.link.profiles import LINKS, parse_link
from evalsuite.engine.link.worker import TransferWorker


class RowStore:
    def __init__(self, rows):
        self.rows = rows

    def copy_into(self, key, dst):
        dst.copy_(self.rows[key])


def link_accuracy(repeats: int) -> None:
    expert = torch.randn(1 << 20)  # 4 MiB of float32, about one Qwen3-30B-A3B expert in bf16
    dst = torch.empty(8, expert.numel())
    start = time.perf_counter()
    for _ in range(20):
        dst[0].copy_(expert)
    host_gbs = 20 * expert.nbytes / (time.perf_counter() - start) / 1e9
    print(f"host memory copy: {host_gbs:.1f} GB/s (links faster than this cannot be emulated)\n")
    print(f"{'link':<12}{'GB/s':>8}{'MB moved':>10}{'nominal ms':>12}{'measured ms':>13}{'ratio':>8}")
    for name in ("sdcard", "ufs3", "ufs4", "4GB/s", "pcie3", "pcie4"):
        link = parse_link(name)
        count = 2 if name == "sdcard" else 8
        nominal = count * link.seconds(expert.nbytes)
        measured = []
        for _ in range(repeats):
            worker = TransferWorker(RowStore({i: expert for i in range(count)}), torch.device("cpu"), link)
            t0 = time.perf_counter()
            for t in [worker.submit(i, dst[i]) for i in range(count)]:
                t.wait(timeout=60)
            measured.append(time.perf_counter() - t0)
            worker.close()
        m = statistics.median(measured)
        print(f"{name:<12}{link.bandwidth / 1e9:>8.2f}{count * expert.nbytes / 1e6:>10.1f}{nominal * 1e3:>12.2f}"
              f"{m * 1e3:>13.2f}{m / nominal:>8.3f}")


def record_routing(model, ids, new_tokens):
    """Experts each sparse layer chose at every forward pass of a greedy generation."""
    trace, hooks = {}, []
    for layer in sparse_layers(model):
        trace[layer.index] = []
        hooks.append(layer.router.register_forward_hook(
            lambda mod, inp, out, i=layer.index: trace[i].append(torch.unique(out[2]).tolist())))
    model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for h in hooks:
        h.remove()
    return trace


def decode(model, ids, new_tokens, link, capacity, trace=None):
    run = copy.deepcopy(model)
    engine = evalsuite.offload(run, cache_capacity=capacity, link=link)
    hooks = []
    if trace is not None:  # oracle: before layer l runs, prefetch what layer l+1 will use
        order = [l.index for l in engine.layers]
        layers = run.model.layers
        for here, nxt in zip(order, order[1:]):
            hooks.append(layers[here].register_forward_pre_hook(_prefetcher(engine, nxt, iter(trace[nxt]))))
    with torch.no_grad():
        out = run.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    stats = engine.stats()
    engine.close()
    return out, stats


def _prefetcher(engine, layer, calls):
    def hook(module, args):  # returns None, so the layer's inputs are left alone
        engine.prefetch(layer, next(calls))
    return hook


def overlap(repeats: int, link: str, capacity: float, new_tokens: int) -> None:
    model = tiny_model("qwen3_moe", hidden_size=512, moe_intermediate_size=512, num_experts=16,
                       num_hidden_layers=4, num_attention_heads=8, head_dim=64, vocab_size=512)
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        trace = record_routing(model, ids, new_tokens)
    expert_mb = sparse_layers(model)[0].experts.gate_up_proj[0].nbytes * 1.5 / 1e6
    results = {"on-demand": [], "oracle prefetch": []}
    for _ in range(repeats):  # interleaved, so drift of the machine hits both alike
        for name, tr in (("on-demand", None), ("oracle prefetch", trace)):
            out, stats = decode(model, ids, new_tokens, link, capacity, tr)
            assert torch.equal(out, reference), "prefetching changed the output"
            results[name].append(stats)
    print(f"\ndecode {new_tokens} tokens, Qwen3-MoE shapes (hidden 512, 16 experts of {expert_mb:.1f} MB, top-2), "
          f"link {link}, cache {capacity:.0%} of experts, median of {repeats}")
    print(f"{'mode':<18}{'TPOT ms':>9}{'stall ms/token':>16}{'hit rate':>10}{'MB moved':>10}")
    base = None
    for name, runs in results.items():
        tpot = statistics.median(s["tpot_ms"]["median"] for s in runs)
        stall = statistics.median(s["stall_s"] / s["tokens"] * 1e3 for s in runs)
        hit = statistics.median(s["hit_rate"] for s in runs)
        moved = statistics.median(s["bytes_transferred"] / 1e6 for s in runs)
        print(f"{name:<18}{tpot:>9.2f}{stall:>16.2f}{hit:>10.3f}{moved:>10.1f}")
        base = base or (tpot, stall)
    print(f"oracle/on-demand: TPOT x{tpot / base[0]:.2f}, stall x{stall / base[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link", default="ufs4", choices=sorted(LINKS))
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core computes, the other serves the link
    link_accuracy(args.repeats)
    overlap(args.repeats, args.link, args.capacity, args.tokens)


if __name__ == "__main__":
    main()
