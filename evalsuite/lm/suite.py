"""`evalsuite eval` (and `make eval`): models x modes x tasks through lm-eval, one table.

Each (model, mode) is one lm-eval run of the `specmoe` model over all tasks; results go to the
results database (and lm-eval's JSON). Speculative runs are compared with the resident run
of the same model sample by sample: first differing generated token, share of identical ones.
"""
from __future__ import annotations

import json
import os
import time

from ..generate import divergence_from

ACCURACY_METRICS = ("exact_match", "pass@1", "pass_at_1", "acc", "accuracy")


def model_args(model: str, mode: str, predictor: str | None, predictor_path: str | None, cache_capacity,
               link: str | None, extra: str = "") -> str:
    args = [f"pretrained={model}", f"mode={mode}", f"cache_capacity={cache_capacity}"]
    if mode not in ("resident", "on-demand") and predictor:
        args.append(f"predictor={predictor}")
    if predictor_path and mode not in ("resident", "on-demand"):
        args.append(f"predictor_path={predictor_path}")
    if link and mode != "resident":
        args.append(f"link={link}")
    return ",".join(args + ([extra] if extra else []))


def accuracy(task_results: dict) -> tuple[str, float] | None:
    """The task's headline metric: the first accuracy-like entry outside the engine filter."""
    for name in ACCURACY_METRICS:
        for key, value in task_results.items():
            metric, _, flt = key.partition(",")
            if metric == name and flt != "engine" and isinstance(value, (int, float)):
                return key, value
    return None


def divergence(results: dict, reference: dict, tokenizer) -> dict[str, dict]:
    """Per task: mean first-divergence position and identical-token share against `reference`."""
    out = {}
    for task, samples in results.get("samples", {}).items():
        ref = {s["doc_id"]: s for s in reference.get("samples", {}).get(task, [])}
        rows = []
        for s in samples:
            if s["doc_id"] in ref:
                a = tokenizer(str(s["resps"][0][0]))["input_ids"]
                b = tokenizer(str(ref[s["doc_id"]]["resps"][0][0]))["input_ids"]
                rows.append(divergence_from(_row(a), _row(b), 0))
        if rows:
            firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
            out[task] = {"identical_share": sum(r["identical_share"] for r in rows) / len(rows),
                         "samples_changed": len(firsts), "samples": len(rows), "per_sample": rows}
    return out


def _row(ids):
    import torch

    return torch.tensor([ids])


def run_suite(models, modes, tasks, limit, predictor="gate", predictor_path=None, cache_capacity=0.25, link=None,
              db_url=None, out_dir="results", confirm_run_unsafe_code=False, progress=print) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tasks_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tasks")
    manager = TaskManager(include_path=tasks_dir)
    rows = []
    for model in models:
        tokenizer = AutoTokenizer.from_pretrained(model)
        reference = None
        for mode in modes:
            args = model_args(model, mode, predictor, predictor_path, cache_capacity, link)
            progress(f"[evalsuite] {os.path.basename(model.rstrip('/'))} / {mode}: {', '.join(tasks)} (limit {limit})")
            started = time.time()
            results = lm_eval.simple_evaluate(model="specmoe", model_args=args, tasks=list(tasks), limit=limit,
                                              device="cpu", batch_size=1, log_samples=True, task_manager=manager,
                                              confirm_run_unsafe_code=confirm_run_unsafe_code)
            if mode == "resident":
                reference = results
            diverged = divergence(results, reference, tokenizer) if reference is not None and mode != "resident" else {}
            results["divergence"] = diverged
            run_id = store(results, model, mode, predictor, cache_capacity, link, limit, db_url, out_dir)
            for task, values in sorted(results["results"].items()):
                headline = accuracy(values)
                if headline is None:
                    continue
                recall = next((v for k, v in values.items() if k.startswith("recall@")), None)
                rows.append({"model": os.path.basename(model.rstrip("/")), "mode": mode, "task": task,
                             "metric": headline[0], "accuracy": headline[1], "recall": recall,
                             "hit_rate": values.get("hit_rate,engine"), "tpot_ms": values.get("tpot_ms,engine"),
                             "identical_share": diverged.get(task, {}).get("identical_share"), "run": run_id,
                             "seconds": time.time() - started})
    return rows


def store(results, model, mode, predictor, cache_capacity, link, limit, db_url, out_dir):
    """Write the run to the results database when it exists, and always to a JSON file."""
    os.makedirs(out_dir, exist_ok=True)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.path.basename(model.rstrip('/'))}-{mode}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1, default=str)
    try:
        from ..results import ResultsDB
    except ImportError:
        return name
    config = {"model": model, "mode": mode, "predictor": predictor if mode not in ("resident", "on-demand") else None,
              "cache_capacity": str(cache_capacity), "link": link, "limit": limit, "dtype": "float32", "device": "cpu"}
    return ResultsDB(db_url).record_lm_eval(config, results, results.get("engine"))


def format_rows(rows) -> str:
    numbers = ("accuracy", "recall", "hit rate", "TPOT ms", "same tok")
    header = f"{'model':<16}{'task':<22}{'mode':<19}" + "".join(f"{n:>10}" for n in numbers)
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = (_fmt(r["accuracy"]), _fmt(r["recall"]), _fmt(r["hit_rate"]), _fmt(r["tpot_ms"], 2),
                 _fmt(r["identical_share"]))
        lines.append(f"{r['model']:<16}{r['task']:<22}{r['mode']:<19}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
