"""Benchmark: a model far larger than its memory budget runs offloaded, exactly, from disk.

Writes a random-weight Qwen3-MoE checkpoint with Qwen3-30B-A3B's expert shapes (hidden 2048,
moe_intermediate 768, 128 experts, top-8) and a few layers, in bfloat16, to a temporary
directory (about 1.2 GiB per layer). Then, each in a process of its own:
  full       from_pretrained, greedy generation (the reference tokens)
  offloaded  evalsuite.engine.load_offloaded(store='disk', cache 10 %, device 'cpu'), the same
             generation; its experts are never loaded whole
and prints the bytes, each process's peak RSS (VmHWM), the bound
non-expert bytes + cache bytes + 1 GiB, and whether the tokens are identical. The checkpoint
is deleted at the end. With --expert-bits 8 or 4 the experts are first packed (evalsuite
pack-experts, timed), the reference is resident at those bits, and the disk store reads the packed
rows. Usage: python bench/big_offload.py [--layers 4] [--tokens 8] [--capacity 0.1] [--expert-bits 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
              vocab_size=32000, max_position_embeddings=4096)
GiB = 2**30


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def prompt() -> torch.Tensor:
    return torch.randint(3, SHAPES["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))


def generate(model, tokens: int) -> list[int]:
    with torch.no_grad():
        ids = prompt()
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)[0].tolist()


def write(path: str, layers: int) -> None:
    from evalsuite.zoo.tiny import tiny_model

    model = tiny_model("qwen3_moe", dtype=torch.bfloat16, num_hidden_layers=layers, **SHAPES)
    model.save_pretrained(path, max_shard_size="2GB")


def pack(path: str, bits: int) -> dict:
    from evalsuite.cli import main

    started = time.perf_counter()
    if main(["pack-experts", "--model", path, "--expert-bits", str(bits), "--dtype", "bfloat16"]) != 0:
        raise SystemExit("pack-experts failed")
    return {"seconds": time.perf_counter() - started, "peak_rss": peak_rss()}


def full(path: str, tokens: int, bits: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    if bits == 16:
        return {"tokens": generate(model, tokens), "peak_rss": peak_rss()}
    from evalsuite.engine import offload

    with offload(model, mode="resident", expert_bits=bits):  # the reference at those bits
        return {"tokens": generate(model, tokens), "peak_rss": peak_rss()}


def offloaded(path: str, tokens: int, capacity: float, bits: int) -> dict:
    from evalsuite.engine import load_offloaded

    model, engine = load_offloaded(path, mode="on-demand", device="cpu", dtype=torch.bfloat16, store="disk",
                                   cache_capacity=capacity, expert_bits=bits)
    out = generate(model, tokens)
    stats = engine.stats()
    non_expert = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))  # experts are empty
    return {"tokens": out, "peak_rss": peak_rss(), "non_expert_bytes": non_expert, "cache_bytes": engine.cache.nbytes,
            "expert_bytes": engine.layout.nbytes, "hit_rate": stats["hit_rate"],
            "bytes_transferred": stats["bytes_transferred"]}


def run(step: str, path: str, args) -> dict:
    options = ["--layers", str(args.layers), "--tokens", str(args.tokens), "--capacity", str(args.capacity),
               "--expert-bits", str(args.expert_bits)]
    done = subprocess.run([sys.executable, __file__, *options, "--step", step, path], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--capacity", type=float, default=0.1)
    p.add_argument("--expert-bits", type=int, default=16, choices=(16, 8, 4))
    p.add_argument("--step", nargs="+", help=argparse.SUPPRESS)  # internal: one process's part
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.step:
        step, path = args.step
        if step == "write":
            write(path, args.layers)
            print(json.dumps({}))
        elif step == "pack":
            print(json.dumps(pack(path, args.expert_bits)))
        elif step == "full":
            print(json.dumps(full(path, args.tokens, args.expert_bits)))
        else:
            print(json.dumps(offloaded(path, args.tokens, args.capacity, args.expert_bits)))
        return
    path = tempfile.mkdtemp(prefix="big_offload_", dir="/tmp")
    try:
        run("write", path, args)
        checkpoint = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        packed = run("pack", path, args) if args.expert_bits != 16 else None
        packed_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".packed"))
        reference = run("full", path, args)
        mine = run("offloaded", path, args)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    bound = mine["non_expert_bytes"] + mine["cache_bytes"] + GiB
    print(f"checkpoint            {checkpoint / GiB:7.2f} GiB  ({args.layers} layers, 128 experts of "
          f"{mine['expert_bytes'] / 2**20:.1f} MiB each)")
    if packed is not None:
        print(f"packed experts        {packed_bytes / GiB:7.2f} GiB  ({args.expert_bits} bits; packed in "
              f"{packed['seconds']:.0f} s, peak RSS {packed['peak_rss'] / GiB:.2f} GiB)")
    print(f"non-expert weights    {mine['non_expert_bytes'] / GiB:7.2f} GiB")
    print(f"cache ({args.capacity:.0%})           {mine['cache_bytes'] / GiB:7.2f} GiB")
    print(f"peak RSS, full        {reference['peak_rss'] / GiB:7.2f} GiB" + (
        f"  (resident at {args.expert_bits} bits: the model and its dequantised experts)" if packed else ""))
    print(f"peak RSS, offloaded   {mine['peak_rss'] / GiB:7.2f} GiB   (bound: non-expert + cache + 1 GiB "
          f"= {bound / GiB:.2f} GiB: {'within' if mine['peak_rss'] <= bound else 'EXCEEDED'})")
    print(f"hit rate {mine['hit_rate']:.3f}, {mine['bytes_transferred'] / GiB:.2f} GiB read from disk")
    print(f"tokens equal          {'yes' if mine['tokens'] == reference['tokens'] else 'NO'}")


if __name__ == "__main__":
    main()
