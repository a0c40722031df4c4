"""The two seeds' tables, from stored runs, measured the way the papers measure them.

accuracy (Speculating Experts): per model and task, the accuracy of resident, speculative (with the `quasi`
    predictor) and hybrid, the drop speculation costs (resident - speculative) and the share of it hybrid
    recovers, (hybrid - speculative) / (resident - speculative), given only where the drop's interval lies above
    zero (a share of no loss is noise). Each run is the newest complete one of its
    (model, mode, predictor) that scored the task; documents are paired across the three runs, and every
    difference and the share get a 95 % percentile bootstrap interval over documents (seeded).
recall (SpecPrefetch): per model, task and predictor, recall@k for the reference's k set and exact@K over
    decode tokens x anchor layers (evalsuite.engine.metrics), and the predictor's trainable parameters.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..table import Column, format_table

ACCURACY_METRICS = ("exact_match", "pass@1", "pass_at_1", "acc", "accuracy")  # the headline, in this order
SPECULATIVE_PREDICTOR = "quasi"  # seed A's speculation runs on the quasi-hidden state
ROUNDS = 2000


def _newest(runs: pd.DataFrame, mode: str, predictor: str | None) -> pd.DataFrame:
    chosen = runs[(runs["mode"] == mode) & runs["status"].isin(("complete", "incomplete"))]
    if predictor is not None:
        chosen = chosen[chosen["predictor"] == predictor]
    return chosen.sort_values("id", ascending=False)


def _scores(samples: pd.DataFrame, task: str) -> pd.DataFrame | None:
    """One run's per-document scores on the task's headline metric (doc_id -> score), or None."""
    rows = samples[(samples["task"] == task) & samples["score"].notna()]
    for metric in ACCURACY_METRICS:
        chosen = rows[rows["metric"] == metric]
        if not chosen.empty:
            first_filter = chosen["filter"].fillna("").iloc[0]
            chosen = chosen[chosen["filter"].fillna("") == first_filter]
            return chosen.drop_duplicates("doc_id").set_index("doc_id")["score"].astype(float)
    return None


def _interval(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size < ROUNDS // 2:  # the statistic is undefined on too many resamples to report an interval
        return math.nan, math.nan
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def paired_effects(resident: np.ndarray, speculative: np.ndarray, hybrid: np.ndarray | None, seed: int = 0) -> dict:
    """Accuracies, drop, hybrid's gain and recovered share, with paired bootstrap intervals (documents resampled
    together across the runs)."""
    n = len(resident)
    draws = np.random.default_rng(seed).integers(0, n, size=(ROUNDS, n))
    r, s = resident[draws].mean(axis=1), speculative[draws].mean(axis=1)
    out = {"n": n, "resident": resident.mean(), "speculative": speculative.mean(),
           "drop": resident.mean() - speculative.mean(), "drop_ci": _interval(r - s)}
    if hybrid is not None:
        out["hybrid"] = hybrid.mean()
        if out["drop_ci"][0] > 0:  # a loss to recover
            h = hybrid[draws].mean(axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                share = (h - s) / (r - s)
            out.update(recovered=(hybrid.mean() - speculative.mean()) / out["drop"], recovered_ci=_interval(share))
    return out


def accuracy_table(db, model: str | None = None) -> pd.DataFrame:
    """Seed A's table: one row per (model, task) that has a resident and a speculative (quasi) run."""
    runs = db.runs()
    if model is not None:
        runs = runs[runs["model"] == model]
    rows = []
    groups = sorted(runs.groupby(["model", "expert_bits"]), key=lambda group: (group[0][0], -group[0][1]))
    for (name, bits), of_model in groups:  # each precision of a model is a model of its own
        chosen = {"resident": _newest(of_model, "resident", None),
                  "speculative": _newest(of_model, "speculative", SPECULATIVE_PREDICTOR),
                  "hybrid": _newest(of_model, "hybrid", None)}
        samples = {key: db.samples(part["id"].tolist()) for key, part in chosen.items() if not part.empty}
        if "resident" not in samples or "speculative" not in samples:
            continue
        tasks = sorted(set(samples["resident"]["task"]) & set(samples["speculative"]["task"]))
        for task in tasks:
            scored = {}
            for key, table in samples.items():  # per mode: its newest run that scored the task
                for run_id in chosen[key]["id"]:
                    found = _scores(table[table["run_id"] == run_id], task)
                    if found is not None:
                        scored[key] = found
                        break
            if "resident" not in scored or "speculative" not in scored:
                continue
            common = scored["resident"].index.intersection(scored["speculative"].index)
            if "hybrid" in scored:
                common = common.intersection(scored["hybrid"].index)
            if not len(common):
                continue
            effects = paired_effects(scored["resident"][common].to_numpy(), scored["speculative"][common].to_numpy(),
                                     scored["hybrid"][common].to_numpy() if "hybrid" in scored else None)
            rows.append({"model": name, "bits": bits, "task": task, **effects})
    return pd.DataFrame(rows)


def _ci(pair) -> str:
    low, high = pair if isinstance(pair, tuple) else (math.nan, math.nan)
    return "-" if math.isnan(low) else f"[{low:+.3f}, {high:+.3f}]"


def _share(row) -> str:
    if "hybrid" not in row or row["hybrid"] is None or row["hybrid"] != row["hybrid"]:
        return "-"
    value = row.get("recovered")
    return "n/a (no clear drop)" if value is None or value != value else f"{value + 0.0:.0%}"


def _share_ci(pair) -> str:
    low, high = pair if isinstance(pair, tuple) else (math.nan, math.nan)
    return "-" if math.isnan(low) else f"[{low + 0.0:.0%}, {high + 0.0:.0%}]"


def format_accuracy(table: pd.DataFrame) -> str:
    if table.empty:
        return ("accuracy (Speculating Experts): no model has both a resident and a speculative (quasi) run; "
                "run e.g. evalsuite eval --modes resident,speculative,hybrid")
    columns = ["model", "task", Column("n", "d"), Column("resident", ".3f"), Column("speculative", ".3f"),
               Column("hybrid", ".3f"), Column("drop", "+.3f"), "drop 95% CI", Column("hybrid recovers", align=">"),
               "recovered 95% CI"]
    cells = [[r["model"], r["task"], r["n"], r["resident"], r["speculative"], r.get("hybrid"), r["drop"],
              _ci(r["drop_ci"]), _share(r), _share_ci(r.get("recovered_ci"))]
             for r in table.to_dict("records")]
    _with_bits(table, columns, cells)
    return ("accuracy (Speculating Experts): resident / speculative (quasi) / hybrid on the same documents; "
            "hybrid recovers = (hybrid - speculative) / (resident - speculative)\n" + format_table(cells, columns))


def recall_table(db, model: str | None = None) -> pd.DataFrame:
    """Seed B's table: one row per (model, task, predictor) of the predicting runs, the newest run of each
    (model, mode, predictor) for a task: recall@k at every k stored, exact@K, recall_next_token@K (evalsuite's own
    target, beside the papers'), and the predictor's trainable parameters (from its calibration artifact)."""
    runs = db.runs()
    runs = runs[runs["predictor"].notna() & runs["status"].isin(("complete", "incomplete"))]
    if model is not None:
        runs = runs[runs["model"] == model]
    if runs.empty:
        return pd.DataFrame()
    engine = db.engine_metrics(runs["id"].tolist())
    whole = engine[engine["layer"].isna() & engine["recall_at_k"].notna()]
    rows, seen = [], set()
    for run in runs.sort_values("id", ascending=False).itertuples(index=False):
        config = run.config if isinstance(run.config, dict) else {}
        for task, part in whole[whole["run_id"] == run.id].groupby("task", sort=True):
            key = (run.model, run.expert_bits, task, run.mode, run.predictor)
            if key in seen:
                continue
            seen.add(key)
            top_k = part["top_k"].dropna()
            row = {"model": run.model, "bits": run.expert_bits, "task": task, "mode": run.mode,
                   "predictor": run.predictor, "run": run.id,
                   "parameters": config.get("predictor_parameters"),
                   "K": int(top_k.iloc[0]) if len(top_k) else None}
            for r in part.sort_values("k").itertuples(index=False):
                row[f"recall@{int(r.k)}"] = r.recall_at_k
                if row["K"] is not None and r.k == row["K"]:
                    row[f"exact@{row['K']}"] = r.exact_at_k
                    row["next token"] = r.recall_next_token
            rows.append(row)
    table = pd.DataFrame(rows)
    return table.sort_values(["model", "bits", "task", "mode", "predictor"], ascending=[True, False, True, True, True]
                             ).reset_index(drop=True)


def _with_bits(table: pd.DataFrame, columns: list, cells: list) -> None:
    """A `bits` column after the model's, where some run's experts are not 16-bit (docs/quantised-experts.md)."""
    if "bits" in table and (table["bits"] != 16).any():
        columns.insert(1, Column("bits", "d"))
        for row, bits in zip(cells, table["bits"]):
            row.insert(1, bits)


def format_recall(table: pd.DataFrame) -> str:
    if table.empty:
        return ("recall (SpecPrefetch): no predicting run stored; run e.g. evalsuite eval --modes router-preserving "
                "--predictor gate,quasi,adapter,adapter-shared,estimator --plan replay")
    scores = [c for c in table.columns if c.startswith(("recall@", "exact@"))]
    scores.sort(key=lambda c: (c.startswith("exact@"), int(c.split("@")[1])))
    columns = ["model", "task", "mode", "predictor", Column("parameters", ",d"), Column("K", "d")] \
        + [Column(c, ".3f") for c in scores] + [Column("next token", ".3f")]
    cells = [[r.get(c if isinstance(c, str) else c.title) for c in columns] for r in table.to_dict("records")]
    _with_bits(table, columns, cells)
    return ("recall (SpecPrefetch): over decode tokens x anchor layers, within the token; next token: the prediction "
            "of the next token's first sparse layer, evalsuite's own, outside the mean\n" + format_table(cells, columns))
