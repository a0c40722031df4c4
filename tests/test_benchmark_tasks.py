"""The benchmark task YAMLs, loaded by lm-eval's TaskManager from tasks/ and run by lm-eval's evaluator.

A reference "model" answers each request from the document's own label (the
GSM8k solution, the boxed AIME answer, the StrategyQA verdict, the HumanEval
canonical body), so every task must score 100 % through its real prompt,
filters and metrics; a model that answers wrongly must score 0.
"""
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from lm_eval.api.model import LM

from evalsuite.scoring import datasets as ds
from evalsuite.tasks import TASKS_DIR as PACKAGE_TASKS

from .helpers import shared_data

TASKS_DIR = Path(PACKAGE_TASKS)

# task -> (data file, metric keys lm-eval reports as "metric,filter")
TASKS = {
    "gsm8k_es": ("gsm8k/test.jsonl", ["exact_match,strict-match", "exact_match,flexible-extract"]),
    "gsm8k_es_5shot": ("gsm8k/test.jsonl", ["exact_match,strict-match", "exact_match,flexible-extract"]),
    "gsm8k_es_cot": ("gsm8k/test.jsonl", ["exact_match,flexible-extract"]),
    "strategyqa_es_cot": ("strategyqa/dev.jsonl", ["exact_match,final-yes-no"]),
    "strategyqa_es_mc": ("strategyqa/dev.jsonl", ["acc,none", "acc_norm,none"]),
    "aime24_es": ("aime/aime2024.jsonl", ["exact_match,boxed-integer"]),
    "aime25_es": ("aime/aime2025.jsonl", ["exact_match,boxed-integer"]),
    "aime_1983_2024_es": ("aime/aime_1983_2024.jsonl", ["exact_match,boxed-integer"]),
    "humaneval_es": ("humaneval/test.jsonl", ["pass_at_1,create_test"]),
    "humaneval_es_sampled": ("humaneval/test.jsonl", ["pass_at_1,create_test", "pass_at_5,create_test"]),
}
SAFE_TASKS = [name for name in TASKS if not name.startswith("humaneval")]


DATA_DIR = Path(shared_data()) if shared_data() else None
pytestmark = pytest.mark.skipif(DATA_DIR is None, reason="benchmark data directory (shared/data) not found")


def offline_env(monkeypatch, data_dir) -> None:
    monkeypatch.setenv(ds.DATA_DIR_ENV, str(data_dir))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as patch:
        offline_env(patch, DATA_DIR)
        yield TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def loaded(manager):
    with pytest.MonkeyPatch.context() as patch:
        offline_env(patch, DATA_DIR)
        return manager.load(["benchmarks_es_with_code", "humaneval_es_sampled"])


def rows_in(relative_file: str) -> list[dict]:
    return ds.read_jsonl(DATA_DIR / relative_file)


def reference_answer(task_name: str, doc: dict, wrong: bool) -> str:
    """The labelled answer written the way the task asks for it; `wrong` shifts it to a wrong one."""
    if task_name.startswith("gsm8k"):
        return doc["answer"].replace(f"#### {doc['target']}", f"#### {int(doc['target']) + wrong}")
    if task_name.startswith("aime"):
        return f"Adding up, the answer is $\\boxed{{{doc['answer'] + wrong}}}$."
    if task_name.startswith("strategyqa"):
        return "So the answer is " + ("yes" if doc["answer"] != wrong else "no") + "."
    if task_name.startswith("humaneval"):
        return "    return None\n" if wrong else doc["canonical_solution"]
    raise KeyError(task_name)


class ReferenceLM(LM):
    """An lm-eval model that answers from the labels (or always wrongly) and records its prompts."""

    def __init__(self, wrong: bool = False):
        super().__init__()
        self.wrong = wrong
        self.contexts = defaultdict(list)

    def generate_until(self, requests, disable_tqdm: bool = False):
        for request in requests:
            self.contexts[request.task_name].append(request.args[0])
        return [reference_answer(r.task_name, r.doc, self.wrong) for r in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        scores = []
        for request in requests:
            self.contexts[request.task_name].append(request.args[0])
            label = "yes" if request.doc["answer"] != self.wrong else "no"
            scores.append((0.0 if request.args[1].strip() == label else -5.0, False))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def evaluate(tasks: dict, lm, **kwargs) -> dict:
    from lm_eval.evaluator import evaluate as lm_eval_evaluate

    return lm_eval_evaluate(lm, {"tasks": tasks, "groups": {}}, bootstrap_iters=0, log_samples=False, **kwargs)


# ---------------------------------------------------------------- loading


def test_every_task_loads_with_as_many_docs_as_its_data_file(loaded):
    assert set(loaded["tasks"]) == set(TASKS)
    for name, (data_file, _) in TASKS.items():
        assert len(list(loaded["tasks"][name].test_docs())) == len(rows_in(data_file)), name


def test_groups_keep_code_execution_out_of_benchmarks_es(manager, loaded):
    assert set(loaded["group_map"]["benchmarks_es_with_code"]) == set(SAFE_TASKS) | {"humaneval_es"}
    unsafe = {name for name, task in loaded["tasks"].items() if getattr(task, "UNSAFE_CODE", False)}
    assert unsafe == {"humaneval_es", "humaneval_es_sampled"}
    with pytest.MonkeyPatch.context() as patch:
        offline_env(patch, DATA_DIR)
        safe_group = manager.load(["benchmarks_es"])
    assert set(safe_group["tasks"]) == set(SAFE_TASKS)


def test_evalsuite_all_runs_the_project_tasks_and_every_benchmark(manager):
    with pytest.MonkeyPatch.context() as patch:
        offline_env(patch, DATA_DIR)
        everything = manager.load(["evalsuite_all"])
    project = {"evalsuite_arith", "evalsuite_yesno", "evalsuite_code", "evalsuite_boxed"}
    assert set(everything["tasks"]) == set(SAFE_TASKS) | {"humaneval_es"} | project
    unsafe = {name for name, task in everything["tasks"].items() if getattr(task, "UNSAFE_CODE", False)}
    assert unsafe == {"humaneval_es", "evalsuite_code"}  # both need --confirm_run_unsafe_code


def test_strategyqa_choices_map_the_label_to_the_right_answer(loaded):
    task = loaded["tasks"]["strategyqa_es_mc"]
    labels = [row["answer"] for row in rows_in("strategyqa/dev.jsonl")]
    docs = list(task.test_docs())
    assert [task.doc_to_choice(doc)[task.doc_to_target(doc)] for doc in docs] == ["yes" if x else "no" for x in labels]


def test_missing_data_file_stops_task_loading_with_a_clear_error(manager, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        offline_env(patch, tmp_path)
        with pytest.raises(ds.MissingDataError, match=f"{ds.DATA_DIR_ENV}=.*{tmp_path / 'gsm8k' / 'test.jsonl'}"):
            manager.load(["gsm8k_es"])


# ---------------------------------------------------------------- scoring through lm-eval's evaluator


def test_reference_answers_score_full_marks_on_every_safe_task(loaded):
    lm = ReferenceLM()
    # Every document, except for the 5-shot variant: lm-eval's exemplar sampling makes it slow, and it
    # shares its filters and scorer with gsm8k_es.
    results = evaluate({name: loaded["tasks"][name] for name in SAFE_TASKS if name != "gsm8k_es_5shot"}, lm)["results"]
    results.update(evaluate({"gsm8k_es_5shot": loaded["tasks"]["gsm8k_es_5shot"]}, lm, limit=100)["results"])
    for name in SAFE_TASKS:
        for metric in TASKS[name][1]:
            assert results[name][metric] == 1.0, (name, metric)
    # The 5-shot prompt carries five exemplars from the train split, the zero-shot ones none.
    five_shot = lm.contexts["gsm8k_es_5shot"][0]
    assert five_shot.count("Question:") == 6 and five_shot.count("####") == 5
    train_questions = {row["question"] for row in rows_in("gsm8k/train.jsonl")}
    exemplars = [part.split("\nAnswer:")[0] for part in five_shot.split("Question: ")[1:-1]]
    assert len(exemplars) == 5 and all(question in train_questions for question in exemplars)
    assert lm.contexts["gsm8k_es"][0].count("Question:") == 1
    assert lm.contexts["gsm8k_es_cot"][0].endswith("Let's think step by step.")


def test_wrong_answers_score_zero(loaded):
    tasks = {name: loaded["tasks"][name] for name in ("gsm8k_es", "strategyqa_es_cot", "strategyqa_es_mc", "aime24_es")}
    results = evaluate(tasks, ReferenceLM(wrong=True), limit=40)["results"]
    for name in tasks:
        for metric in TASKS[name][1]:
            assert results[name][metric] == 0.0, (name, metric)


def test_humaneval_refuses_to_run_code_without_confirmation(loaded):
    lm = ReferenceLM()
    with pytest.raises(ValueError, match="confirm_run_unsafe_code"):
        evaluate({"humaneval_es": loaded["tasks"]["humaneval_es"]}, lm, limit=2)
    assert not lm.contexts  # refused before any generation


@pytest.mark.parametrize("wrong, expected", [(False, 1.0), (True, 0.0)])
def test_humaneval_scores_canonical_solutions_once_confirmed(loaded, wrong, expected):
    tasks = {name: loaded["tasks"][name] for name in ("humaneval_es", "humaneval_es_sampled")}
    lm = ReferenceLM(wrong=wrong)
    results = evaluate(tasks, lm, limit=3, confirm_run_unsafe_code=True)["results"]
    for name in tasks:
        for metric in TASKS[name][1]:
            assert results[name][metric] == expected, (name, metric)
    assert len(lm.contexts["humaneval_es_sampled"]) == 3 * 20  # every repeat was generated and scored


# ---------------------------------------------------------------- lm_eval command line with a tiny model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random qwen3_moe model and the project's character tokenizer, saved as an HF model directory."""
    pytest.importorskip("transformers")
    from evalsuite.zoo.tiny import tiny_model
    from evalsuite.zoo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_lm_eval_cli_runs_generative_and_multiple_choice_tasks_on_a_tiny_model(tiny_model_dir, tmp_path):
    output = tmp_path / "out"
    env = {**os.environ, ds.DATA_DIR_ENV: str(DATA_DIR), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={tiny_model_dir},dtype=float32", "--device", "cpu", "--batch_size", "1",
        "--include_path", str(TASKS_DIR), "--tasks", "gsm8k_es,strategyqa_es_mc", "--limit", "2",
        "--gen_kwargs", "max_gen_toks=8", "--output_path", str(output),
    ]
    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    [result_file] = output.rglob("results_*.json")
    results = json.loads(result_file.read_text())["results"]
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(results["gsm8k_es"])
    assert 0.0 <= results["strategyqa_es_mc"]["acc,none"] <= 1.0
