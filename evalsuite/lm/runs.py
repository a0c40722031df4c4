"""One stored run of `evalsuite eval`: its configuration, its claim on the results database (new, or an
earlier one resumed), each task evaluated through lm-eval and written as soon as it is done, and the rows
of the printed table."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time

from ..engine.metrics import token_divergence
from ..engine.modes import MODES
from ..results.claim import claim_run
from ..results.database import error_line
from .engine_metrics import headline_recall
from .preflight import task_configs

ACCURACY_METRICS = ("exact_match", "pass@1", "pass_at_1", "acc", "accuracy")


def engine_config(engine) -> dict:
    """The cache and store an engine actually runs with, read from the engine (none for resident)."""
    cache = engine.cache
    if cache is None:
        return {"cache_policy": None, "cache_pools": None, "store": None}
    pools = "per-layer" if len({id(pool) for pool in cache.pools.values()}) > 1 else "global"
    store = "disk" if type(engine.store).__name__ == "SafetensorsStore" else "host"
    return {"cache_policy": cache.policy, "cache_pools": pools, "store": store}


def accuracy(task_results: dict) -> tuple[str, float] | None:
    """The task's headline metric: the first accuracy-like entry outside the engine filter."""
    for name in ACCURACY_METRICS:
        for key, value in task_results.items():
            metric, _, flt = key.partition(",")
            if metric == name and flt != "engine" and isinstance(value, (int, float)):
                return key, value
    return None


def divergence(results: dict, reference: dict, tokenizer) -> dict[str, dict]:
    """Per task: mean identical-token share and changed samples against `reference`; each sample
    entry also gets its own `first_divergence` and `identical_share`."""
    out = {}
    for task, samples in results.get("samples", {}).items():
        ref = {s["doc_id"]: s for s in reference.get("samples", {}).get(task, [])}
        rows = []
        for s in samples:
            if not isinstance(s["resps"][0][0], str):
                continue  # a loglikelihood request generates nothing to compare
            if s["doc_id"] in ref:
                a = tokenizer(str(s["resps"][0][0]))["input_ids"]
                b = tokenizer(str(ref[s["doc_id"]]["resps"][0][0]))["input_ids"]
                row = token_divergence(a, b)
                s.update(row)
                rows.append(row)
        if rows:
            firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
            out[task] = {"identical_share": sum(r["identical_share"] for r in rows) / len(rows),
                         "samples_changed": len(firsts), "samples": len(rows)}
    return out


def evaluate_task(lm, task: str | list[str], limit: int, manager, options: dict, confirm_run_unsafe_code: bool) -> dict:
    """One task (or several in one lm-eval call, see `one_task`) through lm-eval with every sample logged;
    `options`: num_fewshot, gen_kwargs, apply_chat_template and seed (lm-eval's four seeds)."""
    import lm_eval

    seed = options["seed"]
    tasks = [task] if isinstance(task, str) else list(task)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True, task_manager=manager,
                                   num_fewshot=options["num_fewshot"], gen_kwargs=options["gen_kwargs"],
                                   apply_chat_template=options["apply_chat_template"], random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                   confirm_run_unsafe_code=confirm_run_unsafe_code)


PER_TASK = ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "samples",
            "task_hashes", "engine")  # the entries of lm-eval's results (and add_engine_metrics') keyed by task


def one_task(results: dict, task: str) -> dict:
    """The results of one lm-eval call over several tasks, as a call over `task` alone would have given them:
    every per-task entry narrowed to it (a group keeps its subtasks); the rest (config, dates) shared."""
    names, todo = set(), [task]
    while todo:
        name = todo.pop()
        names.add(name)
        todo += [child for child in results.get("group_subtasks", {}).get(name, []) if child not in names]
    return {key: {name: v for name, v in value.items() if name in names}
            if key in PER_TASK and isinstance(value, dict) else value for key, value in results.items()}


def open_run(db, config: dict, fresh: bool, progress, poll_s: float = 1.0) -> tuple[int, str, set[str]]:
    """A new run, or the earlier run with this exact configuration and the tasks it already stored: its id,
    uid and stored tasks. While another live process writes that run, wait: it finishes (every task is then
    stored) or dies (its run is then resumed here)."""
    claim = claim_run(db, config, fresh)
    if claim.status == "running":
        progress(f"[evalsuite] run {claim.run_id} with this configuration is being written by another process: "
                 "waiting for it to finish")
        while claim.status == "running":
            time.sleep(poll_s)
            claim = claim_run(db, config, fresh)
    if claim.status == "new":
        return claim.run_id, claim.uid, set()
    if set(config["tasks"]) - claim.done:
        progress(f"[evalsuite] resuming run {claim.run_id} ({claim.status}): {len(claim.done)} of "
                 f"{len(config['tasks'])} tasks stored")
    else:
        progress(f"[evalsuite] run {claim.run_id} already holds every task: kept as it is (--fresh runs again)")
    return claim.run_id, claim.uid, claim.done


def finish(db, run_id: int, status: str, error: str | None) -> None:
    """Close the run; when even that write fails (a full disk) after a failure, the failure is what is
    reported, and the run reads 'incomplete' once this process has ended."""
    try:
        db.finish_run(run_id, status, error)
    except ValueError:
        if status == "complete":
            raise


@contextlib.contextmanager
def writing(db, run_ids: list[int], engine):
    """Runs being written by the block: each closed 'complete' when it ends, 'incomplete' on Ctrl-C (resumable,
    like a killed run) and 'failed' with its error otherwise; the engine (if given) is closed whatever happens."""
    status, error = "failed", None
    try:
        yield
        status = "complete"
    except KeyboardInterrupt:
        status = "incomplete"
        raise
    except BaseException as exc:
        error = error_line(exc)
        raise
    finally:
        try:
            for run_id in run_ids:
                finish(db, run_id, status, error)
        finally:
            if engine is not None:
                engine.close()


def check_generation_lengths(manager, tasks, lm, model_name: str) -> None:
    """lm-eval needs room for a prompt beside the longest generation: refuse, in one line and before any run
    is stored, a task whose max_gen_toks the model's context cannot hold."""
    for task, max_gen_toks in generation_lengths(manager, tasks, lm.max_gen_toks).items():
        if max_gen_toks >= lm.max_length:
            raise ValueError(f"{task} generates up to {max_gen_toks} tokens, but {model_name} has a context of "
                             f"{lm.max_length} tokens, leaving no room for the prompt: evaluate it with a model "
                             "whose context is longer (or leave the task out)")


def generation_lengths(manager, tasks, default: int) -> dict[str, int]:
    """max_gen_toks of every generate_until task among `tasks`, groups and tags expanded, from lm-eval's task index."""
    return {name: int((cfg.get("generation_kwargs") or {}).get("max_gen_toks", default))
            for task in tasks for name, cfg in task_configs(task, manager)
            if cfg.get("output_type") == "generate_until"}


def file_hash(path: str | None) -> str | None:
    """A short content hash, so a run records which calibration artifact it used."""
    if not path:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def table_rows(results, model, mode, predictor, diverged, run_id, seconds, busy: float | None = None,
               replayed: bool = False, probes: list[float] | None = None, expert_bits: int = 16) -> list[dict]:
    """One row per task of a run, for format_rows. `prefill_only`: a speculating run whose task decoded no token
    (a loglikelihood task): speculation never acted, so its accuracy is resident's by construction."""
    rows = []
    for task, values in sorted(results["results"].items()):
        headline = accuracy(values)
        if headline is None:
            continue  # a group without an aggregate
        recall = headline_recall(values)  # recall@K (evalsuite.engine.metrics)
        prefill_only = MODES[mode].speculates and values.get("tpot_ms,engine") is None
        rows.append({"model": model, "mode": mode, "predictor": predictor, "prefill_only": prefill_only,
                     "expert_bits": expert_bits,
                     "task": task, "metric": headline[0], "accuracy": headline[1],
                     "recall": recall, "hit_rate": values.get("hit_rate,engine"),
                     "tpot_ms": values.get("tpot_ms,engine"), "tpot_p10": values.get("tpot_ms_p10,engine"),
                     "tpot_p90": values.get("tpot_ms_p90,engine"), "busy": busy,
                     "identical_share": diverged.get(task, {}).get("identical_share"), "run": run_id,
                     "seconds": seconds, "replayed": replayed, "probes": probes})
    return rows


def save_json(results: dict, out_dir: str, stem: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
