"""Compare two runs task by task: accuracy delta with a paired significance test and a bootstrap CI of the delta,
plus the change in recall, hit rate, TPOT and bytes moved.

Only runs that measured the same thing are compared (same model, task set, limit, few-shot, seed; see
comparable.py) unless forced. Samples are paired on (task, metric, filter, doc_id). The paired test decides
significance: binary scores (all 0/1) get the exact McNemar test (under no difference the discordant pairs split
50/50, so the p-value is a two-sided binomial test of one side's count among them); other scores get the
Wilcoxon signed-rank test on the paired differences. The 95 % CI, a paired percentile bootstrap of the mean
difference (seeded, so reruns agree), is secondary; where it and the test disagree the output says so.
Engine metrics are compared on the same paired documents when the samples carry per-document engine values,
else on each run's whole-run values, and the output says which. Tasks without stored samples fall back to the
task_metrics values, without a test.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.stats import binomtest, bootstrap, wilcoxon

from ..table import Column, format_table
from .comparable import differences

ENGINE_COLUMNS = ("recall_at_k", "hit_rate", "tpot_ms", "bytes_transferred")
BOOTSTRAP_ROUNDS = 2000
ALPHA = 0.05  # a paired test's p below this is significant
WHY_TEST = {"mcnemar-exact": "paired 0/1 outcomes: only the documents the runs disagree on carry information, "
                             "and the binomial test of their split is exact at any n",
            "wilcoxon": "paired continuous scores: signed ranks of the per-document differences, no normality "
                        "assumed"}


def mcnemar_exact(a_correct, b_correct) -> tuple[int, int, float]:
    """(only A right, only B right, two-sided exact p) for paired 0/1 outcomes."""
    a, b = np.asarray(a_correct, bool), np.asarray(b_correct, bool)
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    if only_a + only_b == 0:
        return only_a, only_b, 1.0
    return only_a, only_b, float(binomtest(only_b, only_a + only_b, 0.5).pvalue)


def _mean_difference(a, b, axis=-1):
    return np.mean(b - a, axis=axis)


def bootstrap_ci(scores_a, scores_b, rounds: int = BOOTSTRAP_ROUNDS, level: float = 0.95, seed: int = 0):
    """Percentile CI of the mean paired difference B - A, resampling documents (pairs stay together)."""
    a, b = np.asarray(scores_a, float), np.asarray(scores_b, float)
    if a.size < 2:  # one document has no spread to resample
        return math.nan, math.nan
    # percentile, not scipy's default BCa: BCa is NaN when every paired difference is the same (two exact
    # modes: all zero), a common comparison here; `random_state`, not `rng` (scipy >= 1.15), keeps scipy 1.10
    result = bootstrap((a, b), _mean_difference, paired=True, vectorized=True, n_resamples=rounds,
                       confidence_level=level, method="percentile", random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def paired_test(a: np.ndarray, b: np.ndarray) -> tuple[str, float, int, int]:
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
        test, p, worse, better = paired_test(sa, sb)
        low, high = bootstrap_ci(sa, sb)
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


def headline_k(rows: pd.DataFrame, by) -> pd.DataFrame:
    """Where recall was measured at several k, the rows of recall@K, K the router's top-k (`top_k`, stored since
    schema version 5: evalsuite.engine.metrics); per group of `by` without a row of k = top_k (rows stored before,
    when recall@K was measured alone by default), those of the smallest k."""
    smallest = rows.groupby(by, dropna=False)["k"].transform("min")
    if "top_k" not in rows:
        return rows[rows["k"].isna() | (rows["k"] == smallest)]
    has_top_k = rows.assign(at=rows["k"] == rows["top_k"]).groupby(by, dropna=False)["at"].transform("any")
    wanted = rows["top_k"].where(has_top_k, smallest)
    return rows[rows["k"].isna() | (rows["k"] == wanted)]


def whole_model_rows(engine: pd.DataFrame, by: str) -> pd.DataFrame:
    return headline_k(engine[engine["layer"].isna()], by)


def _engine_by_task(engine: pd.DataFrame) -> pd.DataFrame:
    whole = whole_model_rows(engine, "task")
    columns = [c for c in ENGINE_COLUMNS if c in whole]
    return whole.groupby("task")[columns].mean() if not whole.empty else pd.DataFrame(columns=columns)


def _per_document_engine(samples: pd.DataFrame) -> pd.DataFrame:
    """Per (task, doc_id), the engine values the samples carry (one document is scored under several
    metrics, so its rows repeat them)."""
    columns = [c for c in ENGINE_COLUMNS if c in samples and samples[c].notna().any()]
    if not columns:
        return pd.DataFrame(columns=["task", "doc_id"])
    carrying = samples.dropna(subset=columns, how="all")  # loglikelihood tasks carry none: they compare whole-run
    return carrying.groupby(["task", "doc_id"], as_index=False)[columns].first()


def engine_deltas(samples_a, samples_b, engine_a, engine_b) -> pd.DataFrame:
    """Per task, each run's engine metrics and where they come from (`engine_basis`): the mean over the documents
    both runs scored when both runs' samples carry per-document engine values ('paired'), else the whole-run
    values stored in engine_metrics ('whole-run'), which cover each run's own documents."""
    docs_a, docs_b = _per_document_engine(samples_a), _per_document_engine(samples_b)
    shared = [c for c in ENGINE_COLUMNS if c in docs_a and c in docs_b]
    paired = docs_a.merge(docs_b, on=["task", "doc_id"], suffixes=("_a", "_b")) if shared else pd.DataFrame()
    whole_a, whole_b = _engine_by_task(engine_a), _engine_by_task(engine_b)
    rows = {}
    for task in sorted(set(whole_a.index) | set(whole_b.index) | set(paired.get("task", []))):
        if shared and task in set(paired["task"]):
            part = paired[paired["task"] == task]
            row = {f"{c}_{side}": part[f"{c}_{side}"].mean() if c in shared else math.nan
                   for c in ENGINE_COLUMNS for side in "ab"}
            rows[task] = {**row, "engine_basis": "paired", "engine_n": len(part)}
        else:
            row = {f"{c}_{side}": whole.at[task, c] if task in whole.index and c in whole else math.nan
                   for c in ENGINE_COLUMNS for side, whole in (("a", whole_a), ("b", whole_b))}
            rows[task] = {**row, "engine_basis": "whole-run", "engine_n": math.nan}
    return pd.DataFrame.from_dict(rows, orient="index")


def _documents(samples: pd.DataFrame) -> pd.Series:
    return samples.groupby("task")["doc_id"].nunique() if not samples.empty else pd.Series(dtype=int)


def compare(db, run_a, run_b, tasks=None, force: bool = False) -> pd.DataFrame:
    """One row per (task, metric, filter) both runs have: B minus A, with test, CI and engine deltas.

    Refuses (ValueError) runs that differ in model, task set, limit, few-shot or seed unless `force`; then the
    differences are kept in attrs['warnings']. `tasks` limits the comparison to those tasks."""
    run_a, run_b = db.run(run_a), db.run(run_b)  # ValueError on unknown ids
    a, b = run_a["id"], run_b["id"]
    differ, unknown = differences(run_a, run_b, tasks)
    if differ and not force:
        raise ValueError(f"runs {a} and {b} did not measure the same thing: {'; '.join(differ)} differ; "
                         "compare runs of one configuration, or pass --force to compare them anyway")
    samples_a, samples_b = db.samples([a]), db.samples([b])
    metrics_a, metrics_b = db.task_metrics([a]), db.task_metrics([b])
    engine_a, engine_b = db.engine_metrics([a]), db.engine_metrics([b])
    if tasks:
        samples_a, samples_b, metrics_a, metrics_b, engine_a, engine_b = (
            frame[frame["task"].isin(tasks)] for frame in (samples_a, samples_b, metrics_a, metrics_b, engine_a,
                                                           engine_b))
    sample_rows = _sample_rows(samples_a, samples_b)
    covered = {(r["task"], r["metric"], r["filter"]) for r in sample_rows}
    metric_rows = _metric_rows(metrics_a, metrics_b, covered)
    if not sample_rows and not metric_rows:
        only = f" among tasks {', '.join(tasks)}" if tasks else ""
        raise ValueError(f"runs {a} and {b} share no task metric{only} (A has {_task_list(metrics_a)}, B has "
                         f"{_task_list(metrics_b)}); compare runs that evaluated the same tasks")
    table = pd.DataFrame(sample_rows + metric_rows, columns=[
        "task", "metric", "filter", "n", "value_a", "value_b", "delta", "ci_low", "ci_high", "test", "p_value",
        "a_better", "b_better"])
    table["significant"] = table["p_value"].map(lambda p: None if pd.isna(p) else bool(p < ALPHA))
    engine = engine_deltas(samples_a, samples_b, engine_a, engine_b)
    for column in [f"{c}_{side}" for c in ENGINE_COLUMNS for side in "ab"] + ["engine_basis", "engine_n"]:
        table[column] = table["task"].map(engine[column]) if column in engine else math.nan
    for column in ENGINE_COLUMNS:
        table[f"{column}_delta"] = table[f"{column}_b"] - table[f"{column}_a"]
    table["docs_a"], table["docs_b"] = table["task"].map(_documents(samples_a)), table["task"].map(_documents(samples_b))
    table.attrs.update(run_a=a, run_b=b, warnings=[f"runs {a} and {b} differ in {d}" for d in differ],
                       unknown=unknown, label_a=run_label(run_a), label_b=run_label(run_b))
    return table.sort_values(["task", "metric", "filter"], ignore_index=True)


def run_label(run: dict) -> str:
    """' (mode[/predictor], N-bit experts)': what a run is, for the comparison's first line."""
    bits = run.get("expert_bits", 16)
    what = "/".join(str(part) for part in (run.get("mode"), run.get("predictor")) if part)
    return f" ({what}, {bits}-bit experts)" if what else f" ({bits}-bit experts)"


def _task_list(metrics: pd.DataFrame) -> str:
    tasks = sorted(set(metrics["task"]))
    return ", ".join(tasks) if tasks else "no tasks"


def disagreement(row) -> str | None:
    """A note when the bootstrap CI and the paired test disagree on whether the delta is zero."""
    if pd.isna(row.p_value) or pd.isna(row.ci_low):
        return None
    excludes_zero = row.ci_low > 0 or row.ci_high < 0
    if excludes_zero == bool(row.p_value < ALPHA):
        return None
    name = f"{row.task} {row.metric}"
    if excludes_zero:
        return (f"{name}: the bootstrap CI excludes 0 but {row.test} p = {row.p_value:.3g} >= {ALPHA}: not "
                "significant (a percentile bootstrap of few discordant documents is too narrow; the test decides)")
    return (f"{name}: {row.test} p = {row.p_value:.3g} < {ALPHA} but the bootstrap CI includes 0: significant by "
            "the test, which decides; the CI is a resampling approximation")


def _comparison_cells(row) -> list:
    metric = row.metric if row.filter in ("", "none") else f"{row.metric}/{row.filter}"
    ci = None if math.isnan(row.ci_low) else f"[{row.ci_low:+.4f},{row.ci_high:+.4f}]"
    significant = {None: None, True: "yes", False: "no"}[row.significant]
    return [row.task, metric, row.n, row.value_a, row.value_b, row.delta, row.test, row.p_value, significant, ci,
            row.recall_at_k_delta, row.hit_rate_delta, row.tpot_ms_delta, row.bytes_transferred_delta / 1e6]


def format_comparison(table: pd.DataFrame) -> str:
    """A fixed-width table: one line per task and metric, deltas in points where they are fractions, then what
    decides significance, where the CI disagrees, and what the engine columns cover."""
    lines = [f"run B = {table.attrs.get('run_b')}{table.attrs.get('label_b', '')} vs run A = "
             f"{table.attrs.get('run_a')}{table.attrs.get('label_a', '')}"]
    lines += [f"WARNING: {w}; compared anyway (--force)" for w in table.attrs.get("warnings", [])]
    lines += [f"note: {u}" for u in table.attrs.get("unknown", [])]
    columns = [Column("task", max_width=24), Column("metric", max_width=18), Column("n", "d"), Column("A", ".4f"),
               Column("B", ".4f"), Column("delta", "+.4f"), Column("test", max_width=14), Column("p", ".3g"),
               "sig", "95% CI (bootstrap)", Column("recall", "+.4f"), Column("hit", "+.4f"),
               Column("TPOT ms", "+.2f"), Column("MB", "+.2f")]
    lines.append(format_table([_comparison_cells(row) for row in table.itertuples(index=False)], columns))
    lines.append("delta = B - A over the documents both runs scored.")
    for test in sorted(set(table["test"]) & set(WHY_TEST)):
        lines.append(f"significance ({test}, p < {ALPHA}): {WHY_TEST[test]}.")
    if set(table["test"]) & set(WHY_TEST):
        lines.append(f"The 95% CI (paired percentile bootstrap, {BOOTSTRAP_ROUNDS} resamples, seeded) is secondary.")
    lines += [f"note: {n}" for n in (disagreement(row) for row in table.itertuples(index=False)) if n]
    lines += _engine_notes(table)
    return "\n".join(lines)


def _engine_notes(table: pd.DataFrame) -> list[str]:
    notes = []
    for task, part in table.groupby("task", sort=True):
        row = part.iloc[0]
        if row.engine_basis == "paired":
            notes.append(f"engine {task}: recall/hit/TPOT/MB are B - A means over the {int(row.engine_n)} documents "
                         "both runs scored")
        elif row.engine_basis == "whole-run":
            docs = "" if pd.isna(row.docs_a) or pd.isna(row.docs_b) else \
                f" (A over {int(row.docs_a)} documents, B over {int(row.docs_b)})"
            notes.append(f"engine {task}: recall/hit/TPOT/MB are whole-run deltas{docs}, not restricted to the "
                         "paired documents: no per-document engine values stored")
    return notes
