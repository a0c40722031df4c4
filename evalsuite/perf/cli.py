"""`evalsuite bench | simulate`: add_commands(subparsers) adds them to the main parser."""
from __future__ import annotations

import json
import os
from pathlib import Path

def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _calibrated(model_spec: str, predictors: list[str], epochs: int):
    """A calibration artifact for a trained model (None, and the predictors it cannot serve, otherwise)."""
    from ..generate import load_model
    from ..predict.calibrate import calibrate, calibration_texts, token_batches
    from .shapes import MODELS

    from ..engine.prediction import PREDICTORS

    wanted = [p for p in predictors if p in PREDICTORS and PREDICTORS[p].needs_artifact and p != "frequency"]
    if not wanted:
        return None, []
    if model_spec in MODELS or model_spec.startswith("tiny:"):
        return None, wanted  # random weights: no text to calibrate on
    model, tokenizer = load_model(model_spec)
    batches = list(token_batches(calibration_texts(None, 128), tokenizer, model.config.get_text_config().vocab_size, max_len=128))
    return calibrate(model, batches, "all", epochs=epochs), []


def _db_rows(db_url, result: dict) -> int:
    from ..results.database import ResultsDB

    written = 0
    with ResultsDB(db_url) as db:
        for cfg in result["configs"]:
            for row in cfg["rows"]:
                run_id = db.start_run({"model": result["model"], "mode": row["mode"], "predictor": row["predictor"],
                                       "cache_capacity": cfg["capacity"], "link": cfg["link"],
                                       "kind": "bench", "case": row["case"], "tokens": result["tokens"],
                                       "warm": result.get("warm", False)})
                metrics = [{"metric": k, "value": row[k]} for k in
                           ("tpot_ms", "ttft_ms", "gap_closed", "gap_closed_at_speed", "simulated_tpot_ms", "sim_error")
                           if row[k] is not None]
                metrics += [{"metric": "bound_tpot_ms", "value": cfg["bound_tpot_ms"]},
                            {"metric": "engine_overhead_ratio", "value": result["engine_overhead"]["ratio"]}]
                db.add_task(run_id, "bench", metrics, engine=[{"hit_rate": row["hit_rate"], "tpot_ms": row["tpot_ms"],
                                                             "ttft_ms": row["ttft_ms"], "tokens": result["tokens"]}])
                db.finish_run(run_id)
                written += 1
    return written


def cmd_bench(args) -> int:
    from .. import timing
    from .bench import bench_model, format_result

    timing.pin(args.threads)  # the rest of the cores serve the link
    links, capacities = args.links, [float(c) for c in _list(args.capacities)]
    if args.repeats < 1 or args.tokens < 2:
        raise ValueError("--repeats must be at least 1 and --tokens at least 2")
    out = Path(args.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    (out / "profiles").mkdir(exist_ok=True)
    results = []
    for spec in _list(args.models):
        predictors = list(args.predictors)
        artifact, dropped = _calibrated(spec, predictors, args.calibration_epochs)
        if dropped:
            print(f"{spec}: {', '.join(dropped)} need a calibrated model with a tokenizer; left out")
            predictors = [p for p in predictors if p not in dropped]
        result = bench_model(spec, links, capacities, predictors, tokens=args.tokens, repeats=args.repeats,
                             layers=args.layers, device=args.device, artifact=artifact, prompt_tokens=args.prompt_tokens,
                             warm=args.warm)
        name = Path(spec).name.replace(":", "-")
        for cfg in result["configs"]:
            for case_label, trace in cfg.pop("traces").items():
                safe = case_label.replace("/", "-").replace(" ", "-")
                trace.save(out / "traces" / f"{name}-{cfg['link']}-{cfg['capacity']}-{safe}.json")
            measured = {k.replace("_s", "_ms"): v * 1e3 for k, v in cfg["costs"].items()
                        if k in ("dense_s", "expert_s", "step_s", "handoff_s", "lookup_s", "miss_s", "transfer_s",
                                 "prefetch_s") and v is not None}
            measured.update(predictor_ms={  # per case: router-preserving/gate, speculative/gate, hybrid, ...
                label: c["per_prediction"] * 1e3 for label, c in cfg["case_costs"].items() if "per_prediction" in c},
                predictor_step_ms={label: c["per_step"] * 1e3 for label, c in cfg["case_costs"].items()
                                   if "per_step" in c},
                predict_call_ms={label: c["call"] * 1e3 for label, c in cfg["case_costs"].items() if "call" in c},
                put_off_ms={label: c["put_off"] * 1e3 for label, c in cfg["case_costs"].items() if "put_off" in c})
            profile = {"name": f"{name} on this machine, link {cfg['link']} (measured by evalsuite bench)",
                       "measured": measured}
            # JSON is YAML: the profile loads with load_profile
            path = out / "profiles" / f"{name}-{cfg['link']}-{cfg['capacity']}.yaml"
            path.write_text(json.dumps(profile, indent=1) + "\n")
        print(format_result(result))
        results.append(result)
        if args.db or os.environ.get("EVALSUITE_DB") or os.path.exists("results/results.db"):
            print(f"{_db_rows(args.db, result)} rows written to the results database")
    (out / "bench.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out / 'bench.json'}, traces and measured profiles under {out}")
    return 0


def cmd_simulate(args) -> int:
    from .profiles import load_profile
    from .project import fit_trace, format_projection, project
    from .shapes import model_shape
    from ..engine.trace import RoutingTrace

    trace = RoutingTrace.load(args.trace) if args.trace else None
    if args.model is None and trace is None:
        raise ValueError("give --model (a real model's shape) or --trace")
    try:
        bits_list = [int(b) for b in _list(args.expert_bits)] if args.expert_bits else [None]
    except ValueError:
        raise ValueError(f"--expert-bits takes 16, 8 or 4, comma-separated, not {args.expert_bits!r}") from None
    if args.expert_bits and args.model is None:
        raise ValueError("--expert-bits prices a real model's shape: give --model too")
    bad = [b for b in bits_list if b not in (None, 16, 8, 4)]
    if bad:
        raise ValueError(f"--expert-bits {bad[0]} is not one of 16, 8, 4")
    shapes = {}
    for bits in bits_list:
        if args.model is None:  # replay the trace on its own model (a measured profile)
            shapes[bits] = (None, trace, f"recorded trace ({len(trace.steps)} decode steps), its own model")
        else:
            shape = model_shape(args.model, bits)
            shapes[bits] = (shape, *fit_trace(trace, shape, steps=args.steps, reuse=args.reuse, recall=args.recall,
                                              predicted_reuse=args.predicted_reuse))
    name = args.model or trace.meta.get("model") or "the traced model"
    predictor = args.predictor or (trace.meta.get("predictor") if trace else None) or "gate"
    everything = []
    for spec in _list(args.profile):
        profile = load_profile(spec)
        for capacity in [float(c) for c in _list(args.capacity)]:
            for bits, (shape, fitted, origin) in shapes.items():
                rows = project(fitted, shape, profile, capacity, predictor, policy=args.cache_policy)
                stored = "" if bits is None else f", experts at {bits} bits ({shape.expert_bytes / 2**20:.2f} MiB each)"
                title = (f"\n{name} on {profile.name}, cache {capacity:g} of experts "
                         f"({rows[0]['cache_experts']}, {args.cache_policy}), predictor {predictor}{stored}; {origin}")
                print(format_projection(rows, title))
                everything.append({"model": name, "profile": profile.name, "capacity": capacity, "expert_bits": bits,
                                   "rows": rows})
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1) + "\n")
    return 0


def add_commands(sub) -> None:
    from ..argtypes import POLICIES, PREDICTORS, link_list, names_in
    from .profiles import profile_names
    from .shapes import MODELS

    b = sub.add_parser("bench", help="decode TPOT/TTFT of every mode vs the overlap bound; simulator check")
    b.add_argument("--models", default="models/tiny-qwen3-moe,qwen3-30b-a3b",
                   help=f"model directories, tiny:<type>, or real shapes with random weights: {', '.join(MODELS)}")
    b.add_argument("--links", default="pcie4,ufs4,sdcard", type=link_list,
                   help="comma-separated link profiles, native (real copies) or bandwidths such as 8GB/s+20us")
    b.add_argument("--capacities", default="0.1,0.25,0.5", help="fractions of all experts")
    b.add_argument("--predictors", default="gate,quasi,adapter,estimator,trace-oracle,oracle",
                   type=names_in(PREDICTORS, "predictor"), help=f"comma-separated: {', '.join(PREDICTORS)}")
    b.add_argument("--tokens", type=int, default=16, help="new tokens per request")
    b.add_argument("--repeats", type=int, default=5, help="interleaved repetitions; medians are reported")
    b.add_argument("--layers", type=int, default=2, help="sparse layers of a real-shape random model")
    b.add_argument("--prompt-tokens", type=int, default=16,
                   help="prompt length of a random-weight model (random tokens; a trained model answers a task)")
    b.add_argument("--calibration-epochs", type=int, default=30,
                   help="training epochs of the adapters and estimators (evalsuite calibrate's default)")
    b.add_argument("--warm", action="store_true",
                   help="each case's engine first serves another request, then empties its cache (what it learned of "
                        "its predictor's precision stays), as an engine serving requests one after another; the "
                        "second request is measured (default: a fresh engine's first)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--threads", type=int, default=1, help="torch threads for compute")
    b.add_argument("--out", default="results/bench", help="bench.json, traces/ and profiles/ go here")
    b.add_argument("--db", help="also write rows here (default: $EVALSUITE_DB or results/results.db if it exists)")
    b.set_defaults(run=cmd_bench)

    s = sub.add_parser("simulate", help="projected TPOT per mode for a real model on given hardware")
    s.add_argument("--trace", help="routing trace JSON (evalsuite bench writes them under OUT/traces)")
    s.add_argument("--model", help=f"a real model's shape: {', '.join(MODELS)}; without it the trace is replayed "
                                   "on its own model (needs a measured profile)")
    s.add_argument("--profile", required=True,
                   help=f"comma-separated: {', '.join(profile_names())}, or YAML files")
    s.add_argument("--capacity", default="0.25", help="comma-separated fractions of all experts")
    s.add_argument("--predictor", choices=PREDICTORS, help="predictor whose cost to charge (default: the trace's)")
    s.add_argument("--cache-policy", default="lru", choices=POLICIES, help="the engine's eviction policy")
    s.add_argument("--reuse", type=float, help="temporal reuse for a synthetic trace (default: the trace's)")
    s.add_argument("--recall", type=float, help="predictor recall for a synthetic trace (default: the trace's)")
    s.add_argument("--predicted-reuse", type=float,
                   help="share of the predicted set kept from one step to the next, for a synthetic trace "
                        "(default: the trace's, else the routing's)")
    s.add_argument("--steps", type=int, default=64, help="decode steps of a synthetic trace")
    s.add_argument("--expert-bits", help="comma-separated 16, 8, 4: the model's experts as the engine stores them at "
                                         "those bits, priced side by side (default: as the model ships them)")
    s.add_argument("--json", help="also write the rows here")
    s.set_defaults(run=cmd_simulate)
