"""DeepSeek-style routers: DeepSeek-V2 (softmax) and DeepSeek-V3, GLM-4.5/4.7 (sigmoid + groups).

deepseek_v2: scores = softmax(logits) in float32; greedy or group-limited top-k;
             weights = scores at the chosen ids * routed_scaling_factor (no renormalisation).
deepseek_v3, glm4_moe, glm4_moe_lite: scores = sigmoid(logits); selection adds
             e_score_correction_bias and keeps the best topk_group groups (group score = sum of
             the top-2 in the group); weights = scores at the chosen ids, renormalised when
             norm_topk_prob, times routed_scaling_factor.
Unweighted shared experts and the first dense layers live outside the routed experts.
"""
from __future__ import annotations

import torch

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm4v_moe")
ROUTER_ATTR = "gate"


def route_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if hasattr(router, "e_score_correction_bias"):  # sigmoid routers
        weights = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    else:
        weights = logits.softmax(dim=-1, dtype=torch.float32).gather(1, ids)
    return weights * router.routed_scaling_factor


def selection_scores(router, logits: torch.Tensor) -> torch.Tensor:
    """Scores whose top-k is the router's choice, group limits aside: sigmoid + correction
    bias for the sigmoid routers, the logits (monotonic in the softmax) for DeepSeek-V2."""
    if hasattr(router, "e_score_correction_bias"):
        return logits.float().sigmoid() + router.e_score_correction_bias.float()
    return logits if logits.dtype == torch.float32 else logits.float()


def expert_sources(read, experts_path: str, expert: int) -> dict[str, tuple]:
    gate, up, down = (f"{experts_path}.{expert}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))
    return {"gate_up_proj": ((gate, None), (up, None)), "down_proj": ((down, None),)}
