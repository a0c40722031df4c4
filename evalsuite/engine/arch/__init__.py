"""Per-architecture knowledge, one small module per router family.

Each family module defines:
  MODEL_TYPES    the transformers `model_type`s it covers
  ROUTER_ATTR    the attribute of the MoE block that holds the router
  route_weights(router, logits, ids) -> [T, K] weights the layer's own formula gives an
                 arbitrary expert set `ids` (speculative execution needs this)
  selection_scores(router, logits) -> [T, E] scores whose top-k is the router's choice
                 (predictors rank experts with it)
  expert_sources(read, experts_path, expert) -> {param name: ((checkpoint key, index), ...)}
                 where one expert's tensors are in a checkpoint (`read.has(key)` tells which
                 keys it holds): each param is its sources one after another along the first
                 dimension, `index` the expert's slice of a stacked tensor or None (the disk
                 tier reads them straight into the expert's flat buffer: store.read_expert_into)
Everything else (finding the sparse layers, the fused weight layout) is read off the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch.nn as nn

from evalsuite.engine.arch import deepseek, gpt_oss, softmax_topk

FAMILIES: dict[str, ModuleType] = {t: fam for fam in (softmax_topk, deepseek, gpt_oss) for t in fam.MODEL_TYPES}
SUPPORTED = tuple(sorted(FAMILIES))


class UnsupportedModelError(ValueError):
    """The model is not a Mixture-of-Experts model evalsuite knows how to offload."""


@dataclass
class SparseLayer:
    """One MoE layer of a model: where its router and experts live."""

    index: int  # decoder layer index (dense layers keep their numbers)
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    experts_path: str  # module path of the experts, also their checkpoint key prefix
    norm: nn.Module  # the pre-router norm (post_attention_layernorm): its input is the residual
    decoder_layer: nn.Module  # the whole decoder layer (attention, norms and `block`)

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)

    @property
    def num_experts(self) -> int:
        return int(self.experts.num_experts)


def model_type(model: nn.Module) -> str:
    return config_model_type(model.config)


def config_model_type(config) -> str:
    """The supported `model_type` of a transformers config (a VLM's may sit on its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for candidate in (config.model_type, getattr(text, "model_type", None)):
        if candidate in FAMILIES:
            return candidate
    return config.model_type


def family_of(model: nn.Module) -> ModuleType:
    return _family(model_type(model))


def _family(mtype: str) -> ModuleType:
    if mtype not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {mtype!r} is not supported; evalsuite offloads: {', '.join(SUPPORTED)}"
        )
    return FAMILIES[mtype]


def check_top_k(top_k, num_experts, where: str) -> None:
    """Each token is routed to top-k of the layer's experts: 1 <= top-k <= experts."""
    if not (isinstance(top_k, int) and isinstance(num_experts, int) and 1 <= top_k <= num_experts):
        raise UnsupportedModelError(f"{where}: num_experts_per_tok={top_k!r} must lie between 1 and the "
                                    f"{num_experts} experts; fix the model's config.json")


def check_config(config, where: str) -> None:
    """Refuse, before any weight is loaded, a config evalsuite cannot offload: an unsupported
    model type, or a top-k outside 1..number of experts."""
    _family(config_model_type(config))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((getattr(text, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, name, None) is not None), None)
    check_top_k(getattr(text, "num_experts_per_tok", None), experts, where)


def sparse_layers(model: nn.Module) -> list[SparseLayer]:
    """Every MoE layer of a supported model, in order; raises on dense or unknown models."""
    family = family_of(model)
    decoder = _decoder_layers(model)
    found = []
    for index, (path, layer) in enumerate(decoder):
        block = getattr(layer, "mlp", None)
        experts = getattr(block, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            continue  # a dense layer (first_k_dense_replace, mlp_only_layers, ...)
        router = getattr(block, family.ROUTER_ATTR)
        found.append(SparseLayer(index, block, router, experts, f"{path}.mlp.experts", layer.post_attention_layernorm,
                                 layer))
    for layer in found:
        check_top_k(layer.top_k, layer.num_experts, f"sparse layer {layer.index}")
    if not found:
        raise UnsupportedModelError(
            f"model type {model_type(model)!r} has no sparse MoE layers in this configuration; "
            f"evalsuite needs a Mixture-of-Experts model ({', '.join(SUPPORTED)})"
        )
    return found


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer of the model's text stack, dense ones included, in order."""
    return [layer for _, layer in _decoder_layers(model)]


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # The decoder stack is the ModuleList whose children own an `mlp`; VLMs nest it under
    # `language_model`, and the vision tower has its own (dense) blocks, so prefer text.
    candidates = [
        (name, mod) for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod)
        and hasattr(mod[0], "mlp") and "visual" not in name and "vision" not in name
    ]
    if not candidates:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    name, layers = candidates[0]
    return [(f"{name}.{i}", layer) for i, layer in enumerate(layers)]
