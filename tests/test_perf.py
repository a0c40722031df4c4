"""Routing traces from the engine, real model shapes, hardware profiles, bench and simulate commands."""
import copy
import functools
import json

import pytest
import torch

import evalsuite
from evalsuite.cli import main
from evalsuite.perf import bench
from evalsuite.perf.bench import bench_model
from evalsuite.perf.profiles import costs, load_profile, profile_names
from evalsuite.perf.shapes import MODELS, model_shape, random_model
from evalsuite.perf.replay import executed_experts
from evalsuite.engine.trace import RoutingTrace

from .helpers import reference_model

NEW_TOKENS = 6


def traced(mode, predictor=None, capacity=0.5):
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with evalsuite.offload(model, mode=mode, predictor=predictor, cache_capacity=capacity, trace=True) as engine:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return engine.routing_trace()


def test_a_trace_holds_every_decode_step_and_layer():
    trace = traced("router-preserving", "gate")
    assert len(trace.steps) == NEW_TOKENS - 1  # the prefill is not a decode step
    assert all(len(step) == len(trace.layers) == 3 for step in trace.steps)
    for step in trace.steps:
        for r in step:
            assert r.executed == r.native and len(r.native) == trace.top_k
    # every sparse layer is predicted: the first one across the token boundary, from the previous
    # token (so not at a request's first decode step)
    assert trace.steps[0][0].predicted is None
    assert all(len(r.predicted) == trace.top_k for s, step in enumerate(trace.steps) for r in step[s == 0:])
    assert trace.meta["mode"] == "router-preserving" and trace.meta["predictor"] == "gate"
    # the prefill's experts are kept, to warm the simulated cache as the real prefill does
    [(start, per_layer)] = trace.prefills
    assert start == 0 and len(per_layer) == 3 and all(len(e) >= trace.top_k for e in per_layer)
    assert 0 <= trace.recall() <= 1


def test_a_trace_keeps_each_prediction_with_the_step_it_is_for():
    # trace-oracle predicts perfectly, the first layer from the next step of the resident run's trace
    resident = traced("resident")
    model = copy.deepcopy(reference_model("qwen3_moe"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with evalsuite.offload(model, mode="router-preserving", predictor="trace-oracle", artifact=resident,
                           cache_capacity=0.5, trace=True) as engine:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        trace = engine.routing_trace()
    assert [[sorted(r.predicted or []) for r in step] for step in trace.steps[1:]] == \
        [[r.native for r in step] for step in trace.steps[1:]]
    assert trace.recall() == 1.0


def test_speculative_traces_execute_the_prediction_and_keep_the_native_choice():
    trace = traced("speculative", "gate")
    executed = [r.executed for step in trace.steps for r in step]
    derived = [executed_experts("speculative", pos, r, trace.top_k)
               for step in trace.steps for pos, r in enumerate(step)]
    assert executed == derived
    assert any(r.executed != r.native for step in trace.steps for r in step[1:])  # gate is not perfect here


def test_traces_round_trip_and_bad_files_are_refused(tmp_path):
    trace = traced("router-preserving", "gate")
    trace.save(tmp_path / "t.json")
    again = RoutingTrace.load(tmp_path / "t.json")
    assert again.steps == trace.steps and again.layers == trace.layers
    assert len(trace.prompts) == len(trace.prefills) == 1 and set(trace.prompts[0]) == set(trace.layers)
    assert again.prompts == trace.prompts  # the prefill's rows scored, per sparse layer
    (tmp_path / "bad.json").write_text('{"layers": [1]')
    with pytest.raises(ValueError, match="not a routing trace"):
        RoutingTrace.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="trace=True"):
        evalsuite.offload(copy.deepcopy(reference_model("qwen3_moe"))).routing_trace()


def test_real_shapes_match_the_published_sizes():
    qwen = model_shape("qwen3-30b-a3b")
    assert qwen.expert_bytes == 3 * 2048 * 768 * 2 and (qwen.experts, qwen.top_k, qwen.sparse_layers) == (128, 8, 48)
    total_params = (qwen.total_experts * qwen.expert_bytes + qwen.sparse_layers * qwen.sparse_layer_bytes
                    + 2 * qwen.head_bytes) / 2
    assert total_params == pytest.approx(30.5e9, rel=0.02)  # "30.5B parameters in total"
    glm = model_shape("glm-4.7-flash")
    assert (glm.dense_layers, glm.sparse_layers, glm.experts, glm.top_k) == (1, 46, 64, 4)
    with pytest.raises(ValueError, match="unknown model shape"):
        model_shape("gpt-5")


def test_a_random_real_shape_model_has_the_real_expert_size():
    model = random_model("qwen3-30b-a3b", sparse_layers_count=1, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (128, 2 * 768, 2048) and model.config.num_experts_per_tok == 8


def test_every_shipped_profile_loads_and_prices_every_model(tmp_path):
    assert {"a6000", "a100", "h100", "h200", "gh200", "snapdragon-8-elite-sdcard"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.sources, f"{name} must say where its figures come from"
        for shape in MODELS:
            c = costs(profile, model_shape(shape), "adapter")
            assert min(c.dense_s, c.expert_s, c.step_s, c.transfer_s, c.predictor_s) > 0
    # a slower link costs more per expert, nothing else changes
    fast, slow = (costs(load_profile(p), model_shape("qwen3-30b-a3b")) for p in
                  ("snapdragon-8-elite-ufs4", "snapdragon-8-elite-sdcard"))
    assert slow.transfer_s > 10 * fast.transfer_s and slow.expert_s == fast.expert_s
    (tmp_path / "p.yaml").write_text("name: x\nmemory_bandwidth_gbs: 10\n")
    with pytest.raises(ValueError, match="needs memory_bandwidth_gbs"):
        load_profile(str(tmp_path / "p.yaml"))


def test_bench_measures_every_case_and_checks_the_simulator_against_it(monkeypatch):
    ran, run_case = [], bench.run_case
    monkeypatch.setattr(bench, "run_case", lambda *args: ran.append(args[3].label) or run_case(*args))
    result = bench_model("tiny:qwen3_moe", ["ufs4"], [0.5], ["gate", "trace-oracle", "oracle"], tokens=5, repeats=2,
                         progress=False)
    cfg = result["configs"][0]
    cases = [r["case"] for r in cfg["rows"]]
    assert cases == ["resident", "on-demand", "router-preserving/gate", "speculative/gate",
                     "speculative/gate free-running", "router-preserving/trace-oracle", "oracle prefetch"]
    assert ran == cases + cases[1:] + cases[:1]  # the second repeat runs them one place on: no case is always first
    rows = {r["case"]: r for r in cfg["rows"]}
    for row in cfg["rows"]:
        assert row["tpot_ms"] > 0 and row["simulated_tpot_ms"] > 0
        assert row["vs_on_demand_range"][0] <= row["vs_on_demand"] <= row["vs_on_demand_range"][1]
        low, high = row["vs_on_demand_at_speed_range"]
        assert low <= row["vs_on_demand_at_speed"] <= high
    # exact cases predict every resident token; the speculative ones are fed them (teacher-forced) or not
    assert all(rows[c]["same_tokens"] == 1.0 for c in ("on-demand", "router-preserving/trace-oracle"))
    assert rows["speculative/gate"]["forced"] and not rows["speculative/gate free-running"]["forced"]
    assert rows["on-demand"]["vs_on_demand"] == rows["on-demand"]["vs_on_demand_at_speed"] == 1.0
    assert cfg["bound_tpot_ms"] > 0 and cfg["transfer_ms"] > 0 and result["engine_overhead"]["ratio"] > 0
    assert len(cfg["traces"]["on-demand"].steps) == 4


def test_a_warm_bench_measures_and_traces_each_engine_s_second_request(monkeypatch):
    """--warm: each case's engine serves another prompt first and empties its cache; only the second request is
    measured and traced, and trace-oracle replays a recording of both, so its measured predictions are right."""
    from evalsuite.perf import decode

    served, greedy = [], bench.greedy

    def counted(model, ids, *args):
        served.append(ids)
        return greedy(model, ids, *args)
    monkeypatch.setattr(bench, "greedy", counted)
    monkeypatch.setattr(decode, "greedy", counted)  # (serve_earlier's)
    result = bench_model("tiny:qwen3_moe", ["ufs4"], [0.5], ["gate", "trace-oracle"], tokens=5, repeats=1,
                         progress=False, warm=True)
    cfg = result["configs"][0]
    assert result["warm"] and len(cfg["rows"]) == 6
    prompt = served[0]  # the reference's: the measured prompt
    assert sum(not torch.equal(ids, prompt) for ids in served) == 6 + 1  # each case's engine, and the recording
    for name, trace in cfg["traces"].items():
        assert len(trace.steps) == 4 and [start for start, _ in trace.prefills] == [0]
        # the measured request's prompt rows alone, for a predictor that learns from them (not trace-oracle)
        assert len(trace.prompts) == 1 and (trace.prompts[0] is not None) == ("/gate" in name), name
    oracle = [r for step in cfg["traces"]["router-preserving/trace-oracle"].steps for r in step if r.predicted]
    assert oracle and all(set(r.predicted) == set(r.native) for r in oracle)


def test_the_gap_closed_at_speed_compares_every_run_at_the_speed_of_the_bound_s_costs(monkeypatch):
    """The bound comes from the cost runs' clocks; a case run the machine computed at half their speed is
    compared with it at their speed (its stall as measured, the rest halved), not as its clock read."""
    from evalsuite.perf import costs as costs_module
    from evalsuite.perf import simulate as simulate_module

    def probe(seconds):
        class Probe:
            def __init__(self, engine):
                pass

            def median(self):
                return seconds
        return Probe

    monkeypatch.setattr(costs_module, "SpeedProbe", probe(1e-3))  # the cost runs
    monkeypatch.setattr(bench, "SpeedProbe", probe(2e-3))  # every case run at half their speed
    # a share of any gap, however small (the bench leaves one under 5 % of on-demand blank, and a 5-token run's
    # gap at speed can be that small): what is tested is which TPOTs the share is computed from
    monkeypatch.setattr(bench, "gap_closed", functools.partial(simulate_module.gap_closed, min_gap=float("-inf")))
    cfg = bench_model("tiny:qwen3_moe", ["sdcard"], [0.25], ["trace-oracle"], tokens=5, repeats=1,
                      progress=False)["configs"][0]
    rows = {r["case"]: r for r in cfg["rows"]}

    def at_speed(row):
        return bench.at_speed({"tpot_s": row["tpot_ms"] / 1e3, "stall_ms_per_token": row["stall_ms_per_token"]}, 2.0)

    od, oracle, bound = at_speed(rows["on-demand"]), at_speed(rows["router-preserving/trace-oracle"]), \
        cfg["bound_tpot_ms"] / 1e3
    assert rows["router-preserving/trace-oracle"]["speed_factor"] == 2.0
    assert rows["router-preserving/trace-oracle"]["gap_closed_at_speed"] == pytest.approx((od - oracle) / (od - bound))
    assert rows["resident"]["gap_closed_at_speed"] is None


def test_a_run_at_speed_rescales_its_compute_and_keeps_its_stall():
    run = {"tpot_s": 10e-3, "stall_ms_per_token": 2.0}  # 8 ms of compute on a machine at half speed
    assert bench.at_speed(run, 2.0) == pytest.approx(6e-3)
    assert bench.at_speed({"tpot_s": 10e-3, "stall_ms_per_token": None}, 0.5) == pytest.approx(20e-3)


def test_simulate_command_projects_every_mode(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["simulate", "--model", "qwen3-30b-a3b", "--profile", "a6000", "--reuse", "0.3", "--recall", "0.8",
                 "--steps", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())[0]["rows"]
    modes = [r["mode"] for r in rows]
    assert modes == ["resident", "on-demand", "router-preserving", "speculative", "perfect-prefetch", "overlap bound"]
    by_mode = {r["mode"]: r["tpot_ms"] for r in rows}
    assert by_mode["resident"] < by_mode["overlap bound"] <= by_mode["on-demand"]
    assert "synthetic trace" in capsys.readouterr().out


def test_a_recorded_trace_of_another_shape_gives_its_predicted_reuse_to_the_synthetic_one():
    from evalsuite.perf.project import fit_trace

    recorded = traced("router-preserving", "gate")
    shape = model_shape("qwen3-30b-a3b")
    fitted, origin = fit_trace(recorded, shape, steps=48)
    assert fitted.meta["predicted_reuse"] == pytest.approx(recorded.predicted_reuse())
    assert fitted.meta["recall"] == pytest.approx(recorded.recall())
    assert f"predicted reuse {fitted.meta['predicted_reuse']:.3f}" in origin
    # by hand it wins over the trace's; without either it is the routing's, and the line says so
    fitted, origin = fit_trace(recorded, shape, steps=48, predicted_reuse=0.4)
    assert fitted.meta["predicted_reuse"] == 0.4 and "predicted reuse 0.400" in origin
    _, origin = fit_trace(None, shape, steps=48, reuse=0.3, recall=0.8)
    assert "(the routing's)" in origin


def test_simulate_command_takes_the_predicted_reuse(tmp_path, capsys):
    argv = ["simulate", "--model", "qwen3-30b-a3b", "--profile", "a6000", "--reuse", "0.3", "--recall", "0.8",
            "--steps", "4", "--predicted-reuse", "0.35"]
    assert main(argv) == 0
    assert "recall@8 0.800 and predicted reuse 0.350" in capsys.readouterr().out


def test_simulate_command_takes_the_engines_eviction_policy(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["simulate", "--model", "qwen3-30b-a3b", "--profile", "a6000", "--reuse", "0.3", "--recall", "0.8",
            "--steps", "4", "--capacity", "0.05", "--json", str(out)]
    rows = {}
    for policy in ("lru", "least-stale"):
        assert main(argv + ["--cache-policy", policy]) == 0
        rows[policy] = {r["mode"]: r for r in json.loads(out.read_text())[0]["rows"]}
    assert "least-stale), predictor" in capsys.readouterr().out
    assert rows["lru"]["on-demand"]["hit_rate"] != rows["least-stale"]["on-demand"]["hit_rate"]


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--profile", "tpu-v9", "--model", "qwen3-30b-a3b", "--reuse", "0.3", "--recall", "0.8"],
     "unknown hardware profile"),
    (["simulate", "--profile", "a6000", "--model", "gpt-5", "--reuse", "0.3", "--recall", "0.8"],
     "unknown model shape"),
    (["simulate", "--profile", "a6000", "--model", "qwen3-30b-a3b"], "give a trace"),
    (["simulate", "--profile", "a6000"], "give --model"),
])
def test_simulate_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_bench_command_writes_traces_profiles_and_rows_that_simulate_reproduces(tmp_path, capsys, monkeypatch):
    from evalsuite.engine.prediction.scheduler import PrefetchScheduler

    # every prediction of the second sparse layer is put off, the others made: the engine and both replays agree
    monkeypatch.setattr(PrefetchScheduler, "worth_predicting", lambda self, target, h: target != 1)
    db = tmp_path / "r.db"
    out = tmp_path / "bench"
    assert main(["bench", "--models", "tiny:qwen3_moe", "--links", "ufs4", "--capacities", "0.5",
                 "--predictors", "gate,oracle", "--tokens", "4", "--repeats", "1", "--out", str(out),
                 "--db", str(db)]) == 0
    printed = capsys.readouterr().out
    assert "6 rows written" in printed and "overlap bound" in printed
    result = json.loads((out / "bench.json").read_text())[0]
    rows = {r["case"]: r for r in result["configs"][0]["rows"]}
    trace = out / "traces" / "tiny-qwen3_moe-ufs4-0.5-router-preserving-gate.json"
    profile = out / "profiles" / "tiny-qwen3_moe-ufs4-0.5.yaml"
    assert trace.exists() and profile.exists()
    # the engine's own cost of issuing a prefetch travels with the profile, for the simulated scheduler
    issued = result["configs"][0]["costs"]["prefetch_s"]
    assert issued > 0 and costs(load_profile(str(profile)), predictor="gate").prefetch_s == pytest.approx(issued)
    # and so does its timing of a prediction put off, which the replay charges
    put_off = result["configs"][0]["case_costs"]["router-preserving/gate"]["put_off"]
    assert put_off > 0 and costs(load_profile(str(profile)), predictor="gate").put_off_s == pytest.approx(put_off)
    # the saved trace and the measured profile through `evalsuite simulate` give the bench's replay
    projected = tmp_path / "p.json"
    assert main(["simulate", "--trace", str(trace), "--profile", str(profile), "--capacity", "0.5",
                 "--predictor", "gate", "--json", str(projected)]) == 0
    by_mode = {r["mode"]: r["tpot_ms"] for r in json.loads(projected.read_text())[0]["rows"]}
    assert by_mode["router-preserving"] == pytest.approx(rows["router-preserving/gate"]["profile_tpot_ms"])
    speculative = out / "traces" / "tiny-qwen3_moe-ufs4-0.5-speculative-gate.json"  # priced as speculative/gate
    assert main(["simulate", "--trace", str(speculative), "--profile", str(profile), "--capacity", "0.5",
                 "--predictor", "gate", "--json", str(projected)]) == 0
    by_mode = {r["mode"]: r["tpot_ms"] for r in json.loads(projected.read_text())[0]["rows"]}
    assert by_mode["speculative"] == pytest.approx(rows["speculative/gate"]["profile_tpot_ms"])
    from evalsuite.results.database import ResultsDB

    with ResultsDB(str(db)) as store:
        runs = store.runs()
        metrics = store.task_metrics(runs["id"].tolist())
    assert len(runs) == 6 and set(runs["mode"]) == {"resident", "on-demand", "router-preserving", "speculative"}
    assert {"tpot_ms", "ttft_ms", "simulated_tpot_ms", "sim_error", "bound_tpot_ms"} <= set(metrics["metric"])


def test_a_version_1_trace_has_its_first_layer_predictions_moved_to_the_step_they_are_for(tmp_path):
    trace = traced("router-preserving", "gate")
    trace.save(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    del data["version"]  # as written before: the prediction sat on the step that made it
    for before, now in zip(data["steps"], data["steps"][1:]):
        before[0]["predicted"] = now[0]["predicted"]
    data["steps"][-1][0]["predicted"] = None
    (tmp_path / "v1.json").write_text(json.dumps(data))
    assert RoutingTrace.load(tmp_path / "v1.json").steps == RoutingTrace.load(tmp_path / "t.json").steps
