"""The engine's counters add up, and the device never holds more than the cache's capacity."""
import copy

import pytest
import torch

import evalsuite

from .helpers import batch, reference_model


@pytest.mark.parametrize("model_type,capacity", [("qwen3_moe", 2), ("qwen3_moe", 0.5), ("gpt_oss", 3),
                                                  ("deepseek_v3", "all"), ("mixtral", "64KiB")])
def test_counters_add_up(model_type, capacity):
    model = copy.deepcopy(reference_model(model_type, "float32"))
    ids, mask = batch(4)
    with evalsuite.offload(model, cache_capacity=capacity) as engine:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        s = engine.stats()
        capacity_bytes = s["cache_experts"] * s["expert_bytes"]
        # measured from the tensors actually allocated: cache slots plus what is left in the model
        assert engine.device_expert_bytes() <= capacity_bytes
        assert all(getattr(l.experts, "gate_up_proj").numel() == 0 for l in engine.layers)
    assert s["expert_uses"] > 0
    assert s["hits"] + s["misses"] == s["expert_uses"]
    assert s["bytes_transferred"] == s["misses"] * s["expert_bytes"]
    for name in ("expert_uses", "hits", "misses", "bytes_transferred"):
        assert sum(layer[name] for layer in s["layers"].values()) == s[name]
    assert s["requests"] == 1 and s["sequences"] == 4 and s["tokens"] == 4 * 6  # 6 forward passes
    # TPOT per sequence: the batch's four sequences each got one token per step
    assert s["ttft_ms"]["n"] == 4 and s["tpot_ms"]["n"] == 4 and s["tpot_ms"]["mean"] > 0
    assert s["tpot_ms"]["p10"] <= s["tpot_ms"]["median"] <= s["tpot_ms"]["p90"]


def test_full_cache_hits_after_warmup():
    model = copy.deepcopy(reference_model("olmoe", "float32"))
    ids, mask = batch(2)
    with evalsuite.offload(model, cache_capacity="all") as engine, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        engine.reset_stats()
        model(input_ids=ids, attention_mask=mask)
        s = engine.stats()
    assert s["misses"] == 0 and s["hits"] == s["expert_uses"] > 0 and s["hit_rate"] == 1.0


def test_smaller_cache_misses_more():
    misses = {}
    for capacity in (2, 0.5, "all"):
        model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
        with evalsuite.offload(model, cache_capacity=capacity) as engine, torch.no_grad():
            model.generate(*batch(1)[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
            misses[capacity] = engine.stats()["misses"]
    assert misses[2] > misses[0.5] > misses["all"]
    assert misses["all"] <= 3 * 8  # each expert fetched at most once


def test_stall_per_token_is_what_the_decode_steps_waited_per_step():
    # the prefill's wait is TTFT's: counted into the stall per token, it read 159 ms beside a 224 ms TPOT
    # (Qwen3-30B-A3B shapes on ufs4), and the bench subtracted it from TPOT as if decode had waited it
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    ids, mask = batch(2)
    with evalsuite.offload(model, cache_capacity=2, link="1GB/s+2000us") as engine, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        s = engine.stats()
    decode = sum(layer["decode_stall_s"] for layer in s["layers"].values())
    assert decode == pytest.approx(s["decode_stall_s"]) and 0 < decode < s["stall_s"]  # the prefill waited too
    assert s["stall_ms_per_token"] == pytest.approx(decode * 1e3 / 3)  # 4 forward passes: 3 decode steps


def test_prefetch_turns_misses_into_hits():
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    ids, mask = batch(1)
    with evalsuite.offload(model, cache_capacity="all") as engine, torch.no_grad():
        started = sum(engine.prefetch(layer.index, range(layer.num_experts)) for layer in engine.layers)
        assert engine.prefetch(0, range(8)) == 0  # already resident or in flight
        model(input_ids=ids, attention_mask=mask)
        s = engine.stats()
    assert started == 24 and s["prefetches"] == 24 and s["misses"] == 0
    assert s["bytes_transferred"] == (s["misses"] + s["prefetches"]) * s["expert_bytes"]


def test_resident_mode_computes_with_the_models_own_kernel_and_counts_every_use_a_hit(model_type="mixtral"):
    ids, mask = batch(4, seq=24)
    logits = {}
    for kernel in ("eager", "grouped_mm"):
        model = copy.deepcopy(reference_model(model_type, "bfloat16"))  # where the kernels round differently
        model.set_experts_implementation(kernel)
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids, attention_mask=mask).logits
            with evalsuite.offload(model, mode="resident") as engine:
                assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits[kernel])
                stats = engine.stats()
        assert model.config._experts_implementation == kernel  # handed back on close
        assert stats["hits"] == stats["expert_uses"] > 0 and stats["misses"] == 0
    assert not torch.equal(logits["eager"], logits["grouped_mm"])  # the kernels differ, so the test tells them apart


def test_the_spread_holds_the_median_even_where_the_percentile_formula_rounds_above_it():
    from evalsuite.engine.metrics import summarise

    seconds = [0.0017461749148192807] * 5 + [0.006682027389099894]  # quantiles() gives p10 one ulp above
    spread = summarise(seconds)
    assert spread["p10"] <= spread["median"] <= spread["p90"]
    assert spread["median"] == pytest.approx(1.7461749148192807) and spread["p90"] > spread["median"]
