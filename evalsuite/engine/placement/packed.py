"""Quantised experts on disk: every expert's packed row (QuantisedLayout) in one file beside the checkpoint.

`evalsuite pack-experts` (write_packed) quantises a checkpoint's experts once, expert by expert, so its memory
stays one expert whatever the model's size. The disk store at expert_bits 8 or 4 (PackedStore) then reads one
row per fetch: the bytes read from flash are the packed bytes, as the bytes over the link are.

The file: 8 bytes (little-endian header length), the header (JSON: what the rows are and in which order), then
the rows back to back, layer by layer and expert by expert.
"""
from __future__ import annotations

import json
import os
import struct

import torch

from evalsuite.engine.placement.store import Checkpoint, SafetensorsStore, read_expert, read_exactly

FORMAT, VERSION = "evalsuite-packed-experts", 1


def packed_path(checkpoint: str, layout) -> str:
    """Where the experts of the checkpoint in directory `checkpoint` are packed at `layout`'s bits and group size."""
    return os.path.join(checkpoint, f"experts-{layout.bits}bit-g{layout.group_size}.packed")


def pack_command(checkpoint: str, layout) -> str:
    """The command that writes packed_path(checkpoint, layout)."""
    return (f"evalsuite pack-experts --model {checkpoint} --expert-bits {layout.bits} --expert-group-size "
            f"{layout.group_size}")


def _header(layout, layers) -> dict:
    """What a packed file must say to hold these layers' experts as `layout` packs them."""
    return {"format": FORMAT, "version": VERSION, "bits": layout.bits, "group_size": layout.group_size,
            "meta_dtype": str(layout.meta_dtype), "transposed": layout.transposed,
            "dense_dtype": str(layout.dense.dtype), "fields": [[name, list(shape)] for name, shape, _ in layout.fields],
            "row_bytes": layout.nbytes, "layers": [[layer.index, layer.num_experts] for layer in layers]}


def write_packed(checkpoint: str, layers, layout, family, progress=None) -> str:
    """Pack every expert of `layers` read from the safetensors checkpoint in directory `checkpoint` at `layout`,
    into packed_path(checkpoint, layout); returns the path. Written under a temporary name and renamed at the
    end, so a file cut off mid-way is never taken for a whole one."""
    path = packed_path(checkpoint, layout)
    header = json.dumps(_header(layout, layers)).encode()
    source = Checkpoint(checkpoint, layout.dense.dtype)
    row = torch.empty(layout.numel, dtype=torch.uint8)
    partial = path + ".partial"
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for layer in layers:
                for expert in range(layer.num_experts):
                    layout.pack(read_expert(source, family, layer.experts_path, expert), row)
                    f.write(row.numpy().tobytes())
                if progress is not None:
                    progress(layer)
        os.replace(partial, path)
    finally:
        source.close()
        if os.path.exists(partial):
            os.remove(partial)
    return path


class PackedStore(SafetensorsStore):
    """The disk store of quantised experts: one packed row read from the packed file per fetch (into a CPU slot
    directly, into a device slot through the staging ring, as SafetensorsStore reads dense ones)."""

    def __init__(self, checkpoint: str, layers, layout, pin: bool):
        path = packed_path(checkpoint, layout)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no experts packed at {layout.bits} bits (group {layout.group_size}) in "
                                    f"{checkpoint}: run `{pack_command(checkpoint, layout)}` first")
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            found = json.loads(f.read(size))
        wanted = _header(layout, layers)
        differ = [key for key in wanted if found.get(key) != wanted[key]]
        if differ:
            raise ValueError(f"{path} holds experts packed for another model or layout ({', '.join(differ)} "
                             "differ): run `evalsuite pack-experts` again for this one")
        self.layout, self.path = layout, path
        start, rows = 8 + size, 0
        self.offsets = {}
        for index, experts in found["layers"]:
            for expert in range(experts):
                self.offsets[index, expert] = start + rows * layout.nbytes
                rows += 1
        self.fd = os.open(path, os.O_RDONLY)
        self._staging_ring(layout, pin)

    def _read_into(self, key: tuple[int, int], flat: torch.Tensor) -> None:
        read_exactly(self.fd, self.offsets[key], flat, f"{self.path} ends before its rows do: pack the experts again")

    def close(self) -> None:
        """Let go of the packed file (Engine.close)."""
        os.close(self.fd)
