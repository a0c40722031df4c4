"""Expert computation in the order of transformers' eager kernel, from any weight source.

The sums are bit-identical to the unmodified model running `experts_implementation="eager"`:
experts in ascending id order, each expert's tokens in (k, token) order, one `index_add_` per
expert. The tokens are grouped by expert once per layer (a stable sort), not searched per expert. The weights of each expert come from a callback, so they can be device cache slots
that are still arriving while earlier experts compute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp(experts: torch.nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One expert's MLP on tokens x, with the experts class's own gate (SwiGLU, GPT-OSS clamp)."""
    if experts.is_transposed:  # GPT-OSS: x @ W + b
        h = x @ w["gate_up_proj"]
        if "gate_up_proj_bias" in w:
            h = h + w["gate_up_proj_bias"]
        h = experts._apply_gate(h)
        y = h @ w["down_proj"]
        return y + w["down_proj_bias"] if "down_proj_bias" in w else y
    h = experts._apply_gate(F.linear(x, w["gate_up_proj"]))
    return F.linear(h, w["down_proj"])


def run_experts(experts, hidden_states, top_k_index, top_k_weights, weights_in_order) -> torch.Tensor:
    """Mix the routed experts' outputs.

    `weights_in_order(needed)` receives the ascending list of expert ids the tokens need and
    yields (expert id, weight views) in that order; it may block until an expert is resident.
    """
    out = torch.zeros_like(hidden_states)
    tokens = top_k_index.shape[0]
    with torch.no_grad():
        # the (k, token) positions grouped by expert, in (k, token) order within each: one sort and
        # one read of the counts per layer (on CUDA one host synchronisation, not one per expert)
        flat = top_k_index.t().reshape(-1)  # position k * tokens + token
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    starts, at = {}, 0
    for expert, count in enumerate(counts):
        starts[expert], at = at, at + count
    for expert, w in weights_in_order([e for e, count in enumerate(counts) if count]):
        positions = order[starts[expert]:starts[expert] + counts[expert]]
        top_k_pos, token_idx = positions // tokens, positions % tokens
        y = expert_mlp(experts, hidden_states[token_idx], w)
        y = y * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
