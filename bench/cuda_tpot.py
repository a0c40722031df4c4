"""Decode TPOT on one GPU at real Qwen3-30B-A3B layer shapes, with real host-to-device copies.

Random weights (hidden 2048, 128 experts of intermediate 768, top-8, bf16) in `--layers`
sparse layers; the experts live in pinned host memory and are copied over the real PCIe link
(no emulation) on the engine's side stream. Modes: resident, on-demand, router-preserving and
speculative with the gate predictor, and oracle prefetch; cache 25 % of the experts; medians
of interleaved repeats. Writes the table (and JSON) to --out. On a machine without CUDA it
runs on the CPU with two layers, slower, so the script is always runnable.

    python bench/cuda_tpot.py --out results/cuda_tpot.txt      # about 3-5 minutes on one H100/H200
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from evalsuite.perf.bench import bench_model, format_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="sparse layers (default: 12 on CUDA, 2 on CPU)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--out", default="results/cuda_tpot.txt")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layers = args.layers or (12 if cuda else 2)
    if not cuda:
        torch.set_num_threads(1)
    started = time.time()
    result = bench_model("qwen3-30b-a3b", ["native"], [args.capacity], ["gate", "oracle"], tokens=args.tokens,
                         repeats=args.repeats if cuda else min(args.repeats, 3), layers=layers, device=device)
    for cfg in result["configs"]:
        cfg.pop("traces")
    name = torch.cuda.get_device_name() if cuda else "CPU"
    text = (f"{name}: Qwen3-30B-A3B shapes, {layers} sparse layers, bf16, real copies; "
            f"{time.time() - started:.0f} s in all\n" + format_result(result))
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
