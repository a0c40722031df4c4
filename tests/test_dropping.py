"""Ended rows leave a batch (evalsuite.lm.dropping): each row generates what it generates in the full batch,
and the shadow record of every sequence is the one the full batch records up to that sequence's end."""
import copy
import math

import pytest
import torch

import evalsuite
from evalsuite.engine.metrics import recall_summary, row_recall
from evalsuite.engine.prediction.request_recall import recall_per_row
from evalsuite.lm.dropping import batch_one_length, generate_dropping_ended

from .helpers import batch, reference_model
from .test_modes import artifact_for

NAMES = ["gate", "estimator"]


class Words:
    """A tokenizer whose token i reads 't<i> ': a stop sequence 't<i>' ends a row when it generates token i."""

    def encode(self, text, add_special_tokens=False):
        return [int(word[1:]) for word in text.split()]

    def batch_decode(self, rows):
        return ["".join(f"t{i} " for i in row) for row in rows]


def _full(model, ids, mask, tokens):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_rows_that_end_leave_the_batch_and_keep_their_own_tokens_and_record(model_type):
    model = copy.deepcopy(reference_model(model_type))
    model.generation_config.eos_token_id = None  # rows end at the stop sequence alone
    ids, mask = batch(3)
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)  # two row groups of three slots
    start, tokens = ids.shape[1], 8

    def engine():
        return evalsuite.offload(model, mode="speculative", predictor="gate", artifact=artifact_for(model_type),
                                 keep_experts=True, shadows=NAMES, row_predictors=NAMES)

    full_engine = engine()
    full = _full(model, ids, mask, tokens)
    # a stop that row 0 meets at its third token: its slot ends early (row 3 too, or at the latest step)
    stop = [f"t{int(full[0, start + 2])}"]
    lengths = [batch_one_length(Words(), row, stop, set()) for row in full[:, start:].tolist()]
    full_engine.shadows.end_request([n - 1 for n in lengths])
    full_recall, full_sequences = full_engine.take_shadows()
    full_engine.close()

    dropping, kept = engine(), []
    keep_rows = dropping.keep_rows
    dropping.keep_rows = lambda rows: (kept.append(list(rows)), keep_rows(rows))
    out, got = generate_dropping_ended(model, dropping, Words(), ids, mask, start + tokens, stop, groups=2, pad=0)
    dropping.shadows.end_request([n - 1 for n in got])
    recall, sequences = dropping.take_shadows()
    dropping.close()

    assert kept and len(kept[0]) < ids.shape[0]  # rows did leave the batch
    assert got == lengths
    for row, n in enumerate(lengths):
        assert torch.equal(out[row, :start + n], full[row, :start + n]), row
        assert (out[row, start + n:] == 0).all()  # padded after its end
    assert [(s.native, s.executed, s.predicted, s.executed_by) for s in sequences] == \
           [(s.native, s.executed, s.predicted, s.executed_by) for s in full_sequences]
    for name in NAMES:
        assert recall[name].keys() == full_recall[name].keys()
        for metric, ks in full_recall[name].items():
            for k, layers in ks.items():
                assert recall[name][metric][k].keys() == layers.keys()
                for layer, values in layers.items():
                    assert recall[name][metric][k][layer] == pytest.approx(values, abs=1e-6)


def test_only_an_engine_that_moves_no_experts_lets_rows_leave():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with evalsuite.offload(model, mode="on-demand", cache_capacity=0.5) as engine:
        with pytest.raises(ValueError, match="keep_rows: only an engine that keeps every expert"):
            engine.keep_rows([0])


def test_a_row_with_no_prediction_has_no_recall():
    scores = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 1.0]])
    native = torch.tensor([[0], [0]])
    # step 0: both rows; step 1: row 1 alone (row 0 left); row 1 alone is counted at step 1
    made = [(scores, native, None), (scores[1:], native[1:], torch.tensor([1]))]
    assert recall_per_row(made, 1, 2) == [1.0, 0.0]
    only_late = [(scores[1:], native[1:], torch.tensor([1]))]
    got = recall_per_row(only_late, 1, 2)
    assert math.isnan(got[0]) and got[1] == 0.0
    assert recall_summary({3: got})["layers"] == {3: 0.0}  # the row without a prediction is left out
    assert row_recall({3: got[0], 5: 1.0})["mean"] == 1.0


def test_only_the_plans_greedy_batched_passes_let_rows_leave():
    """A measured run keeps lm-eval's generation, resident included: its TPOT is per step of the whole batch,
    as every other measured mode's is."""
    from types import SimpleNamespace

    from evalsuite.lm.specmoe import EngineAdapter

    def drops(rows=4, shadows=object(), cache=None, **kwargs):
        adapter = SimpleNamespace(engine=SimpleNamespace(shadows=shadows, cache=cache, tracer=None), _plain_cache=True)
        return EngineAdapter._drops_ended_rows(adapter, rows, kwargs)

    assert drops()
    assert not drops(shadows=None)  # a measured run
    assert not drops(cache=object())  # an engine that moves experts
    assert not drops(rows=1) and not drops(do_sample=True) and not drops(temperature=0.7)
