"""Configurations of the two shipped tiny MoE models (one per router family)."""
from __future__ import annotations

from transformers import Glm4MoeConfig, PretrainedConfig, Qwen3MoeConfig, Qwen3VLMoeConfig

MODEL_NAMES = {"qwen": "tiny-qwen3-moe", "glm": "tiny-glm4-moe", "vl": "tiny-qwen3-vl-moe"}
BALANCE_LOSS_COEF = 0.01


def qwen_config(vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """Qwen3-MoE: softmax top-2 over 16 experts in all 4 layers, no shared expert."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        router_aux_loss_coef=BALANCE_LOSS_COEF,
        output_router_logits=False,  # switched on only inside the training forward
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


def glm_config(vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """GLM-4.5-style MoE: sigmoid router, one shared expert, first layer dense, 4 MoE layers."""
    return Glm4MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_hidden_layers=5,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


# Room for a benchmark's long generations (MATH-Vision asks for up to 1,024 new tokens) after its
# prompt; rotary positions have no table, so the length changes no weight.
VL_CONTEXT = 2048


def vl_config(vocab_size: int, pad_id: int, eos_id: int, vision_ids: dict[str, int]) -> PretrainedConfig:
    """Qwen3-VL-MoE: a two-block vision tower (8-px patches, 2x2 merge, one deepstack feature)
    feeding a language model of 4 MoE layers, softmax top-2 over 8 experts. `vision_ids` maps
    image / video / vision_start / vision_end to token ids."""
    return Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=VL_CONTEXT, router_aux_loss_coef=BALANCE_LOSS_COEF, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5]),
            pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None),
        vision_config=dict(
            depth=2, hidden_size=96, intermediate_size=192, num_heads=4, out_hidden_size=128, patch_size=8,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=vision_ids["image"], video_token_id=vision_ids["video"],
        vision_start_token_id=vision_ids["vision_start"], vision_end_token_id=vision_ids["vision_end"],
        tie_word_embeddings=True, pad_token_id=pad_id, eos_token_id=eos_id,
    )


CONFIG_BUILDERS = {"qwen": qwen_config, "glm": glm_config}
