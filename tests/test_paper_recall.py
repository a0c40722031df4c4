"""Recall@k and exact@K are SpecPrefetch's: per decode token and within-token anchor layer (l -> l+1), averaged
within a sample, then across samples, at k in {K/2, K, 4K/3}; the next token's first sparse layer, predicted at
this token's last, is scored apart (recall_next_token@K). Recomputed here from a routing trace with plain sets."""
import functools
import json

import pandas as pd
import pytest
import torch

import evalsuite
from evalsuite.engine.metrics import recall_ks
from evalsuite.lm.engine_metrics import engine_entries, headline_recall
from evalsuite.results.compare import whole_model_rows
from evalsuite.results.gate import evaluate_gates
from evalsuite.results.lm_eval_rows import stored_results
from evalsuite.zoo.tiny import tiny_model

from .helpers import batch
from .results_data import open_db


@functools.lru_cache(maxsize=None)
def _k6_model():
    """tiny-qwen3-moe with SpecPrefetch's K = 6 (of 16 experts): recall@3, @6 and @8."""
    return tiny_model("qwen3_moe", num_experts=16, num_experts_per_tok=6)


def test_the_k_set_keeps_the_references_fractions_of_k():
    assert recall_ks(6, 64) == (3, 6, 8)
    assert recall_ks(2, 8) == (1, 2, 3)
    assert recall_ks(4, 64) == (2, 4, 5)
    assert recall_ks(8, 64) == (4, 8, 11)
    assert recall_ks(1, 8) == (1,)
    assert recall_ks(6, 7) == (3, 6, 7)  # capped at the number of experts
    assert recall_ks(2, 8, [1, 4]) == (1, 2, 4)  # asked for: K always among them


def _recomputed(trace):
    """From the trace alone, with set operations: per sample (one batch-1 request), the mean over its decode tokens
    x within-token target layers of recall@k and exact@K, and of recall for the next token's first sparse layer;
    then the mean over samples. Also the same mean with the cross-token predictions counted in (what no longer is)."""
    top_k = trace.top_k
    ks = recall_ks(top_k, trace.experts)
    starts = [start for start, _ in trace.prefills] + [len(trace.steps)]
    samples = []
    for start, end in zip(starts, starts[1:]):
        within = {k: [] for k in ks}
        exact, next_token, with_cross = [], [], []
        for step in trace.steps[start:end]:
            for pos, routing in enumerate(step):
                if routing.predicted is None:
                    continue
                native = set(routing.native)
                assert len(native) == top_k
                at = {k: len(set(routing.predicted[:k]) & native) / top_k for k in ks}
                with_cross.append(at[top_k])
                if pos == 0:  # made at the previous token's last sparse layer
                    next_token.append(at[top_k])
                    continue
                for k in ks:
                    within[k].append(at[k])
                exact.append(float(set(routing.predicted[:top_k]) == native))
        if exact:
            samples.append({**{("recall", k): within[k] for k in ks}, ("exact", top_k): exact,
                            ("recall_next_token", top_k): next_token, "with_cross": with_cross})
    assert len(samples) > 1

    def across(key):
        means = [sum(s[key]) / len(s[key]) for s in samples if s[key]]
        return sum(means) / len(means)
    return {key: across(key) for key in samples[0]}


@functools.lru_cache(maxsize=None)
def _run(mode: str):
    """The engine's summary and routing trace of three batch-1 requests of different lengths."""
    model = _k6_model()
    ids, mask = batch(3, seq=8)
    # a budget of every expert: the trace keeps each prediction's whole ranking, so its top-8 is there
    with evalsuite.offload(model, mode=mode, predictor="gate", cache_capacity=0.5,
                           prefetch_budget=model.config.num_experts, trace=True) as engine, torch.no_grad():
        for row, new in enumerate((6, 9, 4)):
            keep = mask[row].bool()
            model.generate(ids[row:row + 1, keep], attention_mask=mask[row:row + 1, keep], max_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return engine.stats(), engine.routing_trace()


@pytest.mark.parametrize("mode", ["router-preserving", "speculative"])
def test_recall_and_exact_match_a_recount_from_the_routing_trace(mode):
    stats, trace = _run(mode)
    top_k, first = trace.top_k, trace.layers[0]
    assert top_k == 6 and tuple(stats["recall"]) == (3, 6, 8) and stats["top_k"] == 6
    expected = _recomputed(trace)
    for k in (3, 6, 8):
        assert stats["recall"][k]["mean"] == pytest.approx(expected[("recall", k)], abs=1e-6), k
        assert stats["recall"][k]["samples"] == 3
    assert stats["exact"][6]["mean"] == pytest.approx(expected[("exact", 6)], abs=1e-6)
    assert stats["recall_next_token"][6]["mean"] == pytest.approx(expected[("recall_next_token", 6)], abs=1e-6)
    # the cross-token prediction is reported on its own and is in no within-token mean
    assert first not in stats["recall"][6]["layers"] and first not in stats["exact"][6]["layers"]
    assert set(stats["recall_next_token"][6]["layers"]) == {first}
    assert set(stats["recall"][6]["layers"]) == set(trace.layers[1:])
    assert expected["with_cross"] != pytest.approx(expected[("recall", 6)], abs=1e-6)  # (so the check above bites)
    entries = engine_entries(stats)
    assert entries["recall@6,engine"] == stats["recall"][6]["mean"]
    assert {key for key in entries if "@" in key} == {"recall@3,engine", "recall@6,engine", "recall@8,engine",
                                                      "exact@6,engine", "recall_next_token@6,engine"}


@pytest.mark.parametrize("as_json", [False, True])
def test_stored_runs_keep_recall_at_k_as_the_headline_with_exact_and_next_token_beside(tmp_path, as_json):
    """Every reader of stored results takes recall@K (k = top_k) where recall@K/2 and @4K/3 are stored too."""
    stats, trace = _run("router-preserving")
    summary = json.loads(json.dumps(stats)) if as_json else stats  # (a summary read back from JSON: string keys)
    db = open_db(tmp_path)
    results = {"results": {"arith": {"exact_match,none": 0.5, **engine_entries(stats)}}}
    run_id = db.record_lm_eval({"model": "tiny", "mode": "router-preserving"}, results, {"arith": summary})
    engine = db.engine_metrics([run_id])
    whole = engine[engine["layer"].isna()].set_index("k")
    assert sorted(whole.index) == [3, 6, 8] and set(whole["top_k"]) == {6}
    assert whole.loc[6, "recall_at_k"] == pytest.approx(stats["recall"][6]["mean"])
    assert whole.loc[6, "exact_at_k"] == pytest.approx(stats["exact"][6]["mean"])
    assert whole.loc[6, "recall_next_token"] == pytest.approx(stats["recall_next_token"][6]["mean"])
    assert whole.loc[[3, 8], ["exact_at_k", "recall_next_token"]].isna().all().all()
    first = engine[(engine["layer"] == trace.layers[0]) & (engine["k"] == 6)].iloc[0]
    assert pd.isna(first["recall_at_k"]) and first["recall_next_token"] == pytest.approx(
        stats["recall_next_token"][6]["mean"])
    # compare and report read the whole-model row of k = K; a gate on recall_at_k or exact_at_k does too
    assert whole_model_rows(engine, "task")["k"].tolist() == [6]
    rules = [{"name": name, "where": {"mode": "router-preserving"}, "engine_metric": column,
              "min": stats[metric][6]["mean"] - 1e-9, "max": stats[metric][6]["mean"] + 1e-9}
             for name, column, metric in (("r", "recall_at_k", "recall"), ("e", "exact_at_k", "exact"))]
    assert evaluate_gates(db, rules)["passed"].tolist() == [True, True]
    # a stored run read back as lm-eval's results: every key, and the table's recall column is recall@K
    back = stored_results(db.task_metrics([run_id]), engine, db.samples([run_id]))["results"]["arith"]
    assert {key: back[key] for key in back if "@" in key} == pytest.approx(
        {key: value for key, value in results["results"]["arith"].items() if "@" in key})
    assert headline_recall(back) == pytest.approx(stats["recall"][6]["mean"])
