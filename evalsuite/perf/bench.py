"""`evalsuite bench`: decode TPOT and TTFT of every execution mode, against the overlap bound.

For each model, link profile and cache capacity, every case (resident, on-demand,
router-preserving with each predictor, speculative, hybrid, trace-oracle, oracle prefetch)
decodes the same prompt, batch 1, teacher-forced on the resident run's greedy tokens: each
step feeds the resident token, so every case does the same work (speculative execution would
otherwise decode other tokens, with other routing and reuse). Exact cases must predict exactly
those tokens. Speculative cases also run free-running (feeding their own tokens), labelled so.
Cases are interleaved and repeated, and medians reported, because these machines are noisy;
every ratio compares numbers measured in the same run.

Also measured, once per model: this machine's per-token costs (dense part of a sparse layer,
one routed expert, the rest of a step) from a resident engine run with layer clocks; each
predictor's cost (resident with the predictor minus resident); and the engine overhead
(resident engine vs the unmodified model, tokens/s). With those and the measured link time
per expert, the overlap bound and the simulator's TPOT of each case are computed from the
case's own routing trace, so the simulator is validated against the measurement.
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine import offload
from ..engine.modes import MODES
from ..table import Column, format_table
from .costs import SpeedProbe, engine_overhead, handoff_seconds, measure_costs, scaled
from .decode import bench_store, greedy, load_bench_model, other_prompt, serve_earlier, whole
from .profiles import case_label
from .simulate import PERFECT_PREFETCH, Costs, gap_closed, overlap_bound, simulate


FREE = " free-running"  # the label suffix of a case that feeds its own tokens
PERFECT = ("trace-oracle", "oracle")  # predictors that know the routing: run only where the router decides


@dataclass(frozen=True)
class Case:
    label: str
    mode: str
    predictor: str | None = None
    forced: bool = True  # teacher-forced on the resident tokens (False: free-running)

    @property
    def sim_mode(self) -> str:
        """The simulator's mode for this case: a perfect predictor prefetching for the router is perfect-prefetch."""
        mode = MODES[self.mode]
        perfect = self.predictor in PERFECT and mode.predicts and not mode.speculates
        return PERFECT_PREFETCH.name if perfect else self.mode


def _case(mode: str, predictor: str | None = None, forced: bool = True) -> Case:
    label = case_label(mode, predictor) or mode
    return Case(label if forced else label + FREE, mode, predictor, forced)


def cases(predictors, hybrid: bool) -> list[Case]:
    """Every case of one configuration: the modes without a predictor; each prefetching mode with each
    predictor; each speculating mode with each predictor (or its own, where the estimator it needs is
    calibrated: `hybrid`), teacher-forced and free-running; then the perfect predictors, `trace-oracle`
    (free, replaying the resident run's routing) and `oracle` (paying a look-ahead pass), which run
    only in the modes where the router decides."""
    plain = [name for name, mode in MODES.items() if not mode.predicts]
    preserving = [name for name, mode in MODES.items() if mode.predicts and not mode.speculates]
    out = [_case(m) for m in plain] + [_case(m, p) for m in preserving for p in predictors if p not in PERFECT]
    speculating = [(name, p) for name, mode in MODES.items() if mode.speculates and not mode.own_predictor
                   for p in predictors if p not in (*PERFECT, "frequency")]
    speculating += [(name, mode.predictor) for name, mode in MODES.items() if mode.own_predictor and hybrid]
    out += [_case(m, p) for m, p in speculating] + [_case(m, p, forced=False) for m, p in speculating]
    return out + [_case(m, p) for m in preserving for p in PERFECT if p in predictors]


def rotated(all_cases: list[Case], repeat: int) -> list[Case]:
    """The cases in the order repeat `repeat` runs them: shifted by one each repeat, so that over len(all_cases)
    repeats every case runs once in every position. In one fixed order, whatever a case's place brings (the first
    after the cost runs, the one after a given engine) is in its median on every repeat."""
    shift = repeat % len(all_cases)
    return all_cases[shift:] + all_cases[:shift]


def _artifact(case: Case, artifact, trace):
    """What the case's predictor is built from: the resident trace for trace-oracle, else the calibration."""
    return trace if case.predictor == "trace-oracle" else artifact


def run_case(model, ids, tokens, case: Case, link, capacity, artifact, reference, trace=None,
             earlier=None) -> dict:
    """One case's request on a fresh engine; with `earlier` (prompt ids), its second: the engine serves that one
    first, then empties its cache (Engine.clear_cache), and only the second is measured and traced."""
    options = dict(mode=case.mode, cache_capacity=capacity, link=link, trace=True, store=bench_store(model))
    if case.predictor is not None:
        options.update(predictor=case.predictor, artifact=_artifact(case, artifact, trace))
    if not MODES[case.mode].offloads:  # no cache, no link
        options = dict(mode=case.mode, trace=True)
    with offload(model, **options) as engine:
        before = (0, 0)
        if earlier is not None:
            serve_earlier(engine, model, earlier, tokens)
            served = engine.routing_trace()
            before = (len(served.steps), len(served.prefills))
        probe = SpeedProbe(engine)
        out = greedy(model, ids, tokens, reference if case.forced else None)
        s = engine.stats()
        attention_s = probe.median()
        transfer_s = engine.transfers.seconds_per_transfer() if engine.transfers is not None else None
        handoff_s = engine.transfers.handoff_seconds() if engine.transfers is not None else None
        prefetch_s = engine.prefetch_cost_s  # compute-thread seconds per prefetch issued (None: none issued)
        scheduler = engine.driver.scheduler if engine.driver is not None else None
        put_off_s = scheduler.put_off_s if scheduler is not None else None  # per prediction put off (None: none)
        trace = _since(engine.routing_trace(), *before)
        cache_experts = engine.cache.slots.shape[0] if engine.cache is not None else None
    new = slice(ids.shape[1], None)
    same = (out[:, new] == reference[:, new]).float().mean().item()  # greedy tokens equal to resident's
    return {"out": out, "same_tokens": same, "tpot_s": s["tpot_ms"]["median"] / 1e3, "ttft_s": s["ttft_ms"]["median"] / 1e3,
            "hit_rate": s["hit_rate"], "transfer_s": transfer_s, "handoff_s": handoff_s, "attention_s": attention_s,
            "trace": trace, "cache_experts": cache_experts, "prefetch_s": prefetch_s,
            "put_off_s": put_off_s,
            "stall_ms_per_token": s["stall_ms_per_token"], "bytes_per_token": s["bytes_per_token"]}


def _since(trace, steps: int, prefills: int):
    """`trace` without its first `steps` decode steps and `prefills` prefills (an earlier request's), and their
    prompts' rows scored."""
    if not steps and not prefills:
        return trace
    return replace(trace, steps=trace.steps[steps:], prefills=[(i - steps, p) for i, p in trace.prefills[prefills:]],
                   prompts=trace.prompts[prefills:])


def bench_model(spec, links, capacities, predictors, tokens=16, repeats=5, layers=2, device="cpu",
                artifact=None, progress=True, prompt_tokens=16, warm=False) -> dict:
    """Everything `evalsuite bench` reports for one model, as a JSON-ready dict. `warm`: each case's engine
    serves another request first (run_case)."""
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-") as workdir:
        model, ids, tokenizer = load_bench_model(spec, layers, device, workdir, prompt_tokens)
        earlier = other_prompt(model, tokenizer, ids) if warm else None
        return _bench(model, ids, spec, links, capacities, predictors, tokens, repeats, device, artifact, progress,
                      earlier)


def _bench(model, ids, spec, links, capacities, predictors, tokens, repeats, device, artifact, progress,
           earlier=None) -> dict:
    hybrid = artifact is not None and "estimator" in artifact.meta.get("predictors", ["estimator"])
    all_cases = cases(predictors, hybrid)
    with whole(model):
        overhead = engine_overhead(model, ids, tokens, repeats)
        reference = greedy(model, ids, tokens)
    handoff = handoff_seconds(device)
    trace = None
    if any(c.predictor == "trace-oracle" for c in all_cases):
        # two requests: the warm cost runs make two, and a warm case's engine serves `earlier` first
        with offload(model, mode="resident", trace=True) as engine:
            for prompt in (ids if earlier is None else earlier, ids):
                greedy(model, prompt, tokens)
            trace = engine.routing_trace()
    predicting = [(c.label, c.mode, c.predictor, _artifact(c, artifact, trace)) for c in all_cases
                  if c.predictor is not None and c.forced]  # free-running costs what its twin does
    result = {"model": spec, "tokens": tokens, "repeats": repeats, "warm": earlier is not None,
              "engine_overhead": overhead,
              "handoff_ms": handoff * 1e3, "configs": []}
    total = len(links) * len(capacities) * repeats * (len(all_cases) + 1)
    bar = tqdm(total=total, desc=f"bench {Path(spec).name}", disable=not progress)
    for link in links:
        for capacity in capacities:
            # This machine's costs are measured inside the same interleaved loop as the cases,
            # so the simulator and the bound see the machine as it was for this configuration.
            runs, measured = {c: [] for c in all_cases}, []
            for repeat in range(repeats):
                measured.append(measure_costs(model, ids, tokens, 1, predicting, artifact))
                bar.update(1)
                for case in rotated(all_cases, repeat):
                    r = run_case(model, ids, tokens, case, link, capacity, artifact, reference, trace, earlier)
                    if MODES[case.mode].exact and not torch.equal(r["out"], reference):
                        raise AssertionError(f"{case.label} changed the output: the engine is not exact here")
                    runs[case].append(r)
                    bar.update(1)
            measured = [(replace(c, handoff_s=handoff), p, a) for c, p, a in measured]
            result["configs"].append(_summarise(runs, measured, link, capacity))
    bar.close()
    return result


def _medians(measured: list[tuple[Costs, dict, float]]) -> tuple[Costs, dict]:
    """Field-wise medians of per-repeat costs and predictor costs."""
    med = statistics.median
    costs = Costs(**{f: med(getattr(c, f) for c, _, _ in measured) for f in Costs.__dataclass_fields__
                     if getattr(measured[0][0], f) is not None})
    pcost = {c: {k: med(m[c][k] for _, m, _ in measured) for k in kinds} for c, kinds in measured[0][1].items()}
    return costs, pcost


def _case_costs(costs: Costs, pcost: dict, case: Case, transfer_s: float, handoff_s: float) -> Costs:
    c = pcost.get(case.label.removesuffix(FREE), {})  # free-running costs what its teacher-forced twin does
    return replace(costs, transfer_s=transfer_s, handoff_s=handoff_s, predictor_s=c.get("per_prediction", 0.0),
                   predictor_step_s=c.get("per_step", 0.0), predict_call_s=c.get("call"),
                   put_off_s=c.get("put_off", 0.0))


def at_speed(run: dict, factor: float) -> float:
    """A run's TPOT with its compute at the reference machine speed: its stall (waiting for the link, which keeps
    wall-clock time; per decode step, as TPOT is: the engine's stall_ms_per_token) as measured, the rest divided
    by the run's speed factor (its attention time over the reference's, SpeedProbe)."""
    stall = (run["stall_ms_per_token"] or 0.0) / 1e3
    return stall + (run["tpot_s"] - stall) / factor


def _summarise(runs, measured, link, capacity) -> dict:
    """Per case: medians of the measured repeats, and the simulator's error paired per run: each run
    is simulated from its own routing trace with the configuration's median costs, scaled by how
    fast this machine computed during that run (its attention time over the median of the cost
    runs', SpeedProbe), so the speed of this shared machine drifting between runs is not counted
    as a simulator error."""
    med = statistics.median
    costs, pcost = _medians(measured)  # costs that are differences of two timings are noisy per repeat
    attention = [a for _, _, a in measured if a]
    reference = statistics.median(attention) if attention else None
    # The link as the compute thread saw it in these runs: time per transfer and the wake-up of a
    # waiter (medians over every run that moved experts; the idle-thread hand-off otherwise).
    transfer_s = med([r["transfer_s"] for rs in runs.values() for r in rs if r["transfer_s"]] or [0.0])
    handoff_s = med([r["handoff_s"] for rs in runs.values() for r in rs if r["handoff_s"] is not None]
                    or [costs.handoff_s])
    # what issuing a prefetch cost the compute thread, as the engine timed it (its scheduler weighs a
    # wrong guess by it; the simulated scheduler must too): median over every run that prefetched
    issued = [r["prefetch_s"] for rs in runs.values() for r in rs if r["prefetch_s"] is not None]
    costs = replace(costs, prefetch_s=med(issued) if issued else None)
    # what putting a prediction off cost the compute thread, as each case's scheduler timed it in these runs
    for case, rs in runs.items():
        put_off = [r["put_off_s"] for r in rs if r["put_off_s"] is not None]
        if put_off and case.forced:
            pcost.setdefault(case.label, {})["put_off"] = med(put_off)
    link_costs = replace(costs, transfer_s=transfer_s, handoff_s=handoff_s)
    on_demand = next(c for c in runs if c.mode == "on-demand")
    slots = runs[on_demand][0]["cache_experts"]
    bound = overlap_bound(runs[on_demand][0]["trace"], link_costs, slots)
    rows = []
    od_tpot = med(r["tpot_s"] for r in runs[on_demand])

    def speeds(rs):
        return [r["attention_s"] / reference if reference and r["attention_s"] else 1.0 for r in rs]

    od_at_speed = [at_speed(r, f) for r, f in zip(runs[on_demand], speeds(runs[on_demand]))]
    od_tpot_at_speed = med(od_at_speed)
    for case, rs in runs.items():
        speed = speeds(rs)
        case_costs = _case_costs(costs, pcost, case, transfer_s, handoff_s)
        simulated = [simulate(r["trace"], scaled(case_costs, f), slots, case.sim_mode).tpot_s
                     for r, f in zip(rs, speed)]
        tpot = med(r["tpot_s"] for r in rs)
        paired = [r["tpot_s"] / o["tpot_s"] for r, o in zip(rs, runs[on_demand])]
        # the same, each run's compute at the speed of this configuration's cost runs (median): on the CPU the speed
        # moves up to 2x between runs, and on a fast link TPOT follows it (on-demand's, ufs4 at 10 %, with its
        # attention time: correlation 0.94 over 24 runs), by more than prediction can change it
        tpot_at_speed = [at_speed(r, f) for r, f in zip(rs, speed)]
        paired_at_speed = [t / o for t, o in zip(tpot_at_speed, od_at_speed)]
        # what `evalsuite simulate` gives with this configuration's measured profile and saved trace
        replayed = simulate(rs[0]["trace"], case_costs, slots, case.sim_mode).tpot_s
        rows.append({"case": case.label, "mode": case.mode, "predictor": case.predictor, "tpot_ms": tpot * 1e3,
                     # paired per repeat (the runs of one repeat are adjacent in time), with the spread
                     "vs_on_demand": med(paired), "vs_on_demand_range": [min(paired), max(paired)],
                     "vs_on_demand_at_speed": med(paired_at_speed),
                     "vs_on_demand_at_speed_range": [min(paired_at_speed), max(paired_at_speed)],
                     "ttft_ms": med(r["ttft_s"] for r in rs) * 1e3,
                     "hit_rate": med(r["hit_rate"] for r in rs) if MODES[case.mode].offloads else 1.0,
                     "forced": case.forced, "same_tokens": med(r["same_tokens"] for r in rs),
                     "stall_ms_per_token": med(r["stall_ms_per_token"] or 0.0 for r in rs),
                     "gap_closed": gap_closed(od_tpot, tpot, bound) if MODES[case.mode].offloads else None,
                     # the same with every run's compute at the cost runs' speed, as the bound's costs are
                     "gap_closed_at_speed": gap_closed(od_tpot_at_speed, med(tpot_at_speed), bound)
                     if MODES[case.mode].offloads else None,
                     "simulated_tpot_ms": med(simulated) * 1e3, "speed_factor": med(speed),
                     "profile_tpot_ms": replayed * 1e3,
                     "sim_error": med(sim / r["tpot_s"] - 1 for sim, r in zip(simulated, rs))})
    # perfect prediction at no cost, replayed on the native routing: prediction's ceiling
    free = simulate(runs[on_demand][0]["trace"], link_costs, slots, PERFECT_PREFETCH.name).tpot_s
    return {"link": link, "capacity": capacity, "cache_experts": slots, "transfer_ms": transfer_s * 1e3,
            "costs": link_costs.__dict__, "case_costs": pcost,
            "bound_tpot_ms": bound * 1e3, "perfect_prefetch_tpot_ms": free * 1e3, "rows": rows,
            "traces": {c.label: rs[0]["trace"] for c, rs in runs.items()}}


# (row key, printed column) of the bench table, in order
_COLUMNS = [("case", Column("case")), ("tpot_ms", Column("TPOT ms", ".2f")), ("vs_on_demand", Column("/ on-dem", ".3f")),
            ("vs_on_demand_at_speed", Column("at speed", ".3f")),
            ("ttft_ms", Column("TTFT ms", ".2f")), ("hit_rate", Column("hit", ".3f")),
            ("stall_ms_per_token", Column("stall/tok", ".2f")), ("gap_closed", Column("gap closed", ".2f")),
            ("gap_closed_at_speed", Column("at speed", ".2f")),
            ("same_tokens", Column("same tok", ".3f")), ("simulated_tpot_ms", Column("sim ms", ".2f")),
            ("sim_error", Column("sim err", "+.1%")), ("speed_factor", Column("speed", ".2f"))]


def format_result(result: dict) -> str:
    warm = "; each case's engine warm (the measured request is its second)" if result.get("warm") else ""
    lines = [f"model {result['model']}: {result['tokens']} new tokens, batch 1, median of {result['repeats']}{warm}",
             "engine overhead (resident engine / unmodified model, tokens/s): "
             f"{result['engine_overhead']['ratio']:.3f}; waking a thread that waits for a copy "
             f"{result['handoff_ms']:.3f} ms"]
    for cfg in result["configs"]:
        lines.append("\nmeasured per token: dense part of a sparse layer {:.3f} ms, one expert {:.3f} ms, rest of a "
                     "step {:.3f} ms; offloaded: bookkeeping per expert use {:.3f} ms, starting a transfer {:.3f} ms"
                     .format(*(cfg["costs"][k] * 1e3 for k in ("dense_s", "expert_s", "step_s", "lookup_s", "miss_s"))))
        lines.append(f"link {cfg['link']} ({cfg['transfer_ms']:.3f} ms per expert measured), cache "
                     f"{cfg['capacity']} = {cfg['cache_experts']} experts; "
                     f"overlap bound {cfg['bound_tpot_ms']:.2f} ms; "
                     f"perfect prefetch at no cost (simulated) {cfg['perfect_prefetch_tpot_ms']:.2f} ms")
        lines.append(format_table([[r[key] for key, _ in _COLUMNS] for r in cfg["rows"]],
                                  [column for _, column in _COLUMNS]))
    return "\n".join(lines)

