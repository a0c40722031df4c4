"""Nothing happens on `import evalsuite`; `import evalsuite.lm` registers the lm-eval models and changes
nothing in lm-eval; engine metrics reach lm-eval's results only where they are added explicitly."""
import json
import os
import subprocess
import sys

from .helpers import REPO


def fresh_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter that imports this checkout."""
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_import_evalsuite_imports_neither_lm_eval_nor_datasets():
    result = fresh_python("import evalsuite; print(evalsuite.__file__); evalsuite.offload", "-X", "importtime")
    assert result.stdout.strip() == os.path.join(REPO, "evalsuite", "__init__.py")
    # -X importtime writes one line per imported module: "import time: self | cumulative | name"
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "evalsuite.engine.offload" in imported  # the report really lists what was imported
    top_level = {name.split(".")[0] for name in imported}
    assert not top_level & {"lm_eval", "datasets", "evaluate"}, sorted(top_level & {"lm_eval", "datasets", "evaluate"})


def test_import_evalsuite_lm_registers_the_models_and_leaves_lm_eval_unchanged():
    code = """
import json
import lm_eval, lm_eval.evaluator
before = (lm_eval.simple_evaluate, lm_eval.evaluator.simple_evaluate, lm_eval.evaluator.evaluate)
import evalsuite.lm
from lm_eval.api.registry import get_model
after = (lm_eval.simple_evaluate, lm_eval.evaluator.simple_evaluate, lm_eval.evaluator.evaluate)
print(json.dumps({"models": [get_model(name).__name__ for name in ("specmoe", "specmoe-vlm")],
                  "unchanged": all(a is b for a, b in zip(before, after))}))
"""
    out = json.loads(fresh_python(code).stdout.strip().splitlines()[-1])
    assert out == {"models": ["SpecMoELM", "SpecMoEVLM"], "unchanged": True}


SUMMARY = {"recall": {2: {"mean": 0.5}}, "hit_rate": 0.75, "prefetch_precision": None,
           "tpot_ms": {"median": 2.0, "mean": 2.5}, "ttft_ms": {"median": 9.0, "mean": 9.5},
           "bytes_per_token": 64.0, "stall_ms_per_token": 0.1, "by_token_kind": None}


def test_engine_metrics_move_from_the_models_report_into_the_results():
    from evalsuite.lm.engine_metrics import TASK_SUMMARIES, add_engine_metrics

    results = {"results": {"arith": {"exact_match,none": 1.0}},
               "config": {"model": "specmoe", TASK_SUMMARIES: {"arith": SUMMARY, "yesno": SUMMARY}}}
    add_engine_metrics(results)
    assert results["results"]["arith"] == {"exact_match,none": 1.0, "recall@2,engine": 0.5, "hit_rate,engine": 0.75,
                                           "tpot_ms,engine": 2.0, "tpot_ms_mean,engine": 2.5, "ttft_ms,engine": 9.0,
                                           "ttft_ms_mean,engine": 9.5, "bytes_per_token,engine": 64.0,
                                           "stall_ms_per_token,engine": 0.1}
    assert results["engine"] == {"arith": SUMMARY}  # a task these results do not hold gets nothing
    assert results["config"] == {"model": "specmoe"}
    other = {"results": {"arith": {"acc,none": 1.0}}, "config": {"model": "hf"}}
    assert add_engine_metrics(other) == {"results": {"arith": {"acc,none": 1.0}}, "config": {"model": "hf"}}


def test_the_cli_wrapper_adds_engine_metrics_only_while_it_runs():
    import lm_eval

    from evalsuite.lm.cli import engine_metrics_in_results
    from evalsuite.lm.engine_metrics import TASK_SUMMARIES

    original = lm_eval.simple_evaluate
    try:
        lm_eval.simple_evaluate = lambda **_: {"results": {"arith": {}}, "config": {TASK_SUMMARIES: {"arith": SUMMARY}}}
        stub = lm_eval.simple_evaluate
        with engine_metrics_in_results():
            assert lm_eval.simple_evaluate()["results"]["arith"]["hit_rate,engine"] == 0.75
        assert lm_eval.simple_evaluate is stub
    finally:
        lm_eval.simple_evaluate = original
