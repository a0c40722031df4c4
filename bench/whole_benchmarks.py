"""Wall time of a whole evaluation grid, three ways, in one run (this machine drifts: compare within a run).

  plain     lm-eval's own `hf` model, resident, at --batch-size: the floor any suite is measured against
  replay    `evalsuite eval --plan replay` at --batch-size: one resident pass with every router-preserving
            predictor as a shadow, one pass per speculative predictor, engine metrics replayed
  measure   `evalsuite eval --plan measure` at batch 1: every configuration generated through the engine

Default grid, one request (`--predictor 'gate,quasi,adapter,estimator;speculative=gate,quasi'`): resident,
on-demand, router-preserving x gate/quasi/adapter/estimator, speculative x gate/quasi, on gsm8k_es and
evalsuite_arith, limit 64, tiny-qwen3-moe. Calibration (for quasi, adapter, estimator) runs first, untimed.

    python bench/whole_benchmarks.py [--model DIR] [--limit 64] [--batch-size 16] [--repeats 3] [--skip-measure] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from evalsuite import timing  # noqa: E402
from evalsuite.lm import preflight  # noqa: E402
from evalsuite.table import Column, format_table  # noqa: E402
from evalsuite.tasks import TASKS_DIR  # noqa: E402

GRID_MODES = ["resident", "on-demand", "router-preserving", "speculative"]
GRID_PREDICTORS = "gate,quasi,adapter,estimator;speculative=gate,quasi"


def plain(model: str, tasks: list[str], limit: int, batch_size: int) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=tasks, limit=limit,
                            batch_size=batch_size, device="cpu", task_manager=TaskManager(include_path=TASKS_DIR))
    return time.perf_counter() - started


def suite(model, tasks, limit, batch_size, plan, artifact, workdir, round_: int) -> tuple[float, list[dict]]:
    """The grid as one `evalsuite eval` request: each predicting mode with its own predictors (--predictor groups)."""
    from evalsuite.lm.suite import EVAL_ENGINE, RunOptions, run_suite

    started = time.perf_counter()
    rows = run_suite([model], GRID_MODES, tasks, limit, predictor=GRID_PREDICTORS,
                     engine=EVAL_ENGINE.replace(predictor_path=artifact, link="ufs4"), run=RunOptions(batch_size=batch_size),
                     db_url=f"sqlite:///{workdir}/{plan}-{round_}.db", out_dir=os.path.join(workdir, plan), plan=plan,
                     fresh=True, progress=lambda *_: None)
    return time.perf_counter() - started, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=os.path.join(REPO, "models", "tiny-qwen3-moe"))
    p.add_argument("--tasks", default="gsm8k_es,evalsuite_arith")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="rounds of plain then replay")
    p.add_argument("--skip-measure", action="store_true", help="leave out the per-configuration batch-1 runs")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    os.environ.setdefault("EVALSUITE_DATA_DIR", os.path.abspath(os.path.join(REPO, "..", "shared", "data")))
    tasks = args.tasks.split(",")
    timing.pin(1)  # every way computes on one thread
    workdir = tempfile.mkdtemp(prefix="whole-")
    artifact = os.path.join(workdir, "predictor.safetensors")
    subprocess.run([sys.executable, "-m", "evalsuite.cli", "calibrate", "--model", args.model, "--predictor", "all",
                    "--out", workdir], check=True, capture_output=True)
    out = {"model": args.model, "tasks": tasks, "limit": args.limit, "batch_size": args.batch_size,
           "machine": timing.machine("cpu"), "torch_threads": torch.get_num_threads()}
    # rounds of plain then replay: this machine's speed drifts by up to 2x over minutes, so each round's ratio
    # compares adjacent runs, and the spread over rounds says how far one ratio can be trusted
    rounds = []
    for r in range(args.repeats):
        preflight.task_manager.cache_clear()  # every way builds lm-eval's task index itself, in every round
        plain_s = plain(args.model, tasks, args.limit, args.batch_size)
        preflight.task_manager.cache_clear()
        replay_s, rows = suite(args.model, tasks, args.limit, args.batch_size, "replay", artifact, workdir, r)
        rounds.append({"plain_s": plain_s, "replay_s": replay_s, "ratio": replay_s / plain_s})
        print(f"round {r + 1}: plain {plain_s:.1f} s, replay {replay_s:.1f} s ({replay_s / plain_s:.2f}x)", flush=True)
    out["rounds"] = rounds
    ratios = sorted(r["ratio"] for r in rounds)
    out["replay_x_plain"] = statistics.median(ratios)
    table = [[f"plain lm_eval hf, batch {args.batch_size}", statistics.median(r["plain_s"] for r in rounds), 1.0, ""],
             [f"--plan replay, batch {args.batch_size}", statistics.median(r["replay_s"] for r in rounds),
              out["replay_x_plain"], f"{ratios[0]:.2f}-{ratios[-1]:.2f}"]]
    if not args.skip_measure:  # once (minutes), against the replay just before it
        preflight.task_manager.cache_clear()
        out["measure_s"], _ = suite(args.model, tasks, args.limit, 1, "measure", artifact, workdir, 0)
        out["measure_x_replay"] = out["measure_s"] / rounds[-1]["replay_s"]
        table.append(["--plan measure, batch 1", out["measure_s"], out["measure_s"] / rounds[-1]["plain_s"], ""])
    print(format_table(table, ["way", Column("wall s (median)", ".1f"), Column("x plain (median)", ".2f"),
                               "range over rounds"]))
    if "measure_s" in out:
        print(f"replay is {out['measure_x_replay']:.1f}x faster than measuring every configuration "
              "(against the last round's replay)")
    print(f"{len(rows)} rows replayed: " + ", ".join(sorted({r['mode'] for r in rows})))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
