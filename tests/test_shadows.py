"""Shadow predictors: one generation scores every predictor, batched rows as their batch-1 runs."""
import copy

import pytest
import torch

import evalsuite
from evalsuite.engine.prediction.shadows import routing_trace

from .helpers import batch, reference_model
from .test_modes import artifact_for

PREDICTORS = ["gate", "quasi", "adapter", "estimator"]


def _generate(model, ids, mask, tokens=5):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def _unpadded(ids, mask, row):
    keep = mask[row].bool()
    return ids[row : row + 1, keep], mask[row : row + 1, keep]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_shadows_score_each_predictor_as_its_own_router_preserving_run(model_type):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(3)
    engine = evalsuite.offload(model, mode="resident", shadows=PREDICTORS, artifact=artifact_for(model_type),
                               recall_k=[1, 2])
    for row in range(3):
        _generate(model, *_unpadded(ids, mask, row))
    shadow_recall, sequences = engine.take_shadows()
    engine.close()
    for name in PREDICTORS:
        engine = evalsuite.offload(model, mode="router-preserving", predictor=name, artifact=artifact_for(model_type),
                                   cache_capacity=0.5, recall_k=[1, 2], trace=True)
        for row in range(3):
            _generate(model, *_unpadded(ids, mask, row))
        measured = engine.take_record().scores
        prompts = engine.routing_trace().prompts
        engine.close()
        # recall@k, exact@K and recall_next_token@K per sample and layer, exactly
        assert shadow_recall[name] == measured and set(measured) == {"recall", "exact", "recall_next_token"}, name
        # and the prompt's rows as the engine's scheduler learns from them (evalsuite.engine.prediction.prompt_precision)
        assert [s.prompt[name] for s in sequences] == prompts and all(prompts), name


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_left_padded_batch_records_what_each_row_alone_records(model_type):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(4)
    engine = evalsuite.offload(model, mode="resident", shadows=["gate", "quasi"], artifact=artifact_for(model_type))
    alone = []
    for row in range(4):
        _generate(model, *_unpadded(ids, mask, row))
        alone.append(engine.take_shadows())
    _generate(model, ids, mask)
    recall, together = engine.take_shadows()
    engine.close()
    for row, (row_recall, (sequence,)) in enumerate(alone):
        assert together[row].prefill == sequence.prefill  # padding left out
        assert together[row].prefill_predicted == sequence.prefill_predicted
        assert together[row].prompt == sequence.prompt and set(sequence.prompt) == {"gate", "quasi"}
        assert together[row].native == sequence.native
        assert together[row].predicted == sequence.predicted
        for name in ("gate", "quasi"):
            for metric, ks in row_recall[name].items():
                for k, layers in ks.items():
                    for layer, (value,) in layers.items():
                        assert recall[name][metric][k][layer][row] == pytest.approx(value)


def test_rows_count_only_the_steps_their_batch_one_run_made():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(2)
    engine = evalsuite.offload(model, mode="resident", shadows=["gate"])
    _generate(model, ids, mask, tokens=6)  # 5 decode steps
    engine.shadows.end_request(steps=[2, 5])
    _, sequences = engine.take_shadows()
    engine.close()
    assert [len(s.native) for s in sequences] == [2, 5]
    trace = routing_trace(sequences, "gate", [l.index for l in engine.layers], engine.layers[0].num_experts,
                          engine.layers[0].top_k, {})
    assert len(trace.steps) == 7 and [start for start, _ in trace.prefills] == [0, 2]
    assert trace.steps[0][1].predicted == sequences[0].predicted["gate"][0][1]
    assert trace.steps[0][0].predicted is None  # a request's first step has no cross-token prediction


def test_speculative_shadows_see_the_native_routing_and_what_ran():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids, mask = batch(2)
    engine = evalsuite.offload(model, mode="speculative", predictor="gate", shadows=["gate"], cache_capacity="all")
    _generate(model, ids, mask)
    _, sequences = engine.take_shadows()
    record = engine.take_record()
    engine.close()
    step = sequences[0].native[1]
    ran = sequences[0].executed[1]
    # from the second sparse layer on, what ran is the shadow's (= the driver's) predicted top-k
    top_k = engine.layers[0].top_k
    assert sorted(ran[1]) == sorted(sequences[0].predicted["gate"][1][1][:top_k])
    assert len(step[1]) == top_k and record.recall  # the driver scored recall too


def test_oracles_cannot_be_shadows():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with pytest.raises(ValueError, match="shadows=.*must be a list of predictors among"):
        evalsuite.offload(model, mode="resident", shadows=["oracle"])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("mode,predictor", [("speculative", "quasi"), ("hybrid", "hybrid")])
def test_speculating_with_every_expert_kept_in_the_model_gives_the_offloaded_tokens(model_type, mode, predictor):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(3)
    out = {}
    for keep in (False, True):
        engine = evalsuite.offload(model, mode=mode, predictor=predictor, artifact=artifact_for(model_type),
                                   cache_capacity=0.5, keep_experts=keep)
        with torch.no_grad():
            out[keep] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                       output_logits=True, return_dict_in_generate=True)
        moved = engine.stats()["bytes_transferred"]
        engine.close()
        assert (moved == 0) == keep  # kept in the model, nothing moves
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(out[True].logits, out[False].logits))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_row_groups_speculate_each_with_its_predictor_as_its_own_generation_would(model_type):
    model = copy.deepcopy(reference_model(model_type))
    ids, mask = batch(3)
    names, alone = ["gate", "estimator", "frequency"], {}  # on these random models gate, quasi, adapter agree
    for name in names:
        engine = evalsuite.offload(model, mode="speculative", predictor=name, artifact=artifact_for(model_type),
                                   keep_experts=True, shadows=[name])
        with torch.no_grad():
            alone[name] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                         output_logits=True, return_dict_in_generate=True)
        alone[name].shadows = engine.take_shadows()
        engine.close()
    # the predictors execute different experts: what row groups must keep apart
    assert not all(torch.equal(a, b) for a, b in zip(alone["gate"].logits, alone["estimator"].logits))
    engine = evalsuite.offload(model, mode="speculative", predictor="gate", artifact=artifact_for(model_type),
                               keep_experts=True, shadows=names, row_predictors=names)
    with torch.no_grad():
        together = model.generate(ids.repeat(3, 1), attention_mask=mask.repeat(3, 1), max_new_tokens=6,
                                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    recall, sequences = engine.take_shadows()
    assert engine.describe()["predictor"] == "gate+estimator+frequency"
    engine.close()
    for group, name in enumerate(names):
        rows = slice(3 * group, 3 * group + 3)
        assert torch.equal(together.sequences[rows], alone[name].sequences), name
        # the same tokens; logits equal up to the rounding of a larger batch's matrix products
        assert all(torch.allclose(a[rows], b, rtol=1e-4, atol=1e-5) for a, b in zip(together.logits, alone[name].logits))
        alone_recall, alone_sequences = alone[name].shadows
        assert recall[name] == alone_recall[name]  # its own rows only, sample for sample
        own = [s for s in sequences if s.executed_by == name]
        assert [(s.native, s.executed, s.predicted[name]) for s in own] == \
               [(s.native, s.executed, s.predicted[name]) for s in alone_sequences]


def test_row_predictors_need_a_mode_that_executes_predictions():
    model = copy.deepcopy(reference_model("qwen3_moe"))
    with pytest.raises(ValueError, match="row_predictors: mode 'router-preserving' executes no prediction"):
        evalsuite.offload(model, mode="router-preserving", row_predictors=["gate", "quasi"])
