"""Rows for the results tables from the dict lm-eval's simple_evaluate() returns, and back: a stored run's tasks
shaped like that dict again (what a resumed evaluation shows and compares with)."""
from __future__ import annotations

import json
import math
from numbers import Real

_NOT_METRICS = {"alias", "name", "sample_len", "sample_count", " ", ""}


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, Real) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None  # 'N/A', aggregated tuples (bleu), NaN


def _text(value) -> str | None:
    if value is None:
        return None
    while isinstance(value, (list, tuple)) and len(value) == 1:  # one request per document: unwrap
        value = value[0]
    return value if isinstance(value, str) else json.dumps(value, default=str)


def task_metric_rows(task_results: dict, n: int | None, skip_filters=()) -> list[dict]:
    """'acc,none': 0.5 and 'acc_stderr,none': 0.05 -> one row {metric: acc, filter: none, value, stderr, n}."""
    rows = []
    for key, value in task_results.items():
        if key in _NOT_METRICS or "," not in key:
            continue
        metric, filter_name = key.split(",", 1)
        if metric.endswith("_stderr") or filter_name in skip_filters:
            continue
        stderr = _number(task_results.get(f"{metric}_stderr,{filter_name}"))
        rows.append({"metric": metric, "filter": filter_name, "value": _number(value), "stderr": stderr, "n": n})
    return rows


def sample_rows(entries: list[dict]) -> list[dict]:
    """One row per document, metric and filter: the score it got, and whether it is right when the score is 0/1."""
    rows = []
    for entry in entries:
        prediction, target = _text(entry.get("filtered_resps", entry.get("resps"))), _text(entry.get("target"))
        for metric in entry.get("metrics", []):
            score = _number(entry.get(metric))
            rows.append({"doc_id": int(entry["doc_id"]), "metric": metric, "filter": entry.get("filter"),
                         "score": score, "correct": None if score not in (0.0, 1.0) else score == 1.0,
                         "prediction": prediction, "target": target, "response": generated_text(entry),
                         # set by evalsuite eval on runs compared with a resident reference
                         "first_divergence": entry.get("first_divergence"),
                         "identical_share": entry.get("identical_share"),
                         **sample_engine_columns(entry.get("engine"))})
    return rows


def sample_engine_columns(engine: dict | None) -> dict:
    """A logged sample's engine metrics (evalsuite.lm.add_engine_metrics puts them under sample["engine"]) as
    samples columns: recall@K (K the router's top-k, `top_k`; older samples without it: the smallest k, which then
    was K by default) with its per-layer values."""
    if not engine:
        return {}
    recall = engine.get("recall") or {}
    k = _key_of(recall, engine.get("top_k"))
    at_k = recall[k] if k is not None else {}
    return {"recall_at_k": at_k.get("mean"), "k": _int(k),
            "recall_per_layer": {str(layer): value for layer, value in (at_k.get("layers") or {}).items()} or None,
            "hit_rate": engine.get("hit_rate"), "bytes_transferred": engine.get("bytes_transferred"),
            "tpot_ms": engine.get("tpot_ms")}


def generated_text(entry: dict) -> str | None:
    """The raw text a generate_until request produced (lm-eval's resps[0][0]); None for loglikelihoods."""
    try:
        first = entry["resps"][0][0]
    except (KeyError, IndexError, TypeError):
        return None
    return first if isinstance(first, str) else None


def stored_results(metrics, engine, samples) -> dict:
    """One run's stored rows (task_metrics, engine_metrics, samples DataFrames) as simple_evaluate() would
    return them: results[task] with '<metric>,<filter>' values and the whole-model '<metric>,engine' entries,
    samples[task] with each document's raw response, and divergence[task] with the stored identical share."""
    results: dict[str, dict] = {}
    for row in metrics.itertuples(index=False):
        results.setdefault(row.task, {})[f"{row.metric},{row.filter}"] = _number(row.value)
    whole = engine[engine["layer"].isna()].sort_values("k", na_position="last")
    for task, rows in whole.groupby("task", sort=False):
        entries = results.setdefault(task, {})
        for row in rows.itertuples(index=False):
            if _number(row.recall_at_k) is not None:
                entries.setdefault(f"recall@{int(row.k)},engine", row.recall_at_k)
            top_k = _number(getattr(row, "top_k", None))
            if top_k is not None and _number(row.k) == top_k:  # exact@K and recall_next_token@K (schema version 5)
                for metric, column in (("exact", "exact_at_k"), ("recall_next_token", "recall_next_token")):
                    if _number(getattr(row, column, None)) is not None:
                        entries.setdefault(f"{metric}@{int(top_k)},engine", getattr(row, column))
        for name in ("hit_rate", "tpot_ms"):
            if _number(rows.iloc[0][name]) is not None:
                entries[f"{name},engine"] = float(rows.iloc[0][name])
    logged: dict[str, list] = {}
    for (task, _doc, _filter), rows in samples.groupby(["task", "doc_id", "filter"], sort=False, dropna=False):
        row = rows.iloc[0]  # one per metric: the response and its comparison are the document's
        response = row["response"] if isinstance(row["response"], str) else None
        logged.setdefault(task, []).append({"doc_id": int(row["doc_id"]), "resps": [[response]],
                                            "identical_share": _number(row["identical_share"])})
    divergence = {}
    for task, entries in logged.items():
        shares = [e["identical_share"] for e in entries if e["identical_share"] is not None]
        if shares:
            divergence[task] = {"identical_share": sum(shares) / len(shares), "samples": len(shares)}
    return {"results": results, "samples": logged, "divergence": divergence}


def task_count(results: dict, task: str) -> int | None:
    counts = results.get("n-samples", {}).get(task)
    if counts:
        return counts.get("effective")
    return results["results"][task].get("sample_len")


def run_config(config: dict, results: dict) -> dict:
    """The caller's configuration, completed from what lm-eval reports about itself."""
    merged = dict(config)
    lm_config = results.get("config") or {}
    merged.setdefault("model", results.get("model_name") or lm_config.get("model_args") or lm_config.get("model"))
    merged.setdefault("lm_eval_version", results.get("lm_eval_version"))
    for ours, theirs in (("limit", "limit"), ("seed", "random_seed"), ("device", "device")):
        if lm_config.get(theirs) is not None:
            merged.setdefault(ours, lm_config[theirs])
    merged.setdefault("lm_eval", {k: results[k] for k in ("n-shot", "versions", "task_hashes") if k in results})
    return {k: v for k, v in merged.items() if v is not None}


def engine_rows(engine) -> list[dict]:
    """engine_by_task[task]: the engine's summary (evalsuite.engine.metrics), one row dict, or a list of row dicts."""
    if engine is None:
        return []
    if isinstance(engine, dict):
        return summary_rows(engine) if _is_summary(engine) else [dict(engine)]
    return [dict(row) for row in engine]


def _is_summary(engine: dict) -> bool:
    return "layers" in engine or "recall" in engine or isinstance(engine.get("tpot_ms"), dict)


def _median(value):
    return value.get("median") if isinstance(value, dict) else value


def _counters(counters: dict) -> dict:
    return {name: counters.get(name) for name in ("hit_rate", "prefetch_precision", "bytes_transferred", "stall_s")}


def summary_rows(summary: dict) -> list[dict]:
    """A whole-model row and one row per layer, each once per recall k (evalsuite.engine.metrics.recall_ks), each
    with the router's `top_k` (K); the rows of k = K also hold exact@K (`exact_at_k`) and recall_next_token@K.

    TTFT and TPOT are the medians over requests, as lm-eval's table shows them."""
    recall = summary.get("recall") or {}
    ks = sorted(recall, key=lambda k: int(k)) or [None]
    top_k = _int(summary.get("top_k"))
    beside = {}  # column -> the summary's exact@K or recall_next_token@K ({} where it has none)
    for metric, column in _AT_TOP_K:
        per_k = summary.get(metric) or {}
        key = _key_of(per_k, top_k) if top_k is not None else None
        beside[column] = per_k[key] if key is not None else {}

    def at_top_k(k, layer=None) -> dict:
        """exact@K and recall_next_token@K of the whole model (layer None) or a layer, on the rows of k = K."""
        if top_k is None or _int(k) != top_k:
            return {}
        if layer is None:
            return {column: values.get("mean") for column, values in beside.items()}
        return {column: {str(l): v for l, v in (values.get("layers") or {}).items()}.get(layer)
                for column, values in beside.items()}

    whole = {**_counters(summary), "ttft_ms": _median(summary.get("ttft_ms")),
             "tpot_ms": _median(summary.get("tpot_ms")), "tokens": summary.get("tokens")}
    rows = [{**whole, "layer": None, "k": _int(k), "recall_at_k": recall[k].get("mean") if k is not None else None,
             "top_k": top_k, **at_top_k(k)} for k in ks]
    counters = {str(layer): c for layer, c in (summary.get("layers") or {}).items()}
    recall_by_layer = {k: {str(layer): v for layer, v in (recall[k].get("layers") or {}).items()}
                       for k in ks if k is not None}
    scored = {str(layer) for values in beside.values() for layer in (values.get("layers") or {})}
    for layer in sorted(set(counters).union(scored, *recall_by_layer.values()), key=int):
        for k in ks:
            rows.append({**_counters(counters.get(layer, {})), "layer": int(layer), "k": _int(k),
                         "recall_at_k": recall_by_layer[k].get(layer) if k is not None else None,
                         "top_k": top_k, **at_top_k(k, layer)})
    return rows


_AT_TOP_K = (("exact", "exact_at_k"), ("recall_next_token", "recall_next_token"))  # summary key, column


def _key_of(per_k: dict, k):
    """The key of `per_k` (a {k: ...} dict, its keys ints or, read back from JSON, strings) for k; None where it has
    none. k None: the smallest key (the default k of results made before top_k was reported)."""
    if k is None:
        return min(per_k, key=int, default=None)
    return next((key for key in per_k if int(key) == int(k)), min(per_k, key=int, default=None))


def _int(value):
    return None if value is None else int(value)
