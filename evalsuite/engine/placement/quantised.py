"""Quantised experts: an expert's row as packed integer codes, dequantised when the kernel reads it.

With `--expert-bits 8` or `4` the store, the link and the device cache hold each expert as a flat
`torch.uint8` row (`QuantisedLayout`) instead of its dense tensors: fewer bytes per transfer and
per cache slot. Each 2-D weight is quantised along its input dimension in groups of `group_size`
(asymmetric: a scale and a zero per group); the 1-D biases (GPT-OSS) are kept exact.

Quantisation and bit packing are HQQ's (`hqq.core.quantize.Quantizer`, the quantiser of
mixtral-offloading), run on the CPU so the codes do not depend on the device. HQQ keeps its
fp16-safe limits: a group whose range is under 1e-4 gets a step of 1 (it dequantises to its
minimum) and no step is under 5e-5, far below real expert weights' ranges (~0.1 per group).
Dequantisation is HQQ's too, computed in float32 from the row's bytes alone and rounded once to
the dense dtype: a pure function of the bytes. The resident reference ("resident at the same
bits") replaces every expert weight by exactly that function's result (`quantise_in_place`), so
offloaded modes that dequantise the same bytes compute bit-identical results.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from hqq.core.quantize import Quantizer

from .store import EXPERT_BITS as BITS, ExpertLayout

ALIGN = 16  # bytes: every segment (and so every row of a slab) starts aligned for a view as any dtype
_PACKING = {8: "8bit_u8", 4: "4bit_u8"}  # HQQ's bit packings: one code per byte, two codes per byte


def _shapes(layout_or_shapes) -> dict[str, tuple[int, ...]]:
    """name -> shape from an ExpertLayout / QuantisedLayout, a mapping name -> shape, or (name, shape, ...) tuples."""
    if hasattr(layout_or_shapes, "fields"):
        layout_or_shapes = layout_or_shapes.fields
    if isinstance(layout_or_shapes, Mapping):
        return {name: tuple(shape) for name, shape in layout_or_shapes.items()}
    return {entry[0]: tuple(entry[1]) for entry in layout_or_shapes}


def infer_transposed(shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether the 2-D weights are stored [in, out] (GPT-OSS: gate_up [H, 2I], down [I, H]) rather than
    [out, in] (gate_up [2I, H], down [H, I]). Told apart by the width they share, H: gate_up's last
    dimension is down's first in [out, in] (both can never hold, as 2I != I); [out, in] when unsure."""
    gate_up, down = shapes.get("gate_up_proj"), shapes.get("down_proj")
    if gate_up is None or down is None or len(gate_up) != 2 or len(down) != 2:
        return False
    return gate_up[1] != down[0] and gate_up[0] == down[1]


def _input_width(shape: tuple[int, ...], transposed: bool) -> int:
    return shape[0] if transposed else shape[-1]


def _suggest(widths: Iterable[int]) -> str:
    """Up to three group sizes that divide every width: the largest powers of two from 16 to 128, else any divisors."""
    common = math.gcd(*widths)
    options = [d for d in (16, 32, 64, 128) if common % d == 0][-3:] or \
        [d for d in range(1, min(common, 128) + 1) if common % d == 0][-3:]
    return ", ".join(map(str, options[:-1])) + (" or " if len(options) > 1 else "") + str(options[-1])


def check_quantisation(bits: int, group_size: int, layout_or_shapes, transposed: bool | None = None) -> None:
    """Raise a one-line ValueError saying what to do when experts of these shapes cannot be stored at
    `bits` with groups of `group_size` along each 2-D weight's input dimension (16 bits: always fine)."""
    if bits not in BITS:
        raise ValueError(f"expert_bits={bits!r} is not supported: use one of {', '.join(map(str, BITS))}")
    if bits == 16:
        return
    if bits not in Quantizer.SUPPORTED_BITS or bits not in _PACKING:
        raise ValueError(f"expert_bits={bits}: hqq's Quantizer cannot pack {bits}-bit codes here; "
                         "use expert_bits=8 or 4")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"expert_group_size={group_size!r} must be a positive integer such as 64")
    shapes = _shapes(layout_or_shapes)
    for name, shape in shapes.items():
        if len(shape) not in (1, 2):
            raise ValueError(f"expert tensor {name} {list(shape)} is neither a 1-D bias nor a 2-D weight: "
                             "store these experts at expert_bits=16")
    transposed = infer_transposed(shapes) if transposed is None else transposed
    weights = {name: shape for name, shape in shapes.items() if len(shape) == 2}
    widths = [_input_width(shape, transposed) for shape in weights.values()]
    for name, shape in weights.items():
        width = _input_width(shape, transposed)
        if width % group_size:
            raise ValueError(f"expert_group_size={group_size} does not divide {name}'s input width {width}: "
                             f"use a divisor such as {_suggest(widths)}")
        groups = math.prod(shape) // group_size
        if bits == 4 and groups % 2:
            raise ValueError(f"expert_bits=4 packs two groups per byte row but {name} {list(shape)} has {groups} "
                             f"groups of {group_size}: use a group size of {group_size // 2 or 1} or expert_bits=8")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class _Segment:
    """Where one tensor's bytes sit in a quantised row. A 2-D weight: its codes, then scale and zero
    (`groups` of each, in meta_dtype); a 1-D bias: its raw bytes at `codes` (groups == 0)."""

    name: str
    shape: tuple[int, ...]
    codes: int
    codes_nbytes: int
    scale: int = 0
    zero: int = 0
    groups: int = 0


@dataclass(frozen=True)
class QuantisedLayout:
    """An expert's tensors packed as quantised bytes in one flat uint8 row; the same interface as
    ExpertLayout (`fields`, `numel`, `dtype`, `nbytes`, `views`, `pack`), but `views` dequantises.

    `fields` keeps the dense names and shapes, each with the byte offset its bytes start at.
    """

    dense: ExpertLayout
    bits: int
    group_size: int
    meta_dtype: torch.dtype = torch.float16  # the per-group scale and zero
    transposed: bool = False  # 2-D weights stored [in, out] (GPT-OSS): grouped along dimension 0
    optimize: bool = False  # HQQ's half-quadratic refinement of scale and zero: slower (~20x), a little more exact
    fields: tuple[tuple[str, tuple[int, ...], int], ...] = field(init=False)
    numel: int = field(init=False)
    segments: tuple[_Segment, ...] = field(init=False, repr=False)
    _meta_size: int = field(init=False, repr=False, compare=False)  # bytes per scale or zero

    @classmethod
    def of(cls, dense: ExpertLayout, bits: int, group_size: int, meta_dtype: torch.dtype = torch.float16,
           transposed: bool | None = None, optimize: bool = False) -> "QuantisedLayout":
        if bits == 16:
            raise ValueError("expert_bits=16 keeps experts dense: use the ExpertLayout itself (layout_for)")
        return cls(dense, bits, group_size, meta_dtype,
                   infer_transposed(_shapes(dense)) if transposed is None else transposed, optimize)

    def __post_init__(self):
        check_quantisation(self.bits, self.group_size, self.dense, self.transposed)
        if not self.meta_dtype.is_floating_point:
            raise ValueError(f"meta_dtype={self.meta_dtype} must be a floating dtype such as torch.float16")
        meta_size = torch.empty((), dtype=self.meta_dtype).element_size()
        dense_size = torch.empty((), dtype=self.dense.dtype).element_size()
        segments, offset = [], 0
        for name, shape, _ in self.dense.fields:
            numel = math.prod(shape)
            if len(shape) == 2:
                groups = numel // self.group_size
                codes_nbytes = numel * self.bits // 8
                scale = _aligned(offset + codes_nbytes)
                zero = _aligned(scale + groups * meta_size)
                segments.append(_Segment(name, shape, offset, codes_nbytes, scale, zero, groups))
                offset = _aligned(zero + groups * meta_size)
            else:
                segments.append(_Segment(name, shape, offset, numel * dense_size))
                offset = _aligned(offset + numel * dense_size)
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "fields", tuple((s.name, s.shape, s.codes) for s in segments))
        object.__setattr__(self, "numel", offset)
        object.__setattr__(self, "_meta_size", meta_size)  # (read at every dequantisation: the kernel's path)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def nbytes(self) -> int:
        return self.numel

    def _grouped(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as [out, in], so groups of consecutive elements run along its input dimension."""
        return weight.t() if self.transposed else weight

    def _meta(self, flat: torch.Tensor, offset: int, groups: int) -> torch.Tensor:
        nbytes = groups * self._meta_size
        return flat[offset:offset + nbytes].view(self.meta_dtype).view(groups, 1)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's dense tensors (dense dtype and shapes), dequantised from the row `flat` (fresh tensors)."""
        out = {}
        for s in self.segments:
            raw = flat[s.codes:s.codes + s.codes_nbytes]
            if not s.groups:
                out[s.name] = raw.view(self.dense.dtype).view(s.shape).clone()
                continue
            rows = s.groups * self.bits // 8  # HQQ packs 4-bit codes two groups to a byte row
            shape = tuple(reversed(s.shape)) if self.transposed else s.shape
            meta = {"nbits": self.bits, "group_size": self.group_size, "shape": torch.Size(shape), "axis": 1,
                    "packing": _PACKING[self.bits], "view_as_float": False, "compute_dtype": torch.float32,
                    "scale": self._meta(flat, s.scale, s.groups), "zero": self._meta(flat, s.zero, s.groups)}
            weight = Quantizer.dequantize(raw.view(rows, self.group_size), meta).to(self.dense.dtype)
            out[s.name] = self._grouped(weight).contiguous()
        return out

    @torch.no_grad()
    def pack(self, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
        """Quantise the expert's dense `tensors` (by name) into the row `flat` (numel uint8 bytes, any device)."""
        if flat.dtype != torch.uint8 or flat.numel() != self.numel:
            raise ValueError(f"a quantised row is {self.numel} uint8 bytes, got {flat.numel()} {flat.dtype}")
        row = torch.zeros(self.numel, dtype=torch.uint8)  # built on the CPU: the codes never depend on the device
        for s in self.segments:
            tensor = tensors[s.name].detach().to("cpu")
            if tuple(tensor.shape) != s.shape:
                raise ValueError(f"{s.name} is {list(tensor.shape)}, the layout's {list(s.shape)}")
            if not s.groups:
                raw = tensor.to(self.dense.dtype).contiguous().view(-1)
                row[s.codes:s.codes + s.codes_nbytes] = raw.view(torch.uint8)
                continue
            codes, meta = Quantizer.quantize(self._grouped(tensor).float().contiguous(), nbits=self.bits,
                                             channel_wise=True, group_size=self.group_size, optimize=self.optimize,
                                             axis=1, bitpack=True, view_as_float=False, device="cpu")
            scale, zero = meta["scale"].to(self.meta_dtype), meta["zero"].to(self.meta_dtype)
            if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
                raise ValueError(f"{s.name}'s group scales or zeros overflow {self.meta_dtype}: "
                                 "use meta_dtype=torch.float32")
            row[s.codes:s.codes + s.codes_nbytes] = codes.reshape(-1)
            self._meta(row, s.scale, s.groups).copy_(scale.reshape(-1, 1))
            self._meta(row, s.zero, s.groups).copy_(zero.reshape(-1, 1))
        flat.copy_(row)

    def dequantised(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """views(pack(tensors)): what the kernel reads for these weights (the resident reference's weights)."""
        row = torch.empty(self.numel, dtype=torch.uint8)
        self.pack(tensors, row)
        return self.views(row)


DEFAULT_GROUP = 64


def default_group_size(layout_or_shapes) -> int:
    """DEFAULT_GROUP, or the largest power of two below it that divides every 2-D weight's input width (a tiny
    model's widths of 96)."""
    shapes = _shapes(layout_or_shapes)
    transposed = infer_transposed(shapes)
    common = math.gcd(*[_input_width(shape, transposed) for shape in shapes.values() if len(shape) == 2])
    group = DEFAULT_GROUP
    while common % group:
        group //= 2
    return group


def layout_for(dense: ExpertLayout, bits: int, group_size: int | None = None,
               **options) -> ExpertLayout | QuantisedLayout:
    """The layout of experts stored at `bits`: `dense` itself at 16 bits, else its QuantisedLayout with groups of
    `group_size` (default: default_group_size). A layout they cannot have is refused there (check_quantisation)."""
    if bits == 16:
        return dense
    return QuantisedLayout.of(dense, bits, group_size or default_group_size(dense), **options)


@torch.no_grad()
def quantise_in_place(experts: torch.nn.Module, layout: QuantisedLayout) -> None:
    """Replace every expert's 2-D weights in a fused experts module (`gate_up_proj` [E, ...], `down_proj`
    [E, ...]) by their dequantised values, expert by expert: the resident reference at `layout.bits`."""
    names = [name for name, _, _ in layout.fields]
    weights = [s.name for s in layout.segments if s.groups]
    for e in range(getattr(experts, weights[0]).shape[0]):
        values = layout.dequantised({name: getattr(experts, name)[e] for name in names})
        for name in weights:
            getattr(experts, name)[e].copy_(values[name])
