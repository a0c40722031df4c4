"""Where an offloaded model's weights go: the non-expert weights on the device, experts in the store.

A model may reach `offload()` whole on the device, whole on the host, or built without its
experts (their fused parameters on the meta device, see evalsuite.engine.placement.loading). These helpers
say where its non-expert weights are, what the device gains and loses by offloading, and move
only the non-expert weights.
"""
from __future__ import annotations

import torch

from evalsuite.engine.placement.store import read_expert


def expert_params(layers, layout) -> list[torch.Tensor]:
    return [getattr(layer.experts, name) for layer in layers for name, _, _ in layout.fields]


def experts_unloaded(layers, layout) -> bool:
    """True when the model was built without its expert weights (they sit on the meta device)."""
    return any(p.is_meta for p in expert_params(layers, layout))


def non_expert_tensors(model, layers, layout):
    experts = {id(p) for p in expert_params(layers, layout)}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in experts:
            yield t


def home_device(model, layers, layout) -> torch.device:
    """Where the non-expert weights are: the device offloading targets unless told otherwise."""
    for t in non_expert_tensors(model, layers, layout):
        if not t.is_meta:
            return t.device
    raise ValueError("the model has no weights outside its experts: load it before offloading")


def on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (t.device.index or 0) == (device.index or 0)


def device_bytes_change(model, layers, layout, device: torch.device, store: str) -> int:
    """Bytes `device` gains by offloading, the cache aside: non-expert weights still elsewhere
    move there; expert weights already there leave it (unless the host store on the host keeps them)."""
    moving = sum(t.nbytes for t in non_expert_tensors(model, layers, layout) if not on(t, device))
    leaving = sum(p.nbytes for p in expert_params(layers, layout) if not p.is_meta and on(p, device))
    if device.type == "cpu" and store == "host":
        leaving = 0  # they leave the model for host buffers of the same size
    return moving - leaving


def move_non_experts(model, layers, layout, device: torch.device) -> None:
    """Put every parameter and buffer outside the experts on `device`, leaving the experts alone.
    Parameters move in place (`.data`), so tied weights and references to them stay valid."""
    experts = {id(p) for p in expert_params(layers, layout)}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in experts and not on(p, device):
                p.data = p.data.to(device)
        for name, b in module._buffers.items():
            if b is not None and not on(b, device):
                module._buffers[name] = b.to(device)


def load_experts(layers, layout, family, checkpoint, device: torch.device) -> None:
    """Fill the fused expert parameters of a model built without them, expert by expert from
    `checkpoint` (a resident run of such a model: the reference needs every expert in place)."""
    for layer in layers:
        fused = {name: torch.empty(layer.num_experts, *shape, dtype=layout.dtype, device=device)
                 for name, shape, _ in layout.fields}
        for e in range(layer.num_experts):
            for name, t in read_expert(checkpoint, family, layer.experts_path, e).items():
                fused[name][e].copy_(t)
        for name, t in fused.items():
            setattr(layer.experts, name, torch.nn.Parameter(t, requires_grad=False))


def drop_experts(layers, layout) -> None:
    """Give the experts back to the meta device: the model is again one built without them."""
    for layer in layers:
        for name, shape, _ in layout.fields:
            empty = torch.empty(layer.num_experts, *shape, dtype=layout.dtype, device="meta")
            setattr(layer.experts, name, torch.nn.Parameter(empty, requires_grad=False))


def quantise_experts(layers, layout) -> dict:
    """Give every expert's weights their values at `layout`'s bits (dequantised: the reference at those bits), in new
    parameters; returns the model's own, which restore_experts puts back."""
    from evalsuite.engine.placement.quantised import quantise_in_place

    own = {}
    for layer in layers:
        for name, _, _ in layout.fields:
            param = getattr(layer.experts, name)
            own[layer.index, name] = param
            setattr(layer.experts, name, torch.nn.Parameter(param.detach().clone(), requires_grad=False))
        quantise_in_place(layer.experts, layout)
    return own


def restore_experts(layers, own: dict) -> None:
    """The parameters quantise_experts (or an offloading engine) set aside, back in the model."""
    for layer in layers:
        for (index, name), param in own.items():
            if index == layer.index:
                setattr(layer.experts, name, param)
