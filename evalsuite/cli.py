"""The `evalsuite` command: one subcommand per job; bad input gets one line and exit code 2."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog.split()[0]} --help)\n")


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default where it has one (not for required options or flags)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def _add_engine_options(p: argparse.ArgumentParser, several_predictors: bool = False) -> None:
    """The engine's flags (EngineConfig's `flag` options, their defaults and rules the engine's)."""
    from .argtypes import PREDICTORS, predictor_groups
    from .engine.config import EngineConfig

    EngineConfig.add_arguments(p, skip=("predictor",) if several_predictors else ())
    if several_predictors:  # eval: each predicting mode runs once with each that fits it
        p.add_argument("--predictor", default=None, type=predictor_groups,
                       help=f"comma-separated, of {PREDICTORS.shown()} (default: each mode's own); groups "
                       "separated by ';' may name one mode each: 'gate,quasi,adapter;speculative=gate' runs "
                       "speculative with gate alone, the other predicting modes with all three")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What `evalsuite eval` hands the adapter (device, dtype, batch size) and lm-eval (the rest), named as in lm_eval."""
    p.add_argument("--device", default="cpu", help="where the non-expert weights and the expert cache go: cpu, cuda, "
                                                   "cuda:1 (offloading modes keep the other experts off it, so the "
                                                   "model need not fit there; resident needs every expert there)")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16 (default: the checkpoint's own)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per batch (left-padded; exact modes stay "
                                                             "exact against resident at the same batch size)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--gen-kwargs", default=None,
                   help="generation arguments for every generating task, e.g. temperature=0.7,do_sample=True")
    p.add_argument("--seed", type=int, default=0, help="Python, numpy, torch and few-shot sampling seed")
    p.add_argument("--apply-chat-template", nargs="?", const=True, default=False, metavar="TEMPLATE",
                   help="format prompts with the tokenizer's chat template (or the one named TEMPLATE)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch compute threads (pinned and recorded; the other cores serve the link, see "
                        "evalsuite/timing.py)")


def _add_sandbox_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox", choices=("namespaces", "weak"), default="namespaces",
                   help="confinement for generated code: namespaces (default; needs root with CAP_SYS_ADMIN) or "
                        "weak (rlimits and audit hooks only, for machines without namespaces; recorded on every run)")


def _use_sandbox(args) -> None:
    """The scorers run inside lm-eval and take no options: the choice travels in the environment."""
    import os

    from .scoring.sandbox import CHOICE_ENV

    if args.sandbox == "weak":
        os.environ[CHOICE_ENV] = "weak"


def cmd_generate(args) -> int:
    from .engine.modes import MODES
    from .engine.config import EngineConfig
    from .generate import DEMO_PROMPTS, check_modes, compare_modes, format_table, load_model

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]}
    check_modes(args.modes, **options)  # before the model loads
    model, tokenizer = load_model(args.model, args.dtype, args.device, args.store)
    rows = compare_modes(model, tokenizer, args.modes, prompts=args.prompt or DEMO_PROMPTS,
                         max_new_tokens=args.max_new_tokens, **options)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    # the exact modes must reproduce resident; speculative ones may not
    broken = [r["mode"] for r in rows if MODES[r["mode"]].exact and r["same_as_resident"] is False]
    if broken:
        print(f"evalsuite: error: {', '.join(broken)} changed the output", file=sys.stderr)
    return 1 if broken else 0


def cmd_calibrate(args) -> int:
    import os

    from .generate import load_model
    from .predict.calibrate import calibrate, calibration_texts, token_batches

    for name in ("prompts", "max_len", "rank", "hidden", "shared_width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("epochs", "shared_blocks"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or more")
    if not 0 <= args.heldout < 1:
        raise ValueError("--heldout must be a fraction of the batches, 0 or more and below 1")
    texts = calibration_texts(args.data, args.prompts) if args.data else None  # checked before loading
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    if texts is None:
        # a random-weight tiny model has no tokenizer: random token ids serve as well as text
        texts = calibration_texts(None, args.prompts) if tokenizer is not None else [""] * args.prompts
    batches = list(token_batches(texts, tokenizer, model.config.get_text_config().vocab_size, max_len=args.max_len))
    artifact = calibrate(model, batches, args.predictor, rank=args.rank, horizon=args.horizon, hidden=args.hidden,
                         epochs=args.epochs, lr=args.lr, shared_width=args.shared_width,
                         shared_blocks=args.shared_blocks, heldout=args.heldout,
                         quasi_shared_experts=args.quasi_shared_experts)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "predictor.safetensors")
    artifact.save(path)
    _print_calibration(artifact.meta, len(batches), path)
    return 0


def _print_calibration(meta: dict, batches: int, path: str) -> None:
    """What `evalsuite calibrate` made: per predictor its trainable parameters beside its recall@K on the held-out
    tokens (and on the calibration tokens), then recall per target layer."""
    def mean(per_layer):
        return sum(per_layer.values()) / len(per_layer) if per_layer else float("nan")

    held = meta["heldout_batches"]
    print(f"calibrated on {meta['tokens']} tokens; wrote {path}")
    if held:
        print(f"held out of training: the last {held} of {batches} batches ({meta['heldout_tokens']} tokens)")
    else:
        print(f"nothing held out ({batches} batch{'es' if batches != 1 else ''}): recall on the calibration tokens "
              "only")
    params, width = meta["parameters"], max(len("predictor"), *map(len, meta["recall"]))
    print(f"  {'predictor':<{width}}  {'trainable parameters':>20}  {'held-out recall@K':>17}  "
          f"{'calibration recall@K':>20}")
    for name, per_layer in meta["recall"].items():
        count = params.get(name, params.get(name.split("_")[0]))  # adapter_h2: the adapters' own
        held_out = meta["heldout_recall"].get(name)
        note = "*" if name in meta.get("statistics", {}) else " "
        print(f"  {name:<{width}}  {'-' if count is None else f'{count:,}':>19}{note}  "
              f"{'-' if not held_out else f'{mean(held_out):.3f}':>17}  {mean(per_layer):>20.3f}")
    statistics = meta.get("statistics", {})
    if statistics:
        print("  * not trained: " + ", ".join(f"{name}'s {what} ({statistics[name]:,} numbers)"
                                             for name, what in (("quasi", "default vectors"), ("frequency", "counts"))
                                             if name in statistics) + " are statistics of the calibration tokens")
    print("recall@K per target layer on the calibration tokens, of every predictor (a trained one on the tokens "
          "it was fitted to)" + (", and on the held-out tokens:" if held else ":"))
    width = max(map(len, meta["recall"]))
    for name, per_layer in meta["recall"].items():
        layers = " ".join(f"L{k}={v:.3f}" for k, v in per_layer.items())
        print(f"  recall@K {name:<{width}} mean={mean(per_layer):.3f} {layers}")
    for name, per_layer in meta["heldout_recall"].items():
        layers = " ".join(f"L{k}={v:.3f}" for k, v in per_layer.items())
        print(f"  held-out {name:<{width}} mean={mean(per_layer):.3f} {layers}")
    if meta.get("next_token_recall"):
        first = meta["layers"][0]
        print(f"recall@K of the next token's first sparse layer (L{first}), predicted at this token's last: "
              + " ".join(f"{name}={value:.3f}" for name, value in meta["next_token_recall"].items()))
    for name, loss in meta["final_loss"].items():
        print(f"  final KL {name}: {loss:.4f}")


# lm-eval's and the adapter's settings that `evalsuite eval` passes on (evalsuite.lm.run_options.RunOptions)
RUN_FLAGS = ("device", "dtype", "batch_size", "num_fewshot", "gen_kwargs", "apply_chat_template", "seed")


def as_flags(message: str) -> str:
    """An engine option as lm-eval's model_args spell it (`predictor_path=X`) -> as this command's flag
    (`--predictor-path X`), so an error tells the user the syntax of the interface they are in."""
    import re

    from .engine.config import EngineConfig

    options = [f.name for f in dataclasses.fields(EngineConfig)]
    names = "|".join(sorted({*options, *RUN_FLAGS}, key=len, reverse=True))
    return re.sub(rf"\b({names})=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


def _flags_in_errors(command):
    """`command` with an engine option in its errors spelled as the command's flag (as_flags)."""
    def run(args) -> int:
        try:
            return command(args)
        except (ValueError, FileNotFoundError) as exc:
            raise type(exc)(as_flags(str(exc))) from None
    return run


def _suite_inputs(args):
    """(models, tasks, engine, run) of `evalsuite eval` and `recall-curve`, from their shared flags; the sandbox
    and data directory they name are set for the scorers."""
    import os

    from .engine.config import EngineConfig
    from .lm.preflight import split_names
    from .lm.suite import RunOptions

    models = split_names(args.model, "--model") if args.model is not None else default_models()
    _use_sandbox(args)
    if args.data_dir:
        os.environ["EVALSUITE_DATA_DIR"] = os.path.abspath(args.data_dir)
    if args.tasks is not None:
        tasks = split_names(args.tasks, "--tasks")
    else:
        tasks = {model: default_tasks(model) for model in models}
    engine = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                             if f.metadata["flag"] and f.name != "predictor"})
    run = RunOptions(**{name: getattr(args, name) for name in RUN_FLAGS})
    return models, tasks, engine, run


@_flags_in_errors
def cmd_eval(args) -> int:
    import os

    from .lm.preflight import check_eval
    from .lm.suite import format_rows, run_suite

    models, tasks, engine, run = _suite_inputs(args)
    modes = args.modes  # a list: checked by its type (evalsuite.argtypes)
    # the whole request is checked before run_suite loads the first model or stores anything
    check_eval(models, modes, tasks, args.limit, engine=engine, predictor=args.predictor, run=run, db_url=args.db,
               confirm_run_unsafe_code=args.confirm_run_unsafe_code)
    rows = run_suite(models, modes, tasks, args.limit, engine=engine, predictor=args.predictor, run=run,
                     db_url=args.db, out_dir=args.out, confirm_run_unsafe_code=args.confirm_run_unsafe_code,
                     fresh=args.fresh, threads=args.threads, plan=args.plan)
    print(format_rows(rows))
    if args.tasks is None and not os.environ.get("EVALSUITE_DATA_DIR"):
        print("the real benchmarks (GSM8k, StrategyQA; MATH-Vision for a vision-language model) were skipped: no data "
              "directory; pass --data-dir DIR (make eval DATA_DIR=DIR; by default ../shared/data beside the checkout)")
    return 0


@_flags_in_errors
def cmd_recall_curve(args) -> int:
    from .lm.preflight import split_names
    from .sweep.recall_curve import CurveGrid, run_recall_curve

    def listed(text, flag):
        return tuple(split_names(text, flag))

    try:
        levels = tuple(float(v) for v in listed(args.levels, "--levels"))
        range_levels = tuple(float(v) for v in listed(args.range_levels, "--range-levels"))
    except ValueError:
        raise ValueError(f"--levels and --range-levels take numbers in [0, 1], e.g. --levels 1.0,0.9,0.8 (got "
                         f"{args.levels!r}, {args.range_levels!r})") from None
    grid = CurveGrid(levels, listed(args.errors, "--errors"), listed(args.layers, "--layers"), range_levels,
                     listed(args.real, "--real") if args.real else (), not args.no_hybrid)
    models, tasks, engine, run = _suite_inputs(args)
    report, wall_s = run_recall_curve(models, tasks, args.limit, grid, engine=engine, run=run, db_url=args.db,
                                      out_dir=args.out, plot_dir=args.plots,
                                      confirm_run_unsafe_code=args.confirm_run_unsafe_code, fresh=args.fresh,
                                      threads=args.threads)
    print(report)
    print(f"recall-curve: {len(grid.controlled())} controlled and {len(grid.real) + grid.hybrid} real configurations "
          f"per model and task in {wall_s:.0f} s (replay plan: batched passes, row groups per predictor)")
    return 0


def cmd_sweep(args) -> int:
    from .results import ResultsDB
    from .results.cli import format_pareto
    from .results.report import pareto_table, summary_table, sweep_runs
    from .sweep import load_sweep, run_sweep

    _use_sandbox(args)
    sweep = load_sweep(args.file)
    if args.retries is not None:
        sweep.retries = args.retries
    outcome = run_sweep(sweep, db_url=args.db, ray_address=args.ray, workers=args.workers)
    with ResultsDB(args.db or sweep.db) as db:
        runs = sweep_runs(db.runs(status="complete"), sweep.name)
        ids = runs["id"].tolist()
        summary = summary_table(runs, db.task_metrics(ids), db.engine_metrics(ids))
    print(f"sweep {sweep.name}: {len(outcome.done)} cells ran, {len(outcome.skipped)} already stored, "
          f"{len(outcome.failed)} failed")
    print(format_pareto(pareto_table(summary)))
    for label, error in outcome.failed.items():
        print(f"  failed: {label}: {error}", file=sys.stderr)
    return 1 if outcome.failed else 0


SHIPPED_MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-qwen3-vl-moe")


def default_models() -> list[str]:
    """The shipped tiny models in models/ under the working directory (a checkout's root: the package itself
    carries no models, they are too large for it)."""
    import os

    models = [os.path.join("models", name) for name in SHIPPED_MODELS]
    for model in models:  # a path, not a Hub id: say so when it is missing
        if not os.path.isdir(model):
            raise FileNotFoundError(f"no model directory {model!r} under {os.getcwd()}: run from the checkout's "
                                    "root (the shipped models live in models/) or pass --model DIR")
    return models


def default_tasks(model: str) -> list[str]:
    """The project's own tasks for the model's kind (text or vision-language), plus the real
    benchmarks when their data directory is set (AIME and HumanEval are left to explicit --tasks:
    their long generations dwarf everything else)."""
    import os

    from .lm.suite import is_vision_language

    benchmarks = bool(os.environ.get("EVALSUITE_DATA_DIR"))
    if is_vision_language(model):
        return ["evalsuite_vision"] + (["mathvision_testmini_es"] if benchmarks else [])
    tasks = ["evalsuite_arith", "evalsuite_yesno", "evalsuite_code", "evalsuite_boxed"]
    return tasks + (["gsm8k_es", "strategyqa_es_cot", "strategyqa_es_mc"] if benchmarks else [])


def cmd_pack_experts(args) -> int:
    import torch
    from tqdm import tqdm

    from .engine import arch
    from .engine.placement.loading import meta_model
    from .engine.placement.packed import write_packed
    from .engine.placement.quantised import layout_for
    from .engine.placement.store import ExpertLayout

    if args.expert_bits not in (8, 4):
        raise ValueError(f"--expert-bits {args.expert_bits}: pack experts at 8 or 4 bits (at 16 the disk store reads "
                         "the checkpoint itself)")
    model = meta_model(args.model, getattr(torch, args.dtype) if args.dtype else None)
    layers = arch.sparse_layers(model)
    dense = ExpertLayout.of(layers[0].experts)
    dtype = dense.dtype
    layout = layout_for(dense, args.expert_bits, args.expert_group_size)
    with tqdm(total=len(layers), desc="layers packed", unit="layer") as bar:
        path = write_packed(args.model, layers, layout, arch.family_of(model), progress=lambda _: bar.update())
    experts = sum(layer.num_experts for layer in layers)
    print(f"wrote {path}: {experts} experts of {layout.nbytes:,} bytes each ({layout.nbytes / dense.nbytes:.3f} of "
          f"their {dense.nbytes:,} in {str(dtype).replace('torch.', '')}), {layout.bits} bits, group "
          f"{layout.group_size}")
    return 0


def cmd_train_tiny(args) -> int:
    from .zoo import train

    return train.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    from .argtypes import MODES, names_in
    from .engine.config import EngineConfig
    from .lm.run_options import EVAL_ENGINE
    from .sweep.recall_curve import LEVELS, REAL_PREDICTORS
    from .predict.calibrate import HELDOUT, QUASI_SHARED_EXPERTS, TRAINED

    modes = names_in(MODES, "mode")
    parser = Parser(prog="evalsuite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy generation under several modes, with engine metrics")
    g.add_argument("--model", default="tiny:qwen3_moe", help="model directory, or tiny:<model_type> (random weights)")
    g.add_argument("--modes", default="resident,on-demand", type=modes,
                   help=f"comma-separated execution modes: {', '.join(MODES)} (resident runs first, the "
                        "reference for the others, wherever its experts fit in memory: EVALSUITE_AVAILABLE_MEMORY)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", help="also write the rows to this JSON file")
    _add_engine_options(g)
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser("calibrate", help="routing traces -> default vectors, adapters, estimators (an artifact)",
                       formatter_class=DefaultsShown)
    c.add_argument("--model", required=True, help="model directory, or tiny:<model_type>")
    c.add_argument("--predictor", default="all", choices=TRAINED,
                   help="what to train (all: every one; gate, quasi and frequency need no training)")
    c.add_argument("--data", help="JSONL of calibration texts (default: the project's generated training data)")
    c.add_argument("--out", required=True, help="directory for predictor.safetensors")
    c.add_argument("--prompts", type=int, default=256, help="calibration texts to use")
    c.add_argument("--max-len", type=int, default=128, help="tokens kept of each calibration text")
    c.add_argument("--rank", type=int, default=16, help="adapter rank r (trainable parameters r(D+E) each)")
    c.add_argument("--horizon", type=int, default=1, choices=(1, 2), help="layers ahead the adapters predict")
    c.add_argument("--hidden", type=int, default=64, help="estimator hidden width")
    c.add_argument("--shared-width", type=int, default=64,
                   help="adapter-shared width d (trainable parameters d(D+E+A+3) + blocks(4d^2+5d) + E, "
                        "A anchor layers)")
    c.add_argument("--shared-blocks", type=int, default=2, help="adapter-shared residual MLP blocks")
    c.add_argument("--heldout", type=float, default=HELDOUT,
                   help="fraction of the calibration batches (the last ones, at least one where there are two) held "
                        "out of training to measure recall on")
    c.add_argument("--quasi-shared-experts", action=argparse.BooleanOptionalAction, default=QUASI_SHARED_EXPERTS,
                   help="the quasi state (quasi, estimator, hybrid) adds the shared experts' output on the router "
                        "input, in models that have them")
    c.add_argument("--epochs", type=int, default=30, help="training epochs of each adapter and estimator")
    c.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the model is loaded in")
    c.add_argument("--device", default="cpu", help="where the model runs")
    c.set_defaults(run=cmd_calibrate)

    e = sub.add_parser("eval", help="models x modes x tasks through lm-eval; one table, stored results")
    e.add_argument("--model", help="comma-separated model directories (default: the shipped tiny models, "
                                   "models/tiny-qwen3-moe,models/tiny-glm4-moe,models/tiny-qwen3-vl-moe)")
    e.add_argument("--modes", default="resident,on-demand,router-preserving,speculative", type=modes,
                   help=f"comma-separated execution modes: {', '.join(MODES)}")
    e.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the project's own, plus benchmarks "
                                   "when a data directory is given)")
    e.add_argument("--limit", type=int, default=20, help="documents per task")
    e.add_argument("--data-dir", help="offline benchmark data laid out like shared/data (sets EVALSUITE_DATA_DIR)")
    e.add_argument("--db", help="results database URL (default: EVALSUITE_DB or sqlite:///results/results.db)")
    e.add_argument("--out", default="results", help="folder for lm-eval's JSON results")
    e.add_argument("--fresh", action="store_true",
                   help="start new runs even where a run with this exact configuration is stored (default: resume it)")
    e.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="allow scoring generated code (in the sandbox): needed by code tasks")
    _add_sandbox_option(e)
    _add_engine_options(e, several_predictors=True)
    _add_run_options(e)
    e.add_argument("--plan", default="measure", choices=("measure", "replay"),
                   help="measure: every configuration generates through the engine; replay: one batched resident "
                        "pass (every router-preserving predictor as a shadow) and one speculative pass (a text "
                        "model's speculative predictors share it, a row group each), the engine metrics of each "
                        "configuration replayed (docs/whole-benchmarks.md)")
    # eval's engine (EVAL_ENGINE) under the flags; no predictor: each mode runs its own
    e.set_defaults(run=cmd_eval, cache_capacity=EVAL_ENGINE.cache_capacity)

    r = sub.add_parser("recall-curve", help="accuracy as a function of recall: speculation with controlled-recall "
                                            "predictors and the real ones, one report and plot per model")
    r.add_argument("--model", help="comma-separated model directories (default: the shipped tiny models)")
    r.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the project's own, plus benchmarks "
                                   "when a data directory is given)")
    r.add_argument("--limit", type=int, default=64, help="documents per task")
    r.add_argument("--levels", default=",".join(map(str, LEVELS)), help="recall levels of the curve")
    r.add_argument("--errors", default="uniform,near", help="error models: uniform (any unselected expert), near "
                                                            "(the router's next-ranked experts)")
    r.add_argument("--layers", default="all", help="layer ranges: all, early, middle, late (a confined range "
                                                   "runs at --range-levels)")
    r.add_argument("--range-levels", default="0.5", help="recall levels of the confined layer ranges")
    r.add_argument("--real", default=",".join(REAL_PREDICTORS),
                   help="real predictors executed speculatively beside the curve ('' for none)")
    r.add_argument("--no-hybrid", action="store_true", help="leave out the hybrid mode")
    r.add_argument("--plots", default="results/recall-curve", help="folder for the plots (one PNG per model)")
    r.add_argument("--data-dir", help="offline benchmark data laid out like shared/data (sets EVALSUITE_DATA_DIR)")
    r.add_argument("--db", help="results database URL (default: EVALSUITE_DB or sqlite:///results/results.db)")
    r.add_argument("--out", default="results", help="folder for lm-eval's JSON results")
    r.add_argument("--fresh", action="store_true", help="start new runs even where stored ones match")
    r.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="allow scoring generated code (in the sandbox): needed by code tasks")
    _add_sandbox_option(r)
    EngineConfig.add_arguments(r, skip=("predictor",))  # the grid names the predictors
    _add_run_options(r)
    r.set_defaults(run=cmd_recall_curve, cache_capacity=EVAL_ENGINE.cache_capacity, batch_size=16)

    w = sub.add_parser("sweep", help="a grid of models x modes x predictors x caches x links x seeds (YAML), "
                                     "here or on Ray; skips cells already stored")
    w.add_argument("file", help="sweep YAML (docs/sweeps.md)")
    w.add_argument("--ray", metavar="ADDRESS", help="run each cell as a Ray task: 'auto', 'ray://host:10001', "
                                                    "or 'local' (start Ray here)")
    w.add_argument("--db", help="results database URL (default: the file's `db`, else EVALSUITE_DB or "
                                "sqlite:///results/results.db); a Ray cluster needs PostgreSQL")
    w.add_argument("--workers", type=int, help="local cells at once (processes; default: the file's `workers`)")
    w.add_argument("--retries", type=int, help="extra attempts for a failed cell (default: the file's `retries`)")
    _add_sandbox_option(w)
    w.set_defaults(run=cmd_sweep)

    from .results.cli import add_commands

    add_commands(sub)  # runs, report, compare, gate
    from .perf.cli import add_commands as add_perf_commands

    add_perf_commands(sub)  # bench, simulate

    k = sub.add_parser("pack-experts", help="quantise a checkpoint's experts once into the file the disk store "
                                            "reads at --expert-bits 8 or 4 (docs/quantised-experts.md)")
    k.add_argument("--model", required=True, help="a model directory with safetensors")
    k.add_argument("--expert-bits", type=int, required=True, help="8 or 4")
    k.add_argument("--expert-group-size", type=int, default=None,
                   help="weights per scale and zero (default: 64, or the largest power of two below it that divides "
                        "every expert's input width)")
    k.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the dtype the model will run in (default: the checkpoint's own)")
    k.set_defaults(run=cmd_pack_experts)

    t = sub.add_parser("train-tiny", help="train the shipped tiny MoE models", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(run=cmd_train_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "run", None) is cmd_train_tiny:  # its options belong to evalsuite.zoo.train
        args.rest = unknown + args.rest
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as exc:  # bad input: one line, exit 2
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"evalsuite: error: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
