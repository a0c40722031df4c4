"""`evalsuite eval --plan replay`: a grid of modes and predictors from the fewest generations.

Exact modes (on-demand, and router-preserving with any predictor) generate resident's tokens by
construction (the exactness tests and `make gate` check it on measured runs), so their accuracy and
samples are the resident pass's; a speculative decision is per token, so speculative and hybrid
accuracy does not depend on the batch or the cache either. The plan therefore generates, batched:

  one resident pass     every predictor of the router-preserving runs scored beside it as a shadow
                        (evalsuite.engine.prediction.shadows): recall@k per sample and layer, and the routing
  one speculative pass  every expert resident; each batch is generated once per speculative predictor
                        in one call, row group g executing predictor g (`row_predictors`), each
                        predictor its own rows' shadow; lm-eval then scores every group's answers; its
                        requests are batched longest first by the resident pass's lengths, so that a batch's
                        rows end at about the same step
  one pass per hybrid predictor (and per predictor that reads more than its own row's states; on a
                        vision-language model, per speculative predictor: image inputs are not repeated)

and gives every requested run its engine metrics (hit rate, prefetch precision, bytes, stall, TPOT)
by replaying the recorded routing through the engine's own cache and scheduler
(evalsuite.perf.replay) at batch 1, with this machine's measured compute costs and the link's
transfer time. Each run is stored as its own mode with `engine_metrics: replayed` (and the pass that
generated it) in its configuration; `--plan measure` runs every configuration through the engine.
"""
from __future__ import annotations

import contextlib
import copy
import math
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace

import torch

from .. import timing
from ..engine.cache.slots import capacity_in_experts
from ..engine.metrics import scores_summary, summarise
from ..engine.modes import MODES, REFERENCE
from ..engine.prediction import PREDICTORS, artifact_beside
from ..engine.link.profiles import parse_link
from ..perf.replay import replayed_sequences
from ..predict import Artifact
from ..predict.artifact import predictor_parameters
from ..predict.predictors import PREDICTORS as PREDICTOR_CLASSES
from ..results.lm_eval_rows import stored_results
from .preflight import requested_runs
from .engine_metrics import ENGINE_FILTER, add_engine_metrics, engine_entries
from .reference import find_reference
from .request import load_adapter, run_config
from .runs import check_generation_lengths, divergence, evaluate_task, file_hash, finish, generation_lengths, \
    one_task, open_run, save_json, table_rows, writing

COST_TOKENS, COST_REPEATS = 16, 3  # the cost measurement's generation


@dataclass
class Pass:
    """One generation of the plan and the runs it gives: (mode, predictor) pairs."""

    mode: str  # resident, speculative or hybrid
    predictor: str | None  # what a speculative pass executes
    shadows: list[str]
    serves: list[tuple[str, str | None]]
    row_predictors: tuple[str, ...] = ()  # several speculative predictors, one row group each

    @property
    def label(self) -> str:
        return self.mode + (f"/{'+'.join(self.row_predictors) or self.predictor}" if self.predictor else "")


def plan_passes(modes, predictor, row_groups: bool = True) -> list[Pass]:
    """The fewest generations that give every (mode, predictor) run the request asks for; `row_groups=False`:
    one speculative pass per predictor (a vision-language model, whose image inputs are not repeated per group)."""
    runs = requested_runs(modes, predictor)
    exact = [(mode, chosen) for mode, chosen in runs if not MODES[mode].speculates]
    passes = []
    if exact:
        shadows = list(dict.fromkeys(chosen for _, chosen in exact if chosen))
        passes.append(Pass(REFERENCE, None, shadows, exact))
    speculative = [(mode, chosen) for mode, chosen in runs if MODES[mode].speculates]
    merged = []
    for at_target in (False, True):  # predictors that predict ahead, and controlled-recall ones: a pass each
        together = [chosen for mode, chosen in speculative if mode == "speculative" and row_independent(chosen)
                    and PREDICTORS[chosen].at_target == at_target]
        if len(together) > 1 and row_groups:
            merged += [("speculative", chosen) for chosen in together]
            passes.append(Pass("speculative", together[0], together, [("speculative", c) for c in together],
                               tuple(together)))
    return passes + [Pass(mode, chosen, [chosen], [(mode, chosen)]) for mode, chosen in speculative
                     if (mode, chosen) not in merged]


def row_independent(predictor: str) -> bool:
    """Whether the predictor scores each token from that token's own states alone, so rows executing
    other predictors can share its batch (not the oracles, which replay a recorded pass, nor hybrid); a
    controlled-recall predictor draws its errors for its own rows alone."""
    return PREDICTORS[predictor].at_target or (predictor in PREDICTOR_CLASSES
                                                and PREDICTOR_CLASSES[predictor].stateless)


def describe(passes: list[Pass], target, request) -> str:
    runs = sum(len(p.serves) for p in passes)
    lines = [f"[evalsuite] plan for {target.name}: {len(passes)} generation(s) at batch {request.run.batch_size} over "
             f"{len(target.tasks)} task(s) (limit {request.limit}); {runs} run(s), engine metrics replayed"]
    for i, p in enumerate(passes, 1):
        served = ", ".join(mode + (f"/{chosen}" if chosen else "") for mode, chosen in p.serves)
        shadows = f" with shadows {','.join(p.shadows)}" if p.shadows else ""
        groups = f" ({len(p.row_predictors)} row groups: each batch generated once per predictor in one call)" \
            if p.row_predictors else ""
        lines.append(f"  {i}. {p.label}{shadows}{groups} -> {served}")
    return "\n".join(lines)


def run_plan(db, request, target) -> list[dict]:
    """Every pass of the plan; each run's tasks are stored once their replays are done, after the last pass
    (the replays run in a second process meanwhile, see `replays`; the runs close when all are stored); the rows
    in the order the runs were asked for, as `--plan measure` prints them."""
    passes = plan_passes(request.modes, request.predictor, row_groups=target.adapter == "specmoe")
    request.progress(describe(passes, target, request))
    rows, costs, reference, queued, lengths = {}, None, {}, [], None
    with contextlib.ExitStack() as open_runs:
        for index, p in enumerate(passes):
            speculative = MODES[p.mode].speculates
            # the shadow hooks record the routing; with no predictor asked for, the gate's (it needs no artifact)
            extra = [f"shadows={';'.join(p.shadows or ['gate'])}"]
            if speculative:  # every expert stays in the model: its tokens do not depend on the cache
                extra.append("keep_experts=True")
            if p.row_predictors:
                extra.append(f"row_predictors={';'.join(p.row_predictors)}")
            if p.shadows and request.engine.predictor_path and not speculative:
                extra.append(f"predictor_path={request.engine.predictor_path}")
            lm, args = load_adapter(request, target, p.mode, p.predictor, link=None, extra=",".join(extra))
            lm.length_hints = lengths  # the resident pass's lengths batch like rows together (SpecMoELM._in_batches)
            runs, configs = {}, {}
            try:
                check_generation_lengths(request.manager, target.tasks, lm, target.name)
                for mode, chosen in p.serves:
                    config = replayed_config(run_config(request, target, lm, mode, args), request, mode, chosen, p)
                    configs[(mode, chosen)] = config
                    runs[(mode, chosen)] = open_run(db, config, request.fresh, request.progress)
            except BaseException:
                lm.engine.close()
                for run_id, _, _ in runs.values():
                    finish(db, run_id, "incomplete", None)
                raise
            open_runs.enter_context(writing(db, [run_id for run_id, _, _ in runs.values()], None))
            with contextlib.closing(lm.engine):
                _stored_rows(db, runs, target, reference, rows, request.engine.expert_bits)
                missing = [t for t in target.tasks if any(t not in done for _, _, done in runs.values())]
                if missing:
                    if costs is None:
                        costs = measured_costs(lm, target, request, [chosen for q in passes for chosen in q.shadows
                                                                     if not PREDICTORS[chosen].at_target])
                    timing.warm_up(lm.model, target.tokenizer, lm.engine, rows=len(p.row_predictors) or 1)
                    if index == 0:
                        request.progress(estimate(lm, target, request, passes, missing))
                if not missing:
                    continue
                # every missing task in one lm-eval call per row group (lm-eval's fixed cost per call is ~0.5-1 s)
                request.progress(f"[evalsuite] {target.name} / pass {p.label} / {', '.join(missing)} "
                                 f"(limit {request.limit})")
                started = time.time()
                answers = _evaluate_groups(lm, missing, request, p)
                if p.mode == REFERENCE:
                    lengths = dict(lm.generated_lengths)
                for task in missing:
                    shadows = lm.shadow_records.pop(task)
                    if p.mode == REFERENCE:
                        reference[task] = one_task(answers[None], task)
                    queued += [(runs[(mode, chosen)], configs[(mode, chosen)], mode, chosen, task,
                                one_task(answers.get(chosen, answers[None]), task), started,
                                replayed_summary(lm.engine, shadows, costs, request, mode, chosen))
                               for (mode, chosen), (_, _, done) in runs.items() if task not in done]
        for (run_id, uid, _), config, mode, chosen, task, results, started, summary in queued:
            out = with_engine_summary(results, task, summary())
            if mode != REFERENCE:  # an exact mode's tokens are the resident pass's: counted, 1.0
                find_reference(db, config, task, reference, request.progress)
            diverged = divergence(out, reference[task], target.tokenizer) \
                if mode != REFERENCE and task in reference else {}
            out["divergence"] = diverged
            name = target.name.replace("/", "--")
            save_json(out, request.out_dir, f"{run_id}-{name}-{mode}-{chosen or ''}-{task}-{uid}")
            db.add_lm_eval_tasks(run_id, out, out["engine"])
            rows.setdefault((mode, chosen), []).extend(
                table_rows(out, target.name, mode, chosen, diverged, run_id, time.time() - started,
                           replayed=True, expert_bits=request.engine.expert_bits))
    return [row for run in requested_runs(request.modes, request.predictor) for row in rows.get(run, [])]


def _evaluate_groups(lm, tasks: list[str], request, p: Pass) -> dict:
    """lm-eval's results of the pass on `tasks`: {None: the generation's}, and with row groups, each group's
    predictor -> its rows' answers scored (generated with the first group's, see SpecMoELM.answer_as)."""
    out = {None: add_engine_metrics(evaluate_task(lm, tasks, request.limit, request.manager, request.lm_eval,
                                                  request.confirm_run_unsafe_code))}
    for group, name in enumerate(p.row_predictors):
        if group == 0:
            out[name] = out[None]
            continue
        lm.answer_as(group)
        try:
            out[name] = add_engine_metrics(evaluate_task(lm, tasks, request.limit, request.manager, request.lm_eval,
                                                         request.confirm_run_unsafe_code))
        finally:
            lm.answer_as(None)  # (its shadow record gained nothing: the generation's holds every group)
    return out


def _stored_rows(db, runs, target, reference: dict, rows: dict, expert_bits: int) -> None:
    """Add to `rows` (per run) the table rows of tasks an earlier invocation stored (a resumed plan)."""
    for (mode, chosen), (run_id, _, done) in runs.items():
        if not done:
            continue
        stored = stored_results(db.task_metrics([run_id]), db.engine_metrics([run_id]), db.samples([run_id]))
        if mode == REFERENCE:
            reference.update(dict.fromkeys(stored["results"], stored))
        rows.setdefault((mode, chosen), []).extend(
            table_rows(stored, target.name, mode, chosen, stored["divergence"], run_id, 0.0, replayed=True,
                       expert_bits=expert_bits))


def replayed_config(config: dict, request, mode: str, predictor: str | None, p: Pass) -> dict:
    """A run's configuration as replayed: its own mode, predictor, cache and link, and the pass it came from."""
    offloads, engine = MODES[mode].offloads, request.engine
    path = artifact_of(request, config.get("model_path"))
    return {**config, "mode": mode, "predictor": predictor,
            "predictor_parameters": predictor_parameters(path, predictor),
            "cache_capacity": str(engine.cache_capacity) if offloads else None,
            "cache_policy": engine.cache_policy if offloads else None,
            "cache_pools": engine.cache_pools if offloads else None,
            "store": engine.store if offloads else None,
            "link": engine.link if offloads else None, "engine_metrics": "replayed", "generated_by": p.label}


def artifact_of(request, model_dir) -> str | None:
    """The calibration artifact a pass's predictors read: the one given, else the model's own."""
    return request.engine.predictor_path or artifact_beside(model_dir)


_MEASURED: dict = {}  # (model, artifact, link, device, threads) -> costs: measured once per process


def measured_costs(lm, target, request, predictors: list[str]) -> dict:
    """`measure`, once per process for a model, artifact, link, device and thread count (a sweep of plans
    replays every cell with the same costs)."""
    key = (lm.fingerprint(), file_hash(artifact_of(request, target.path)), request.engine.link, request.run.device,
           torch.get_num_threads())
    known = _MEASURED.get(key)
    if known is None or not set(predictors) <= set(known):
        _MEASURED[key] = known = measure(lm, target, request, predictors)
    return known


def measure(lm, target, request, predictors: list[str]):
    """This machine's decode costs (evalsuite.perf.costs), on the pass's model with its engine set aside,
    each predictor's cost per prediction included: {predictor or None: Costs}."""
    from ..perf.costs import handoff_seconds, link_costs, measure_costs

    if lm.builds_without_experts:
        raise ValueError("--plan replay measures compute costs on a model loaded whole (device=cpu, store=host): "
                         "use --plan measure here")
    engine = lm.engine
    path = artifact_of(request, target.path)
    artifact = Artifact.load(path, lm.model, engine.layers) if path else None
    nbytes, device = engine.layout.nbytes, str(engine.device)
    engine.close()
    try:
        ids = target.tokenizer("Question: 12 + 7 = ? Answer:", return_tensors="pt")["input_ids"].to(lm.model.device)
        cases = [(name, "router-preserving", name, artifact) for name in dict.fromkeys(predictors)]
        base, per_case, _ = measure_costs(lm.model, ids, COST_TOKENS, COST_REPEATS, predicting=cases)
        # the link as the engine times it here, not its nominal figure: the replayed scheduler decides on it
        transfer_s, prefetch_s = link_costs(lm.model, ids, COST_TOKENS, request.engine.link)
    finally:
        lm.engine = None
        lm._offload()  # the pass's own engine again
    if transfer_s is None:  # nothing moved (the small cache held every expert)
        link = parse_link(request.engine.link)
        transfer_s = link.seconds(nbytes) if link is not None else 0.0
    base = replace(base, transfer_s=transfer_s, prefetch_s=prefetch_s, handoff_s=handoff_seconds(device))
    out = {None: base}
    for name in predictors:
        case = per_case.get(name, {})
        out[name] = replace(base, predictor_s=case.get("per_prediction", 0.0), predict_call_s=case.get("call"))
    return out


def replayed_summary(engine, shadows, costs: dict, request, mode: str, predictor: str | None):
    """One run's engine summary (the keys of EngineRecord.summary) replayed from a pass's shadow record: the
    replay starts in the replay process now; call what this returns to wait for the summary."""
    layers = engine.layers
    experts, top_k = layers[0].num_experts, layers[0].top_k
    meta = {"expert_bytes": engine.layout.nbytes, "budget": engine.budget}
    sequences = [replace(s, prefill_predicted={k: v for k, v in s.prefill_predicted.items() if k == predictor},
                         predicted={k: v for k, v in s.predicted.items() if k == predictor},
                         prompt={k: v for k, v in s.prompt.items() if k == predictor})
                 for s in shadows.sequences if s.executed_by in (None, predictor)]
    # what the replay reads, and no more, goes to the replay process: this run's rows, its predictor's candidates
    capacity = capacity_in_experts(request.engine.cache_capacity, experts * len(layers), engine.layout.nbytes)
    stats = replays().submit(replayed_sequences, sequences, predictor, [l.index for l in layers], experts, top_k,
                             meta, costs.get(predictor, costs[None]), capacity, mode, request.engine.cache_policy,
                             request.engine.cache_pools == "per-layer")
    scores = shadows.scores.get(predictor) if predictor else None

    def summary() -> dict:
        out = stats.result()
        if MODES[mode].speculates:  # speculating layers prefetch what they execute: precision 1.0 by construction
            out["prefetch_precision"] = None
        return {**out, "requests": out["sequences"], "ttft_ms": summarise([]), "layers": {},
                **scores_summary(scores or {}), "top_k": top_k, "by_token_kind": None}
    return summary


class _Inline:
    """A replay pool of no process: each replay runs when submitted (one core, or no fork)."""

    @staticmethod
    def submit(fn, *args) -> Future:
        done = Future()
        done.set_result(fn(*args))
        return done


_REPLAYS = None


def replays():
    """Where replays run: a second process (forked: a replay is pure Python over the trace it is sent, and
    needs nothing the model process is doing), so the next generation need not wait for them; inline on a
    machine of one core, where they would only take its time."""
    global _REPLAYS
    if _REPLAYS is None:
        forks = "fork" in multiprocessing.get_all_start_methods() and (os.cpu_count() or 1) > 1
        _REPLAYS = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) if forks else _Inline()
    return _REPLAYS


def with_engine_summary(results: dict, task: str, summary: dict) -> dict:
    """A pass's results for one task with another run's engine metrics (everything else shared)."""
    out = copy.deepcopy({k: v for k, v in results.items() if k != "engine"})
    metrics = {k: v for k, v in out["results"][task].items() if not k.endswith(f",{ENGINE_FILTER}")}
    out["results"] = {task: {**metrics, **engine_entries(summary)}}
    out["engine"] = {task: summary}
    for sample in out.get("samples", {}).get(task, []):
        sample.pop("engine", None)  # the pass's own per-sample engine metrics, not this run's
    return out


def estimate(lm, target, request, passes: list[Pass], tasks: list[str]) -> str:
    """An upper bound of the plan's generation time: one batched step timed on the first pass's engine with as
    many rows as the widest pass generates at once (a pass with row groups repeats each batch once per group),
    times the steps every pass could take (each batch generating its task's max_gen_toks)."""
    rows = request.run.batch_size
    groups = max(len(p.row_predictors) or 1 for p in passes)  # (one pass at most has row groups)
    ids = target.tokenizer(["Question: 12 + 7 = ? Answer:"] * rows * groups, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        started = time.perf_counter()
        lm.model.generate(ids.to(lm.model.device), attention_mask=torch.ones_like(ids).to(lm.model.device),
                          max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=target.tokenizer.pad_token_id or 0)
        step_s = (time.perf_counter() - started) / 8
    lm.engine.reset_stats()
    lengths = generation_lengths(request.manager, tasks, lm.max_gen_toks)
    steps = sum(math.ceil(request.limit / rows) * tokens for tokens in lengths.values())
    return (f"[evalsuite] estimate: at most ~{steps * step_s * len(passes):.0f} s of generation "
            f"({len(passes)} pass(es) x {steps} batched steps x {step_s * 1e3:.1f} ms per step of {rows * groups} "
            "rows measured now; "
            "most stop well before max_gen_toks)")
