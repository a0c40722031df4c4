"""The `specmoe` lm-eval model: exact under router-preserving, engine metrics per task."""
import os
import subprocess
import sys

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from evalsuite.lm import add_engine_metrics  # (registers specmoe)

from .helpers import TASKS, shared_data, shipped_model

MODEL = shipped_model("tiny-qwen3-moe")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def evaluate(model: str, model_args: str, tasks, limit: int):
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit, device="cpu",
                                      batch_size=1, log_samples=True, task_manager=TaskManager(include_path=TASKS))
    return add_engine_metrics(results)


def responses(results, task):
    return {(s["doc_id"], s.get("filter")): (s["filtered_resps"], s["exact_match"]) for s in results["samples"][task]}


@pytest.mark.parametrize("task", ["gsm8k_es", "evalsuite_arith"])
def test_router_preserving_equals_hf_sample_by_sample(task, monkeypatch):
    if task == "gsm8k_es":
        if shared_data() is None:
            pytest.skip("benchmark data directory (../shared/data) not found")
        monkeypatch.setenv("EVALSUITE_DATA_DIR", shared_data())
    hf = evaluate("hf", f"pretrained={MODEL},experts_implementation=eager", [task], 5)
    spec = evaluate("specmoe", f"pretrained={MODEL},mode=router-preserving,predictor=gate,cache_capacity=0.25",
                    [task], 5)
    assert responses(spec, task) == responses(hf, task)
    for key, value in hf["results"][task].items():
        if key.startswith("exact_match"):
            assert spec["results"][task][key] == value
    engine = spec["results"][task]
    assert 0 <= engine["recall@2,engine"] <= 1 and 0 <= engine["hit_rate,engine"] <= 1
    assert engine["tpot_ms,engine"] > 0 and engine["ttft_ms,engine"] > 0 and engine["bytes_per_token,engine"] > 0
    assert "engine,none" not in hf["results"][task] and "hit_rate,engine" not in hf["results"][task]
    assert spec["config"]["evalsuite_engine"]["mode"] == "router-preserving"


def test_engine_metrics_are_attributed_to_their_task():
    tasks = ["evalsuite_arith", "evalsuite_yesno"]
    out = evaluate("specmoe", f"pretrained={MODEL},mode=on-demand,cache_capacity=0.25", tasks, 3)
    per_task = out["engine"]
    assert set(per_task) == set(tasks)
    # each task's requests ran as their own group: 3 requests each, different generated lengths
    assert [per_task[t]["requests"] for t in tasks] == [3, 3]
    assert per_task["evalsuite_arith"]["tokens"] != per_task["evalsuite_yesno"]["tokens"]
    assert out["results"]["evalsuite_arith"]["bytes_per_token,engine"] != \
        out["results"]["evalsuite_yesno"]["bytes_per_token,engine"]
    for summary in per_task.values():
        assert summary["hits"] + summary["misses"] == summary["expert_uses"]


def test_cli_wrapper_sees_specmoe_and_prints_engine_rows():
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "evalsuite-lm-eval"), "--model", "specmoe", "--model_args",
         f"pretrained={MODEL},mode=router-preserving,predictor=gate,cache_capacity=0.25", "--device", "cpu",
         "--include_path", TASKS, "--tasks", "evalsuite_yesno", "--limit", "2"],
        capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recall@2" in result.stdout and "hit_rate" in result.stdout and "|engine|" in result.stdout


@pytest.mark.parametrize("arg,message", [("mode=warp", "specmoe: mode='warp' is not one of: resident, on-demand"),
                                         ("predictor=psychic", "specmoe: predictor='psychic' is not one of")])
def test_bad_model_args_get_one_line(arg, message):
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "evalsuite-lm-eval"), "--model", "specmoe", "--model_args",
         f"pretrained={MODEL},{arg}", "--device", "cpu", "--include_path", TASKS, "--tasks", "evalsuite_yesno",
         "--limit", "1"], capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("evalsuite-lm-eval: error:")
