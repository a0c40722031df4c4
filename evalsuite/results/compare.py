"""Compare two runs task by task: accuracy delta with a paired significance test and a bootstrap CI of the delta,
plus the change in recall, hit rate and TPOT.

Samples are paired on (task, metric, filter, doc_id). Binary scores (all 0/1) get the exact McNemar test: under
no difference the discordant pairs split 50/50, so the p-value is a two-sided binomial test of one side's count
among them. Other scores get the Wilcoxon signed-rank test on the paired differences. The 95 % CI is a
percentile bootstrap over documents of the mean paired difference (seeded, so reruns agree).
Tasks without stored samples fall back to the task_metrics values, without a test.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.stats import binomtest, wilcoxon

ENGINE_COLUMNS = ("recall_at_k", "hit_rate", "tpot_ms")
BOOTSTRAP_ROUNDS = 2000


def mcnemar_exact(a_correct, b_correct) -> tuple[int, int, float]:
    """(only A right, only B right, two-sided exact p) for paired 0/1 outcomes."""
    a, b = np.asarray(a_correct, bool), np.asarray(b_correct, bool)
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    if only_a + only_b == 0:
        return only_a, only_b, 1.0
    return only_a, only_b, float(binomtest(only_b, only_a + only_b, 0.5).pvalue)


def bootstrap_ci(differences, rounds: int = BOOTSTRAP_ROUNDS, level: float = 0.95, seed: int = 0):
    """Percentile CI of the mean of paired differences, resampling documents."""
    d = np.asarray(differences, float)
    if d.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = np.empty(rounds)
    chunk = max(1, 2_000_000 // d.size)  # bounded memory for large tasks
    for start in range(0, rounds, chunk):
        stop = min(rounds, start + chunk)
        means[start:stop] = d[rng.integers(0, d.size, (stop - start, d.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def _paired_test(a: np.ndarray, b: np.ndarray) -> tuple[str, float, int, int]:
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        only_a, only_b, p = mcnemar_exact(a == 1.0, b == 1.0)
        return "mcnemar-exact", p, only_a, only_b
    d = b - a
    if not np.any(d):
        return "wilcoxon", 1.0, int(np.sum(a > b)), int(np.sum(b > a))
    return "wilcoxon", float(wilcoxon(b, a).pvalue), int(np.sum(a > b)), int(np.sum(b > a))


def _sample_rows(samples_a: pd.DataFrame, samples_b: pd.DataFrame) -> list[dict]:
    keys = ["task", "metric", "filter", "doc_id"]
    a = samples_a.dropna(subset=["score"]).fillna({"metric": "", "filter": ""})
    b = samples_b.dropna(subset=["score"]).fillna({"metric": "", "filter": ""})
    paired = a[keys + ["score"]].merge(b[keys + ["score"]], on=keys, suffixes=("_a", "_b"))
    rows = []
    for (task, metric, filter_name), group in paired.groupby(["task", "metric", "filter"], sort=True):
        sa, sb = group["score_a"].to_numpy(float), group["score_b"].to_numpy(float)
        test, p, worse, better = _paired_test(sa, sb)
        low, high = bootstrap_ci(sb - sa)
        rows.append({"task": task, "metric": metric, "filter": filter_name, "n": len(group),
                     "value_a": sa.mean(), "value_b": sb.mean(), "delta": sb.mean() - sa.mean(),
                     "ci_low": low, "ci_high": high, "test": test, "p_value": p,
                     "a_better": worse, "b_better": better})
    return rows


def _metric_rows(metrics_a: pd.DataFrame, metrics_b: pd.DataFrame, covered: set) -> list[dict]:
    keys = ["task", "metric", "filter"]
    merged = metrics_a.fillna({"filter": ""})[keys + ["value", "n"]].merge(
        metrics_b.fillna({"filter": ""})[keys + ["value", "n"]], on=keys, suffixes=("_a", "_b"))
    rows = []
    for row in merged.itertuples(index=False):
        if (row.task, row.metric, row.filter) in covered:
            continue
        rows.append({"task": row.task, "metric": row.metric, "filter": row.filter,
                     "n": row.n_b if pd.notna(row.n_b) else row.n_a, "value_a": row.value_a,
                     "value_b": row.value_b, "delta": row.value_b - row.value_a, "ci_low": math.nan,
                     "ci_high": math.nan, "test": "none (no samples)", "p_value": math.nan,
                     "a_better": math.nan, "b_better": math.nan})
    return rows


def smallest_k(rows: pd.DataFrame, by) -> pd.DataFrame:
    """Where recall was measured at several k, the rows of the smallest (the default k is the router's top-K;
    larger ones are optional extras)."""
    smallest = rows.groupby(by, dropna=False)["k"].transform("min")
    return rows[rows["k"].isna() | (rows["k"] == smallest)]


def whole_model_rows(engine: pd.DataFrame, by: str) -> pd.DataFrame:
    return smallest_k(engine[engine["layer"].isna()], by)


def _engine_by_task(engine: pd.DataFrame) -> pd.DataFrame:
    whole = whole_model_rows(engine, "task")
    return whole.groupby("task")[list(ENGINE_COLUMNS)].mean() if not whole.empty else pd.DataFrame(
        columns=list(ENGINE_COLUMNS))


def compare(db, run_a, run_b) -> pd.DataFrame:
    """One row per (task, metric, filter) both runs have: B minus A, with test, CI and engine deltas."""
    a, b = db.run(run_a)["id"], db.run(run_b)["id"]  # ValueError on unknown ids
    sample_rows = _sample_rows(db.samples([a]), db.samples([b]))
    covered = {(r["task"], r["metric"], r["filter"]) for r in sample_rows}
    metric_rows = _metric_rows(db.task_metrics([a]), db.task_metrics([b]), covered)
    table = pd.DataFrame(sample_rows + metric_rows, columns=[
        "task", "metric", "filter", "n", "value_a", "value_b", "delta", "ci_low", "ci_high", "test", "p_value",
        "a_better", "b_better"])
    engine_a, engine_b = _engine_by_task(db.engine_metrics([a])), _engine_by_task(db.engine_metrics([b]))
    for column in ENGINE_COLUMNS:
        before = table["task"].map(engine_a[column]) if column in engine_a else math.nan
        after = table["task"].map(engine_b[column]) if column in engine_b else math.nan
        table[f"{column}_a"], table[f"{column}_b"] = before, after
        table[f"{column}_delta"] = table[f"{column}_b"] - table[f"{column}_a"]
    table.attrs.update(run_a=a, run_b=b)
    return table.sort_values(["task", "metric", "filter"], ignore_index=True)


def format_comparison(table: pd.DataFrame) -> str:
    """A fixed-width table: one line per task and metric, deltas in points where they are fractions."""
    if table.empty:
        return f"runs {table.attrs.get('run_a')} and {table.attrs.get('run_b')} share no task metric"
    lines = [f"run B = {table.attrs.get('run_b')} vs run A = {table.attrs.get('run_a')}",
             f"{'task':<24} {'metric':<18} {'n':>6} {'A':>8} {'B':>8} {'delta':>8} {'95% CI':>19} "
             f"{'test':<14} {'p':>8} {'recall':>8} {'hit':>8} {'TPOT ms':>8}"]
    for row in table.itertuples(index=False):
        metric = row.metric if row.filter in ("", "none") else f"{row.metric}/{row.filter}"
        ci = "" if math.isnan(row.ci_low) else f"[{row.ci_low:+.4f},{row.ci_high:+.4f}]"
        lines.append(f"{row.task[:24]:<24} {metric[:18]:<18} {_num(row.n, 'd'):>6} {_num(row.value_a):>8} "
                     f"{_num(row.value_b):>8} {_num(row.delta, '+.4f'):>8} {ci:>19} {row.test[:14]:<14} "
                     f"{_num(row.p_value, '.3g'):>8} {_num(row.recall_at_k_delta, '+.4f'):>8} "
                     f"{_num(row.hit_rate_delta, '+.4f'):>8} {_num(row.tpot_ms_delta, '+.2f'):>8}")
    lines.append("delta = B - A; recall/hit/TPOT columns are B - A of the whole-model engine metrics")
    return "\n".join(lines)


def _num(value, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(int(value), spec) if spec == "d" else format(float(value), spec)
