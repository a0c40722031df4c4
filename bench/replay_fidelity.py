"""Replayed engine metrics against measured ones, router-preserving with the scheduler's window on, in one run.

The same request (router-preserving, every --predictors, one task at --limit, --link, --capacity) runs
--measured times through the engine at batch 1 (`--plan measure`) and --replays times as `--plan replay`
at --batch-size, interleaved (this machine drifts). Per predictor it prints each measured run's prefetch
precision and hit rate, their mean and range, the replay's, and whether the replay lies within --tolerance
of the measured mean. Measured runs differ among themselves: the scheduler decides on live timings, and its
rule sits near its margin for some layers, so the range is printed beside the difference.

    python bench/replay_fidelity.py [--model DIR] [--task evalsuite_arith] [--limit 32] [--link ufs4]
        [--capacity 0.25] [--predictors gate,quasi] [--measured 3] [--replays 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from evalsuite import timing  # noqa: E402
from evalsuite.table import Column, format_table  # noqa: E402

METRICS = ("prefetch_precision", "hit_rate")


def run(args, plan: str, batch_size: int, artifact: str, workdir: str, index: int) -> dict:
    """{predictor: {metric: value}} of one evaluation, as stored (whole-run engine metrics)."""
    from evalsuite.engine.config import EngineConfig
    from evalsuite.lm.suite import RunOptions, run_suite
    from evalsuite.results import ResultsDB

    url = f"sqlite:///{workdir}/{plan}-{index}.db"
    run_suite([args.model], ["router-preserving"], [args.task], args.limit, predictor=args.predictors,
              engine=EngineConfig(predictor_path=artifact, cache_capacity=args.capacity, link=args.link),
              run=RunOptions(batch_size=batch_size), db_url=url, out_dir=os.path.join(workdir, plan), plan=plan,
              fresh=True, progress=lambda *_: None)
    db = ResultsDB(url)
    runs, metrics = db.runs(), db.engine_metrics()
    whole = metrics[metrics["layer"].isna()].set_index("run_id")
    return {predictor: {m: float(whole.loc[run_id, m]) for m in METRICS}
            for run_id, predictor in zip(runs["id"], runs["predictor"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(REPO, "models", "tiny-qwen3-moe"))
    p.add_argument("--task", default="evalsuite_arith")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--link", default="ufs4")
    p.add_argument("--capacity", type=float, default=0.25)
    p.add_argument("--predictors", default="gate,quasi")
    p.add_argument("--measured", type=int, default=3)
    p.add_argument("--replays", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args()
    os.environ.setdefault("EVALSUITE_DATA_DIR", os.path.abspath(os.path.join(REPO, "..", "shared", "data")))
    timing.pin(1)
    workdir = tempfile.mkdtemp(prefix="fidelity-")
    artifact = os.path.join(workdir, "predictor.safetensors")
    subprocess.run([sys.executable, "-m", "evalsuite.cli", "calibrate", "--model", args.model, "--predictor", "all",
                    "--out", workdir], check=True, capture_output=True)
    order = ["measure", "replay"] * max(args.measured, args.replays)  # interleaved: the machine drifts
    counts, runs = {"measure": 0, "replay": 0}, {"measure": [], "replay": []}
    for plan in order:
        wanted = args.measured if plan == "measure" else args.replays
        if counts[plan] < wanted:
            runs[plan].append(run(args, plan, 1 if plan == "measure" else args.batch_size, artifact, workdir,
                                  len(runs["measure"]) + len(runs["replay"])))
            counts[plan] += 1
    rows = []
    for predictor in runs["measure"][0]:
        for metric in METRICS:
            measured = [r[predictor][metric] for r in runs["measure"]]
            replayed = [r[predictor][metric] for r in runs["replay"]]
            mean = statistics.mean(measured)
            worst = max(abs(v - mean) for v in replayed)
            rows.append({"predictor": predictor, "metric": metric, "measured": " ".join(f"{v:.3f}" for v in measured),
                         "mean": mean, "range": max(measured) - min(measured),
                         "replayed": " ".join(f"{v:.3f}" for v in replayed), "difference": worst,
                         "within": "yes" if worst <= args.tolerance else "no"})
    columns = [("predictor", Column("predictor", "")), ("metric", Column("metric", "")),
               ("measured", Column("measured runs", "")), ("mean", Column("mean", ".3f")),
               ("range", Column("range", ".3f")), ("replayed", Column("replayed", "")),
               ("difference", Column("|replay - mean|", ".3f")), ("within", Column(f"<= {args.tolerance}", ""))]
    print(f"{os.path.basename(args.model)}, {args.task} limit {args.limit}, router-preserving, link {args.link}, "
          f"cache {args.capacity:g}, window on")
    print(format_table([[row[key] for key, _ in columns] for row in rows], [c for _, c in columns]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
