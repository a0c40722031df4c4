"""Configurations of the two shipped tiny MoE models (one per router family)."""
from __future__ import annotations

from transformers import Glm4MoeConfig, PretrainedConfig, Qwen3MoeConfig

MODEL_NAMES = {"qwen": "tiny-qwen3-moe", "glm": "tiny-glm4-moe"}
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


CONFIG_BUILDERS = {"qwen": qwen_config, "glm": glm_config}
