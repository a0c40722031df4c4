"""Where offloaded experts live: one flat buffer per expert, in host memory or on disk.

An expert's tensors (gate_up_proj, down_proj and, for GPT-OSS, their biases) are packed back to
back in one flat buffer, so a transfer is one copy and a device cache slot is one flat row.
Checkpoint tensors are read with plain file reads (`Checkpoint`), never memory-mapped, so what
the process holds is what it allocated: experts already read do not stay mapped into it.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
EXPERT_BITS = (16, 8, 4)  # how an expert's weights may be stored: as they are, or quantised (placement/quantised.py)


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


# Pinned host memory comes from an allocator that rounds each allocation up to a power of two:
# experts are placed in slabs of this size, so rounding wastes less than one expert per slab.
SLAB_BYTES = 256 * 2**20


class HostStore:
    """Every expert of every sparse layer in host memory, each in a flat buffer of its own.

    The buffers are rows of a few slabs (pinned when the device is CUDA, so copies are
    asynchronous), filled expert by expert: from the model's fused parameters when they hold
    the weights, or straight from `checkpoint` when the model was built without its experts.
    """

    def __init__(self, layers, layout: ExpertLayout, pin: bool, checkpoint: "Checkpoint | None" = None,
                 family=None):
        self.layout = layout
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        per_slab = max(1, SLAB_BYTES // layout.nbytes)
        keys = [(layer, e) for layer in layers for e in range(layer.num_experts)]
        for first in range(0, len(keys), per_slab):
            chunk = keys[first:first + per_slab]
            slab = torch.empty(len(chunk), layout.numel, dtype=layout.dtype, pin_memory=pin)
            for (layer, e), row in zip(chunk, slab):
                if checkpoint is None:
                    layout.pack({name: getattr(layer.experts, name)[e] for name, _, _ in layout.fields}, row)
                else:
                    read_expert_into(checkpoint, family, layer.experts_path, e, layout, row)
                self.rows[layer.index, e] = row

    def copy_into(self, key: tuple[int, int], dst: torch.Tensor) -> None:
        dst.copy_(self.rows[key], non_blocking=True)

    def close(self) -> None:
        """Nothing to let go of: its rows are freed with it."""

    def read(self, key: tuple[int, int]) -> torch.Tensor:
        return self.rows[key]


class SafetensorsStore:
    """Experts read from the model's safetensors files when fetched: experts on flash.

    Nothing is read until an expert is fetched, and then each of its tensors is read from the file
    straight into its place in the expert's flat buffer (read_expert_into). A CPU slot is that
    buffer; a device slot is filled through a ring of staging buffers (pinned): an expert is read
    into one while the copies out of the others are still running, so reading and copying overlap.
    """

    STAGING = 2

    def __init__(self, checkpoint: str, layers, layout: ExpertLayout, family, pin: bool):
        self.layout = layout
        self.family = family
        self.paths = {layer.index: layer.experts_path for layer in layers}
        self.checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint, layout.dtype)
        missing = [p for p in self.paths.values() if not self.checkpoint.has_experts(p)]
        if missing:
            raise ValueError(f"checkpoint {self.checkpoint.path} has no tensors for {missing[0]}; "
                             "save the model with save_pretrained or use store='host'")
        self._staging_ring(layout, pin)

    def _staging_ring(self, layout, pin: bool) -> None:
        """The staging buffers a device slot is filled through, and what each last copied out."""
        self.staging = [torch.empty(layout.numel, dtype=layout.dtype, pin_memory=pin) for _ in range(self.STAGING)]
        self.copied: list = [None] * self.STAGING  # per staging buffer: the event its last copy records
        self.next = 0

    def _read_into(self, key: tuple[int, int], flat: torch.Tensor) -> None:
        layer, expert = key
        read_expert_into(self.checkpoint, self.family, self.paths[layer], expert, self.layout, flat)

    def read(self, key: tuple[int, int]) -> torch.Tensor:
        """A new flat buffer holding expert `key`."""
        flat = torch.empty(self.layout.numel, dtype=self.layout.dtype)
        self._read_into(key, flat)
        return flat

    def close(self) -> None:
        """Let go of the files it reads (Engine.close)."""
        self.checkpoint.close()

    def copy_into(self, key: tuple[int, int], dst: torch.Tensor) -> None:
        if dst.device.type == "cpu":
            self._read_into(key, dst)
            return
        i, self.next = self.next, (self.next + 1) % self.STAGING
        if self.copied[i] is not None:  # the buffer is still being copied out: wait for that copy only
            self.copied[i].synchronize()
        self._read_into(key, self.staging[i])
        dst.copy_(self.staging[i], non_blocking=True)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()  # on the current stream: the one the copy was queued on


def read_expert(checkpoint: "Checkpoint", family, experts_path: str, expert: int) -> dict[str, torch.Tensor]:
    """One expert's tensors from `checkpoint` by param name, in its dtype: each the family's sources
    (`expert_sources`) one after another along the first dimension."""
    out = {}
    for name, sources in family.expert_sources(checkpoint, experts_path, expert).items():
        parts = [checkpoint(key, index) for key, index in sources]
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


def read_expert_into(checkpoint: "Checkpoint", family, experts_path: str, expert: int, layout: ExpertLayout,
                     flat: torch.Tensor) -> None:
    """Expert `expert` read into its flat buffer `flat`: each source tensor straight from the file into its
    place (one read each, where the checkpoint's dtype is the layout's). Reading the tensors, joining
    gate and up and packing them took three passes over the expert's bytes and two fresh buffers the
    size of it: a Qwen3-30B-A3B expert's fetch into a CPU slot took 2.42 ms that way, 1.46 ms this way."""
    if getattr(layout, "dense", None) is not None:  # a quantised row: the dense tensors read, then packed
        layout.pack(read_expert(checkpoint, family, experts_path, expert), flat)
        return
    views = layout.views(flat)
    for name, sources in family.expert_sources(checkpoint, experts_path, expert).items():
        view, row = views[name], 0
        for key, index in sources:
            row += checkpoint.read_into(key, index, view[row:])
        if row != view.shape[0]:
            raise ValueError(f"checkpoint {checkpoint.path}: the tensors of {experts_path}.{name} for expert "
                             f"{expert} hold {row} rows, the model's {view.shape[0]}: it does not match config.json")


# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Checkpoint:
    """The tensors of a safetensors checkpoint by name, each read from its file on request.

    Calling it (`checkpoint(name, index=None)`) gives one tensor, or its `index`-th slice along
    the first dimension, in `dtype`; `read_into` writes one into a buffer of the caller's.
    """

    def __init__(self, path: str, dtype: torch.dtype | None = None):
        self.path, self.dtype = path, dtype
        self.entries: dict[str, tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        for file in sorted(set(_safetensors_index(path).values())):
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                self.entries[name] = (file, entry, 8 + size)
        self.fds: dict[str, int] = {}

    def has(self, name: str) -> bool:
        return name in self.entries

    def has_experts(self, experts_path: str) -> bool:
        stem = experts_path.replace(".mlp.experts", "")
        return any(k.startswith(stem + ".") and ".experts" in k for k in self.entries)

    def _locate(self, name: str, index: int | None) -> tuple[str, int, torch.dtype, list[int]]:
        """(file, byte offset, dtype, shape) of the tensor, or of its `index`-th slice along the first dimension."""
        if name not in self.entries:
            raise KeyError(f"checkpoint {self.path} has no tensor {name!r}")
        file, entry, data = self.entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} of {self.path} has dtype {entry['dtype']}, which cannot be read")
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if index is not None:
            begin, shape = begin + index * ((end - begin) // shape[0]), shape[1:]
        return file, data + begin, dtype, shape

    def tensor(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor as stored (its own dtype)."""
        file, offset, dtype, shape = self._locate(name, index)
        out = torch.empty(shape, dtype=dtype)
        self._read_bytes(file, offset, out)
        return out

    def read_into(self, name: str, index: int | None, out: torch.Tensor) -> int:
        """The tensor (as `__call__` gives it) written into the first rows of contiguous `out`, read from the file
        straight into them where it is stored in `out`'s dtype; returns the rows written."""
        file, offset, dtype, shape = self._locate(name, index)
        rows = shape[0] if shape else 1
        if list(out.shape[1:]) != shape[1:] or out.shape[0] < rows:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} has shape {shape}, which does not fit the "
                             f"model's {list(out.shape)}: it does not match config.json")
        if dtype == out.dtype:
            self._read_bytes(file, offset, out[:rows])
        else:
            out[:rows].copy_(self(name, index))
        return rows

    def __call__(self, name: str, index: int | None = None) -> torch.Tensor:
        t = self.tensor(name, index)
        return t if self.dtype is None else t.to(self.dtype)

    def _read_bytes(self, file: str, offset: int, out: torch.Tensor) -> None:
        """`out`'s bytes from `file` at `offset` (`out` contiguous, on the CPU)."""
        if file not in self.fds:
            self.fds[file] = os.open(file, os.O_RDONLY)
        read_exactly(self.fds[file], offset, out, f"{file} ends before its tensors do: the checkpoint is truncated")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def read_exactly(fd: int, offset: int, out: torch.Tensor, truncated: str) -> None:
    """`out`'s bytes (contiguous, on the CPU) from the open file `fd` at `offset`; ValueError(`truncated`) where the
    file ends first."""
    buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buffer):  # a large read may return fewer bytes than asked
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise ValueError(truncated)
        done += n


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
    return {"": single}
