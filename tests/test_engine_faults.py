"""Injected faults in a real offloaded tiny model: failing and hanging transfers, damaged artifacts.

A fault must surface as a clear error (TransferError, ArtifactError) within the configured
timeout, never as a hang or a wrong answer; after it, the engine keeps working or fails clearly.
Every risky call runs in a daemon thread with a deadline, so a deadlock fails the test instead
of hanging the suite.
"""
import copy
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import evalsuite
from evalsuite.engine.link.worker import TransferError
from evalsuite.predict import Artifact, ArtifactError

from .helpers import batch, reference_model
from .test_modes import artifact_for

TIMEOUT_S = 0.5  # the engine's transfer_timeout_s in these tests


def within(seconds, fn, *args, **kwargs):
    """Run fn in a daemon thread; returns (result, exception, elapsed). Fails if it is still running."""
    outcome = {}

    def call():
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed back to the test
            outcome["error"] = exc

    start = time.perf_counter()
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{fn.__name__} still running after {seconds} s: a deadlock"
    return outcome.get("result"), outcome.get("error"), time.perf_counter() - start


class FaultyStore:
    """Wraps the engine's store: copies of `broken` keys raise; copies wait on `gate` if given."""

    def __init__(self, store, broken=(), gate: threading.Event | None = None):
        self.store, self.broken, self.gate = store, set(broken), gate

    def copy_into(self, key, dst):
        if self.gate is not None and not self.gate.wait(30):
            raise OSError("gate never opened")
        if key in self.broken or "all" in self.broken:
            raise OSError(f"injected read error on expert {key}")
        self.store.copy_into(key, dst)

    def read(self, key):
        return self.store.read(key)


@pytest.fixture
def offloaded():
    """A tiny model, its resident logits, and an offloaded copy with a short transfer timeout."""
    reference = reference_model("qwen3_moe", "float32")
    ids, mask = batch(2)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
    model = copy.deepcopy(reference)
    engine = evalsuite.offload(model, cache_capacity=4, transfer_timeout_s=TIMEOUT_S)
    yield model, engine, (ids, mask), expected
    engine.transfers.store = engine.store  # a healthy store, so close() can put the experts back
    within(10, engine.close)


def forward(model, inputs):
    ids, mask = inputs
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_failing_transfer_raises_transfer_error(offloaded):
    model, engine, inputs, _ = offloaded
    engine.transfers.store = FaultyStore(engine.store, broken={"all"})
    _, error, elapsed = within(10, forward, model, inputs)
    assert isinstance(error, TransferError) and "injected read error" in str(error)
    assert elapsed < TIMEOUT_S + 2
    assert engine.cache.pins == {}  # the failed layer released every expert it held


def test_hanging_transfer_times_out_and_never_deadlocks(offloaded):
    model, engine, inputs, expected = offloaded
    gate = threading.Event()
    engine.transfers.store = FaultyStore(engine.store, gate=gate)
    _, error, elapsed = within(10, forward, model, inputs)
    assert isinstance(error, TransferError) and f"did not finish within {TIMEOUT_S:g} s" in str(error)
    assert elapsed < TIMEOUT_S + 2
    # Still stuck: the next forward fails the same way, on time.
    _, error, elapsed = within(10, forward, model, inputs)
    assert isinstance(error, TransferError) and elapsed < TIMEOUT_S + 2
    gate.set()  # the link recovers: queued copies land, and the model is exact again
    logits, error, _ = within(30, forward, model, inputs)
    assert error is None and torch.allclose(logits, expected, atol=1e-5)
    assert engine.cache.pins == {}  # the timed-out layers released every expert they held


def test_forward_after_a_failed_transfer_is_exact_with_a_healthy_store(offloaded):
    model, engine, inputs, expected = offloaded
    engine.transfers.store = FaultyStore(engine.store, broken={(0, e) for e in range(8)})
    _, error, _ = within(10, forward, model, inputs)
    assert isinstance(error, TransferError)
    engine.transfers.store = engine.store
    # The experts whose copies failed must not count as resident: their slots hold no valid weights.
    logits, error, _ = within(30, forward, model, inputs)
    assert error is None, error
    assert torch.allclose(logits, expected, atol=1e-5), "a failed copy left a stale expert marked resident"


def test_failed_prefetch_is_not_used_as_a_hit(offloaded):
    model, engine, inputs, expected = offloaded
    engine.transfers.store = FaultyStore(engine.store, broken={"all"})
    assert engine.prefetch(0, [0, 1, 2, 3]) == 4
    time.sleep(0.1)  # the copies fail in the background; nobody waits for them
    engine.transfers.store = engine.store
    logits, error, _ = within(30, forward, model, inputs)
    assert error is None, error
    assert torch.allclose(logits, expected, atol=1e-5), "a failed prefetch was served as a hit"


def test_generation_fails_clearly_then_recovers(offloaded):
    model, engine, (ids, mask), _ = offloaded
    reference = reference_model("qwen3_moe", "float32")
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    engine.transfers.store = FaultyStore(engine.store, broken={(1, e) for e in range(8)})
    _, error, _ = within(20, generate)
    assert isinstance(error, TransferError)
    engine.transfers.store = engine.store
    tokens, error, _ = within(60, generate)
    assert error is None and torch.equal(tokens, expected)


# ---------------------------------------------------------------- damaged predictor artifacts
# (truncated, garbage, foreign-format and other-model artifacts: tests/test_predictors.py)

@pytest.fixture
def saved_artifact(tmp_path):
    path = tmp_path / "predictor.safetensors"
    artifact_for("qwen3_moe").save(str(path))
    return path


def rewrite(path, tensors=None, metadata=None):
    """Save `path` again with some tensors or metadata entries replaced."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    data = load_file(str(path))
    data.update(tensors or {})
    meta.update(metadata or {})
    save_file(data, str(path), metadata=meta)


@pytest.mark.parametrize("damage", ["empty", "missing", "directory"])
def test_unreadable_artifact_paths_are_rejected(tmp_path, damage):
    path = tmp_path / "predictor.safetensors"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "directory":
        path.mkdir()
    with pytest.raises(ArtifactError, match="cannot read predictor artifact"):
        Artifact.load(str(path))


def test_artifact_with_unparseable_metadata_is_rejected(saved_artifact):
    rewrite(saved_artifact, metadata={"fingerprint": "{not json"})
    with pytest.raises(ArtifactError):
        Artifact.load(str(saved_artifact))


def test_artifact_with_wrong_tensor_shapes_is_rejected_before_offloading(saved_artifact):
    name = next(k for k in load_file(str(saved_artifact)) if k.startswith("default"))
    rewrite(saved_artifact, tensors={name: torch.zeros(3, 5)})
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    with pytest.raises(ArtifactError):
        evalsuite.offload(model, mode="router-preserving", predictor="quasi", predictor_path=str(saved_artifact))
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0  # nothing offloaded


def test_artifact_missing_a_predictors_tensors_is_rejected(saved_artifact):
    kept = {k: v for k, v in load_file(str(saved_artifact)).items() if not k.startswith("estimator.")}
    from safetensors import safe_open

    with safe_open(str(saved_artifact), framework="pt") as f:
        meta = dict(f.metadata())
    save_file(kept, str(saved_artifact), metadata=meta)
    model = copy.deepcopy(reference_model("qwen3_moe", "float32"))
    with pytest.raises(ArtifactError, match="has no"):
        evalsuite.offload(model, mode="router-preserving", predictor="estimator", predictor_path=str(saved_artifact))
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0
    assert json.loads(meta["rank"]) == 4  # the rest of the artifact was intact
