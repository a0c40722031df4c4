"""One registry per concept: the modes' flags drive the engine and the simulator, the commands'
choices are the registries' own, and recall@k has one definition."""
import copy
import functools

import pytest
import torch

import evalsuite
from evalsuite.cli import build_parser
from evalsuite.engine.cache.eviction import POLICIES
from evalsuite.engine.metrics import ranked_recall, token_recall
from evalsuite.engine.modes import MODES, Mode, predictor_choice
from evalsuite.engine.config import check_options
from evalsuite.engine.prediction import PREDICTORS
from evalsuite.engine.trace import LayerRouting, RoutingTrace
from evalsuite.perf.simulate import SIMULATED_MODES, Costs, simulate
from evalsuite.predict.calibrate import calibrate, recall

from .helpers import batch, reference_model


def action(command: str, flag: str):
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    return subcommands[command]._option_string_actions[flag]


# ---- the commands read the registries ------------------------------------------------------
@pytest.mark.parametrize("command,flag,registry", [
    ("generate", "--predictor", PREDICTORS), ("simulate", "--predictor", PREDICTORS),
    ("generate", "--cache-policy", POLICIES), ("eval", "--cache-policy", POLICIES), ("simulate", "--cache-policy", POLICIES),
])
def test_single_value_flags_choose_from_the_registry(command, flag, registry):
    assert list(action(command, flag).choices) == list(registry)


@pytest.mark.parametrize("command,flag,registry", [("generate", "--modes", MODES), ("eval", "--modes", MODES),
                                                   ("bench", "--predictors", PREDICTORS),
                                                   ("eval", "--predictor", PREDICTORS)])
def test_list_flags_take_every_registered_name_and_refuse_others(command, flag, registry):
    parse = action(command, flag).type
    taken = parse(",".join(registry))  # eval's --predictor keeps its text (it may hold per-mode groups)
    assert (predictor_choice(taken)[None] if isinstance(taken, str) else taken) == list(registry)
    with pytest.raises(Exception) as refused:
        parse(f"{next(iter(registry))},warp")
    message = str(refused.value)
    assert "warp" in message and all(name in message for name in registry) and "\n" not in message


def test_a_new_mode_is_one_registry_entry(monkeypatch):
    monkeypatch.setitem(MODES, "warm-resident", Mode("warm-resident", offloads=False, predicts=False,
                                                     speculates=False, exact=True))
    assert action("generate", "--modes").type("resident,warm-resident") == ["resident", "warm-resident"]
    check_options(mode="warm-resident")  # the engine's option rule knows it
    from evalsuite.sweep.grid import Sweep

    cells = Sweep("s", ["m"], ["warm-resident"], ["t"], cache_capacities=[0.25, 0.5], links=["ufs4", "sdcard"]).cells()
    assert len(cells) == 1 and cells[0].cache_capacity is None  # moves nothing: the cache and link axes collapse


# ---- the flags drive what the engine does --------------------------------------------------
@functools.lru_cache(maxsize=None)
def hybrid_artifact():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 128, (4, 12), generator=g), torch.ones(4, 12, dtype=torch.long)) for _ in range(2)]
    return calibrate(reference_model("qwen3_moe"), batches, predictor="hybrid", hidden=16, epochs=2)


def decode(model, ids, mask):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits)


@pytest.mark.parametrize("name", list(MODES))
def test_a_modes_flags_are_what_its_engine_does(name):
    mode = MODES[name]
    reference = reference_model("qwen3_moe")
    ids, mask = batch(1)
    expected = decode(reference, ids, mask)
    model = copy.deepcopy(reference)
    with_predictor = {"predictor": "gate"} if mode.predicts and not mode.own_predictor else {}
    with_predictor.update({"artifact": hybrid_artifact()} if mode.own_predictor else {})
    with evalsuite.offload(model, mode=name, cache_capacity=0.5, trace=True, **with_predictor) as engine:
        logits = decode(model, ids, mask)
        trace = engine.routing_trace()
        assert (engine.cache is not None) == mode.offloads
        assert (engine.driver is not None and engine.driver.scheduler is not None) == mode.predicts
        assert (engine.stats()["bytes_transferred"] > 0) == mode.offloads
    replaced = any(set(r.executed) != set(r.native) for step in trace.steps for r in step)
    assert replaced == mode.speculates
    assert torch.equal(logits, expected) == mode.exact


def test_the_simulator_reads_the_same_flags():
    steps = [[[s % 8, (s + 3) % 8], [(s + 1) % 8, (s + 5) % 8]] for s in range(6)]
    trace = RoutingTrace([0, 1], 8, 2, [[LayerRouting(n, n, [(n[0] + 1) % 8, n[1]]) for n in step] for step in steps])
    costs = Costs(dense_s=1.0, expert_s=0.5, step_s=1.0, transfer_s=2.0, predictor_s=0.1)
    for name, mode in SIMULATED_MODES.items():
        p = simulate(trace, costs, capacity=4, mode=name)
        assert (p.transfers_per_token > 0) == mode.offloads, name
        assert (p.predictor_s > 0) == mode.predicts, name
    assert set(MODES) < set(SIMULATED_MODES)


# ---- recall@k: one definition --------------------------------------------------------------
def by_sets(ranked, native, k):
    return len(set(ranked[:k]) & set(native)) / len(native)


def test_every_recall_is_the_one_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(40, 16, generator=g)
    native = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(40)])
    ranked = scores.argsort(dim=-1, descending=True).tolist()
    for k in (1, 2, 4, 8):
        expected = [by_sets(r, n, k) for r, n in zip(ranked, native.tolist())]
        assert token_recall(scores, native, k).tolist() == pytest.approx(expected)
        assert ranked_recall(ranked, native.tolist(), k) == pytest.approx(expected)
    assert recall(scores, native) == pytest.approx(sum(by_sets(r, n, 4) for r, n in zip(ranked, native.tolist())) / 40)
    trace = RoutingTrace([0], 16, 4, [[LayerRouting(n, n, r[:6])] for r, n in zip(ranked, native.tolist())])
    assert trace.recall() == pytest.approx(sum(by_sets(r, n, 4) for r, n in zip(ranked, native.tolist())) / 40)


def test_a_ranked_list_shorter_than_k_counts_what_it_has():
    assert ranked_recall([[3], [1, 2, 5]], [[3, 4], [2, 7]], 2) == [0.5, 0.5]
    assert ranked_recall([], [], 2) == []
