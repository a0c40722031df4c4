"""Measure how predictable a trained model's routing is from the previous layer.

Predictor: apply layer l+1's router to layer l's router input (the
post_attention_layernorm output of layer l). Recall@K = |top-K(predicted) ∩
top-K(true router of l+1)| / K over decode tokens, averaged per sample, then
across samples. Decode tokens are the generated tokens fed back as inputs.

    python -m evalsuite.zoo.routing_recall models/tiny-qwen3-moe [--per-skill 20]
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evalsuite.zoo.corpus import SKILLS, heldout_items

MAX_NEW_TOKENS = {"arith": 96, "yesno": 8, "code": 64, "boxed": 96}


def moe_layer_indices(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]


@torch.no_grad()
def sample_recalls(model, input_ids: torch.Tensor, first_decode: int, k: int) -> dict[tuple[int, int], float]:
    """Recall@k per consecutive MoE layer pair for one generated sequence."""
    layers = model.model.layers
    moe = moe_layer_indices(model)
    router_inputs, true_topk, handles = {}, {}, []
    for i in moe:
        handles.append(layers[i].post_attention_layernorm.register_forward_hook(
            lambda mod, inp, out, i=i: router_inputs.__setitem__(i, out[0])))
        handles.append(layers[i].mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: true_topk.__setitem__(i, out[2])))
    try:
        model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    recalls = {}
    for cur, nxt in zip(moe, moe[1:]):
        if nxt != cur + 1:
            continue
        hidden = router_inputs[cur][first_decode:]
        _, _, predicted = layers[nxt].mlp.gate(hidden)
        true = true_topk[nxt][first_decode:]
        overlap = (predicted[:, :k, None] == true[:, None, :k]).any(-1).sum(-1).float() / k
        recalls[(cur, nxt)] = overlap.mean().item()
    return recalls


def measure(path: str, per_skill: int = 20) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    k = model.config.num_experts_per_tok
    per_pair: dict[tuple[int, int], list[float]] = {}
    for skill in SKILLS:
        for item in heldout_items(skill)[:per_skill]:
            prompt = tokenizer(item["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
            full = model.generate(prompt, max_new_tokens=MAX_NEW_TOKENS[skill], do_sample=False)
            # The last generated token is never fed back, so it routes nothing.
            decode_inputs = full[:, :-1]
            if decode_inputs.shape[1] <= prompt.shape[1]:
                continue
            for pair, value in sample_recalls(model, decode_inputs, prompt.shape[1], k).items():
                per_pair.setdefault(pair, []).append(value)
    return {
        "model": path,
        "k": k,
        "samples": len(next(iter(per_pair.values()))),
        "recall_at_k": {f"{a}->{b}": round(sum(v) / len(v), 4) for (a, b), v in per_pair.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--per-skill", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for path in args.models:
        print(json.dumps(measure(path, args.per_skill), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
