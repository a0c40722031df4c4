"""Calibration artifacts, adapter size, the prefetch scheduler's window, and predictor errors."""
import copy

import pytest
import torch

import evalsuite
from evalsuite.engine import arch
from evalsuite.engine.prediction.scheduler import PrefetchScheduler, ranked
from evalsuite.predict import Artifact, ArtifactError, build_predictor
from evalsuite.predict.calibrate import calibrate, collect, next_token_pairs
from evalsuite.predict.predictors import fused_norm
from evalsuite.zoo.tiny import TINY
from evalsuite.engine.pass_state.layer_state import LayerState

from .helpers import reference_model
from .test_modes import artifact_for


def test_adapter_parameters_are_r_times_d_plus_e():
    rank = 4
    art = artifact_for("qwen3_moe")  # hidden 64, 8 experts, horizons 1 and 2
    adapters = {k.rsplit(".", 1)[0] for k in art.tensors if k.startswith("adapter.")}
    # one per (anchor layer, horizon), and the next token's first sparse layer from this token's last
    assert adapters == {"adapter.0.1", "adapter.0.2", "adapter.1.1", "adapter.next_token"}
    for name in adapters:
        count = art.tensors[f"{name}.A"].numel() + art.tensors[f"{name}.B"].numel()
        assert count == rank * (64 + 8)


def test_untrained_adapter_predicts_like_the_gate():
    model = reference_model("gpt_oss")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    batches = [(torch.randint(3, 128, (2, 8)), torch.ones(2, 8, dtype=torch.long))]
    art = calibrate(model, batches, predictor="adapter", rank=3, epochs=0)
    state = LayerState(0, torch.randn(5, 64), torch.randn(5, 64), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))
    adapter = build_predictor("adapter", layers, family, art).scores(state, 1)
    gate = build_predictor("gate", layers, family).scores(state, 1)
    assert torch.equal(adapter, gate)  # B starts at zero


def test_a_quasi_prediction_runs_no_hook_of_the_norm_it_applies():
    """The quasi state goes through the next layer's norm: its forward alone, so the hooks on that norm (which
    record the residual stream the model passes it) neither run nor record the quasi state."""
    model = reference_model("qwen3_moe")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    quasi = build_predictor("quasi", layers, family, artifact_for("qwen3_moe"))
    state = LayerState(0, torch.randn(3, 64), torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [4, 5]]),
                       torch.rand(3, 2))
    seen = []
    hook = layers[1].norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        scores = quasi.scores(state, 1)
    finally:
        hook.remove()
    assert seen == [] and scores.shape == (3, 8)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_quasi_state_is_the_norm_of_the_residual_plus_the_weighted_default_vectors(model_type):
    """q = LN_{p+1}(r_p + sum_e w_e v_e [+ shared(x_p)]), computed the plain way with the norm's own forward, in
    every family (the predictor's fused calls must compute the same, to rounding); the shared experts' output on
    the router input is added where the model has them and the artifact says so (new artifacts do)."""
    model = reference_model(model_type)
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    art = artifact_for(model_type)
    quasi = build_predictor("quasi", layers, family, art)
    g = torch.Generator().manual_seed(0)
    hidden, experts = layers[0].router.weight.shape[1], layers[0].num_experts
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(3)])
    state = LayerState(0, torch.randn(3, hidden, generator=g), torch.randn(3, hidden, generator=g), ids,
                       torch.rand(3, 2, generator=g))
    vectors = art.default_vectors(layers[0].index)
    block = layers[0].block
    with torch.no_grad():
        if hasattr(block, "shared_experts"):  # DeepSeek, GLM-4.5: unweighted
            shared = block.shared_experts(state.x)
        elif hasattr(block, "shared_expert"):  # Qwen2-MoE: gated
            shared = torch.sigmoid(block.shared_expert_gate(state.x)) * block.shared_expert(state.x)
        else:
            shared = torch.zeros_like(state.x)
        routed = state.residual + (state.weights.unsqueeze(-1) * vectors[ids]).sum(dim=1)
        assert art.meta["quasi_shared_experts"] is True
        assert torch.allclose(quasi.quasi_state(state), layers[1].norm.forward(routed + shared), rtol=1e-5, atol=1e-6)
        without = Artifact(art.tensors, {**art.meta, "quasi_shared_experts": False})  # the paper's form
        assert torch.allclose(build_predictor("quasi", layers, family, without).quasi_state(state),
                              layers[1].norm.forward(routed), rtol=1e-5, atol=1e-6)


class _OffsetNorm(torch.nn.Module):
    """An RMS norm scaled by (1 + weight), as Gemma's: not what `F.rms_norm` computes."""

    def __init__(self, width):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(width)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_the_fused_norm_is_used_only_where_it_computes_what_the_norm_does():
    rms = reference_model("qwen3_moe").model.layers[1].post_attention_layernorm
    x = torch.randn(4, rms.weight.shape[0])
    with torch.no_grad():
        assert fused_norm(rms) is not rms.forward and torch.allclose(fused_norm(rms)(x), rms.forward(x))
        for other in (_OffsetNorm(64), torch.nn.LayerNorm(64)):
            assert fused_norm(other) == other.forward  # kept: F.rms_norm would compute something else


def test_artifact_round_trip(tmp_path):
    art = artifact_for("deepseek_v3")
    path = str(tmp_path / "predictor.safetensors")
    art.save(path)
    model = reference_model("deepseek_v3")
    loaded = Artifact.load(path, model, arch.sparse_layers(model))
    assert loaded.meta == art.meta and set(loaded.tensors) == set(art.tensors)
    assert all(torch.equal(loaded.tensors[k], art.tensors[k]) for k in art.tensors)
    assert loaded.meta["rank"] == 4 and loaded.meta["layers"] == [1, 2] and "fingerprint" in loaded.meta
    copy_model = copy.deepcopy(model)
    with evalsuite.offload(copy_model, mode="router-preserving", predictor="adapter", predictor_path=path) as engine:
        assert engine.predictor.name == "adapter"


def test_artifact_for_another_model_is_rejected(tmp_path):
    path = str(tmp_path / "predictor.safetensors")
    artifact_for("qwen3_moe").save(path)
    other = copy.deepcopy(reference_model("qwen3_moe"))
    with torch.no_grad():
        other.model.layers[1].mlp.gate.weight.add_(1.0)  # same architecture, other weights
    with pytest.raises(ArtifactError, match="calibrated for model .* not this one"):
        evalsuite.offload(other, mode="router-preserving", predictor="quasi", predictor_path=path)
    assert other.model.layers[0].mlp.experts.gate_up_proj.numel() > 0  # nothing offloaded


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_artifacts_are_rejected(tmp_path, damage):
    path = tmp_path / "predictor.safetensors"
    artifact_for("qwen3_moe").save(str(path))
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        from safetensors.torch import save_file
        save_file({"w": torch.ones(2)}, str(path))
    with pytest.raises(ArtifactError, match="cannot read predictor artifact|not an evalsuite predictor artifact"):
        Artifact.load(str(path))


@pytest.mark.parametrize("options,message", [
    (dict(mode="router-preserving", predictor="psychic"), "predictor='psychic' is not one of"),
    (dict(mode="router-preserving", predictor="quasi"), "needs a calibration artifact"),
    (dict(mode="speculative", predictor="gate", horizon=2), "use horizon=1"),
    (dict(mode="router-preserving", predictor="quasi", horizon=2), "predicts horizons"),
    (dict(mode="on-demand", predictor="gate"), "uses no predictor"),
    (dict(mode="router-preserving", prefetch_budget=1), "prefetch_budget=1 is below top-k=2"),
])
def test_bad_predictor_options(options, message):
    art = artifact_for("qwen3_moe") if options.get("predictor") == "quasi" and "horizon" in options else None
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with pytest.raises(ValueError, match=message):
        evalsuite.offload(model, artifact=art, **options)
    assert model.model.layers[0].mlp.experts.gate_up_proj.numel() > 0  # refused before touching the model


class StubEngine:
    """Just enough engine for the scheduler: a layer list, a cache, a link, a prefetch log."""

    def __init__(self, per_transfer, queued=0, resident=()):
        self.layers = [type("L", (), {"index": i, "top_k": 2})() for i in range(3)]
        self.cache = type("C", (), {"resident": staticmethod(lambda key: key in resident),
                                    "victim_regret": staticmethod(lambda: 0.0), "spare": staticmethod(lambda layer: 0)})()
        self.transfers = type("T", (), {"seconds_per_transfer": staticmethod(lambda: per_transfer),
                                        "prefetches_queued": staticmethod(lambda: queued), "chunk_bytes": 64,
                                        "chunk_s": None})()
        self.layout = type("X", (), {"nbytes": 4096})()  # a chunk is 1/64 of a copy
        self.prefetch_cost_s = None
        self.demand_cost_s = None  # unmeasured: a right prefetch spares what it costs
        self.started = []

    def prefetch(self, layer, experts, keep=()):
        self.started += [(layer, e) for e in experts]
        return len(experts)


def test_scheduler_ranks_skips_resident_and_respects_the_window():
    scores = ranked(torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]), 4)
    engine = StubEngine(per_transfer=0.45e-3, resident={(1, 0)})
    scheduler = PrefetchScheduler(engine, budget=4, window=True)
    # a layer takes 1 ms: two 0.45 ms transfers land in time, a third hides 0.1 ms of its copy: it goes too
    scheduler.layer_s = 1e-3
    assert scheduler.schedule(1, scores, h=1) == 3
    assert engine.started == [(1, 1), (1, 2), (1, 3)]
    engine = StubEngine(per_transfer=0.45e-3, queued=3)  # three prefetches already queued: none starts in time
    scheduler = PrefetchScheduler(engine, budget=4, window=True)
    scheduler.layer_s = 1e-3
    assert scheduler.schedule(1, scores, h=1) == 0
    assert scheduler.schedule(1, scores, h=2) == 2  # two layers ahead: more time
    unlimited = StubEngine(per_transfer=0.45e-3)
    scheduler = PrefetchScheduler(unlimited, budget=4, window=False)
    scheduler.layer_s = 1e-3
    assert scheduler.schedule(1, scores, h=1) == 4 and [e for _, e in unlimited.started] == [0, 1, 2, 3]


def test_calibration_measures_the_recall_of_every_predictor_it_trains():
    model = reference_model("qwen3_moe")
    layers = arch.sparse_layers(model)
    batches = [(torch.randint(3, 128, (2, 12)), torch.ones(2, 12, dtype=torch.long))]
    art = calibrate(model, batches, predictor="all", rank=3, horizon=2, hidden=8, epochs=0)
    recall = art.meta["recall"]
    assert set(recall) == {"gate", "quasi", "frequency", "adapter", "adapter_h2", "adapter-shared", "estimator"}
    one_ahead = [str(l.index) for l in layers[1:]]
    assert all(list(recall[name]) == one_ahead
               for name in ("gate", "quasi", "frequency", "adapter", "adapter-shared", "estimator"))
    assert list(recall["adapter_h2"]) == [str(l.index) for l in layers[2:]]
    assert recall["adapter"] == recall["gate"] == recall["adapter-shared"]  # untrained adapters predict like the gate
    assert all(0 <= v <= 1 for per_layer in recall.values() for v in per_layer.values())
    only_estimator = calibrate(model, batches, predictor="estimator", hidden=8, epochs=0).meta["recall"]
    assert set(only_estimator) == {"gate", "quasi", "frequency", "estimator"}


def test_the_estimator_runs_the_gelu_its_artifact_was_trained_with():
    """New calibrations train the estimators with the tanh GELU and say so; an artifact that names no form was
    trained with the exact one and is still scored with it; an unknown form is refused with what to do."""
    model = reference_model("qwen3_moe")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    batches = [(torch.randint(3, 128, (2, 12)), torch.ones(2, 12, dtype=torch.long))]
    art = calibrate(model, batches, predictor="estimator", hidden=8, epochs=1)
    assert art.meta["estimator_gelu"] == "tanh"
    hidden = layers[0].router.weight.shape[1]
    g = torch.Generator().manual_seed(0)
    state = LayerState(0, torch.randn(3, hidden, generator=g), torch.randn(3, hidden, generator=g) * 4,
                       torch.randint(0, layers[0].num_experts, (3, 2), generator=g), torch.rand(3, 2, generator=g))
    w1, b1, w2, b2 = art.estimator(layers[0].index)

    def by_hand(form):
        q = build_predictor("quasi", layers, family, art).quasi_state(state).float()
        return torch.nn.functional.linear(torch.nn.functional.gelu(q @ w1.T + b1, approximate=form), w2, b2)

    older = Artifact(art.tensors, {k: v for k, v in art.meta.items() if k != "estimator_gelu"})
    with torch.no_grad():
        new, old = (build_predictor("estimator", layers, family, a).scores(state, 1) for a in (art, older))
        assert torch.allclose(new, by_hand("tanh"), atol=1e-6) and torch.allclose(old, by_hand("none"), atol=1e-6)
        assert not torch.allclose(by_hand("tanh"), by_hand("none"), atol=1e-6)  # the two forms differ here
    with pytest.raises(ArtifactError, match="unknown estimator GELU 'sigmoid'.*evalsuite calibrate"):
        build_predictor("estimator", layers, family, Artifact(art.tensors, {**art.meta, "estimator_gelu": "sigmoid"}))


def test_next_token_pairs_never_cross_a_row_or_its_padding():
    """The next token's first sparse layer is fitted on (this token's last router input, the next token's first
    routing) within a row: padded rows of a batch give len − 1 pairs each, and each pair's target is what the
    first sparse layer routed for the token after it, as a run of that row alone records it."""
    model = reference_model("qwen3_moe")
    layers = arch.sparse_layers(model)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (7, 3, 1, 5)]
    ids, mask = torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 7, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    x, logits, targets = next_token_pairs(collect(model, layers, [(ids, mask)]))
    assert len(x) == len(logits) == len(targets) == 6 + 2 + 0 + 4
    alone = [collect(model, layers, [(r[None], torch.ones(1, len(r), dtype=torch.long))]) for r in rows]
    expected_x = torch.cat([t[-1]["x"][:-1] for t in alone]).float()
    expected_ids = torch.cat([t[0]["ids"][1:] for t in alone])
    assert torch.allclose(x, expected_x, atol=1e-5) and torch.equal(targets, expected_ids)


def test_the_trained_predictors_score_the_next_token_s_first_layer_with_what_they_trained_for_it():
    """adapter: the gate rule plus B A x; estimator (and hybrid, which has no quasi state across the token
    boundary): its next-token net on x; an artifact without them (calibrated before there were any) keeps the
    gate rule, and one with a part missing is refused in one line."""
    model = reference_model("qwen3_moe")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    batches = [(torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1)),
                torch.ones(2, 12, dtype=torch.long))]
    art = calibrate(model, batches, predictor="all", rank=3, hidden=8, epochs=2)
    assert set(art.meta["next_token_recall"]) == {"gate", "adapter", "estimator"}
    x = torch.randn(3, layers[-1].router.weight.shape[1], generator=torch.Generator().manual_seed(2))
    gate = build_predictor("gate", layers, family).next_token_scores(x)
    a, b = art.next_token_adapter()
    w1, b1, w2, b2 = art.next_token_estimator()
    router = layers[0].router
    by_hand = {"adapter": x @ router.weight.T + (x @ a.T) @ b.T,
               "estimator": torch.nn.functional.gelu(x @ w1.T + b1, approximate="tanh") @ w2.T + b2}
    older = Artifact({k: v for k, v in art.tensors.items() if ".next_token." not in k}, art.meta)
    with torch.no_grad():
        for name in ("adapter", "estimator", "hybrid"):
            scores = build_predictor(name, layers, family, art).next_token_scores(x)
            expected = family.selection_scores(router, by_hand["estimator" if name == "hybrid" else name])
            assert torch.allclose(scores, expected, atol=1e-5) and not torch.allclose(scores, gate, atol=1e-5)
            assert torch.equal(build_predictor(name, layers, family, older).next_token_scores(x), gate)
    damaged = Artifact({k: v for k, v in art.tensors.items() if k != "estimator.next_token.b2"}, art.meta)
    with pytest.raises(ArtifactError, match="no 'estimator.next_token.b2'.*evalsuite calibrate"):
        build_predictor("estimator", layers, family, damaged)


def test_an_untrained_next_token_adapter_is_the_gate_rule_and_training_beats_it():
    model = reference_model("qwen3_moe")
    batches = [(torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(3)),
                torch.ones(4, 16, dtype=torch.long))]
    untrained = calibrate(model, batches, predictor="adapter", rank=4, epochs=0).meta["next_token_recall"]
    assert set(untrained) == {"gate", "adapter"} and untrained["adapter"] == untrained["gate"]  # B starts at zero
    torch.manual_seed(0)
    trained = calibrate(model, batches, predictor="all", rank=4, hidden=32, epochs=300, lr=1e-2)
    assert trained.meta["next_token_recall"]["estimator"] > trained.meta["next_token_recall"]["gate"] + 0.1
