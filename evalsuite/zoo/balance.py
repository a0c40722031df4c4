"""Load-balancing loss for sigmoid (DeepSeek-V3 / GLM-4.5 style) routers.

transformers computes no auxiliary loss for these routers, so the router logits
are captured with forward hooks and balanced here: the fraction of tokens sent
to each expert times its mean normalised affinity, summed (Switch/DeepSeek form).
"""
from __future__ import annotations

import torch


class RouterRecorder:
    """Collects the router logits of every MoE layer during one forward pass."""

    def __init__(self, model: torch.nn.Module):
        self.logits: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [
            layer.mlp.gate.register_forward_hook(self._record)
            for layer in model.model.layers if hasattr(layer.mlp, "gate")
        ]

    def _record(self, module, inputs, output):
        router_logits, _, topk_indices = output
        self.logits.append((router_logits, topk_indices))

    def clear(self) -> None:
        self.logits = []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def sigmoid_balance_loss(recorded: list, attention_mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mean over layers of E * sum_i f_i * P_i on non-padding tokens (1.0 when perfectly balanced)."""
    keep = attention_mask.reshape(-1).bool()
    losses = []
    for router_logits, topk_indices in recorded:
        logits, chosen = router_logits[keep], topk_indices[keep]
        num_experts = logits.shape[-1]
        affinity = torch.sigmoid(logits.float())
        affinity = affinity / affinity.sum(dim=-1, keepdim=True)
        load = torch.zeros(num_experts, device=logits.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))
        load = load / (chosen.shape[0] * top_k)
        losses.append(num_experts * (load * affinity.mean(dim=0)).sum())
    return torch.stack(losses).mean()
