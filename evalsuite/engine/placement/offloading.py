"""Where an offloaded model's experts live (built by Engine when its mode offloads): every expert in a store
(host memory, or read from the checkpoint's safetensors files), the device's expert cache of a few slots, and
the link that copies one into a slot. The model's own expert parameters are emptied: the device then holds
only what the cache holds.
"""
from __future__ import annotations

import torch

from evalsuite.engine import placement
from evalsuite.engine.cache.slots import ExpertCache, capacity_in_experts, check_fits
from evalsuite.engine.link.lazy import INLINE_MAX_BYTES, LazyLink
from evalsuite.engine.placement.packed import PackedStore
from evalsuite.engine.placement.store import Checkpoint, HostStore, SafetensorsStore
from evalsuite.engine.link.worker import TransferWorker


def move_experts_out(engine, config):
    """The store, the expert cache and the link of `engine`'s model (its layers, layout, device, link), as
    `config` (an EngineConfig) asks, with its experts moved out of the model; returns (store, cache, link, own): own,
    where the store holds quantised codes, the model's own weights set aside for put_experts_back (else None).
    Raises ValueError where the cache cannot hold one token's experts or does not fit the device."""
    model, layers, layout, device = engine.model, engine.layers, engine.layout, engine.device
    dense = engine.dense_layout  # the model's own tensors (layout: the store's rows, packed where quantised)
    cache_capacity, store, checkpoint = config.cache_capacity, config.store, config.checkpoint
    per_layer = config.cache_pools == "per-layer"
    total = sum(layer.num_experts for layer in layers)
    capacity = capacity_in_experts(cache_capacity, total, layout.nbytes)
    pool_size = capacity // len(layers) if per_layer else capacity
    top_k = max(layer.top_k for layer in layers)
    if pool_size < top_k:
        need = top_k * (len(layers) if per_layer else 1)
        raise ValueError(f"cache_capacity={cache_capacity!r} gives {pool_size} slots per pool, below "
                         f"top-k={top_k}: one token's experts must fit; use at least {need} experts")
    check_fits(capacity, layout.nbytes, device, other_bytes=placement.device_bytes_change(
        model, layers, dense, device, store))
    pin = device.type == "cuda"
    path = checkpoint or model.config._name_or_path
    if store == "host":  # a model built without its experts fills the host store from its checkpoint
        source = Checkpoint(path, dense.dtype) if engine.unloaded else None
        expert_store = HostStore(layers, layout, pin, source, engine.family)
    elif layout is dense:
        expert_store = SafetensorsStore(path, layers, layout, engine.family, pin)
    else:  # the rows `evalsuite pack-experts` wrote beside the checkpoint
        expert_store = PackedStore(path, layers, layout, pin)
    own = None
    if layout is not dense and not engine.unloaded:  # the store's codes are lossy: close() puts these back
        own = {(layer.index, name): getattr(layer.experts, name).cpu()
               for layer in layers for name, _, _ in dense.fields}
    for layer in layers:  # the device now holds only what the cache holds
        for name, _, _ in dense.fields:
            empty = torch.empty(0, dtype=dense.dtype, device=device)
            setattr(layer.experts, name, torch.nn.Parameter(empty, requires_grad=False))
    placement.move_non_experts(model, layers, dense, device)
    cache = ExpertCache([layer.index for layer in layers], capacity, layout.numel, layout.dtype, device,
                        config.cache_policy, per_layer)
    if engine.link is not None and device.type == "cpu" and layout.nbytes <= INLINE_MAX_BYTES:
        link = LazyLink(expert_store, engine.link, engine.timeout_s)  # no thread to hand the GIL to
    else:
        link = TransferWorker(expert_store, device, engine.link, engine.timeout_s)
    return expert_store, cache, link, own


def put_experts_back(layers, dense, layout, store, device: torch.device, own: dict | None = None) -> None:
    """Put every expert back into the model's fused parameters (Engine.close): the model's own set aside (`own`,
    where the store holds quantised codes), else read from `store`."""
    for layer in layers:
        for name, _, _ in dense.fields:
            if own is not None:
                fused = own[layer.index, name].data.to(device)
            else:
                fused = torch.stack([layout.views(store.read((layer.index, e)))[name].clone()
                                     for e in range(layer.num_experts)]).to(device)
            setattr(layer.experts, name, torch.nn.Parameter(fused, requires_grad=False))
