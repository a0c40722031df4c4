"""`evalsuite eval` (and `make eval`): models x modes x tasks through lm-eval, one table.

Each (model, mode) is one lm-eval run of the `specmoe` model (`specmoe-vlm` for a vision-language
model) over its tasks; results go to the results database (and lm-eval's JSON, named by the run's uid).
Speculative runs are compared with the resident run of the same model sample by sample: first differing
generated token, share of identical ones. A resumed run's stored tasks are read back from the database,
never from JSON files, which another database's runs may share a folder with.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

from .. import __version__, timing
from ..engine.metrics import token_divergence
from ..results.claim import claim_run
from ..results.lm_eval_rows import stored_results
from ..results.provenance import git_commit
from ..results.store import error_line
from ..scoring.sandbox import confinement_to_use
from ..tasks import TASKS_DIR
from ..engine.offload import PREDICTING
from ..hub import is_hub_id, local_model
from .preflight import check_eval, parse_gen_kwargs, predictor_for, task_configs, unsafe_tasks
from .engine_metrics import add_engine_metrics

ACCURACY_METRICS = ("exact_match", "pass@1", "pass_at_1", "acc", "accuracy")
SEED = 0  # every seed lm-eval takes (Python, numpy, torch, few-shot sampling), as its `--seed N` sets them


def is_vision_language(model: str) -> bool:
    """A model (directory or Hub id) whose config has a vision tower (run through specmoe-vlm)."""
    path = os.path.join(local_model(model) if is_hub_id(model) else model, "config.json")
    if not os.path.isfile(path):
        return False  # run_suite reports the missing model
    with open(path) as f:
        return "vision_config" in json.load(f)


def model_args(model: str, mode: str, predictor: str | None, predictor_path: str | None, cache_capacity,
               link: str | None, extra: str = "", dtype: str | None = None, **engine_options) -> str:
    """lm-eval's model_args for one run: the mode's own predictor where none is given, and only the options
    the mode uses; `engine_options` (cache_policy, cache_pools, store) go to every offloading mode."""
    args = [f"pretrained={model}", f"mode={mode}", f"cache_capacity={cache_capacity}"]
    if dtype is not None:
        args.append(f"dtype={dtype}")
    predictor = predictor_for(mode, predictor)
    if predictor:
        args.append(f"predictor={predictor}")
    if predictor_path and mode in PREDICTING:
        args.append(f"predictor_path={predictor_path}")
    if link and mode != "resident":
        args.append(f"link={link}")
    if mode != "resident":
        args += [f"{name}={value}" for name, value in engine_options.items() if value is not None]
    return ",".join(args + ([extra] if extra else []))


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


def run_suite(models, modes, tasks, limit, predictor=None, predictor_path=None, cache_capacity=0.25, link=None,
              cache_policy=None, cache_pools=None, store=None, db_url=None, out_dir="results",
              confirm_run_unsafe_code=False, fresh=False, progress=print, seed=SEED, device="cpu", dtype=None,
              batch_size=1, num_fewshot=None, gen_kwargs=None, apply_chat_template=False, threads: int = 1,
              extra_config: dict | None = None) -> list[dict]:
    """Evaluate every (model, mode) over `tasks` (a list for all models, or a dict: model -> its tasks);
    each task lands in the database as soon as it is done.

    `device`, `dtype`, `batch_size` go to the adapter; `num_fewshot`, `gen_kwargs` (lm-eval's
    'name=value,...' or a dict), `apply_chat_template` (True or a template's name) and `seed` to lm-eval.
    A run made earlier with exactly the same configuration (model fingerprint, mode, predictor and
    artifact, cache, link, limit, tasks, device, dtype, batch size, few-shot, generation arguments, chat
    template, seed, code version) is resumed: its stored tasks are kept and only
    the missing ones run, so an interrupted `make eval` finishes what is missing and every result is
    stored once. A task cut off mid-way is run again whole, so its engine metrics stay complete.
    `fresh=True` always starts new runs. `extra_config` is stored with each run's configuration (a sweep
    names its cell there). A run another live process is writing with the same configuration is waited for.
    A failed run stores its error; a task that would generate more tokens than the model's context holds is
    refused before any run is stored."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from ..results import ResultsDB

    manager = TaskManager(include_path=TASKS_DIR)
    tasks_of = tasks if isinstance(tasks, dict) else {model: list(tasks) for model in models}
    # the whole request, before any model is loaded (the CLI and sweeps have checked it already)
    run_options = dict(device=device, dtype=dtype, batch_size=batch_size, num_fewshot=num_fewshot,
                       gen_kwargs=gen_kwargs, apply_chat_template=apply_chat_template, seed=seed)
    check_eval(models, modes, tasks_of, limit, predictor=predictor, predictor_path=predictor_path,
               cache_capacity=cache_capacity, link=link, cache_policy=cache_policy, cache_pools=cache_pools,
               store=store, confirm_run_unsafe_code=confirm_run_unsafe_code, manager=manager, open_db=False,
               **run_options)
    gen_kwargs = parse_gen_kwargs(gen_kwargs)
    db = ResultsDB(db_url)  # opened first: a bad URL fails before any model is loaded
    timing.pin(threads)  # evalsuite.timing: one protocol for every TPOT the suite reports
    rows = []
    for model in models:
        tasks = tasks_of[model]
        path = local_model(model)  # a Hub id: its snapshot in the local Hugging Face cache
        adapter = "specmoe-vlm" if is_vision_language(path) else "specmoe"
        tokenizer = AutoTokenizer.from_pretrained(path)
        # what confined the generated code of this model's runs (None: no task runs code)
        sandbox = confinement_to_use() if unsafe_tasks(tasks, manager) else None
        reference: dict[str, dict] = {}
        for mode in modes:
            # a local directory is known by its name, so gates and reports work from any checkout; a Hub model by its id
            name = model if is_hub_id(model) else os.path.basename(model.rstrip("/"))
            args = model_args(path, mode, predictor, predictor_path, cache_capacity, link, dtype=dtype,
                              cache_policy=cache_policy, cache_pools=cache_pools, store=store)
            lm = get_model(adapter).create_from_arg_string(args, {"batch_size": batch_size, "device": device})
            config = {"model": name, "model_path": os.path.abspath(path),
                      "mode": mode, "predictor": lm.engine.describe()["predictor"],
                      "predictor_artifact": file_hash(predictor_path), "seed": seed,
                      "cache_capacity": str(cache_capacity) if mode != "resident" else None,
                      **engine_config(lm.engine), "link": link if mode != "resident" else None, "limit": limit,
                      "dtype": str(lm.model.dtype).replace("torch.", ""), "device": device, "batch_size": batch_size,
                      "num_fewshot": num_fewshot, "gen_kwargs": gen_kwargs, "apply_chat_template": apply_chat_template,
                      "model_fingerprint": lm.fingerprint(), "model_args": args, "tasks": list(tasks),
                      "sandbox": sandbox, "git_commit": git_commit(), "evalsuite_version": __version__,
                      "threads": threads, "machine": timing.machine(device),
                      **(extra_config or {})}
            try:  # refused, or waited for, before anything is stored
                check_generation_lengths(manager, tasks, lm, name)
                run_id, uid, done = open_run(db, config, fresh, progress)
            except BaseException:
                lm.engine.close()
                raise
            status, error = "failed", None
            try:
                if done:  # stored by an earlier, interrupted invocation: read back from this database only
                    stored = stored_results(db.task_metrics([run_id]), db.engine_metrics([run_id]),
                                            db.samples([run_id]))
                    if mode == "resident":
                        reference.update(dict.fromkeys(stored["results"], stored))
                    rows += table_rows(stored, name, mode, stored["divergence"], run_id, 0.0)
                if set(tasks) - done:
                    timing.warm_up(lm.model, tokenizer, lm.engine)
                for task in tasks:
                    if task in done:
                        continue
                    progress(f"[evalsuite] {name} / {mode} / {task} (limit {limit}, run {run_id})")
                    started = time.time()
                    results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, log_samples=True,
                                                      task_manager=manager, num_fewshot=num_fewshot,
                                                      gen_kwargs=gen_kwargs, apply_chat_template=apply_chat_template,
                                                      random_seed=seed, numpy_random_seed=seed,
                                                      torch_random_seed=seed, fewshot_random_seed=seed,
                                                      confirm_run_unsafe_code=confirm_run_unsafe_code)
                    add_engine_metrics(results)
                    if mode == "resident":
                        reference[task] = results
                    diverged = divergence(results, reference[task], tokenizer) if task in reference and \
                        mode != "resident" else {}
                    results["divergence"] = diverged
                    save_json(results, out_dir, f"{run_id}-{name.replace('/', '--')}-{mode}-{task}-{uid}")
                    db.add_lm_eval_tasks(run_id, results, results.get("engine"))
                    rows += table_rows(results, name, mode, diverged, run_id, time.time() - started,
                                       busy=timing.busy(device))
                status = "complete"
            except KeyboardInterrupt:
                status = "incomplete"  # resumable, like a killed run
                raise
            except BaseException as exc:
                error = error_line(exc)
                raise
            finally:
                try:
                    finish(db, run_id, status, error)
                finally:
                    lm.engine.close()
    return rows


def finish(db, run_id: int, status: str, error: str | None) -> None:
    """Close the run; when even that write fails (a full disk) after a failure, the failure is what is
    reported, and the run reads 'incomplete' once this process has ended."""
    try:
        db.finish_run(run_id, status, error)
    except ValueError:
        if status == "complete":
            raise


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


def table_rows(results, model, mode, diverged, run_id, seconds, busy: float | None = None) -> list[dict]:
    rows = []
    for task, values in sorted(results["results"].items()):
        headline = accuracy(values)
        if headline is None:
            continue  # a group without an aggregate
        recall = next((v for k, v in values.items() if k.startswith("recall@")), None)
        rows.append({"model": model, "mode": mode, "task": task, "metric": headline[0], "accuracy": headline[1],
                     "recall": recall, "hit_rate": values.get("hit_rate,engine"),
                     "tpot_ms": values.get("tpot_ms,engine"), "tpot_p10": values.get("tpot_ms_p10,engine"),
                     "tpot_p90": values.get("tpot_ms_p90,engine"), "busy": busy,
                     "identical_share": diverged.get(task, {}).get("identical_share"), "run": run_id,
                     "seconds": seconds})
    return rows


def save_json(results: dict, out_dir: str, stem: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def format_rows(rows) -> str:
    """The table `evalsuite eval` prints: accuracy (the task's headline metric, named), recall, hit rate,
    TPOT as median [p10-p90] over sequences (flagged * when the machine was busy), same tokens."""
    numbers = ("accuracy", "recall", "hit rate", "TPOT ms [p10-p90]", "same tok")
    wide = {k: max([len(k)] + [len(str(r[k])) for r in rows]) + 2 for k in ("model", "task", "metric", "mode")}
    widths = (10, 10, 10, 22, 10)
    header = "".join(f"{k:<{wide[k]}}" for k in wide) + "".join(f"{n:>{w}}" for n, w in zip(numbers, widths))
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = (_fmt(r["accuracy"]), _fmt(r["recall"]), _fmt(r["hit_rate"]), _tpot(r), _fmt(r["identical_share"]))
        lines.append("".join(f"{r[k]:<{wide[k]}}" for k in wide) + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    loads = [r["busy"] for r in rows if r.get("busy") is not None]
    if loads:
        lines.append(f"* timed while the machine was busy (load average up to {max(loads):.1f} on {os.cpu_count()} "
                     "cores): these TPOTs measure the other work too; compare TPOT from a quiet machine")
    return "\n".join(lines)


def _tpot(row) -> str:
    if row["tpot_ms"] is None:
        return "-"
    spread = f" [{row['tpot_p10']:.2f}-{row['tpot_p90']:.2f}]" if row.get("tpot_p10") is not None else ""
    return f"{row['tpot_ms']:.2f}{spread}{'*' if row.get('busy') is not None else ''}"


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
