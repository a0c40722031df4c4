"""Recall@K of every predictor per layer, and hit rate / stall / TPOT of every mode, on one model.

Calibrates all predictors on the project's generated training data, then decodes held-out
prompts of the project's tasks (greedy) under each mode and predictor with an emulated link.
Usage: python bench/predictors.py --model models/tiny-qwen3-moe [--prompts 16] [--tokens 48]
"""
from __future__ import annotations

import argparse
import copy

import torch

import evalsuite
from evalsuite.generate import load_model
from evalsuite.engine.metrics import token_divergence
from evalsuite.predict.calibrate import calibrate, calibration_texts, token_batches
from evalsuite.table import Column, format_table
from evalsuite.taskgen.corpus import SKILLS, heldout_items

RUNS = [("on-demand", None)] + [("router-preserving", p) for p in
                                ("frequency", "gate", "quasi", "adapter", "estimator", "oracle")] + \
       [("speculative", "gate"), ("speculative", "quasi"), ("speculative", "adapter"), ("hybrid", "hybrid"),
        ("speculative", "oracle")]


def prompts(count: int) -> list[str]:
    per_skill = max(1, count // len(SKILLS))
    return [item["prompt"] for skill in SKILLS for item in heldout_items(skill)[:per_skill]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--link", default="ufs4")
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    texts = calibration_texts(None, 256)
    artifact = calibrate(model, list(token_batches(texts, tokenizer, 0, max_len=192)), "all", rank=16, horizon=1,
                         hidden=64, epochs=args.epochs)
    inputs = [torch.tensor([tokenizer(p)["input_ids"]]) for p in prompts(args.prompts)]
    with torch.no_grad():
        reference = [model.generate(i, max_new_tokens=args.tokens, do_sample=False) for i in inputs]
    layers = None
    print(f"model {args.model}, {len(inputs)} held-out prompts, {args.tokens} new tokens, link {args.link}, "
          f"cache {args.capacity:.0%} of experts; calibration KL: "
          + ", ".join(f"{k} {v:.3f}" for k, v in artifact.meta["final_loss"].items()))
    rows = []
    for mode, predictor in RUNS:
        run = copy.deepcopy(model)
        with evalsuite.offload(run, mode=mode, predictor=predictor, artifact=artifact, cache_capacity=args.capacity,
                               link=args.link) as engine, torch.no_grad():
            outputs = [run.generate(i, max_new_tokens=args.tokens, do_sample=False) for i in inputs]
            s = engine.stats()
        same = [token_divergence(o[0, i.shape[1]:].tolist(), r[0, i.shape[1]:].tolist())["identical_share"]
                for o, r, i in zip(outputs, reference, inputs)]
        recall = (s["recall"] or {}).get(engine.layers[0].top_k, {"layers": {}, "mean": None})
        layers = layers or sorted(recall["layers"])
        rows.append((mode, predictor or "-", recall, s, sum(same) / len(same)))
    columns = ["mode", "predictor"] + [Column(f"L{l}", ".3f") for l in layers] + [
        Column(title, ".2f" if title == "TPOT ms" else ".3f")
        for title in ("mean", "hit", "prec", "stall/tok", "TPOT ms", "same")]
    print(format_table([[mode, predictor] + [recall["layers"].get(l) for l in layers]
                        + [recall["mean"], s["hit_rate"], s["prefetch_precision"], s["stall_ms_per_token"],
                           s["tpot_ms"]["median"], same] for mode, predictor, recall, s, same in rows], columns))


if __name__ == "__main__":
    main()
