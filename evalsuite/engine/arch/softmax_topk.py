"""Softmax top-k routers: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, Qwen3-VL-MoE.

probs = softmax(logits) in float32; the k largest are kept and renormalised when the router
says so (`norm_topk_prob`; Mixtral and Qwen3-VL always renormalise). Qwen2-MoE's gated
shared expert lives in the block and is left untouched.
"""
from __future__ import annotations

import torch

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3_vl_moe")
ROUTER_ATTR = "gate"


def route_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, ids)
    if getattr(router, "norm_topk_prob", True):
        weights /= weights.sum(dim=-1, keepdim=True)
    # Mixtral keeps float32 weights; the others cast back to the logits' dtype.
    return weights if type(router).__name__.startswith("Mixtral") else weights.to(logits.dtype)


def selection_scores(router, logits: torch.Tensor) -> torch.Tensor:
    """Scores whose top-k is the router's choice (softmax is monotonic: the logits)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def expert_sources(read, experts_path: str, expert: int) -> dict[str, tuple]:
    if read.has(f"{experts_path}.gate_up_proj"):  # fused, as the model holds it (Qwen3-VL-MoE checkpoints)
        return {name: ((f"{experts_path}.{name}", expert),) for name in ("gate_up_proj", "down_proj")}
    if experts_path.endswith(".mlp.experts") and _is_mixtral_key(read, experts_path):
        prefix = experts_path.replace(".mlp.experts", ".block_sparse_moe.experts")
        gate, up, down = (f"{prefix}.{expert}.{w}.weight" for w in ("w1", "w3", "w2"))
    else:
        gate, up, down = (f"{experts_path}.{expert}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))
    return {"gate_up_proj": ((gate, None), (up, None)), "down_proj": ((down, None),)}


def _is_mixtral_key(read, experts_path: str) -> bool:
    # Mixtral checkpoints keep the historical `block_sparse_moe.experts.{e}.w1/w2/w3` names.
    return read.has(experts_path.replace(".mlp.experts", ".block_sparse_moe.experts") + ".0.w1.weight")
