"""Engine metrics inside lm-eval's own results, so its table and JSON show them.

lm-eval has no hook for model-side metrics, so `evaluate` is wrapped: after it returns, each
task's engine measurements are added as `<metric>,engine` entries of results["results"][task]
and in full (per layer) under results["engine"][task]. Runs with other models are untouched.
"""
from __future__ import annotations

import functools

import lm_eval.evaluator as evaluator

ENGINE_FILTER = "engine"


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
        "ttft_ms": summary["ttft_ms"]["median"],
        "ttft_ms_mean": summary["ttft_ms"]["mean"],
        "bytes_per_token": summary["bytes_per_token"],
        "stall_ms_per_token": summary["stall_ms_per_token"],
    })
    for kind, row in (summary.get("by_token_kind") or {}).items():  # vision-language models
        entries.update({f"{kind}_{name}": value for name, value in row.items() if name != "tokens_x_experts"})
    return {f"{name},{ENGINE_FILTER}": value for name, value in entries.items() if value is not None}


def add_engine_metrics(results: dict, summaries: dict[str, dict]) -> dict:
    results.setdefault("engine", {})
    for task, summary in summaries.items():
        if task in results.get("results", {}):
            results["results"][task].update(engine_entries(summary))
            results["engine"][task] = summary
    return results


def _wrap(evaluate):
    @functools.wraps(evaluate)
    def evaluate_with_engine_metrics(lm, *args, **kwargs):
        results = evaluate(lm, *args, **kwargs)
        if results is not None and hasattr(lm, "engine_summaries"):
            add_engine_metrics(results, lm.engine_summaries())
        return results

    evaluate_with_engine_metrics.__evalsuite__ = True
    return evaluate_with_engine_metrics


if not getattr(evaluator.evaluate, "__evalsuite__", False):
    evaluator.evaluate = _wrap(evaluator.evaluate)
