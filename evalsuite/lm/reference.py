"""The resident run a mode's generations are compared with (the "same tok" column) when the invocation ran none:
the newest stored resident run of the same configuration that holds the task.

The same configuration is what decides resident's tokens: the settings `evalsuite compare` checks (model
fingerprint, task, limit, few-shot, seed, batch size, generation arguments, chat template;
evalsuite.results.comparable) and the dtype and device. A run that left any of them unrecorded is not used.
"""
from __future__ import annotations

from ..engine.modes import REFERENCE
from ..results.comparable import differences
from ..results.database import stored_config
from ..results.lm_eval_rows import stored_results

_TOKEN_SETTINGS = ("dtype", "device")  # beside comparable's settings


def find_reference(db, config: dict, task: str, reference: dict, progress) -> None:
    """Put into `reference[task]` a stored resident run's results of `task` for the run configured by `config`,
    unless `reference` has the task already or no stored run fits."""
    if task in reference:
        return
    found = stored_reference(db, config, task)
    if found is not None:
        run_id, reference[task] = found
        progress(f"[evalsuite] {config['model']} / {config['mode']} / {task}: same tokens counted against the "
                 f"stored resident run {run_id}")


def stored_reference(db, config: dict, task: str) -> tuple[int, dict] | None:
    """The newest complete or resumable resident run of `config`'s configuration whose every stored sample of
    `task` has its generated text: (its id, its results shaped as simple_evaluate() returns them)."""
    runs = db.runs()
    resident = runs[(runs["mode"] == REFERENCE) & runs["status"].isin(("complete", "incomplete"))]
    this = {"id": "this", "config": config}
    for run in resident.to_dict("records"):
        stored = stored_config(run["config"])
        if any(key not in stored or stored[key] != config.get(key) for key in _TOKEN_SETTINGS):
            continue
        differ, unknown = differences(this, run, tasks=[task])
        if differ or unknown:
            continue
        ids = [run["id"]]
        results = stored_results(db.task_metrics(ids), db.engine_metrics(ids), db.samples(ids))
        samples = results["samples"].get(task)
        if samples and all(isinstance(s["resps"][0][0], str) for s in samples):
            return int(run["id"]), results
    return None
