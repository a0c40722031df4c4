"""Models larger than the device: built without their experts, offloaded to any device, exact."""
import copy
import math

import pytest
import torch

from evalsuite.engine import arch
from evalsuite.engine.cache import slots as cache_module
from evalsuite.engine import load_offloaded, load_skeleton, offload
from evalsuite.engine.placement.store import Checkpoint, ExpertLayout, HostStore, read_expert, read_expert_into
from evalsuite.generate import load_model
from .helpers import batch, reference_model

ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "gpt_oss"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> directory of its tiny reference model, saved with save_pretrained."""
    out = {}
    for model_type in ARCHS:
        path = tmp_path_factory.mktemp(model_type)
        copy.deepcopy(reference_model(model_type)).save_pretrained(path)  # saving changes the config
        out[model_type] = str(path)
    return out


def _reference(model_type, ids, mask):
    with torch.no_grad():
        model = reference_model(model_type)
        return (model(input_ids=ids, attention_mask=mask).logits,
                model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))


def _run(model, ids, mask):
    with torch.no_grad():
        return (model(input_ids=ids, attention_mask=mask).logits,
                model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("model_type", ARCHS)
def test_disk_store_never_materialises_experts_and_is_exact(saved, model_type):
    skeleton = load_skeleton(saved[model_type], dtype=torch.float32)
    layers = arch.sparse_layers(skeleton)
    assert all(layer.experts.gate_up_proj.is_meta and layer.experts.down_proj.is_meta for layer in layers)
    assert not any(p.is_meta for n, p in skeleton.named_parameters() if ".experts." not in n)
    ids, mask = batch(3)
    model, engine = load_offloaded(saved[model_type], dtype=torch.float32, store="disk", cache_capacity=0.5)
    assert engine.device_expert_bytes() == engine.cache.nbytes  # only the cache holds expert weights
    logits, tokens = _run(model, ids, mask)
    want_logits, want_tokens = _reference(model_type, ids, mask)
    assert torch.equal(logits, want_logits) and torch.equal(tokens, want_tokens)
    engine.close()
    assert all(layer.experts.gate_up_proj.is_meta for layer in arch.sparse_layers(model))  # not read back whole


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_host_store_reads_expert_by_expert_into_own_buffers(saved, model_type):
    model, engine = load_offloaded(saved[model_type], dtype=torch.float32, store="host", cache_capacity=0.25)
    store, layers = engine.store, engine.layers
    assert isinstance(store, HostStore)
    assert len(store.rows) == sum(layer.num_experts for layer in layers)
    assert all(row.shape == (engine.layout.numel,) and row.is_contiguous() for row in store.rows.values())
    pointers = {row.data_ptr() for row in store.rows.values()}
    assert len(pointers) == len(store.rows)  # one buffer per expert, none shared
    ids, mask = batch(2)
    logits, tokens = _run(model, ids, mask)
    want_logits, want_tokens = _reference(model_type, ids, mask)
    assert torch.equal(logits, want_logits) and torch.equal(tokens, want_tokens)
    engine.close()


def test_host_store_of_a_loaded_model_keeps_its_outputs():
    model = copy.deepcopy(reference_model("olmoe"))
    ids, mask = batch(2)
    with offload(model, mode="on-demand", store="host", cache_capacity=0.25) as engine:
        assert len({row.data_ptr() for row in engine.store.rows.values()}) == 3 * 8
        logits, tokens = _run(model, ids, mask)
    want_logits, want_tokens = _reference("olmoe", ids, mask)
    assert torch.equal(logits, want_logits) and torch.equal(tokens, want_tokens)
    # close() put every expert back
    for mine, theirs in zip(arch.sparse_layers(model), arch.sparse_layers(reference_model("olmoe"))):
        assert torch.equal(mine.experts.gate_up_proj, theirs.experts.gate_up_proj)


def test_device_may_differ_from_where_the_model_sits(saved):
    skeleton = load_skeleton(saved["qwen3_moe"], dtype=torch.float32)  # experts on meta, the rest on the CPU
    ids, mask = batch(2)
    with offload(skeleton, mode="on-demand", device="cpu", store="disk", cache_capacity=0.5) as engine:
        assert engine.device == torch.device("cpu")
        logits, _ = _run(skeleton, ids, mask)
    assert torch.equal(logits, _reference("qwen3_moe", ids, mask)[0])
    whole = copy.deepcopy(reference_model("qwen3_moe"))
    with offload(whole, mode="on-demand", device=torch.device("cpu"), cache_capacity=0.5):
        assert torch.equal(_run(whole, ids, mask)[0], _reference("qwen3_moe", ids, mask)[0])


def test_bad_device_is_refused_before_the_model_is_touched():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        offload(model, mode="on-demand", device="gpu0")
    assert arch.sparse_layers(model)[0].experts.gate_up_proj.numel() > 0


def test_resident_reads_the_experts_in_and_close_drops_them(saved):
    skeleton = load_skeleton(saved["mixtral"], dtype=torch.float32)
    ids, mask = batch(2)
    with offload(skeleton, mode="resident"):
        assert torch.equal(_run(skeleton, ids, mask)[0], _reference("mixtral", ids, mask)[0])
    assert arch.sparse_layers(skeleton)[0].experts.gate_up_proj.is_meta


def test_fit_check_counts_the_experts_the_cache_replaces(monkeypatch, tmp_path):
    """Offloading a model that sits whole on the device frees its experts there: a cache that fits
    only once they leave is accepted (disk store); the host store on the host keeps them, so the
    same cache is refused there."""
    model = copy.deepcopy(reference_model("qwen3_moe"))
    model.save_pretrained(tmp_path)
    experts = sum(l.experts.gate_up_proj.nbytes + l.experts.down_proj.nbytes for l in arch.sparse_layers(model))
    monkeypatch.setattr(cache_module, "free_bytes", lambda device: int(0.3 * experts / 0.9))  # < half of them
    with offload(model, mode="on-demand", store="disk", checkpoint=str(tmp_path), cache_capacity=0.5) as engine:
        assert engine.cache.nbytes == experts // 2
    with pytest.raises(ValueError, match="does not fit"):
        offload(copy.deepcopy(reference_model("qwen3_moe")), mode="on-demand", store="host", cache_capacity=0.5)


def test_checkpoint_reads_tensors_and_slices(saved):
    from safetensors import safe_open

    checkpoint = Checkpoint(saved["gpt_oss"])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(f"{saved['gpt_oss']}/model.safetensors", framework="pt") as f:
        whole = f.get_tensor(name)
    assert torch.equal(checkpoint.tensor(name), whole)
    assert torch.equal(checkpoint.tensor(name, index=5), whole[5])
    with pytest.raises(KeyError, match="no tensor"):
        checkpoint.tensor("nope")
    checkpoint.close()


def test_generate_loads_a_directory_without_experts_for_the_disk_store(saved):
    model, _ = load_model(saved["olmoe"], "float32", "cpu", store="disk")
    assert arch.sparse_layers(model)[0].experts.gate_up_proj.is_meta
    model, _ = load_model(saved["olmoe"], "float32", "cpu")
    assert not arch.sparse_layers(model)[0].experts.gate_up_proj.is_meta


def test_a_checkpoint_with_fused_experts_is_read_one_expert_at_a_time():
    """Qwen3-VL-MoE checkpoints keep each layer's experts fused ([E, ...] tensors): the disk store reads one
    expert's slice of them, and the model built without its experts gives the loaded model's tokens."""
    from transformers import AutoModelForImageTextToText

    from .helpers import shipped_model

    path = shipped_model("tiny-qwen3-vl-moe")
    ids, mask = batch(2, vocab=100)
    whole = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    whole.set_experts_implementation("eager")
    skeleton = load_skeleton(path, torch.float32, "cpu", AutoModelForImageTextToText)
    with torch.no_grad(), offload(skeleton, mode="on-demand", store="disk", cache_capacity=0.25):
        got = skeleton.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = whole.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_a_disk_fetch_reads_each_tensor_straight_into_the_expert_buffer(saved, model_type, monkeypatch):
    """One read per tensor, into its place in the flat buffer, where the checkpoint holds the model's dtype
    (no tensor of its own is made to be joined and packed); in another dtype, converted on the way; a
    checkpoint whose tensors do not fit the model's shapes is refused in one line."""
    skeleton = load_skeleton(saved[model_type], dtype=torch.float32)
    layer, family = arch.sparse_layers(skeleton)[1], arch.family_of(skeleton)
    layout = ExpertLayout.of(reference_model(model_type).model.layers[layer.index].mlp.experts)
    wanted = torch.empty(layout.numel)
    layout.pack(read_expert(Checkpoint(saved[model_type], torch.float32), family, layer.experts_path, 3), wanted)
    gate_up = reference_model(model_type).model.layers[layer.index].mlp.experts.gate_up_proj[3]
    assert layout.fields[0][0] == "gate_up_proj" and torch.equal(wanted[:gate_up.numel()], gate_up.reshape(-1))
    checkpoint = Checkpoint(saved[model_type], torch.float32)
    monkeypatch.setattr(Checkpoint, "tensor", lambda *a, **k: pytest.fail("read through a tensor of its own"))
    flat = torch.full((layout.numel,), float("nan"))
    read_expert_into(checkpoint, family, layer.experts_path, 3, layout, flat)
    assert torch.equal(flat, wanted)
    monkeypatch.undo()
    half = torch.empty(layout.numel, dtype=torch.bfloat16)
    read_expert_into(Checkpoint(saved[model_type], torch.bfloat16), family, layer.experts_path, 3,
                     ExpertLayout(layout.fields, layout.numel, torch.bfloat16), half)
    assert torch.equal(half, wanted.to(torch.bfloat16))
    name, shape, offset = layout.fields[-1]
    narrow = ExpertLayout(layout.fields[:-1] + ((name, (shape[0] + 1, *shape[1:]), offset),),
                          layout.numel + math.prod(shape[1:]), torch.float32)
    with pytest.raises(ValueError, match="does not match config.json"):
        read_expert_into(checkpoint, family, layer.experts_path, 3, narrow, torch.empty(narrow.numel))
