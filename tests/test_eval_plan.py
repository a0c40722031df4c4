"""`evalsuite eval --plan replay`: the fewest generations, batched, and every run's engine metrics replayed."""
import os
import subprocess
import sys

import pytest

from evalsuite.lm import plan
from evalsuite.lm.plan import plan_passes
from evalsuite.lm.runs import one_task
from evalsuite.lm.suite import run_suite
from evalsuite.results import ResultsDB
from evalsuite.results.database import stored_config

from .helpers import eval_request, shipped_model

TASK = "evalsuite_arith"


def test_one_resident_pass_serves_every_exact_run_and_one_pass_every_speculative_predictor():
    passes = plan_passes(["resident", "on-demand", "router-preserving", "speculative"], "gate,quasi")
    assert [(p.label, p.shadows, p.row_predictors) for p in passes] == [
        ("resident", ["gate", "quasi"], ()), ("speculative/gate+quasi", ["gate", "quasi"], ("gate", "quasi"))]
    assert passes[0].serves == [("resident", None), ("on-demand", None), ("router-preserving", "gate"),
                                ("router-preserving", "quasi")]
    assert passes[1].serves == [("speculative", "gate"), ("speculative", "quasi")]
    assert [p.label for p in plan_passes(["hybrid", "on-demand"], None)] == ["resident", "hybrid/hybrid"]
    # an oracle replays a recorded pass, not its row's own states: a generation of its own
    assert [p.label for p in plan_passes(["speculative"], "gate,quasi,oracle")] == \
        ["speculative/gate+quasi", "speculative/oracle"]


def _suite(db, out, modes, plan_="replay", batch_size=4, model="tiny-qwen3-moe", limit=6, predictor=None,
           predictor_path=None):
    return run_suite([shipped_model(model)], modes, [TASK], limit, db_url=f"sqlite:///{db}", out_dir=str(out),
                     plan=plan_, progress=lambda *_: None, predictor=predictor,
                     **eval_request(link="ufs4", batch_size=batch_size, predictor_path=predictor_path))


def _runs(db):
    with ResultsDB(f"sqlite:///{db}") as store:
        runs = store.runs()
        configs = {int(r.id): stored_config(r.config) for r in runs.itertuples()}
        samples = store.samples(list(configs))
        engine = store.engine_metrics(list(configs))
    return configs, samples, engine


def test_replayed_runs_are_stored_labelled_and_resumed(tmp_path, monkeypatch):
    db, out = tmp_path / "r.db", tmp_path / "out"
    rows = _suite(db, out, ["resident", "on-demand", "router-preserving"])
    assert [(r["mode"], r["predictor"]) for r in rows] == [
        ("resident", None), ("on-demand", None), ("router-preserving", "adapter")]
    assert all(r["replayed"] for r in rows)  # marked in the printed table
    configs, samples, _ = _runs(db)
    assert {c["engine_metrics"] for c in configs.values()} == {"replayed"}
    assert {c["generated_by"] for c in configs.values()} == {"resident"}
    by_mode = {c["mode"]: run for run, c in configs.items()}
    assert configs[by_mode["on-demand"]]["link"] == "ufs4" and configs[by_mode["resident"]]["link"] is None
    responses = {mode: samples[samples.run_id == run].sort_values("doc_id")["response"].tolist()
                 for mode, run in by_mode.items()}
    assert responses["on-demand"] == responses["resident"] == responses["router-preserving"]
    assert len({r["hit_rate"] for r in rows}) == 3  # each run its own replayed engine metrics
    assert rows[2]["recall"] is not None and rows[0]["recall"] is None

    def no_generation(*args, **kwargs):
        raise AssertionError("a stored run was generated again")

    monkeypatch.setattr(plan, "evaluate_task", no_generation)
    again = _suite(db, out, ["resident", "on-demand", "router-preserving"])
    assert [(r["run"], r["hit_rate"]) for r in again] == [(r["run"], r["hit_rate"]) for r in rows]


def test_on_demand_hit_rate_replayed_equals_the_measured_run(tmp_path):
    db, out = tmp_path / "r.db", tmp_path / "out"
    replayed = _suite(db, out, ["on-demand"])
    measured = _suite(db, out, ["on-demand"], plan_="measure", batch_size=1)
    assert replayed[0]["hit_rate"] == measured[0]["hit_rate"]
    configs, _, engine = _runs(db)
    uses = {configs[run]["engine_metrics"]: engine[(engine.run_id == run) & engine.layer.isna()]["tokens"].iloc[0]
            for run in configs}
    assert uses["replayed"] == uses["measured"]  # the same tokens: every prefill and decode step replayed


def test_tasks_of_one_call_are_stored_as_if_each_ran_alone(tmp_path):
    # a pass evaluates every missing task in one lm-eval call; each run's stored tasks are its own
    db, out = tmp_path / "r.db", tmp_path / "out"
    tasks = [TASK, "evalsuite_yesno"]

    def plan_(db_, tasks_):
        return run_suite([shipped_model()], ["resident", "speculative"], tasks_, 4, db_url=f"sqlite:///{db_}",
                         out_dir=str(out), plan="replay", progress=lambda *_: None, **eval_request(link="ufs4", batch_size=4),
                         predictor="gate")

    together = plan_(db, tasks)
    alone = {task: plan_(tmp_path / f"{task}.db", [task]) for task in tasks}
    configs, samples, engine = _runs(db)
    for task in tasks:
        for mode in ("resident", "speculative"):
            run = next(run for run, c in configs.items() if c["mode"] == mode)
            got = samples[(samples.run_id == run) & (samples.task == task)].sort_values("doc_id")
            assert len(got) == 4 and set(samples[samples.run_id == run].task) == set(tasks)
            one_configs, one_samples, _ = _runs(tmp_path / f"{task}.db")
            one_run = next(r for r, c in one_configs.items() if c["mode"] == mode)
            want = one_samples[one_samples.run_id == one_run].sort_values("doc_id")
            assert got["response"].tolist() == want["response"].tolist()
            assert engine[(engine.run_id == run) & (engine.task == task)].shape[0] > 0
    assert sorted((r["mode"], r["task"], r["accuracy"], r["recall"]) for r in together) == \
        sorted((r["mode"], r["task"], r["accuracy"], r["recall"]) for task in tasks for r in alone[task])


def test_speculative_requests_are_batched_by_the_resident_lengths(tmp_path, monkeypatch):
    from evalsuite.lm.specmoe import SpecMoELM

    batches, lengths, generate = [], {}, SpecMoELM._model_generate

    def spy(self, context, *args, **kwargs):
        out = generate(self, context, *args, **kwargs)
        if self.answering is None:
            batches.append((self.engine.mode, list(self._batch_texts)))
            if self.engine.mode == "resident":
                lengths.update(self.generated_lengths)
        return out

    monkeypatch.setattr(SpecMoELM, "_model_generate", spy)
    db, out = tmp_path / "r.db", tmp_path / "out"
    _suite(db, out, ["resident", "speculative"], limit=12, predictor="gate")
    speculative = [[lengths[text] for text in texts] for mode, texts in batches if mode == "speculative"]
    assert len(speculative) == 3 and all(len(b) == 4 for b in speculative)
    assert all(min(a) >= max(b) for a, b in zip(speculative, speculative[1:]))  # longest first, batch by batch
    resident = [lengths[text] for mode, texts in batches if mode == "resident" for text in texts]
    assert resident != sum(speculative, [])  # (lm-eval's own order, by context length, is another)
    _suite(tmp_path / "one.db", out, ["speculative"], batch_size=1, limit=12, predictor="gate")
    configs, samples, _ = _runs(db)
    _, one, _ = _runs(tmp_path / "one.db")
    run = next(run for run, c in configs.items() if c["mode"] == "speculative")
    assert samples[samples.run_id == run].sort_values("doc_id")["response"].tolist() == \
        one.sort_values("doc_id")["response"].tolist()


def test_one_task_narrows_every_per_task_entry():
    results = {"results": {"g": {"acc": 1}, "a": {"acc": 0}, "b": {"acc": 1}}, "group_subtasks": {"g": ["a"], "b": []},
               "samples": {"a": [1], "b": [2]}, "configs": {"a": {}, "b": {}}, "config": {"model": "m"}, "date": 1.0}
    assert one_task(results, "g") == {"results": {"g": {"acc": 1}, "a": {"acc": 0}}, "group_subtasks": {"g": ["a"]},
                                      "samples": {"a": [1]}, "configs": {"a": {}}, "config": {"model": "m"}, "date": 1.0}
    assert one_task(results, "b")["results"] == {"b": {"acc": 1}} and one_task(results, "b")["samples"] == {"b": [2]}


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-glm4-moe"])
def test_speculative_batched_generates_what_batch_one_does(tmp_path, model):
    db, out = tmp_path / "r.db", tmp_path / "out"
    batched = _suite(db, out, ["speculative"], batch_size=8, model=model, limit=8)
    single = _suite(db, out, ["speculative"], batch_size=1, model=model, limit=8)
    configs, samples, _ = _runs(db)
    by_batch = {configs[run]["batch_size"]: samples[samples.run_id == run].sort_values("doc_id")
                for run in configs}
    assert by_batch[8]["response"].tolist() == by_batch[1]["response"].tolist()
    assert by_batch[8]["correct"].tolist() == by_batch[1]["correct"].tolist()
    assert batched[0]["recall"] == pytest.approx(single[0]["recall"])
    # (hit rates are replayed with the compute costs each invocation measures: they may differ a little)
    assert batched[0]["hit_rate"] is not None and single[0]["hit_rate"] is not None


def test_speculative_predictors_sharing_one_generation_answer_as_each_alone(tmp_path):
    db, out = tmp_path / "r.db", tmp_path / "out"
    made = subprocess.run([sys.executable, "-m", "evalsuite.cli", "calibrate", "--model", shipped_model(), "--out",
                           str(tmp_path), "--prompts", "8", "--epochs", "1", "--predictor", "estimator"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert made.returncode == 0, made.stderr
    artifact = str(tmp_path / "predictor.safetensors")  # quasi's default vectors
    together = _suite(db, out, ["speculative"], limit=8, predictor="gate,quasi", predictor_path=artifact)
    alone = [_suite(db, out, ["speculative"], limit=8, predictor=name, predictor_path=artifact)[0]
             for name in ("gate", "quasi")]
    configs, samples, _ = _runs(db)
    responses = {(configs[run]["predictor"], configs[run]["generated_by"]): samples[samples.run_id == run]
                 .sort_values("doc_id")["response"].tolist() for run in configs}
    assert responses[("gate", "speculative/gate+quasi")] == responses[("gate", "speculative/gate")]
    assert responses[("quasi", "speculative/gate+quasi")] == responses[("quasi", "speculative/quasi")]
    assert responses[("gate", "speculative/gate")] != responses[("quasi", "speculative/quasi")]
    assert [r["recall"] for r in together] == pytest.approx([r["recall"] for r in alone])
    assert [r["accuracy"] for r in together] == [r["accuracy"] for r in alone]


def test_a_vision_language_model_is_planned_too(tmp_path):
    """Image tokens and all: on-demand replayed from the batched resident pass equals the measured run, and the
    speculative pass at batch 4 answers as batch 1 does (one pass per speculative predictor: image inputs are
    not repeated into row groups)."""
    db, out = tmp_path / "r.db", tmp_path / "out"
    assert [p.label for p in plan_passes(["on-demand", "speculative"], "gate,quasi", row_groups=False)] == \
        ["resident", "speculative/gate", "speculative/quasi"]

    def suite(plan_, batch_size):
        return run_suite([shipped_model("tiny-qwen3-vl-moe")], ["on-demand", "speculative"], ["evalsuite_vision"], 6,
                         db_url=f"sqlite:///{db}", out_dir=str(out), plan=plan_,
                         **eval_request(link="ufs4", batch_size=batch_size),
                         progress=lambda *_: None)

    replayed, measured = suite("replay", 4), suite("measure", 1)
    assert [r["replayed"] for r in replayed] == [True, True] and not any(r["replayed"] for r in measured)
    assert replayed[0]["hit_rate"] == measured[0]["hit_rate"]
    assert replayed[1]["recall"] == pytest.approx(measured[1]["recall"])
    configs, samples, engine = _runs(db)
    key = {run: (c["mode"], c["engine_metrics"]) for run, c in configs.items()}
    responses = {key[run]: samples[samples.run_id == run].sort_values("doc_id")["response"].tolist() for run in key}
    assert responses[("speculative", "replayed")] == responses[("speculative", "measured")]
    uses = {key[run]: engine[(engine.run_id == run) & engine.layer.isna()]["tokens"].iloc[0] for run in key}
    assert uses[("on-demand", "replayed")] == uses[("on-demand", "measured")]


def test_row_groups_are_refused_on_a_vision_language_model():
    from evalsuite.lm.specmoe import SpecMoEVLM

    with pytest.raises(ValueError, match="row_predictors is for text models"):
        SpecMoEVLM(pretrained=shipped_model("tiny-qwen3-vl-moe"), mode="speculative", keep_experts=True,
                   row_predictors="gate;quasi")
