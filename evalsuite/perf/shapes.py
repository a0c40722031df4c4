"""Real MoE models' shapes, as their published transformers configs give them.

Parameter counts come from instantiating the config on the meta device (no memory, no
weights), so the simulator's byte counts are transformers' own. `random_model` builds the
same layer shapes with only a few layers and a small vocabulary, with random weights, so
the engine can be timed at real expert sizes on a small machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..engine.arch import decoder_layers, sparse_layers
from ..zoo.tiny import tiny_model

_QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936)
_GPT_OSS = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, num_experts_per_tok=4, vocab_size=201088)
# name -> (config fields, bits per expert weight as shipped, note)
MODELS = {
    "qwen3-30b-a3b": (_QWEN3_30B, 16, "Qwen/Qwen3-30B-A3B"),
    "qwen3-vl-30b-a3b": (_QWEN3_30B, 16, "Qwen/Qwen3-VL-30B-A3B-Instruct, language model (vision tower not counted)"),
    "gpt-oss-20b": (dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32), 4.25,
                    "openai/gpt-oss-20b, MXFP4 experts"),
    "gpt-oss-120b": (dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128), 4.25,
                     "openai/gpt-oss-120b, MXFP4 experts"),
    "glm-4.7-flash": (dict(model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240,
                           moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                           num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
                           qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=64, n_shared_experts=1,
                           num_experts_per_tok=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                           routed_scaling_factor=1.8, vocab_size=154880), 16, "zai-org/GLM-4.7-Flash"),
    "deepseek-v2-lite": (dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
                              moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                              num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                              num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                              topk_group=1, vocab_size=102400), 16, "deepseek-ai/DeepSeek-V2-Lite"),
    "mixtral-8x7b": (dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          vocab_size=32000), 16, "mistralai/Mixtral-8x7B-v0.1"),
}


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs to know about a model, per decode token."""

    name: str
    sparse_layers: int
    dense_layers: int  # decoder layers without routed experts
    experts: int  # routed experts per sparse layer
    top_k: int
    hidden: int
    expert_bytes: int  # one routed expert's weights as stored and transferred
    sparse_layer_bytes: int  # per sparse layer: attention, norms, router, shared experts (always resident)
    dense_layer_bytes: int  # per dense layer
    head_bytes: int  # final norm and LM head read per token (one embedding row is negligible)

    @property
    def total_experts(self) -> int:
        return self.sparse_layers * self.experts


def _config(fields: dict, **overrides):
    from transformers import AutoConfig

    fields = {**fields, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@lru_cache(maxsize=None)
def model_shape(name: str, expert_bits: int | None = None) -> ModelShape:
    """The shape of a real model by name (see MODELS), counted on the meta device. `expert_bits`: its routed
    experts as the engine stores them at 16 (bf16), 8 or 4 bits (the engine's own packed row,
    evalsuite.engine.placement.quantised, at its default group size); default: as the model ships them."""
    if name not in MODELS:
        raise ValueError(f"unknown model shape {name!r}: use one of {', '.join(MODELS)}")
    fields, shipped_bits, _ = MODELS[name]
    from transformers import AutoModelForCausalLM

    config = _config(fields)
    layers = config.num_hidden_layers
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    probe = _config(fields, num_hidden_layers=first_dense + 1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(probe)
    sparse = sparse_layers(model)[0]
    expert_params = sum(p.numel() for p in sparse.experts.parameters()) // sparse.num_experts
    weight_bytes = 2  # bf16 for everything but the routed experts
    block = sparse.decoder_layer
    sparse_rest = sum(p.numel() for p in block.parameters()) - expert_params * sparse.num_experts
    dense_params = sum(p.numel() for p in decoder_layers(model)[0].parameters()) if first_dense else 0
    head = model.lm_head.weight.numel() + model.model.norm.weight.numel()
    return ModelShape(name=name, sparse_layers=layers - first_dense, dense_layers=first_dense,
                      experts=sparse.num_experts, top_k=sparse.top_k, hidden=config.hidden_size,
                      expert_bytes=_expert_bytes(sparse.experts, expert_params, shipped_bits, expert_bits),
                      sparse_layer_bytes=sparse_rest * weight_bytes,
                      dense_layer_bytes=dense_params * weight_bytes, head_bytes=head * weight_bytes)


def random_model(name: str, sparse_layers_count: int = 2, vocab_size: int = 1024, dtype=torch.bfloat16, seed: int = 0):
    """A random-weight model with `name`'s real layer shapes, few layers and a small vocabulary."""
    if name not in MODELS:
        raise ValueError(f"unknown model shape {name!r}: use one of {', '.join(MODELS)}")
    fields = dict(MODELS[name][0])
    model_type = fields.pop("model_type")
    first_dense = fields.get("first_k_dense_replace", 0) or 0
    fields.update(num_hidden_layers=first_dense + sparse_layers_count, vocab_size=vocab_size,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    return tiny_model(model_type, seed=seed, dtype=dtype, **fields)


def _expert_bytes(experts, params: int, shipped_bits: float, bits: int | None) -> int:
    """One routed expert's bytes: as shipped (`bits` None), dense bf16 (16), or the engine's packed row (8, 4)."""
    if bits is None:
        return int(params * shipped_bits / 8)
    if bits == 16:
        return params * 2
    from dataclasses import replace

    from ..engine.placement.quantised import layout_for
    from ..engine.placement.store import ExpertLayout

    dense = replace(ExpertLayout.of(experts), dtype=torch.bfloat16)
    return layout_for(dense, bits).nbytes
