"""Router-preserving is exact for every predictor; speculative is exact only with the oracle;
recall is SpecPrefetch's definition."""
import copy
import functools

import pytest
import torch

import evalsuite
from evalsuite.engine import arch
from evalsuite.zoo.tiny import TINY
from evalsuite.predict.calibrate import calibrate
from evalsuite.predict.predictors import router_logits

from .helpers import batch, reference_model

PREDICTORS = ("gate", "quasi", "adapter", "adapter-shared", "estimator", "oracle", "frequency")


@functools.lru_cache(maxsize=None)
def artifact_for(model_type: str):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 128, (4, 12), generator=g), torch.ones(4, 12, dtype=torch.long)) for _ in range(3)]
    return calibrate(reference_model(model_type), batches, predictor="all", rank=4, horizon=2, hidden=16, epochs=3)


def generate(model, ids, mask, tokens=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_router_preserving_is_exact_for_every_predictor(model_type):
    reference = reference_model(model_type)
    ids, mask = batch(2)
    expected = generate(reference, ids, mask)
    with torch.no_grad():
        expected_logits = reference(input_ids=ids, attention_mask=mask).logits
    for predictor in PREDICTORS:
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode="router-preserving", predictor=predictor, artifact=artifact_for(model_type),
                               cache_capacity=0.5) as engine:
            assert torch.equal(generate(model, ids, mask), expected), predictor
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected_logits), predictor
            stats = engine.stats()
        assert stats["recall"][2]["mean"] is not None
        if predictor == "oracle":
            assert stats["recall"][2]["mean"] == 1.0


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_speculative_with_oracle_is_exact(model_type):
    reference = reference_model(model_type)
    ids, mask = batch(2)
    model = copy.deepcopy(reference)
    with evalsuite.offload(model, mode="speculative", predictor="oracle", cache_capacity=0.5) as engine:
        assert torch.equal(generate(model, ids, mask), generate(reference, ids, mask))
        assert engine.stats()["recall"][2]["mean"] == 1.0


def test_speculative_with_an_imperfect_predictor_changes_outputs():
    changed = 0
    for model_type in ("deepseek_v3", "glm4_moe", "qwen2_moe", "mixtral"):
        reference = reference_model(model_type)
        ids, mask = batch(4, seed=3)
        model = copy.deepcopy(reference)
        with evalsuite.offload(model, mode="speculative", predictor="gate", cache_capacity=0.5) as engine:
            out = generate(model, ids, mask, tokens=8)
            assert engine.stats()["recall"][2]["mean"] < 1.0
        changed += int(not torch.equal(out, generate(reference, ids, mask, tokens=8)))
    assert changed > 0


@pytest.mark.parametrize("mode, model_type", [("speculative", "glm4_moe")]
                         + [("router-preserving", t) for t in sorted(TINY)])
def test_recall_equals_a_trace_based_computation(mode, model_type):
    """Record router inputs and native choices with our own hooks; recompute gate recall. Router-preserving
    reads them from the experts call, not the router (see the next test): in every family, the same."""
    model = copy.deepcopy(reference_model(model_type))
    layers = arch.sparse_layers(model)
    family = arch.family_of(model)
    seen = {pos: [] for pos in range(len(layers))}
    for pos, layer in enumerate(layers):  # registered first, so they see the native output
        layer.router.register_forward_hook(
            lambda m, args, out, pos=pos: seen[pos].append((args[0].reshape(-1, args[0].shape[-1]), out[2])))
    ids, mask = batch(1, seed=5)
    with evalsuite.offload(model, mode=mode, predictor="gate", cache_capacity=0.5) as engine, torch.no_grad():
        model.generate(ids, attention_mask=mask, min_new_tokens=7, max_new_tokens=7, do_sample=False, pad_token_id=0)
        k = layers[0].top_k
        measured = engine.stats()["recall"][k]
    for pos in range(1, len(layers)):
        decode = list(zip(seen[pos - 1], seen[pos]))[1:]  # drop the prefill
        values = []
        for (x_prev, _), (_, native) in decode:
            router = layers[pos].router
            predicted = family.selection_scores(router, router_logits(router, x_prev)).topk(k).indices
            values.append((predicted.unsqueeze(-1) == native.unsqueeze(1)).any(1).sum().item() / k)
        assert measured["layers"][layers[pos].index] == pytest.approx(sum(values) / len(values), abs=1e-6)


def test_only_a_mode_that_replaces_the_routing_hooks_the_routers():
    """A module hook costs every call of its module: modes that execute no prediction are driven from the
    engine's experts implementation, and only speculating modes hook the router (to replace its output)."""
    model = copy.deepcopy(reference_model("qwen3_moe"))
    for mode, hooked in (("router-preserving", False), ("resident", False), ("speculative", True)):
        with evalsuite.offload(model, mode=mode, predictor="gate", cache_capacity=0.5) as engine:
            assert [bool(layer.router._forward_hooks) for layer in engine.layers] == [hooked] * len(engine.layers)


def test_preserving_every_layer_makes_hybrid_exact():
    reference = reference_model("deepseek_v3")
    ids, mask = batch(2, seed=3)
    model = copy.deepcopy(reference)
    all_layers = [layer.index for layer in arch.sparse_layers(model)]
    with evalsuite.offload(model, mode="hybrid", artifact=artifact_for("deepseek_v3"), cache_capacity=0.5,
                           preserve_layers=all_layers):
        assert torch.equal(generate(model, ids, mask), generate(reference, ids, mask))


def test_hybrid_picks_drift_layers_by_calibration_recall():
    art = artifact_for("qwen3_moe")
    model = copy.deepcopy(reference_model("qwen3_moe"))
    quasi = art.meta["recall"]["quasi"]
    threshold = sorted(quasi.values())[len(quasi) // 2] + 1e-9
    with evalsuite.offload(model, mode="hybrid", artifact=art, drift_threshold=threshold) as engine:
        chosen = engine.predictor.drift_layers
    assert chosen == {int(layer) for layer, value in quasi.items() if value < threshold}
    assert 0 < len(chosen) < len(quasi) + 1


def test_oracle_prefetches_are_all_used_with_room_for_them():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode="router-preserving", predictor="oracle", cache_capacity="all") as engine:
        generate(model, *batch(1))
        stats = engine.stats()
    assert stats["prefetches"] > 0 and stats["prefetch_precision"] == 1.0 and stats["prefetch_wasted"] == 0
    assert stats["bytes_transferred"] == (stats["misses"] + stats["prefetches"]) * stats["expert_bytes"]
    assert stats["hits"] + stats["misses"] == stats["expert_uses"]


def test_token_divergence_definition():
    from evalsuite.engine.metrics import token_divergence

    assert token_divergence([1, 2, 3], [1, 2, 3]) == {"first_divergence": None, "identical_share": 1.0}
    assert token_divergence([1, 5, 3], [1, 2, 3]) == {"first_divergence": 1, "identical_share": 2 / 3}
    assert token_divergence([1, 2], [1, 2, 3, 4]) == {"first_divergence": 2, "identical_share": 0.5}


@pytest.mark.parametrize("mode", ["speculative", "hybrid"])
def test_prefetch_precision_is_left_out_where_speculating_layers_make_it_one(mode):
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode=mode, artifact=artifact_for("qwen3_moe"), cache_capacity=0.5) as engine:
        generate(model, *batch(2))
        stats = engine.stats()
    assert stats["prefetches"] > 0 and stats["prefetch_used"] > 0  # it prefetched: the precision is withheld
    assert stats["prefetch_precision"] is None
    assert all(layer["prefetch_precision"] is None for layer in stats["layers"].values())


def test_prefetch_precision_stays_where_the_router_decides():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5) as engine:
        generate(model, *batch(2))
        stats = engine.stats()
    assert stats["prefetch_precision"] == stats["prefetch_used"] / stats["prefetches"]


def test_each_row_of_each_request_gets_its_own_recall_and_a_share_of_its_bytes():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=0.5) as engine:
        generate(model, *batch(2))
        engine.record.label_last_request(["first", "second"])
        generate(model, *batch(1, seed=5))
        engine.record.label_last_request(["alone"])
        generate(model, *batch(1, seed=6))  # unlabelled: no row of it is reported
        record = engine.take_record()
    rows = dict(record.per_row())
    assert list(rows) == ["first", "second", "alone"]
    first, second, alone = rows.values()
    assert first["recall"][2] != second["recall"][2]  # rows of one batch are scored apart
    assert (first["hit_rate"], first["tpot_ms"]) == (second["hit_rate"], second["tpot_ms"])  # and share their request
    batched, single, _ = (record.counters_of(r) for r in record.requests)
    assert first["bytes_transferred"] + second["bytes_transferred"] == batched.bytes_transferred
    assert alone["bytes_transferred"] == single.bytes_transferred
    assert sum(record.counters_of(r).bytes_transferred for r in record.requests) == \
        record.summary()["bytes_transferred"]
    for layer, whole in record.summary()["recall"][2]["layers"].items():  # the three rows' mean
        assert whole == pytest.approx(sum(r.recall[2][layer][i] for r in record.requests for i in range(r.rows)) / 4)
