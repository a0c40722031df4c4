"""Quantised expert rows (QuantisedLayout): accuracy, size, determinism, exactness against the resident reference."""
import math

import pytest
import torch

from evalsuite.engine.arch import sparse_layers
from evalsuite.engine.placement.quantised import (ALIGN, BITS, QuantisedLayout, check_quantisation, layout_for,
                                                  quantise_in_place)
from evalsuite.engine.placement.store import ExpertLayout, HostStore
from evalsuite.zoo.tiny import tiny_model


def dense_layout(shapes: dict, dtype=torch.bfloat16) -> ExpertLayout:
    fields, offset = [], 0
    for name, shape in shapes.items():
        fields.append((name, shape, offset))
        offset += math.prod(shape)
    return ExpertLayout(tuple(fields), offset, dtype)


def random_weights(layout: ExpertLayout, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * 0.02).to(layout.dtype) for name, shape, _ in layout.fields}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# [out, in] weights, as Qwen/Mixtral/DeepSeek store them: gate_up [2I, H], down [H, I]
PLAIN = dense_layout({"gate_up_proj": (256, 128), "down_proj": (128, 128)})
# GPT-OSS: [in, out] weights and biases kept exact
GPT_OSS = dense_layout({"gate_up_proj": (128, 256), "gate_up_proj_bias": (256,), "down_proj": (128, 128),
                        "down_proj_bias": (128,)})


def test_round_trip_error_is_small_and_smaller_at_8_bits_than_at_4():
    weights = random_weights(PLAIN)
    errors = {bits: {name: rel_error(value, weights[name])
                     for name, value in QuantisedLayout.of(PLAIN, bits, 64).dequantised(weights).items()}
              for bits in (8, 4)}
    for name in weights:
        # uniform codes over a group's range (~4.8 sigma of a Gaussian): rms error ~ range / (2^bits - 1) / sqrt(12)
        assert errors[8][name] < 0.01, errors
        assert errors[4][name] < 0.12, errors
        assert errors[8][name] < errors[4][name] / 8, errors


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])
def test_bytes_per_row_follow_bits_group_size_and_metadata_dtype(bits, meta_dtype):
    group = 64
    layout = QuantisedLayout.of(PLAIN, bits, group, meta_dtype=meta_dtype)
    assert layout.dtype == torch.uint8 and layout.nbytes == layout.numel and layout.dense is PLAIN
    meta_size, dense_size = meta_dtype.itemsize, PLAIN.dtype.itemsize
    # per weight: bits/8 bytes of code plus a scale and a zero per group; at most ALIGN bytes of padding per segment
    expected = (bits / 8 + 2 * meta_size / group) / dense_size
    ratio = layout.nbytes / PLAIN.nbytes
    assert expected <= ratio <= expected + 3 * len(PLAIN.fields) * ALIGN / PLAIN.nbytes, (ratio, expected)
    assert layout.numel % ALIGN == 0  # rows of a slab stay aligned


@pytest.mark.parametrize("bits", [8, 4])
def test_packing_and_dequantising_are_deterministic(bits):
    weights = random_weights(PLAIN, seed=1)
    layout = QuantisedLayout.of(PLAIN, bits, 64)
    slab = torch.zeros(3, layout.numel, dtype=layout.dtype)  # rows of a slab, as the host store and cache hold them
    layout.pack(weights, slab[0])
    QuantisedLayout.of(PLAIN, bits, 64).pack(weights, slab[2])  # another instance, another row
    assert torch.equal(slab[0], slab[2])
    first, second = layout.views(slab[0]), layout.views(slab[2])
    for name, shape, _ in PLAIN.fields:
        assert first[name].shape == shape and first[name].dtype == PLAIN.dtype
        assert torch.equal(first[name], second[name])
        assert torch.equal(first[name], layout.views(slab[0])[name])


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantised_is_views_of_the_packed_row(bits):
    weights = random_weights(PLAIN, seed=2)
    layout = QuantisedLayout.of(PLAIN, bits, 32)
    row = torch.empty(layout.numel, dtype=torch.uint8)
    layout.pack(weights, row)
    viewed, dequantised = layout.views(row), layout.dequantised(weights)
    assert viewed.keys() == dequantised.keys() == weights.keys()
    assert all(torch.equal(viewed[name], dequantised[name]) for name in weights)


@pytest.mark.parametrize("bits", [8, 4])
def test_gpt_oss_layout_keeps_biases_exact_and_groups_along_the_input_dimension(bits):
    weights = random_weights(GPT_OSS, seed=3)
    weights["gate_up_proj_bias"] = torch.randn(256).to(torch.bfloat16)
    # output channels (columns of [in, out]) twenty times apart: only groups along the input keep both
    weights["down_proj"] = weights["down_proj"] * torch.tensor([0.05, 1.0]).repeat(64).to(torch.bfloat16)
    layout = QuantisedLayout.of(GPT_OSS, bits, 64)
    assert layout.transposed  # told from the shapes: gate_up [H, 2I], down [I, H]
    out = layout.dequantised(weights)
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        assert torch.equal(out[name], weights[name])
    for name in ("gate_up_proj", "down_proj"):
        assert out[name].shape == weights[name].shape and out[name].dtype == torch.bfloat16
    small = slice(0, None, 2)
    assert rel_error(out["down_proj"][:, small], weights["down_proj"][:, small]) < 0.12
    assert rel_error(out["gate_up_proj"], weights["gate_up_proj"]) < 0.12


def test_bad_group_size_and_bits_are_refused_in_one_line():
    with pytest.raises(ValueError) as bad_group:
        check_quantisation(4, 48, PLAIN)
    assert str(bad_group.value) == ("expert_group_size=48 does not divide gate_up_proj's input width 128: "
                                    "use a divisor such as 32, 64 or 128")
    with pytest.raises(ValueError, match=r"^expert_bits=5 is not supported: use one of 16, 8, 4$"):
        check_quantisation(5, 64, PLAIN)
    with pytest.raises(ValueError, match="expert_group_size=48 does not divide"):
        QuantisedLayout.of(PLAIN, 8, 48)
    with pytest.raises(ValueError, match="expert_bits=3"):
        QuantisedLayout.of(PLAIN, 3, 64)
    with pytest.raises(ValueError, match="positive integer"):
        check_quantisation(8, 0, PLAIN)
    # [in, out] weights are grouped along dimension 0: GPT-OSS's down_proj [I=96, H=128]
    with pytest.raises(ValueError, match="down_proj's input width 96: use a divisor such as 16 or 32$"):
        check_quantisation(8, 64, {"gate_up_proj": (128, 192), "down_proj": (96, 128)})
    check_quantisation(16, 48, PLAIN)  # dense experts have no groups
    assert layout_for(PLAIN, 16, 48) is PLAIN
    assert isinstance(layout_for(PLAIN, 4, 64), QuantisedLayout)
    assert BITS == (16, 8, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_resident_reference_equals_the_packed_rows_of_a_tiny_model(bits, dtype):
    model = tiny_model("qwen3_moe", dtype=dtype)
    layers = sparse_layers(model)
    experts = layers[0].experts
    dense = ExpertLayout.of(experts)
    with pytest.raises(ValueError, match="down_proj's input width 32"):  # the tiny model's I is 32
        QuantisedLayout.of(dense, bits, 64)
    layout = QuantisedLayout.of(dense, bits, 32)
    store = HostStore(layers[:1], layout, pin=False)  # the store holds quantised rows unchanged
    rows = [store.read((layers[0].index, e)) for e in range(layers[0].num_experts)]
    assert all(row.dtype == torch.uint8 and row.numel() == layout.numel for row in rows)
    before = experts.gate_up_proj.detach().clone()
    quantise_in_place(experts, layout)
    assert not torch.equal(experts.gate_up_proj, before)
    for e, row in enumerate(rows):
        viewed = layout.views(row)
        for name, _, _ in dense.fields:
            assert torch.equal(getattr(experts, name)[e], viewed[name]), (e, name)
