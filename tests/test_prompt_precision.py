"""A prefill's rows, each a prediction scored, tell a fresh engine's scheduler how precise its predictor is."""
import copy
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import evalsuite
from evalsuite.engine.cache.slots import capacity_in_experts
from evalsuite.engine.prediction.prompt_precision import PROMPT_ROWS, PromptOutcomes, PromptRows, prompt_rows
from evalsuite.engine.prediction.scheduler import PrefetchScheduler
from evalsuite.perf.replay import Replay

from .helpers import reference_model
from .scheduler_fakes import FakeEngine, candidates
from .test_replayed_metrics import COSTS


def scores_for(ranked_rows, experts=4):
    """[rows, experts] scores whose top candidates per row are `ranked_rows[row]`, in order."""
    scores = torch.zeros(len(ranked_rows), experts)
    for row, ranked in enumerate(ranked_rows):
        for rank, e in enumerate(ranked):
            scores[row, e] = 10.0 - rank
    return scores


# four rows routed to experts 0, 1, 0, 2 (top-1), each predicted with two candidates
IDS = torch.tensor([[0], [1], [0], [2]])
CANDIDATES = [[0, 3], [1, 0], [1, 2], [0, 2]]


def test_each_candidate_keeps_whether_it_was_picked_and_how_many_rows_back_it_was_last_used():
    rows = prompt_rows(scores_for(CANDIDATES), IDS, budget=2)
    assert rows.position == [0, 1, 2, 3]
    assert rows.picked == [[True, False], [True, False], [False, False], [False, True]]
    assert rows.last_used == [[0, 0], [0, 1], [1, 0], [1, 0]]  # 0: no row before used it


def test_a_candidate_is_missing_where_none_of_the_rows_the_cache_holds_used_it():
    rows = prompt_rows(scores_for(CANDIDATES), IDS, budget=2)
    # the cache holds one row's experts: rows 1-3 are scored (row 0's cache is unknown)
    assert rows.outcomes(1) == PromptOutcomes(3, picked=[1, 1], missing=[1, 2], missing_picked=[1, 1])
    # two rows' experts: rows 2-3; row 3's candidate 0, used two rows back, is held
    assert rows.outcomes(2) == PromptOutcomes(2, picked=[0, 1], missing=[0, 2], missing_picked=[0, 1])
    assert rows.outcomes(4) is None  # no row has four before it


def test_padding_is_left_out_and_the_first_layer_is_scored_against_the_next_row():
    padded_ids = torch.cat([torch.tensor([[3], [3]]), IDS])  # two padding rows before the four
    padded = prompt_rows(scores_for([[3, 2], [3, 2]] + CANDIDATES), padded_ids, budget=2,
                         real=torch.tensor([[False, False, True, True, True, True]]))
    assert padded == prompt_rows(scores_for(CANDIDATES), IDS, budget=2)
    # each row's scores are for the row after it: rows 0-2 predict rows 1-3
    shifted = prompt_rows(scores_for(CANDIDATES), IDS, budget=2, shifted=True)
    assert shifted == prompt_rows(scores_for(CANDIDATES[:3]), IDS[1:], budget=2)
    two = prompt_rows(scores_for(CANDIDATES * 2), torch.cat([IDS, IDS]), budget=2, sequences=2)
    assert two.position == [0, 1, 2, 3] * 2  # each sequence's rows count from its own start


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, PROMPT_ROWS + 20), experts=st.integers(4, 9), top_k=st.integers(1, 3),
       budget=st.integers(1, 4), seed=st.integers(0, 2**16), shifted=st.booleans())
def test_each_row_is_scored_as_counted_row_by_row(length, experts, top_k, budget, seed, shifted):
    """prompt_rows against the definition, counted over again row by row: each of the last PROMPT_ROWS rows'
    candidates (its scores' top `budget`), whether its (next, if shifted) row's routing picked each, and how many
    rows back that routing last used it (0: no row before)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(length, experts, generator=g)  # (distinct: one ranking)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(length)])
    rows = prompt_rows(scores, ids, budget, shifted=shifted)
    own_scores, routed = (scores[:-1], ids[1:].tolist()) if shifted else (scores, ids.tolist())
    if not routed:
        assert rows is None
        return
    start = max(0, len(routed) - PROMPT_ROWS)
    expected = PromptRows([], [], [])
    for i in range(start, len(routed)):
        ranked = sorted(range(experts), key=lambda e: -own_scores[i, e].item())[:budget]
        before = [max((j for j in range(i) if e in routed[j]), default=None) for e in ranked]
        expected.position.append(i)
        expected.picked.append([e in routed[i] for e in ranked])
        expected.last_used.append([0 if j is None else i - j for j in before])
    assert rows == expected


def test_the_prompt_only_lowers_what_the_send_rule_weighs():
    """Rank 0's missing candidates were right 2 times in 20 over the prompt's rows, rank 1's 18: the send rule takes
    rank 0's precision from the prompt (3/22 at PROMPT_WEIGHT, not the half it starts from), rank 1's stays where it
    was; the worth test's precision is the decode's alone."""
    engine = FakeEngine()
    engine.cache.pools = {7: SimpleNamespace(free=[], resident=2)}  # the layer's cache holds one row's experts
    engine.prefetch_cost_s = 0.1  # a wrong guess costs a tenth of a copy of compute
    s = PrefetchScheduler(engine, budget=2)
    s.layer_s = 0.3
    s.schedule(1, candidates([3, 5]), h=1)
    assert engine.sent == [[3]]  # at a half, rank 0 pays: 0.5 · 0.3 > 0.5 · 0.005 + 0.1 − 0.05 (5 waits behind)
    # 20 rows, every candidate missing (used by no row before)
    s.learn_prompt(7, PromptRows(list(range(1, 21)), [[i < 2, i < 18] for i in range(20)], [[0, 0]] * 20))
    assert s.prompt[7] == PromptOutcomes(20, picked=[2, 18], missing=[20, 20], missing_picked=[2, 18])
    assert s.send_precision(7) == [3 / 22, 0.5] and s.missing_precision(7) == [0.5, 0.5]
    engine.sent = []
    s.schedule(1, candidates([3, 5]), h=1)
    assert engine.sent == [[5]]  # 3/22 · 0.3 < (19/22) · 0.005 + 0.1 − 3/22 · 0.1: rank 1 goes first
    for _ in range(40):  # the decode shows rank 0's missing candidates always right
        made = candidates([2, 4])
        s.schedule(1, made, h=1)
        s.observe(7, made, {2, 4})
    assert s.send_precision(7)[0] > 0.9


def test_ranks_the_prompt_did_not_score_keep_the_decode_s_precision():
    engine = FakeEngine()
    engine.cache.pools = {7: SimpleNamespace(free=[], resident=2)}
    s = PrefetchScheduler(engine, budget=2)
    s.learn_prompt(7, PromptRows(list(range(1, 21)), [[False]] * 20, [[0]] * 20))  # one rank, never right
    assert s.send_precision(7) == [1 / 22, 0.5]


def test_the_layer_s_share_of_the_cache_says_how_many_rows_it_holds():
    pool = SimpleNamespace(free=[0] * 2, resident=6)  # 8 slots shared by two layers: 4 each, 2 rows of top-2
    engine = FakeEngine()
    engine.cache = SimpleNamespace(pools={7: pool, 9: pool})
    s = PrefetchScheduler(engine, budget=2)
    rows = prompt_rows(scores_for(CANDIDATES), torch.cat([IDS, IDS], dim=1), budget=2)  # top-2, both the same
    s.learn_prompt(7, rows)
    assert s.prompt[7] == rows.outcomes(2)
    s.learn_prompt(7, rows)  # a second prompt adds to the first
    assert s.prompt[7].rows == 2 * rows.outcomes(2).rows


def test_the_replay_learns_from_the_prompt_as_the_engine_did():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    capacity = capacity_in_experts(0.5, 8 * 3, 1)
    with evalsuite.offload(model, mode="router-preserving", predictor="gate", cache_capacity=capacity,
                           trace=True) as engine, torch.no_grad():
        for _ in range(2):  # two requests: the prompts' rows add up
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        learned = dict(engine.driver.scheduler.prompt)
        trace = engine.routing_trace()
    # the cache holds two rows' experts a layer (12 slots, 3 layers, top-2): each request's first two rows are not
    # scored, and the first layer's 11 (each row predicts the next) lose two as well
    assert [learned[layer].rows for layer in trace.layers] == [2 * 9, 2 * 10, 2 * 10]
    replay = Replay(trace, COSTS, capacity, "router-preserving", trace.top_k, True, "lru")
    replay.run()
    assert replay.scheduler.prompt == learned
    # a resident run's trace holds them too, so every mode replays from it; perfect prediction learns nothing
    with evalsuite.offload(model, mode="resident", predictor="gate", trace=True) as engine, torch.no_grad():
        for _ in range(2):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        resident = engine.routing_trace()
    assert resident.prompts == trace.prompts
    perfect = Replay(resident, COSTS, capacity, "perfect-prefetch", trace.top_k, True, "lru")
    perfect.run()
    assert perfect.scheduler.prompt == {}


def test_a_predictor_that_follows_its_run_learns_nothing_from_the_prompt():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode="router-preserving", predictor="oracle", cache_capacity=0.5) as engine:
        with torch.no_grad():
            model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert engine.driver.scheduler.prompt == {}
