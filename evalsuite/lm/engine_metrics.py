"""Engine metrics inside lm-eval's own results, so its table and JSON show them.

lm-eval has no hook for model-side metrics; the one thing a model hands back into the results is
`get_model_info()`, which simple_evaluate merges into results["config"]. The adapters report their
per-task engine summaries there (under TASK_SUMMARIES), and `add_engine_metrics`, called where the
results are used, moves them to where lm-eval's table reads: `<metric>,engine` entries of
results["results"][task], and in full (per layer) under results["engine"][task]. Results of other
models are untouched.
"""
from __future__ import annotations

ENGINE_FILTER = "engine"
TASK_SUMMARIES = "evalsuite_engine_by_task"  # the key in results["config"] the adapters fill


def engine_entries(summary: dict) -> dict[str, float]:
    """The per-task numbers lm-eval's table shows, keyed `<metric>,engine`."""
    entries = {}
    for k, recall in (summary.get("recall") or {}).items():
        entries[f"recall@{k}"] = recall["mean"]
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
    return results
