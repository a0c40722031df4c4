"""Engine metrics inside lm-eval's own results, so its table and JSON show them.

lm-eval has no hook for model-side metrics; the one thing a model hands back into the results is
`get_model_info()`, which simple_evaluate merges into results["config"]. The adapters report their
per-task engine summaries there (under TASK_SUMMARIES), and `add_engine_metrics`, called where the
results are used, moves them to where lm-eval's table reads: `<metric>,engine` entries of
results["results"][task], and in full (per layer) under results["engine"][task]. Each generated response comes
back from the adapters as a GeneratedText carrying the engine metrics of the batch row that produced it; lm-eval
keeps the responses with their logged samples, and `add_engine_metrics` puts each document's metrics there as
results["samples"][task][i]["engine"], which lm-eval's --log_samples writes out. Results of other models are
untouched.
"""
from __future__ import annotations

import statistics

from ..engine.metrics import SCORES, row_recall

ENGINE_FILTER = "engine"
TASK_SUMMARIES = "evalsuite_engine_by_task"  # the key in results["config"] the adapters fill


class GeneratedText(str):
    """A generated response that carries the engine metrics of the batch row that produced it (recall@k per layer
    and mean, hit rate, bytes transferred, TPOT: evalsuite.engine.metrics, 'per sample')."""

    def __new__(cls, text: str, engine: dict | None = None):
        made = super().__new__(cls, text)
        made.engine = engine
        return made

    def __reduce__(self):
        # a response cached or sent between processes is plain text: its metrics belong to the run that made it
        return str, (str(self),)


def engine_entries(summary: dict) -> dict[str, float]:
    """The per-task numbers lm-eval's table shows, keyed `<metric>,engine`."""
    entries = {}
    for metric in SCORES:  # recall@k, exact@K, recall_next_token@K (evalsuite.engine.metrics)
        for k, values in (summary.get(metric) or {}).items():
            entries[f"{metric}@{k}"] = values["mean"]
    entries.update({
        "hit_rate": summary["hit_rate"],
        "prefetch_precision": summary["prefetch_precision"],
        "tpot_ms": summary["tpot_ms"]["median"],
        "tpot_ms_mean": summary["tpot_ms"]["mean"],
        "tpot_ms_p10": summary["tpot_ms"].get("p10"),  # the spread over sequences
        "tpot_ms_p90": summary["tpot_ms"].get("p90"),
        "ttft_ms": summary["ttft_ms"]["median"],
        "ttft_ms_mean": summary["ttft_ms"]["mean"],
        "bytes_per_token": summary["bytes_per_token"],
        "stall_ms_per_token": summary["stall_ms_per_token"],
    })
    for kind, row in (summary.get("by_token_kind") or {}).items():  # vision-language models
        entries.update({f"{kind}_{name}": value for name, value in row.items() if name != "tokens_x_experts"})
    return {f"{name},{ENGINE_FILTER}": value for name, value in entries.items() if value is not None}


def document_metrics(rows: list[dict]) -> dict:
    """A document's engine metrics from those of its generations (several when a task repeats a request):
    recall@k, exact@K and recall_next_token@K per layer, hit rate and TPOT averaged over them, bytes transferred
    summed."""
    if len(rows) == 1:
        return rows[0]
    scores = {}
    for metric in SCORES:
        per_k = {}
        for k in sorted({k for row in rows for k in row.get(metric) or {}}):
            layers = [row[metric][k]["layers"] for row in rows if k in (row.get(metric) or {})]
            per_k[k] = row_recall({layer: statistics.fmean(per[layer] for per in layers if layer in per)
                                   for layer in {layer for per in layers for layer in per}})
        scores[metric] = per_k or None
    return {**scores, "top_k": next((row["top_k"] for row in rows if row.get("top_k") is not None), None),
            "hit_rate": _mean(row["hit_rate"] for row in rows),
            "bytes_transferred": sum(row["bytes_transferred"] for row in rows),
            "tpot_ms": _mean(row["tpot_ms"] for row in rows)}


def headline_recall(values: dict) -> float | None:
    """recall@K (K the router's top-k) of a task's lm-eval results `values` ('<metric>,engine' entries): the k of
    its `exact@K,engine` entry, which only K has; results made before exact@K was reported measured recall@K
    alone by default, so their smallest k."""
    ks = {int(key[len("recall@"):-len(",engine")]): value for key, value in values.items()
          if key.startswith("recall@") and key.endswith(",engine")}
    exact = [int(key[len("exact@"):-len(",engine")]) for key in values
             if key.startswith("exact@") and key.endswith(",engine")]
    k = exact[0] if exact and exact[0] in ks else min(ks, default=None)
    return ks.get(k)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def add_engine_metrics(results: dict) -> dict:
    """The results of `lm_eval.simple_evaluate` with a specmoe model, its engine metrics added (in place).

    Only the tasks of these results get entries: a model evaluated task by task reports every task so far."""
    summaries = (results.get("config") or {}).pop(TASK_SUMMARIES, None) or {}
    if summaries:
        results.setdefault("engine", {})
    for task, summary in summaries.items():
        if task in results.get("results", {}):
            results["results"][task].update(engine_entries(summary))
            results["engine"][task] = summary
    for samples in (results.get("samples") or {}).values():
        for sample in samples:  # one per document and filter
            rows = [response.engine for responses in sample.get("resps") or [] for response in responses
                    if isinstance(response, GeneratedText) and response.engine is not None]
            if rows:
                sample["engine"] = document_metrics(rows)
    return results
