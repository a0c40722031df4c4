"""Where offloaded experts live: one flat buffer per expert, in host memory or on disk.

An expert's tensors (gate_up_proj, down_proj and, for GPT-OSS, their biases) are packed back to
back in one flat buffer, so a transfer is one copy and a device cache slot is one flat row.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclass(frozen=True)
class ExpertLayout:
    """The shapes of one expert's tensors and their offsets inside its flat buffer."""

    fields: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, offset)
    numel: int
    dtype: torch.dtype

    @classmethod
    def of(cls, experts: torch.nn.Module) -> "ExpertLayout":
        fields, offset = [], 0
        for name in EXPERT_PARAMS:
            param = getattr(experts, name, None)
            if isinstance(param, torch.Tensor) and param.dim() >= 2:
                shape = tuple(param.shape[1:])
                fields.append((name, shape, offset))
                offset += math.prod(shape)
        return cls(tuple(fields), offset, experts.gate_up_proj.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's tensors as views into `flat` (no copy)."""
        return {name: flat[off:off + math.prod(shape)].view(shape) for name, shape, off in self.fields}

    @torch.no_grad()
    def pack(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        for name, view in self.views(flat).items():
            view.copy_(tensors[name])


class HostStore:
    """Every expert of every sparse layer, taken out of the model into host memory.

    One row of one contiguous buffer per expert (pinned when CUDA is present, so copies to the
    device can be asynchronous). The model's fused expert parameters are emptied afterwards.
    """

    def __init__(self, layers, layout: ExpertLayout, pin: bool):
        self.layout = layout
        self.row = {}
        count = sum(layer.num_experts for layer in layers)
        self.buffer = torch.empty(count, layout.numel, dtype=layout.dtype, pin_memory=pin)
        for layer in layers:
            fused = {name: getattr(layer.experts, name) for name, _, _ in layout.fields}
            for e in range(layer.num_experts):
                row = len(self.row)
                self.row[layer.index, e] = row
                layout.pack({name: t[e] for name, t in fused.items()}, self.buffer[row])

    def copy_into(self, key: tuple[int, int], dst: torch.Tensor) -> None:
        dst.copy_(self.buffer[self.row[key]], non_blocking=True)

    def read(self, key: tuple[int, int]) -> torch.Tensor:
        return self.buffer[self.row[key]]


class SafetensorsStore:
    """Experts read lazily from the model's safetensors files (memory-mapped): experts on flash.

    Nothing is read until an expert is fetched; each fetch reads that expert's tensors from the
    checkpoint, packs them into a staging buffer and copies that to the device slot.
    """

    def __init__(self, checkpoint: str, layers, layout: ExpertLayout, family, pin: bool):
        self.layout = layout
        self.family = family
        self.paths = {layer.index: layer.experts_path for layer in layers}
        self.key_file = _safetensors_index(checkpoint)
        self.files = {f: safe_open(f, framework="pt") for f in set(self.key_file.values())}
        self.staging = torch.empty(layout.numel, dtype=layout.dtype, pin_memory=pin)
        missing = [p for p in self.paths.values() if not self._has_any(p)]
        if missing:
            raise ValueError(f"checkpoint {checkpoint} has no tensors for {missing[0]}; "
                             "save the model with save_pretrained or use store='host'")

    def _has_any(self, experts_path: str) -> bool:
        stem = experts_path.replace(".mlp.experts", "")
        return any(k.startswith(stem + ".") and ".experts" in k for k in self.key_file)

    def __call__(self, name: str, index: int | None = None) -> torch.Tensor:
        """One checkpoint tensor (or its `index`-th slice), in the layout's dtype."""
        f = self.files[self.key_file[name]]
        t = f.get_slice(name)[index] if index is not None else f.get_tensor(name)
        return t.to(self.layout.dtype)

    def has(self, name: str) -> bool:
        return name in self.key_file

    def read(self, key: tuple[int, int]) -> torch.Tensor:
        layer, expert = key
        tensors = self.family.read_expert(self, self.paths[layer], expert)
        self.layout.pack(tensors, self.staging)
        return self.staging

    def copy_into(self, key: tuple[int, int], dst: torch.Tensor) -> None:
        # Synchronous: the staging buffer is reused by the next read.
        dst.copy_(self.read(key))


def _safetensors_index(checkpoint: str) -> dict[str, str]:
    """Map every tensor name to the safetensors file that holds it."""
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(checkpoint, v) for k, v in weight_map.items()}
    single = os.path.join(checkpoint, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no safetensors checkpoint in {checkpoint!r}: store='disk' needs a "
                                "directory written by save_pretrained")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}
