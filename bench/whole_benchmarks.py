"""Wall time of a whole evaluation grid, three ways, in one run (this machine drifts: compare within a run).

  plain     lm-eval's own `hf` model, resident, at --batch-size: the floor any suite is measured against
  replay    `evalsuite eval --plan replay` at --batch-size: one resident pass with every router-preserving
            predictor as a shadow, one pass per speculative predictor, engine metrics replayed
  measure   `evalsuite eval --plan measure` at batch 1: every configuration generated through the engine

Default grid: resident, on-demand, router-preserving x gate/quasi/adapter/estimator, speculative x gate/quasi
(the speculative pass runs each predictor given that fits it, here gate and quasi), on gsm8k_es and
evalsuite_arith, limit 64, tiny-qwen3-moe. Calibration (for quasi, adapter, estimator) runs first, untimed.

    python bench/whole_benchmarks.py [--model DIR] [--limit 64] [--batch-size 16] [--skip-measure] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from evalsuite import timing  # noqa: E402
from evalsuite.table import Column, format_table  # noqa: E402
from evalsuite.tasks import TASKS_DIR  # noqa: E402

RP_PREDICTORS = ("gate", "quasi", "adapter", "estimator")
SPEC_PREDICTORS = ("gate", "quasi")


def plain(model: str, tasks: list[str], limit: int, batch_size: int) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=tasks, limit=limit,
                            batch_size=batch_size, device="cpu", task_manager=TaskManager(include_path=TASKS_DIR))
    return time.perf_counter() - started


def suite(model, tasks, limit, batch_size, plan, artifact, workdir, grid) -> tuple[float, list[dict]]:
    from evalsuite.lm.suite import run_suite

    rows = []
    started = time.perf_counter()
    for modes, predictors in grid:
        rows += run_suite([model], modes, tasks, limit, predictor=",".join(predictors) if predictors else None,
                          predictor_path=artifact, link="ufs4", db_url=f"sqlite:///{workdir}/{plan}.db",
                          out_dir=os.path.join(workdir, plan), batch_size=batch_size, plan=plan, fresh=True,
                          progress=lambda *_: None)
    return time.perf_counter() - started, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=os.path.join(REPO, "models", "tiny-qwen3-moe"))
    p.add_argument("--tasks", default="gsm8k_es,evalsuite_arith")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
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
    # one request: the suite plans it (and runs router-preserving with every predictor given, speculative with
    # those that fit); measured, each (mode, predictor) is its own batch-1 run
    grid = [(["resident", "on-demand", "router-preserving"], RP_PREDICTORS), (["speculative"], SPEC_PREDICTORS)]
    out = {"model": args.model, "tasks": tasks, "limit": args.limit, "batch_size": args.batch_size,
           "machine": timing.machine("cpu"), "torch_threads": torch.get_num_threads()}
    out["plain_s"] = plain(args.model, tasks, args.limit, args.batch_size)
    out["replay_s"], rows = suite(args.model, tasks, args.limit, args.batch_size, "replay", artifact, workdir, grid)
    if not args.skip_measure:
        out["measure_s"], measured = suite(args.model, tasks, args.limit, 1, "measure", artifact, workdir, grid)
    ways = [(f"plain lm_eval hf, batch {args.batch_size}", "plain_s"),
            (f"--plan replay, batch {args.batch_size}", "replay_s"), ("--plan measure, batch 1", "measure_s")]
    print(format_table([[way, out[key], out[key] / out["plain_s"]] for way, key in ways if key in out],
                       ["way", Column("wall s", ".1f"), Column("x plain", ".2f")]))
    if "measure_s" in out:
        print(f"replay is {out['measure_s'] / out['replay_s']:.1f}x faster than measuring every configuration")
    print(f"{len(rows)} rows replayed: "
          + ", ".join(sorted({r['mode'] for r in rows})))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
