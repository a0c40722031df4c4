"""`evalsuite eval` (and `make eval`): models x modes x tasks through lm-eval, one table.

Each (model, mode) is one lm-eval run of the `specmoe` model (`specmoe-vlm` for a vision-language
model) over its tasks; results go to the results database (and lm-eval's JSON, named by the run's uid).
Speculative runs are compared with the resident run of the same model sample by sample: first differing
generated token, share of identical ones. A resumed run's stored tasks are read back from the database,
never from JSON files, which another database's runs may share a folder with.
"""
from __future__ import annotations

import json
import os
import time

from .. import timing
from ..results.lm_eval_rows import stored_results
from ..scoring.sandbox import confinement_to_use
from ..table import Column, format_table
from ..engine.config import EngineConfig
from ..engine.modes import MODES, REFERENCE, default_predictor
from ..hub import is_hub_id, local_model
from .preflight import check_eval, requested_runs, task_manager, unsafe_tasks
from .engine_metrics import add_engine_metrics
from .request import Request, Target, load_adapter, model_args, run_config  # noqa: F401  (model_args: the adapter's)
from .run_options import EVAL_ENGINE, SEED, RunOptions  # noqa: F401  (what run_suite takes)
from .runs import check_generation_lengths, divergence, evaluate_task, open_run, save_json, table_rows, writing
from .reference import find_reference

PLANS = ("measure", "replay")


def is_vision_language(model: str) -> bool:
    """A model (directory or Hub id) whose config has a vision tower (run through specmoe-vlm)."""
    path = os.path.join(local_model(model) if is_hub_id(model) else model, "config.json")
    if not os.path.isfile(path):
        return False  # run_suite reports the missing model
    with open(path) as f:
        return "vision_config" in json.load(f)


def run_suite(models, modes, tasks, limit, *, engine: EngineConfig = EVAL_ENGINE, predictor=None,
              run: RunOptions = RunOptions(), db_url=None, out_dir="results", confirm_run_unsafe_code=False,
              fresh=False, progress=print, threads: int = 1, extra_config: dict | None = None,
              plan: str = "measure") -> list[dict]:
    """Evaluate every (model, mode, predictor) over `tasks` (a list for all models, or a dict: model -> its
    tasks); each task lands in the database as soon as it is done. `predictor`: one name or several
    ('gate,quasi'): each predicting mode runs once with each that fits it (evalsuite.lm.preflight.predictors_for).
    `engine`: the engine every run uses, its mode and predictor aside (cache, link, store, predictor_path, ...).
    `run`: the adapter's device, dtype and batch size, and lm-eval's few-shot, generation arguments, chat
    template and seed.

    `plan="measure"` runs every configuration through the engine. `plan="replay"` (evalsuite.lm.plan) makes
    the fewest generations the grid needs, batched, and replays the engine metrics of each configuration.
    A run made earlier with exactly the same configuration (model fingerprint, mode, predictor and
    artifact, cache, link, limit, tasks, run options, code version) is resumed: its stored tasks are kept and
    only the missing ones run, so an interrupted `make eval` finishes what is missing and every result is
    stored once. A task cut off mid-way is run again whole, so its engine metrics stay complete.
    `fresh=True` always starts new runs. `extra_config` is stored with each run's configuration (a sweep
    names its cell there). A run another live process is writing with the same configuration is waited for.
    A failed run stores its error; a task that would generate more tokens than the model's context holds is
    refused before any run is stored."""
    from transformers import AutoTokenizer

    from ..results import ResultsDB

    manager = task_manager()
    tasks_of = tasks if isinstance(tasks, dict) else {model: list(tasks) for model in models}
    # the whole request, before any model is loaded (the CLI and sweeps have checked it already)
    if plan not in PLANS:
        raise ValueError(f"--plan {plan!r} is not one of: {', '.join(PLANS)}")
    check_eval(models, modes, tasks_of, limit, engine=engine, predictor=predictor, run=run,
               confirm_run_unsafe_code=confirm_run_unsafe_code, manager=manager, open_db=False)
    request = Request(modes=list(modes), predictor=predictor, limit=limit, engine=engine, run=run,
                      threads=threads, out_dir=out_dir, fresh=fresh, confirm_run_unsafe_code=confirm_run_unsafe_code,
                      progress=progress, extra_config=extra_config or {}, manager=manager)
    db = ResultsDB(db_url)  # opened first: a bad URL fails before any model is loaded
    timing.pin(threads)  # evalsuite.timing: one protocol for every TPOT the suite reports
    rows = []
    for model in models:
        path = local_model(model)  # a Hub id: its snapshot in the local Hugging Face cache
        tasks = tasks_of[model]
        target = Target(
            # a local directory is known by its name, so gates and reports work from any checkout; a Hub model by its id
            name=model if is_hub_id(model) else os.path.basename(model.rstrip("/")), path=path,
            adapter="specmoe-vlm" if is_vision_language(path) else "specmoe",
            tokenizer=AutoTokenizer.from_pretrained(path), tasks=list(tasks),
            # what confined the generated code of this model's runs (None: no task runs code)
            sandbox=confinement_to_use() if unsafe_tasks(tasks, manager) else None)
        if plan == "replay":
            from .plan import run_plan

            rows += run_plan(db, request, target)
            continue
        reference: dict[str, dict] = {}
        runs, measured = requested_runs(modes, predictor), {}
        for mode, chosen in sorted(runs, key=lambda run: run[0] != REFERENCE):  # resident first: the others' same tok
            measured[(mode, chosen)] = measured_run(db, request, target, mode, chosen, reference)
        rows += [row for run in runs for row in measured[run]]
    return rows


def measured_run(db, request: Request, target: Target, mode: str, predictor: str | None, reference: dict) -> list[dict]:
    """One configuration through the engine, task by task; `reference` collects resident's results (run first)
    for the divergence of the modes after it, or, where this invocation runs no resident, a stored resident run's."""
    progress, name = request.progress, target.name
    chosen = default_predictor(mode, predictor)  # what the table names
    lm, args = load_adapter(request, target, mode, predictor)
    config = run_config(request, target, lm, mode, args)
    try:  # refused, or waited for, before anything is stored
        check_generation_lengths(request.manager, target.tasks, lm, name)
        run_id, uid, done = open_run(db, config, request.fresh, progress)
    except BaseException:
        lm.engine.close()
        raise
    rows = []
    with writing(db, [run_id], lm.engine):
        if done:  # stored by an earlier, interrupted invocation: read back from this database only
            stored = stored_results(db.task_metrics([run_id]), db.engine_metrics([run_id]), db.samples([run_id]))
            if mode == REFERENCE:
                reference.update(dict.fromkeys(stored["results"], stored))
            rows += table_rows(stored, name, mode, chosen, stored["divergence"], run_id, 0.0,
                               expert_bits=request.engine.expert_bits)
        if set(target.tasks) - done:
            timing.warm_up(lm.model, target.tokenizer, lm.engine)
        with timing.frozen_heap():  # what the warm-up left is start-up heap, as a server's after its own
            for task in target.tasks:
                if task in done:
                    continue
                progress(f"[evalsuite] {name} / {mode} / {task} (limit {request.limit}, run {run_id})")
                started, before = time.time(), timing.probe(request.run.device)
                results = add_engine_metrics(evaluate_task(lm, task, request.limit, request.manager, request.lm_eval,
                                                           request.confirm_run_unsafe_code))
                results["timing"] = {"probe_ms": [before, timing.probe(request.run.device)]}  # the CPU's speed around it
                if mode == REFERENCE:
                    reference[task] = results
                else:
                    find_reference(db, config, task, reference, progress)
                diverged = divergence(results, reference[task], target.tokenizer) if task in reference and \
                    mode != REFERENCE else {}
                results["divergence"] = diverged
                save_json(results, request.out_dir, f"{run_id}-{name.replace('/', '--')}-{mode}-{task}-{uid}")
                db.add_lm_eval_tasks(run_id, results, results.get("engine"))
                rows += table_rows(results, name, mode, chosen, diverged, run_id, time.time() - started,
                                   busy=timing.busy(request.run.device), probes=results["timing"]["probe_ms"],
                                   expert_bits=request.engine.expert_bits)
    return rows


def format_rows(rows) -> str:
    """The table `evalsuite eval` prints: accuracy (the task's headline metric, named), recall, hit rate,
    TPOT as median [p10-p90] over sequences (flagged * when the machine was busy, ! when its speed changed
    between the rows of a model), same tokens."""
    columns = ["model", "task", "metric", "mode", "predictor", Column("accuracy", align=">"), Column("recall", ".3f"),
               Column("hit rate", align=">"), Column("TPOT ms [p10-p90]", align=">"), Column("same tok", ".3f")]
    spreads = _speed_spreads(rows)
    drifted = {model: ratio for model, ratio in spreads.items() if ratio > timing.DRIFT}
    cells = [[r["model"], r["task"], r["metric"], r["mode"], r.get("predictor"), _accuracy(r), r["recall"],
              _hit_rate(r), _tpot(r, r["model"] in drifted), r["identical_share"]] for r in rows]
    if any(r.get("expert_bits", 16) != 16 for r in rows):  # quantised experts: each row's bits
        columns.insert(4, Column("bits", align=">"))
        for row, r in zip(cells, rows):
            row.insert(4, r.get("expert_bits", 16))
    lines = [format_table(cells, columns)]
    if any(r.get("prefill_only") for r in rows):
        lines.append("n/a (prefill): the task scores loglikelihoods, one prefill per document and no decode token; "
                     "speculation acts on decode tokens only, so its accuracy would be resident's by construction")
    if any(_speculated(r) for r in rows):
        lines.append("§ hit rate of a speculating mode: on its speculated layers the experts it executes are the ones it "
                     "predicted and prefetched, so they hit by construction, whatever the prediction's quality; its "
                     "prediction accuracy is the recall column")
    for model, ratio in drifted.items():
        lines.append(f"! {model}: this machine's speed changed by up to {100 * (ratio - 1):.0f} % while these rows "
                     "were timed (evalsuite.timing.probe): TPOT differences smaller than that are not results; "
                     "compare modes with evalsuite bench (interleaved repeats) or --plan replay (one cost measurement)")
    steady = [f"{100 * (ratio - 1):.0f} % ({model})" for model, ratio in spreads.items() if model not in drifted]
    if steady:  # under DRIFT the rows are not flagged, but modes a few percent apart still differ by the machine
        lines.append(f"this machine's speed varied by up to {', '.join(steady)} while each model's rows were timed "
                     "(evalsuite.timing.probe): TPOT differences between its modes smaller than that are not results")
    loads = [r["busy"] for r in rows if r.get("busy") is not None]
    if loads:
        lines.append(f"* timed while the machine was busy (load average up to {max(loads):.1f} on {os.cpu_count()} "
                     "cores): these TPOTs measure the other work too; compare TPOT from a quiet machine")
    if any(r.get("replayed") for r in rows):
        lines.append("~ replayed (--plan replay): hit rate and TPOT from the recorded routing through the engine's "
                     "cache and scheduler, in time simulated from this machine's measured costs")
    if order := timing.order_line(rows):  # how the modes' TPOTs were compared: in turn, or from one cost measurement
        lines.append(order)
    return "\n".join(lines)


def _speed_spreads(rows) -> dict[str, float]:
    """model -> how far apart (max / min) the probes around its measured TPOTs are (timing.spread)."""
    probes: dict[str, list] = {}
    for r in rows:
        if r.get("probes") and r.get("tpot_ms") is not None and not r.get("replayed"):
            probes.setdefault(r["model"], []).extend(r["probes"])
    return {model: ratio for model, p in probes.items() if (ratio := timing.spread(p)) is not None}


def _accuracy(row) -> str:
    if row["accuracy"] is None:
        return "-"
    return "n/a (prefill)" if row.get("prefill_only") else f"{row['accuracy']:.3f}"


def _speculated(row) -> bool:
    return MODES[row["mode"]].speculates and not row.get("prefill_only") and row["hit_rate"] is not None


def _hit_rate(row) -> str:
    if row["hit_rate"] is None:
        return "-"
    return f"{row['hit_rate']:.3f}" + ("§" if _speculated(row) else "")


def _tpot(row, drifted: bool = False) -> str:
    if row["tpot_ms"] is None:
        return "-"
    spread = f" [{row['tpot_p10']:.2f}-{row['tpot_p90']:.2f}]" if row.get("tpot_p10") is not None else ""
    mark = "*" if row.get("busy") is not None else "~" if row.get("replayed") else "!" if drifted else ""
    return f"{row['tpot_ms']:.2f}{spread}{mark}"

