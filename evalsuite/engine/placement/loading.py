"""Load a MoE checkpoint straight into the offloaded layout: the experts are never whole in memory.

`load_skeleton` builds the model with every parameter on the meta device (no memory), then reads
only the non-expert tensors from the safetensors files, by name, onto the device; the fused
expert parameters stay on meta. `load_offloaded` hands that model to `offload()`: the disk store
reads each expert from the checkpoint when it is fetched, the host store reads the experts one
by one into their own host buffers. Peak host memory (disk store): the non-expert weights, the
cache when the device is the CPU, and a few staging buffers.
"""
from __future__ import annotations

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from evalsuite.engine import arch
from evalsuite.engine.placement.store import EXPERT_PARAMS, Checkpoint


def meta_model(path: str, dtype: torch.dtype | None = None):
    """The model saved at `path` built on the meta device, none of its weights read (its shapes, layers and
    family), in `dtype` (default: the checkpoint's own); a vision-language one as its image-text class."""
    from transformers import AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with init_empty_weights():
        return auto.from_config(config, **({"dtype": dtype} if dtype is not None else {}))


def load_skeleton(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu", auto_class=AutoModelForCausalLM):
    """The model saved at `path` with its non-expert weights on `device` and no expert weights.

    Greedy outputs equal those of `auto_class.from_pretrained(path, dtype=dtype)` once it is offloaded
    (`auto_class`: AutoModelForImageTextToText for a vision-language model); the model computes experts
    with the eager kernel (the order the engine reproduces bit for bit)."""
    config = AutoConfig.from_pretrained(path)
    arch.check_config(config, path)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed, keep them
        model = auto_class.from_config(config, dtype=dtype)
    model.config._name_or_path = path
    layers = arch.sparse_layers(model)
    experts = {f"{layer.experts_path}.{name}" for layer in layers for name in EXPERT_PARAMS}
    checkpoint = Checkpoint(path)
    try:  # parameters and persistent buffers, by name; a tied weight is loaded once and tied below
        for name, t in model.state_dict(keep_vars=True).items():
            key = _checkpoint_name(checkpoint, name)
            if name not in experts and key is not None:
                _assign(model, name, checkpoint.tensor(key).to(device=device, dtype=t.dtype))
    finally:
        checkpoint.close()
    for module in model.modules():  # computed buffers (rotary tables) follow the weights
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to(device)
    model.tie_weights()
    expert_ids = {id(getattr(layer.experts, name, None)) for layer in layers for name in EXPERT_PARAMS}
    missing = [n for n, p in model.named_parameters() if p.is_meta and id(p) not in expert_ids]
    if missing:
        raise ValueError(f"checkpoint {path} has no tensor {missing[0]!r}: it does not match its config.json")
    model.eval()
    model.set_experts_implementation("eager")
    return model


def load_offloaded(path: str, mode: str = "on-demand", device="cpu", dtype: torch.dtype = torch.bfloat16,
                   store: str = "disk", **options):
    """(model, engine): the checkpoint at `path` offloaded without ever loading its experts whole.
    `options` are `offload()`'s; the checkpoint is the store's source."""
    from evalsuite.engine.offload import offload

    model = load_skeleton(path, dtype, device)
    engine = offload(model, mode=mode, device=device, store=store, checkpoint=path, **options)
    return model, engine


def _checkpoint_name(checkpoint: Checkpoint, name: str) -> str | None:
    if checkpoint.has(name):
        return name
    legacy = name.replace(".mlp.", ".block_sparse_moe.")  # Mixtral checkpoints keep the historical name
    return legacy if checkpoint.has(legacy) else None


def _assign(model, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
