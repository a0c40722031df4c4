"""Bad input gets a clear one-line error that says what to do."""
import copy
import os
import re
import subprocess
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import evalsuite
from evalsuite.engine.arch import UnsupportedModelError
from evalsuite.zoo.tiny import tiny_model

from .helpers import reference_model


def fresh(model_type="qwen3_moe"):
    return copy.deepcopy(reference_model(model_type, "float32"))


def test_dense_model_names_the_supported_types():
    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported; evalsuite offloads: .*qwen3_moe"):
        evalsuite.offload(dense)


def test_moe_config_without_sparse_layers():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    model.config.model_type = "qwen3_moe"
    for layer in model.model.layers:
        del layer.mlp.experts
    with pytest.raises(UnsupportedModelError, match="no sparse MoE layers"):
        evalsuite.offload(model)


@pytest.mark.parametrize("capacity,pools", [(1, "global"), (5, "per-layer"), ("100B", "global")])
def test_capacity_below_top_k(capacity, pools):
    with pytest.raises(ValueError, match="below top-k=2.*use at least"):
        evalsuite.offload(fresh(), cache_capacity=capacity, cache_pools=pools)


@pytest.mark.parametrize("option,value,message", [
    ("mode", "fast", "mode='fast' is not one of: resident, on-demand"),
    ("cache_policy", "mru", "cache_policy='mru' is not one of: lru, lfu, least-stale, predicted"),
    ("cache_pools", "shared", "cache_pools='shared'"),
    ("store", "tape", "store='tape'"),
    ("link", "carrier-pigeon", "unknown link 'carrier-pigeon'"),
    ("cache_capacity", 0, "at least one expert"),
    ("cache_capacity", 2.5, r"fraction must lie in \(0, 1\]"),
])
def test_bad_options(option, value, message):
    model = fresh()
    with pytest.raises(ValueError, match=message):
        evalsuite.offload(model, **{option: value})
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0  # nothing was taken out


@pytest.mark.parametrize("option,value,message", [
    ("transfer_timeout_s", "abc", "transfer_timeout_s='abc' must be a number of seconds above 0"),
    ("transfer_timeout_s", float("inf"), "transfer_timeout_s=inf must be a number of seconds above 0"),
    ("transfer_timeout_s", float("nan"), "transfer_timeout_s=nan"),
    ("transfer_timeout_s", -1, "transfer_timeout_s=-1"),
    ("transfer_timeout_s", 0, "transfer_timeout_s=0"),
    ("horizon", 0, "horizon=0 must be a whole number of at least 1"),
    ("horizon", "2", "horizon='2'"),
    ("prefetch_budget", 0, "prefetch_budget=0"),
    ("prefetch_budget", 2.5, "prefetch_budget=2.5"),
    ("window", "no", "window='no' must be True or False"),
    ("trace", 1, "trace=1 must be True or False"),
    ("drift_threshold", float("nan"), "drift_threshold=nan must be a number in [0, 1]"),
    ("drift_threshold", 1.5, "drift_threshold=1.5"),
    ("recall_k", [0], "recall_k=[0]"),
    ("recall_k", 2, "recall_k=2 must be a list"),
    ("drift_layers", ["x"], "drift_layers=['x']"),
    ("preserve_layers", [-1], "preserve_layers=[-1]"),
    ("cache_capacity", float("nan"), "cache_capacity=nan"),
    ("cache_capacity", True, "cache_capacity=True"),
])
@pytest.mark.parametrize("mode", ["resident", "speculative"])
def test_bad_numeric_options(mode, option, value, message):
    """Every option is checked whatever the mode, including those the mode does not use."""
    model = fresh()
    with pytest.raises(ValueError, match=re.escape(message)):
        evalsuite.offload(model, mode=mode, **{option: value})
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0
    assert getattr(model, "_evalsuite_engine", None) is None


@pytest.mark.parametrize("top_k,message", [(0, "num_experts_per_tok=0"), (9, "num_experts_per_tok=9")])
def test_top_k_outside_one_to_the_number_of_experts(top_k, message):
    model = tiny_model("qwen3_moe", num_experts_per_tok=top_k)
    with pytest.raises(UnsupportedModelError, match=f"{message} .*between 1 and the 8 experts"):
        evalsuite.offload(model)


def test_disk_store_without_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        evalsuite.offload(fresh(), store="disk", checkpoint=str(tmp_path))


def test_offloading_twice_is_refused():
    model = fresh()
    with evalsuite.offload(model, cache_capacity=4):
        with pytest.raises(ValueError, match="already offloaded"):
            evalsuite.offload(model)
    evalsuite.offload(model, cache_capacity=4).close()  # after close it can be offloaded again


def test_cli_errors_are_one_line_with_exit_code_2():
    result = subprocess.run([sys.executable, "-m", "evalsuite.cli", "generate", "--model", "tiny:llama"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "unknown tiny model 'llama': use one of" in result.stderr


def test_cli_generate_table(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "-m", "evalsuite.cli", "generate", "--model", "tiny:deepseek_v3",
                             "--max-new-tokens", "3", "--cache-capacity", "2", "--link", "pcie4", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["mode", "predictor", "same", "recall", "uses"]
    assert lines[2].split()[:3] == ["resident", "-", "ref"] and lines[3].split()[:3] == ["on-demand", "-", "yes"]
    assert out.exists()


def test_cli_calibrate_then_generate_with_the_artifact(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "evalsuite.cli"]
    made = subprocess.run(cli + ["calibrate", "--model", "tiny:qwen3_moe", "--out", str(tmp_path), "--prompts", "8",
                                 "--epochs", "1", "--predictor", "estimator"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "predictor.safetensors").exists()
    printed = {line.split()[1] for line in made.stdout.splitlines() if line.startswith("  recall@K ")}
    assert printed == {"gate", "quasi", "frequency", "estimator"}  # the trained estimator too
    assert "training estimator layer 0->1" in made.stderr  # the progress bar names what it trains
    used = subprocess.run(cli + ["generate", "--model", "tiny:qwen3_moe", "--modes", "resident,speculative",
                                 "--predictor", "estimator", "--predictor-path", str(tmp_path / "predictor.safetensors"),
                                 "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300, env=env)
    assert used.returncode == 0, used.stderr  # speculative may differ from resident without failing
    assert used.stdout.splitlines()[-1].split()[0] == "speculative"
    bad = subprocess.run(cli + ["calibrate", "--model", "tiny:qwen3_moe", "--out", str(tmp_path), "--predictor", "x"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "--predictor: invalid choice: 'x'" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0
    shown = subprocess.run(cli + ["calibrate", "--help"], capture_output=True, text=True, timeout=300, env=env)
    for default in ("(default: all)", "(default: 256)", "(default: 30)", "(default: 0.001)", "(default: cpu)"):
        assert default in " ".join(shown.stdout.split())


def test_cache_that_does_not_fit_names_the_largest_that_would(monkeypatch):
    import evalsuite.engine.cache.slots as cache

    model = fresh()
    expert_bytes = 3 * 64 * 32 * 4  # qwen3_moe tiny: gate_up [64, 64] + down [64, 32], float32
    monkeypatch.setattr(cache, "free_bytes", lambda device: 10 * expert_bytes)
    with pytest.raises(ValueError, match=r"does not fit .* the largest that fits is cache_capacity=9"):
        evalsuite.offload(model, cache_capacity=12)
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0
