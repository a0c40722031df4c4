"""Tiny random configurations of every supported architecture (tests, smoke runs, benches).

Each keeps the family's distinctive parts: shared experts, dense first layers, group-limited
routing, biases, at a size that runs in milliseconds on a CPU.
"""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DEEPSEEK = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=2, topk_group=1)

TINY = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "deepseek_v2": dict(_DEEPSEEK, **_MLA, q_lora_rank=None, topk_method="group_limited_greedy"),
    "deepseek_v3": dict(_DEEPSEEK, **_MLA, q_lora_rank=32, rope_scaling=None),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16),
    "glm4_moe": dict(_DEEPSEEK, head_dim=16),
    "glm4_moe_lite": dict(_DEEPSEEK, **_MLA, q_lora_rank=32),
}


# Qwen3-VL-MoE: a one-block vision tower feeding a two-layer MoE language model.
TINY_VL = dict(
    text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=160, num_experts=8,
                     num_experts_per_tok=2,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                       spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]),
    image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


# GLM-4.5V-style MoE (glm4v_moe): the same sizes, GLM's grouped sigmoid router, a shared expert and
# a dense first layer; its image tokens sit between begin/end-of-image tokens.
TINY_GLM_VL = dict(
    text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=160, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                          partial_rotary_factor=0.5)),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                       spatial_merge_size=2, temporal_patch_size=2, image_size=32),
    image_token_id=150, video_token_id=151, image_start_token_id=152, image_end_token_id=153,
    video_start_token_id=154, video_end_token_id=155)
VISION_LANGUAGE = {"qwen3_vl_moe": TINY_VL, "glm4v_moe": TINY_GLM_VL}


def tiny_config(model_type: str, **overrides):
    """A tiny random config of `model_type`; `overrides` change any field."""
    if model_type in VISION_LANGUAGE:
        return AutoConfig.for_model(model_type, **{**VISION_LANGUAGE[model_type], **overrides})
    return AutoConfig.for_model(model_type, **{**_BASE, **TINY[model_type], **overrides})


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny randomly initialised model in eval mode, computing experts with the eager kernel."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    auto = AutoModelForImageTextToText if model_type in VISION_LANGUAGE else AutoModelForCausalLM
    model = auto.from_config(config, dtype=dtype).eval()
    model.set_experts_implementation("eager")
    # Random init leaves routers near uniform; spread them so routing depends on the input.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0, 0.5)
    return model
