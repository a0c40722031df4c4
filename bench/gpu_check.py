"""The checks that need a GPU, in one script of a few minutes: exactness, TPOT, device memory.

1. Exactness on the device: logits and greedy tokens of on-demand and router-preserving (gate,
   oracle) are `torch.equal` to the unmodified model running the eager kernel, on three
   architectures (qwen3_moe, gpt_oss, deepseek_v3; tiny random configs), with real asynchronous
   copies over the device's own link, and with an emulated slow link (prefetches in flight while
   the compute runs).
2. Device memory: a model at Qwen3-30B-A3B layer shapes, built on the host, offloaded to the
   device: peak device memory against non-expert weights + cache (the experts never go there).
3. TPOT at Qwen3-30B-A3B shapes (8 sparse layers, bf16, cache 25 %), real copies, link time from
   CUDA events: every mode, medians of interleaved repeats (`evalsuite bench`'s own table).

    python bench/gpu_check.py --out results/gpu_check.txt      # on one GPU, a few minutes
    python bench/gpu_check.py --cpu                            # the same code paths here, smaller

Exits 1 if an exact mode differs or the memory bound does not hold. On the CPU (`--cpu`) it checks
that the script itself runs; its numbers say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

import evalsuite
from evalsuite.zoo.tiny import tiny_model
from evalsuite.perf.bench import bench_model, format_result
from evalsuite.perf.shapes import random_model

ARCHITECTURES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
# every exact offloading mode; one that predicts, with the gate and the oracle predictor
EXACT_CASES = tuple((name, predictor) for name, mode in evalsuite.MODES.items() if mode.exact and mode.offloads
                    for predictor in (("gate", "oracle") if mode.predicts else (None,)))


def greedy(model, ids, tokens: int):
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return logits, out


def check_exactness(device: str, tokens: int) -> list[str]:
    failures = []
    for model_type in ARCHITECTURES:
        reference = tiny_model(model_type, dtype=torch.bfloat16).to(device).eval()
        reference.set_experts_implementation("eager")
        ids = torch.randint(3, reference.config.vocab_size, (1, 12),
                            generator=torch.Generator().manual_seed(0)).to(device)
        expected = greedy(reference, ids, tokens)
        for link in (None, "sdcard"):
            for mode, predictor in EXACT_CASES:
                model = copy.deepcopy(reference)
                with evalsuite.offload(model, mode=mode, predictor=predictor, cache_capacity=0.25, link=link,
                                       device=device) as engine:
                    got = greedy(model, ids, tokens)
                    stats = engine.stats()
                same = torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
                label = f"{model_type} {mode}/{predictor or '-'} link={link or 'native'}"
                print(f"  exact {'yes' if same else 'NO '}  {label}  hit rate {stats['hit_rate']:.3f}", flush=True)
                if not same:
                    failures.append(label)
    return failures


def check_memory(device: str, layers: int) -> tuple[bool, str]:
    """A host-built model offloaded to `device`: what the device holds against non-expert + cache."""
    model = random_model("qwen3-30b-a3b", layers).eval()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    engine = evalsuite.offload(model, mode="on-demand", cache_capacity=0.25, device=device)
    layout_bytes = engine.device_expert_bytes()
    # the experts' own parameters are empty once offloaded: what is left on the device is the rest
    non_expert = sum(t.nbytes for t in model.parameters() if t.device.type == device)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
    engine.close()
    if device != "cuda":
        return True, f"non-expert {non_expert / 2**30:.2f} GiB + cache {layout_bytes / 2**30:.2f} GiB (CPU: no peak)"
    peak = torch.cuda.max_memory_allocated() - before
    bound = non_expert + layout_bytes + 512 * 2**20  # activations and the KV cache of a short prompt
    text = (f"peak device memory {peak / 2**30:.2f} GiB; non-expert {non_expert / 2**30:.2f} GiB + cache "
            f"{layout_bytes / 2**30:.2f} GiB + 0.5 GiB = {bound / 2**30:.2f} GiB")
    return peak <= bound, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the same code on the CPU, smaller (a dry run)")
    parser.add_argument("--layers", type=int, default=8, help="sparse layers at Qwen3-30B-A3B shapes")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/gpu_check.txt")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; pass --cpu for a dry run of the same code", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    layers, tokens, repeats = (2, 4, 1) if args.cpu else (args.layers, args.tokens, args.repeats)
    torch.set_num_threads(1 if args.cpu else torch.get_num_threads())
    started = time.time()
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    lines = [f"gpu_check on {name}, torch {torch.__version__}"]

    print("1. exactness", flush=True)
    failures = check_exactness(device, tokens)
    lines.append(f"exactness: {3 * len(EXACT_CASES) * 2 - len(failures)} of {3 * len(EXACT_CASES) * 2} cases "
                 f"bit-identical" + (f"; differ: {', '.join(failures)}" if failures else ""))

    print("2. device memory", flush=True)
    fits, memory = check_memory(device, layers)
    lines.append(("memory: " if fits else "memory OVER BOUND: ") + memory)

    print("3. TPOT", flush=True)
    result = bench_model("qwen3-30b-a3b", ["native", "pcie4"], [0.25], ["gate", "oracle"], tokens=tokens,
                         repeats=repeats, layers=layers, device=device)
    for cfg in result["configs"]:
        cfg.pop("traces", None)
    lines.append(f"TPOT, Qwen3-30B-A3B shapes, {layers} sparse layers, bf16, cache 25 %:\n" + format_result(result))
    lines.append(f"{time.time() - started:.0f} s in all")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 1 if failures or not fits else 0


if __name__ == "__main__":
    sys.exit(main())
