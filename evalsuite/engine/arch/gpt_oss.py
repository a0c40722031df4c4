"""GPT-OSS: the router has a bias; top-k is taken on the logits, then a softmax over the k.

Experts differ in layout: gate_up_proj is [E, H, 2I] (transposed, gate and up interleaved in
even/odd columns) with biases [E, 2I] and [E, H]; down_proj is [E, I, H]. Checkpoints keep the
fused tensors, so one expert is a slice of each.
"""
from __future__ import annotations

import torch

MODEL_TYPES = ("gpt_oss",)
ROUTER_ATTR = "router"
_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def route_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)


def selection_scores(router, logits: torch.Tensor) -> torch.Tensor:
    """GPT-OSS takes the top-k of the (biased) logits."""
    return logits if logits.dtype == torch.float32 else logits.float()


def expert_sources(read, experts_path: str, expert: int) -> dict[str, tuple]:
    return {name: ((f"{experts_path}.{name}", expert),) for name in _PARAMS}
