"""A task YAML's filters and scorer, built the way lm-eval builds them, without loading the task's data."""
from __future__ import annotations

from pathlib import Path

from lm_eval.api.filter import FilterEnsemble
from lm_eval.api.instance import Instance
from lm_eval.filters import build_filter_ensemble
from lm_eval.tasks._yaml_loader import load_yaml

from evalsuite.tasks import TASKS_DIR as PACKAGE_TASKS

TASKS_DIR = Path(PACKAGE_TASKS)


def task_config(task: str) -> dict:
    """The YAML with its `include:` merged and its `!function` hooks imported, as lm-eval reads it."""
    return load_yaml(TASKS_DIR / f"{task}.yaml")


def filter_steps(task: str, filter_name: str) -> list[dict]:
    [entry] = [entry for entry in task_config(task)["filter_list"] if entry["name"] == filter_name]
    return entry["filter"]


def filter_pipeline(task: str, filter_name: str) -> FilterEnsemble:
    steps = [[step["function"], {k: v for k, v in step.items() if k != "function"}]
             for step in filter_steps(task, filter_name)]
    return build_filter_ensemble(filter_name, steps)


def apply_filter(task: str, filter_name: str, generations: list[str]) -> list:
    """Each generation, as one document's only response, through the task's named filter pipeline."""
    instances = [Instance("generate_until", {}, ("", {}), i, resps=[text]) for i, text in enumerate(generations)]
    filter_pipeline(task, filter_name).apply(instances)
    return [instance.filtered_resps[filter_name] for instance in instances]


def score(task: str, doc: dict, generation: str, filter_name: str | None = None) -> dict[str, float]:
    """The task's process_results on one generation, after `filter_name` (None: lm-eval's default take_first)."""
    result = generation if filter_name is None else apply_filter(task, filter_name, [generation])[0]
    return task_config(task)["process_results"](doc, [result])
