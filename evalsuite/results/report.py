"""A report over every run in the database: CSV tables, PNG plots and an index.html that shows them."""
from __future__ import annotations

import html
import os
from datetime import datetime, timezone

import pandas as pd

from . import plots
from .compare import whole_model_rows
from .database import stored_config

# which metric stands for a task's accuracy, most preferred first; otherwise the first metric by name
MAIN_METRICS = ("acc", "exact_match", "acc_norm", "em", "f1", "pass@1")
_RUN_LABELS = ["id", "status", "model", "mode", "predictor", "expert_bits", "cache_capacity", "cache_policy", "link",
               "dtype", "device", "limit"]
FRONT_KEYS = ["model", "tasks", "limit"]  # a Pareto front each: a mean over other tasks or documents is another number
# recall@K, exact@K and recall_next_token@K (evalsuite.engine.metrics): the last two stored since schema version 5
_ENGINE_COLUMNS = ["recall_at_k", "exact_at_k", "recall_next_token", "prefetch_precision", "hit_rate",
                   "bytes_transferred", "stall_s", "ttft_ms", "tpot_ms", "tokens"]


def main_metrics(task_metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, task): its main metric (preferred name, filter 'none' first)."""
    if task_metrics.empty:
        return task_metrics
    ranked = task_metrics.dropna(subset=["value"]).assign(
        rank=lambda t: t["metric"].map(lambda m: MAIN_METRICS.index(m) if m in MAIN_METRICS else len(MAIN_METRICS)),
        not_none=lambda t: t["filter"].fillna("none") != "none")
    ranked = ranked.sort_values(["run_id", "task", "rank", "not_none", "metric", "filter"])
    return ranked.drop_duplicates(["run_id", "task"]).drop(columns=["rank", "not_none"])


def _names(column) -> str:
    return ",".join(sorted(set(column)))


def summary_table(runs: pd.DataFrame, task_metrics: pd.DataFrame, engine: pd.DataFrame) -> pd.DataFrame:
    """Per run: its tasks (names, comma-separated), mean main-metric accuracy over them and whole-model engine
    metrics averaged over them."""
    main = main_metrics(task_metrics)
    accuracy = main.groupby("run_id").agg(tasks=("task", _names), accuracy=("value", "mean"), metrics=("metric", _names))
    whole = whole_model_rows(engine, "run_id")
    whole = whole.assign(**{c: float("nan") for c in _ENGINE_COLUMNS if c not in whole})  # (a frame built without)
    engine_means = whole.groupby("run_id")[_ENGINE_COLUMNS].mean() if not whole.empty else pd.DataFrame(
        columns=_ENGINE_COLUMNS)
    table = runs[_RUN_LABELS].set_index("id").join(accuracy).join(engine_means)
    return table.reset_index().rename(columns={"index": "id"})


def main_metric_samples(samples: pd.DataFrame, task_metrics: pd.DataFrame, labels: pd.DataFrame) -> pd.DataFrame:
    """The samples scored under each (run, task)'s main metric and filter, with their run's labels."""
    keys = ["run_id", "task", "metric", "filter"]
    if samples.empty or task_metrics.empty:
        return labels.iloc[:0].assign(recall_at_k=[], k=[], correct=[])
    main = main_metrics(task_metrics)[keys].fillna({"filter": "none"})
    return labels.merge(samples.fillna({"filter": "none"}).merge(main, on=keys), on="run_id")


def sweep_runs(runs: pd.DataFrame, sweep: str) -> pd.DataFrame:
    """The runs a sweep (evalsuite.sweep) stored: their configuration names the sweep."""
    return runs[runs["config"].map(lambda c: stored_config(c).get("sweep") == sweep)] if not runs.empty else runs


def pareto_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per model, task set and limit, the runs no other run of theirs beats on both lower TPOT and higher accuracy
    (mean main metric over the run's tasks), by rising TPOT. Runs without both numbers are left out."""
    data = summary.dropna(subset=["accuracy", "tpot_ms"])
    fronts = [part.iloc[plots.pareto_front(part["tpot_ms"], part["accuracy"])]
              for _, part in data.groupby([data[key].astype(str) for key in FRONT_KEYS], sort=True)]
    columns = [*FRONT_KEYS, "id", "mode", "predictor", "cache_capacity", "link", "accuracy", "tpot_ms", "recall_at_k",
               "hit_rate"]
    return pd.concat(fronts)[columns] if fronts else pd.DataFrame(columns=columns)


def _html_table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0, classes="t")


def report(db, out_dir: str = os.path.join("results", "report"), sweep: str | None = None) -> dict:
    """Write CSVs, PNGs and index.html to out_dir (only `sweep`'s runs when given); returns
    {'html', 'tables', 'plots', 'notes'}."""
    os.makedirs(out_dir, exist_ok=True)
    runs = db.runs()
    if sweep is not None:
        runs = sweep_runs(runs, sweep)
        if runs.empty:
            raise ValueError(f"no runs of sweep {sweep!r} in {db.url}; `evalsuite sweep FILE` stores them")
    ids = runs["id"].tolist()
    task_metrics, engine = db.task_metrics(ids), db.engine_metrics(ids)
    labels = runs[_RUN_LABELS].rename(columns={"id": "run_id"})
    summary = summary_table(runs, task_metrics, engine)
    tables = {
        "runs": runs.drop(columns=["config", "writer_pid", "writer_host", "writer_start"]),
        "summary": summary,
        "pareto": pareto_table(summary),
        "task_metrics": labels.merge(task_metrics, on="run_id"),
        "engine_metrics": labels.merge(engine, on="run_id"),
    }
    for name, frame in tables.items():
        frame.to_csv(os.path.join(out_dir, f"{name}.csv"), index=False)
    layers = tables["engine_metrics"][tables["engine_metrics"]["layer"].notna()]
    scored = main_metric_samples(db.samples(ids), task_metrics, labels)
    drawn, notes = [], []
    for name, title, draw, data in (
            ("accuracy_vs_tpot.png", "Accuracy vs TPOT", plots.accuracy_vs_tpot, tables["summary"]),
            ("accuracy_vs_recall.png", "Share correct vs per-sample recall@K", plots.accuracy_vs_recall, scored),
            ("recall_per_layer.png", "Recall@K per layer and predictor", plots.recall_heatmap, layers),
            ("hit_rate_vs_capacity.png", "Hit rate vs cache capacity", plots.hit_rate_vs_capacity, tables["summary"])):
        note = draw(data, os.path.join(out_dir, name))
        if note is None:
            drawn.append((name, title))
        else:
            notes.append(note)
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write(_page(db.url, tables, drawn, notes))
    return {"html": path, "tables": tables, "plots": [os.path.join(out_dir, n) for n, _ in drawn], "notes": notes}


def _page(url: str, tables: dict, drawn: list, notes: list) -> str:
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>evalsuite results</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:1400px}table.t{border-collapse:collapse;font-size:12px}"
             "table.t td,table.t th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}"
             "img{max-width:100%;border:1px solid #eee}.note{color:#a60}</style></head><body>",
             f"<h1>evalsuite results</h1><p>{html.escape(url)} &middot; {len(tables['runs'])} runs &middot; "
             f"generated {generated}</p>"]
    for name, title in drawn:
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{html.escape(name)}' alt='{html.escape(title)}'>")
    for note in notes:
        parts.append(f"<p class='note'>Skipped: {html.escape(note)}</p>")
    parts.append("<h2>Runs</h2><p>accuracy: mean over the run's tasks of each task's main metric; engine columns: "
                 "whole-model rows averaged over tasks. CSVs: " + ", ".join(
                     f"<a href='{n}.csv'>{n}.csv</a>" for n in tables) + "</p>")
    parts.append(_html_table(tables["summary"]))
    parts.append("<h2>Pareto fronts</h2><p>per model, task set and limit, the runs no other run beats on both lower "
                 "TPOT and higher accuracy</p>" + _html_table(tables["pareto"]))
    task_metrics = tables["task_metrics"].drop(columns=["link", "dtype", "device"])
    parts.append("<h2>Task metrics</h2>" + _html_table(task_metrics))
    parts.append("</body></html>")
    return "\n".join(parts)
