"""Accuracy as a function of recall: how much of a model's accuracy speculative execution keeps as the predictor's
recall@K falls.

Runs read, per model and task: the newest `resident` run (the reference), speculative runs of controlled-recall
predictors (`recall-R[-near][-early|-middle|-late]`, evalsuite.predict.controlled), and speculative runs of real
predictors and `hybrid` runs, which are placed at their measured recall@K (the whole-model engine metric at
K = the router's top-k, `compare.headline_k`; where a run stored none, the mean of its samples' own recall@K).
Every run is paired with the resident run on documents (doc_id), on the resident's main metric.

- Points: each run's accuracy, the paired 95 % bootstrap CI of its difference from resident
  (`compare.bootstrap_ci`) and the paired test (exact McNemar for 0/1 scores, `compare`'s rule).
- Trend: whether accuracy rises with recall is one question about the whole curve, not seven questions about its
  points: testing each level against resident asks many underpowered questions and reads noise at neighbouring
  levels as wiggles. Page's L test (scipy.stats.page_trend_test, documents as blocks, levels ordered by recall,
  asymptotic because 0/1 scores tie) tests the ordered alternative once, paired on documents. Documents scored
  the same at every level are left out, as McNemar leaves out concordant pairs: under no trend they add exactly
  the expected L. scipy's normal approximation assumes untied ranks, so with 0/1 scores its p is conservative;
  `p_ties` is the same approximation with each document's variance from its own tied ranks (the permutation
  variance), the one to read. Spearman's rho of (recall, accuracy) over the levels is for reading only.
  At recall 1.0 every error model and layer range is the same predictor, so a series without its own
  recall-1.0 run borrows the plain `recall-1.0` one.
- Recall needed: for uniform errors over all layers, the lowest controlled level from which every higher tested
  level stays within 1 (and 5) points of resident; its 95 % interval resamples documents (one resample for all
  levels and the resident, seeded) and takes the needed level in each resample.
- Where misses hurt: at each level with early/middle/late runs, the drop from resident of each layer range.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np
import pandas as pd
from scipy.stats import norm, page_trend_test, spearmanr

from ..predict.controlled import ERRORS as ERROR_MODELS, RANGES as LAYER_RANGES, parse_recall_name
from ..table import Column, format_table
from . import plots
from .comparable import differences
from .compare import ALPHA, BOOTSTRAP_ROUNDS, paired_test, bootstrap_ci, whole_model_rows
from .report import main_metrics

MODES = ("resident", "speculative", "hybrid")
TOLERANCES = (0.01, 0.05)  # 1 and 5 points of accuracy

# ---- gathering ---------------------------------------------------------------------------------------------------
def _chosen_runs(db, runs, model) -> pd.DataFrame:
    table = db.runs()
    if runs:
        try:
            wanted = {int(r) for r in runs}
        except (TypeError, ValueError):
            raise ValueError(f"run ids are numbers, not {runs!r}; `evalsuite runs` lists them") from None
        missing = wanted - set(table["id"])
        if missing:
            raise ValueError(f"no run with id {', '.join(map(str, sorted(missing)))} in {db.url}; `evalsuite runs` "
                             "lists them")
        table = table[table["id"].isin(wanted)]
    else:
        table = table[table["status"].isin(("complete", "incomplete"))]
    if model is not None:
        table = table[table["model"] == model]
    return table[table["mode"].isin(MODES)]  # newest first


def _kind(mode, predictor) -> tuple[str, float, str | None, str | None]:
    """(kind, level, errors, layers) of a run: resident, controlled (with its parsed name) or predictor."""
    if mode == "resident":
        return "resident", math.nan, None, None
    parsed = parse_recall_name(predictor) if mode == "speculative" else None
    if parsed is None:
        return "predictor", math.nan, None, None
    return ("controlled", *parsed)


def _measured_recall(engine: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Per (run_id, task): recall@K, K and where it came from ('engine': the whole-model engine row at the headline
    K; 'samples': the mean of the documents' own recall@K, for runs that stored no whole-model row)."""
    engine = engine.dropna(subset=["recall_at_k"])
    whole = whole_model_rows(engine, ["run_id", "task"]) if not engine.empty else engine
    found = whole.groupby(["run_id", "task"]).agg(recall=("recall_at_k", "mean"), k=("k", "first"))
    found["recall_basis"] = "engine"
    own = samples.dropna(subset=["recall_at_k"]).drop_duplicates(["run_id", "task", "doc_id"])
    own = own.groupby(["run_id", "task"]).agg(recall=("recall_at_k", "mean"), k=("k", "first"))
    own["recall_basis"] = "samples"
    return pd.concat([found, own[~own.index.isin(found.index)]])


def _headline(samples: pd.DataFrame) -> tuple[str, str] | None:
    """(metric, filter) of one run's samples of one task: the report's main metric, filter 'none' first."""
    scored = samples.dropna(subset=["score"])
    if scored.empty:
        return None
    candidates = scored.assign(value=1.0, filter=scored["filter"].fillna("none"))
    best = main_metrics(candidates[["run_id", "task", "metric", "filter", "value"]]).iloc[0]
    return best["metric"], best["filter"]


def _scores_of(samples: pd.DataFrame, metric: str, filter_name: str) -> pd.Series:
    rows = samples[(samples["metric"] == metric) & (samples["filter"].fillna("none") == filter_name)]
    return rows.dropna(subset=["score"]).drop_duplicates("doc_id").set_index("doc_id")["score"].astype(float)


def document_scores(db, runs: list | None = None, model: str | None = None) -> pd.DataFrame:
    """One row per (run, document) of the runs the curve uses: model, task, metric, filter, run_id, mode,
    predictor, kind ('resident', 'controlled', 'predictor'), level / errors / layers (controlled runs),
    recall, k, recall_basis, doc_id, score. Per model, task, mode and predictor the newest run that scored the
    task is used (of `runs` when given, else of complete and incomplete runs); attrs['notes'] says what was
    left out and why."""
    chosen = _chosen_runs(db, runs, model)
    ids = chosen["id"].tolist()
    samples, engine = db.samples(ids), db.engine_metrics(ids)
    recall = _measured_recall(engine, samples)
    by_id = {row["id"]: row for row in chosen.to_dict("records")}
    frames, notes = [], []
    present = samples[["run_id", "task"]].drop_duplicates()
    present = present.assign(model=present["run_id"].map(lambda r: by_id[r]["model"]))
    for (model_name, task), part in present.groupby(["model", "task"], sort=True):
        run_ids = sorted(part["run_id"], reverse=True)  # newest first
        residents = [r for r in run_ids if by_id[r]["mode"] == "resident"]
        if not residents:
            notes.append(f"{model_name} {task}: no resident run, nothing to pair with: left out")
            continue
        resident = by_id[residents[0]]
        of_task = samples[samples["task"] == task]
        headline = _headline(of_task[of_task["run_id"] == resident["id"]])
        if headline is None:
            notes.append(f"{model_name} {task}: resident run {resident['id']} stored no scores: left out")
            continue
        seen = set()
        for run_id in run_ids:
            run = by_id[run_id]
            key = (run["mode"], plots._label(run["predictor"]))
            if key in seen or (run["mode"] == "resident" and run_id != resident["id"]):  # older ones
                continue
            differ, _ = differences(resident, run, [task]) if run_id != resident["id"] else ([], [])
            if differ:
                notes.append(f"{model_name} {task}: run {run_id} ({run['predictor']}) differs from resident run "
                             f"{resident['id']} in {'; '.join(differ)}: left out")
                continue
            scores = _scores_of(of_task[of_task["run_id"] == run_id], *headline)
            if scores.empty:
                continue
            seen.add(key)
            kind, level, errors, layers = _kind(run["mode"], run["predictor"])
            measured = recall.loc[(run_id, task)] if (run_id, task) in recall.index else None
            frames.append(pd.DataFrame({
                "model": model_name, "task": task, "metric": headline[0], "filter": headline[1], "run_id": run_id,
                "mode": run["mode"], "predictor": run["predictor"], "kind": kind, "level": level, "errors": errors,
                "layers": layers, "recall": math.nan if measured is None else measured["recall"],
                "k": math.nan if measured is None else measured["k"],
                "recall_basis": None if measured is None else measured["recall_basis"],
                "doc_id": scores.index, "score": scores.to_numpy()}))
    columns = ["model", "task", "metric", "filter", "run_id", "mode", "predictor", "kind", "level", "errors",
               "layers", "recall", "k", "recall_basis", "doc_id", "score"]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    table.attrs["notes"] = notes
    return table


def _resident(group: pd.DataFrame) -> pd.Series:
    rows = group[group["kind"] == "resident"]
    return rows.set_index("doc_id")["score"]


def _run_labels(group: pd.DataFrame) -> pd.DataFrame:
    return group.drop(columns=["doc_id", "score"]).drop_duplicates("run_id").set_index("run_id")


def recall_points(scores: pd.DataFrame) -> pd.DataFrame:
    """One row per non-resident run: its labels, recall@K, the documents it shares with resident (n), resident's
    and its accuracy on them, delta = run - resident with its paired 95 % bootstrap CI, the paired test and p, and
    the resident run, its accuracy over all its documents (`resident_overall`) and their number (`resident_n`)."""
    rows = []
    for (model, task), group in scores.groupby(["model", "task"], sort=True):
        resident = _resident(group)
        labels = _run_labels(group)
        resident_id = labels.index[labels["kind"] == "resident"][0]
        for run_id, label in labels[labels["kind"] != "resident"].iterrows():
            run = group[group["run_id"] == run_id].set_index("doc_id")["score"]
            common = resident.index.intersection(run.index)
            if len(common) == 0:
                continue
            a, b = resident[common].to_numpy(float), run[common].to_numpy(float)
            test, p, _, _ = paired_test(a, b)
            low, high = bootstrap_ci(a, b)
            rows.append({**label.to_dict(), "run_id": run_id, "n": len(common), "resident": a.mean(),
                         "accuracy": b.mean(), "delta": b.mean() - a.mean(), "ci_low": low, "ci_high": high,
                         "test": test, "p_value": p, "resident_run": resident_id,
                         "resident_overall": resident.mean(), "resident_n": len(resident)})
    columns = ["model", "task", "metric", "filter", "run_id", "mode", "predictor", "kind", "level", "errors",
               "layers", "recall", "k", "recall_basis", "n", "resident", "accuracy", "delta", "ci_low", "ci_high",
               "test", "p_value", "resident_run", "resident_overall", "resident_n"]
    table = pd.DataFrame(rows, columns=columns)
    order = {"errors": ERROR_MODELS, "layers": LAYER_RANGES}  # uniform before near, all layers before a third
    table = table.sort_values(["model", "task", "kind", "errors", "layers", "level", "recall"], ignore_index=True,
                              ascending=[True, True, True, True, True, False, False], na_position="last",
                              key=lambda c: c.map(lambda v: order[c.name].index(v) if v in order[c.name] else -1)
                              if c.name in order else c)
    table.attrs["notes"] = scores.attrs.get("notes", [])
    return table


# ---- controlled series -------------------------------------------------------------------------------------------
def _series(group: pd.DataFrame) -> dict[tuple[str, str], dict[float, int]]:
    """Per (errors, layers) of one model and task: {level: run_id}; a series without recall 1.0 borrows the run
    of any series that has it (uniform over all layers first): with no errors they are one predictor."""
    labels = _run_labels(group)
    labels = labels[labels["kind"] == "controlled"]
    series: dict[tuple[str, str], dict[float, int]] = {}
    for run_id, row in labels.iterrows():
        series.setdefault((row["errors"], row["layers"]), {})[float(row["level"])] = run_id
    perfect = [s[1.0] for key, s in sorted(series.items(), key=lambda kv: kv[0] != ("uniform", "all")) if 1.0 in s]
    if perfect:
        for levels in series.values():
            levels.setdefault(1.0, perfect[0])
    return series


def _matrix(group: pd.DataFrame, run_ids: list[int]) -> pd.DataFrame:
    """Documents x runs (in the given order) over the documents every one of the runs scored."""
    wide = group[group["run_id"].isin(run_ids)].pivot_table(index="doc_id", columns="run_id", values="score")
    return wide.reindex(columns=run_ids).dropna()


def _page_with_ties(ranks: np.ndarray) -> float:
    """One-sided p of Page's L (the columns' predicted order rising) with each block's variance from its own
    (tied) ranks: Var = S_c * S_r / (n - 1), the variance of a linear rank statistic under permutation."""
    n = ranks.shape[1]
    weights = np.arange(1, n + 1, dtype=float)
    centred = ranks - ranks.mean(axis=1, keepdims=True)
    variance = ((weights - weights.mean()) ** 2).sum() * (centred ** 2).sum() / (n - 1)
    if variance == 0:
        return 1.0
    return float(norm.sf((centred * weights).sum() / math.sqrt(variance)))


def trend_tests(scores: pd.DataFrame) -> pd.DataFrame:
    """Per (model, task, errors, layers) with controlled runs: the levels tested, the documents all of them scored
    (n) and those whose score changes across levels (changing), Page's L over the changing documents with scipy's
    asymptotic p and `p_ties` (tie-aware variance, see the module's docstring), and Spearman's rho of (level,
    accuracy). Fewer than 3 levels: no test (Page's L needs 3)."""
    rows = []
    for (model, task), group in scores.groupby(["model", "task"], sort=True):
        for (errors, layers), series in sorted(_series(group).items(),
                                               key=lambda kv: (ERROR_MODELS.index(kv[0][0]),
                                                               LAYER_RANGES.index(kv[0][1]))):
            levels = sorted(series)
            matrix = _matrix(group, [series[level] for level in levels]).to_numpy(float)
            row = {"model": model, "task": task, "errors": errors, "layers": layers, "levels": len(levels),
                   "lowest": levels[0], "n": len(matrix), "changing": math.nan, "L": math.nan, "p": math.nan,
                   "p_ties": math.nan, "rho": math.nan, "accuracies": dict(zip(levels, matrix.mean(axis=0)))}
            if len(levels) >= 3 and len(matrix) >= 2:
                changing = matrix[np.ptp(matrix, axis=1) > 0]
                row["changing"] = len(changing)
                if len(changing) == 0:
                    row.update(p=1.0, p_ties=1.0)
                else:
                    used = changing if len(changing) >= 2 else matrix  # scipy needs 2 blocks
                    result = page_trend_test(used, method="asymptotic")
                    ranks = pd.DataFrame(changing).rank(axis=1).to_numpy()
                    row.update(L=float(result.statistic), p=float(result.pvalue), p_ties=_page_with_ties(ranks))
                accuracies = matrix.mean(axis=0)
                if np.ptp(accuracies) > 0:
                    row["rho"] = float(spearmanr(levels, accuracies).statistic)
            rows.append(row)
    return pd.DataFrame(rows, columns=["model", "task", "errors", "layers", "levels", "lowest", "n", "changing", "L",
                                       "p", "p_ties", "rho", "accuracies"])


# ---- recall needed -----------------------------------------------------------------------------------------------
def _needed_levels(deltas: np.ndarray, levels: np.ndarray, tolerance: float) -> np.ndarray:
    """Per row of deltas (level - resident, levels rising): the lowest level from which every higher level is
    within tolerance; inf where even the highest is not."""
    within = deltas >= -tolerance - 1e-12
    from_here = np.logical_and.accumulate(within[..., ::-1], axis=-1)[..., ::-1]
    count = from_here.sum(axis=-1)  # the suffix of levels all within tolerance
    index = np.clip(len(levels) - count, 0, len(levels) - 1)
    return np.where(count > 0, levels[index], np.inf)


def _resampled_means(matrix: np.ndarray, rounds: int, seed: int) -> np.ndarray:
    """Column means of `rounds` resamples of the rows (documents), the same rows for every column; drawn in chunks
    so that a task of many documents does not hold rounds x documents x columns at once."""
    rng = np.random.default_rng(seed)
    chunk = max(1, 4_000_000 // matrix.size)
    return np.concatenate([matrix[rng.integers(0, len(matrix), size=(min(chunk, rounds - start), len(matrix)))]
                           .mean(axis=1) for start in range(0, rounds, chunk)])


def recall_needed(scores: pd.DataFrame, tolerances=TOLERANCES, rounds: int = BOOTSTRAP_ROUNDS,
                  seed: int = 0) -> pd.DataFrame:
    """Per (model, task) with controlled runs of uniform errors over all layers: for each tolerance t (a fraction,
    0.01 = 1 point), `needed_<pts>` the lowest tested level from which every higher level's accuracy is within t
    of resident (missing, None or NaN: not even the highest tested level is), and its 95 % interval
    `low_<pts>`/`high_<pts>` (missing: above the highest tested level), resampling documents together across levels and resident (seeded).
    `lowest`/`highest`: the levels tested; a needed level equal to `lowest` reads '<= lowest'."""
    rows = []
    for (model, task), group in scores.groupby(["model", "task"], sort=True):
        series = _series(group).get(("uniform", "all"))
        if not series:
            continue
        levels = np.array(sorted(series))
        resident_id = int(group.loc[group["kind"] == "resident", "run_id"].iloc[0])
        matrix = _matrix(group, [resident_id] + [series[level] for level in levels]).to_numpy(float)
        if len(matrix) == 0:
            continue
        means = matrix.mean(axis=0)
        resampled = _resampled_means(matrix, rounds, seed)  # rounds x (resident, levels...)
        row = {"model": model, "task": task, "n": len(matrix), "lowest": levels[0], "highest": levels[-1],
               "resident": means[0]}
        for tolerance in tolerances:
            points = f"{tolerance * 100:g}"
            point = _needed_levels(means[1:] - means[0], levels, tolerance)
            spread = _needed_levels(resampled[:, 1:] - resampled[:, :1], levels, tolerance)
            low, high = np.quantile(spread, [0.025, 0.975], method="inverted_cdf")
            row.update({f"needed_{points}": _finite(point), f"low_{points}": _finite(low),
                        f"high_{points}": _finite(high)})
        rows.append(row)
    return pd.DataFrame(rows)


def _finite(value) -> float | None:
    return None if math.isinf(float(value)) else float(value)


# ---- where misses hurt -------------------------------------------------------------------------------------------
def where_misses_hurt(points: pd.DataFrame) -> pd.DataFrame:
    """Per (model, task, error model, level) with a run confined to early, middle or late layers: each layer
    range's drop from resident (resident - run, so a loss is positive) with its 95 % CI and p; the run over all
    layers at that level is listed first where there is one."""
    controlled = points[points["kind"] == "controlled"]
    confined = controlled[controlled["layers"] != "all"][["model", "task", "errors", "level"]].drop_duplicates()
    chosen = controlled.merge(confined, on=["model", "task", "errors", "level"])
    chosen = chosen.assign(order=chosen["layers"].map(LAYER_RANGES.index),
                           drop=-chosen["delta"], drop_low=-chosen["ci_high"], drop_high=-chosen["ci_low"])
    chosen = chosen.sort_values(["model", "task", "errors", "level", "order"], ascending=[True, True, True, False,
                                                                                          True])
    return chosen[["model", "task", "errors", "level", "layers", "run_id", "recall", "n", "accuracy", "drop",
                   "drop_low", "drop_high", "test", "p_value"]].reset_index(drop=True)


# ---- plots -------------------------------------------------------------------------------------------------------
CURVES = {("uniform", "all"): ("C0", "o", "controlled, uniform misses"),
          ("near", "all"): ("C1", "s", "controlled, near misses (next-ranked experts)")}
REAL = {"speculative": ("C3", "D", "speculative, real predictor"), "hybrid": ("C2", "*", "hybrid")}


def _x(points: pd.DataFrame) -> pd.Series:
    """Where a point sits on the recall axis: its measured recall@K, else (controlled runs) its nominal level."""
    return points["recall"].fillna(points["level"])


def _y(points: pd.DataFrame) -> pd.Series:
    """Where a point sits on the accuracy axis: the resident's accuracy plus the run's paired difference, which is
    the run's accuracy when it scored the resident's documents, and what it would be on them when it scored fewer."""
    return points["resident_overall"] + points["delta"]


def _label_of(row) -> str:
    if row["mode"] == "hybrid":
        return "hybrid" if row["predictor"] in ("hybrid", None) else f"hybrid:{row['predictor']}"
    return plots._label(row["predictor"])


def recall_curve_figure(points: pd.DataFrame, model: str):
    """One panel per task of `model`; returns the figure, or a note why there is nothing to draw."""
    data = points[points["model"] == model].assign(x=lambda t: _x(t), y=lambda t: _y(t))
    data = data[data["x"].notna()]
    if data.empty:
        return f"{model}: no run with a measured recall@K (or a controlled level) to draw"
    tasks = sorted(data["task"].unique())
    columns = 2 if len(tasks) in (2, 4) else min(3, len(tasks))
    rows = math.ceil(len(tasks) / columns)
    fig, axes = _subplots(rows, columns)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    ks = sorted({int(k) for k in data["k"].dropna()})
    handles = {}
    for ax, task in zip(axes.flat, tasks):
        part = data[data["task"] == task]
        resident = part["resident_overall"].iloc[0]
        handles["resident"] = ax.axhline(resident, color="0.2", linestyle="--", linewidth=1, label="resident")
        handles["band"] = ax.axhspan(resident - TOLERANCES[0], resident + TOLERANCES[0], color="0.5", alpha=0.15,
                                     linewidth=0, label="resident ± 1 point")
        for key, (color, marker, name) in CURVES.items():
            curve = part[(part["kind"] == "controlled") & (part["errors"] == key[0]) & (part["layers"] == key[1])]
            if curve.empty:
                continue
            curve = curve.sort_values("x")
            below = (curve["delta"] - curve["ci_low"]).clip(lower=0).fillna(0)
            above = (curve["ci_high"] - curve["delta"]).clip(lower=0).fillna(0)
            nominal = " (some at nominal R: no recall stored)" if curve["recall"].isna().any() else ""
            handles[key] = ax.errorbar(curve["x"], curve["y"], yerr=[below, above], color=color,
                                       marker=marker, markersize=5, capsize=3, linewidth=1.4, zorder=3,
                                       label=name + nominal)
        real = part[part["kind"] == "predictor"]
        for mode, (color, marker, name) in REAL.items():
            chosen = real[real["mode"] == mode]
            if not chosen.empty:
                handles[mode] = ax.scatter(chosen["x"], chosen["y"], color=color, marker=marker,
                                           s=70 if marker == "*" else 40, zorder=4, edgecolors="black",
                                           linewidths=0.5, label=name + " (labelled)")
        if (part["n"] < part["resident_n"]).any():
            ax.text(0.01, 0.01, "runs on fewer documents: resident + their paired difference", fontsize=7,
                    color="0.4", transform=ax.transAxes, va="bottom")
        ax.set_title(f"{task}\n{part['metric'].iloc[0]}, {int(part['resident_n'].iloc[0])} documents, resident run "
                     f"{int(part['resident_run'].iloc[0])}", fontsize=9)
        ax.set(xlabel=f"measured recall@{'/'.join(map(str, ks)) or 'K'} (K: the router's top-k)",
               ylabel="accuracy (share of documents)")
        ax.margins(x=0.08, y=0.15)
        ax.grid(alpha=0.3)
    fig.legend(handles=list(handles.values()), fontsize=8, loc="outside right center",
               title="error bars: paired 95% CI\nof the difference from resident", title_fontsize=8)
    plots._title(fig, f"{model}: accuracy vs recall@K")
    plots._freeze_layout(fig)
    for ax, task in zip(axes.flat, tasks):
        real = data[(data["task"] == task) & (data["kind"] == "predictor")]
        if not real.empty:
            plots.place_labels(ax, real["x"], real["y"], [_label_of(r) for _, r in real.iterrows()])
    return fig


def _subplots(rows: int, columns: int):
    return plots.plt.subplots(rows, columns, figsize=(4.8 * columns + 3.2, 3.9 * rows + 0.6), squeeze=False,
                              layout="constrained", dpi=plots.DPI)


def plot_recall_curves(points: pd.DataFrame, out_dir: str) -> list[str]:
    """One PNG per model (recall_curve_<model>.png in out_dir); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for model in sorted(points["model"].unique()):
        path = os.path.join(out_dir, f"recall_curve_{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}.png")
        if plots._save(recall_curve_figure(points, model), path) is None:
            written.append(path)
    return written


# ---- text --------------------------------------------------------------------------------------------------------
def _ci(low, high, scale: float = 100) -> str | None:
    return None if pd.isna(low) else f"[{low * scale + 0.0:+.1f}, {high * scale + 0.0:+.1f}]"


def _level_text(value, lowest, highest) -> str:
    if value is None or pd.isna(value):
        return f"> {highest:g}"
    return f"<= {value:g}" if value == lowest else f"{value:g}"


def _points_table(part: pd.DataFrame) -> str:
    columns = [Column("run", "d"), Column("predictor", max_width=24), "mode", Column("R", "g"), "errors", "layers",
               Column("recall@K", ".3f"), Column("n", "d"), Column("accuracy", ".3f"), Column("delta pts", "+.1f"),
               "95% CI pts", Column("p", ".3g")]
    cells = [[r.run_id, r.predictor, r.mode, r.level, r.errors, r.layers, r.recall, r.n, r.accuracy, r.delta * 100 + 0.0,
              _ci(r.ci_low, r.ci_high), r.p_value] for r in part.itertuples(index=False)]
    return format_table(cells, columns, indent="  ")


def _trend_line(row) -> str:
    what = f"trend ({row.errors} misses, {row.layers} layers; {row.levels} levels from {row.lowest:g})"
    if pd.isna(row.p):
        return f"  {what}: no test (Page's L needs 3 or more levels and 2 documents)"
    rho = "-" if pd.isna(row.rho) else f"{row.rho:+.2f}"
    if pd.isna(row.L):
        return f"  {what}: no document changes across the levels (of {row.n}): no trend, p = 1; Spearman rho {rho}"
    verdict = "accuracy rises with recall" if row.p_ties < ALPHA else "no significant trend"
    return (f"  {what}: Page's L = {row.L:.1f} over the {int(row.changing)} of {row.n} documents that change, "
            f"p = {row.p_ties:.3g} (ties counted; scipy's untied p = {row.p:.3g}): {verdict}; "
            f"Spearman rho (level, accuracy) = {rho}")


def format_recall_report(points: pd.DataFrame, trends: pd.DataFrame, needed: pd.DataFrame,
                         hurt: pd.DataFrame, paths=()) -> str:
    """The text the CLI prints: per model and task the points and trend lines, then the recall-needed and
    where-misses-hurt tables, the notes and the PNGs written."""
    if points.empty:
        lines = ["accuracy vs recall: no model has a resident run and a speculative or hybrid run on the same task; "
                 "run e.g. evalsuite eval --modes resident,speculative with predictors recall-1.0,...,recall-0.5"]
        return "\n".join(lines + [f"note: {n}" for n in points.attrs.get("notes", [])])
    lines = ["accuracy vs recall@K: each run paired with the resident run on documents; delta = run - resident in "
             "points, 95% CI: paired percentile bootstrap; p: the paired test (exact McNemar for 0/1 scores)"]
    for (model, task), part in points.groupby(["model", "task"], sort=True):
        first = part.iloc[0]
        lines.append(f"\n{model} / {task} ({first.metric}, filter {first['filter']}): resident run "
                     f"{int(first.resident_run)}, accuracy {first.resident_overall:.3f}")
        lines.append(_points_table(part))
        for row in trends[(trends["model"] == model) & (trends["task"] == task)].itertuples(index=False):
            if row.layers == "all" or not pd.isna(row.p):  # a third of the layers is usually tested at one level
                lines.append(_trend_line(row))
    if not needed.empty:
        lines.append("\nrecall needed (uniform misses over all layers): the lowest tested level from which every "
                     "higher level stays within 1 / 5 points of resident; 95% interval: documents resampled")
        columns = ["model", "task", Column("n", "d"), Column("resident", ".3f"), Column("1 pt", align=">"),
                   Column("1 pt 95% interval", align=">"), Column("5 pts", align=">"),
                   Column("5 pts 95% interval", align=">")]
        cells = []
        for r in needed.to_dict("records"):
            bounds = (r["lowest"], r["highest"])
            cells.append([r["model"], r["task"], r["n"], r["resident"]] + [
                text for points_ in ("1", "5") for text in (
                    _level_text(r[f"needed_{points_}"], *bounds),
                    f"[{_level_text(r[f'low_{points_}'], *bounds)}, {_level_text(r[f'high_{points_}'], *bounds)}]")])
        lines.append(format_table(cells, columns))
    if not hurt.empty:
        lines.append("\nwhere misses hurt: misses confined to a third of the layers (recall R there, 1.0 elsewhere); "
                     "drop = resident - run in points")
        columns = ["model", "task", "errors", Column("R", "g"), "layers", Column("run", "d"), Column("recall@K", ".3f"),
                   Column("n", "d"), Column("accuracy", ".3f"), Column("drop pts", "+.1f"), "95% CI pts",
                   Column("p", ".3g")]
        cells = [[r.model, r.task, r.errors, r.level, r.layers, r.run_id, r.recall, r.n, r.accuracy, r.drop * 100 + 0.0,
                  _ci(r.drop_low, r.drop_high), r.p_value] for r in hurt.itertuples(index=False)]
        lines.append(format_table(cells, columns))
    lines += [f"note: {n}" for n in points.attrs.get("notes", [])]
    lines += [f"wrote {path}" for path in paths]
    return "\n".join(lines)


def recall_curve_report(db, runs: list[str] | None = None, model: str | None = None,
                        out_dir: str | None = None) -> str:
    """Everything above for the chosen runs (all complete/incomplete runs by default; one model with `model`);
    PNGs to out_dir when given. Returns the text to print."""
    scores = document_scores(db, runs, model)
    points = recall_points(scores)
    paths = plot_recall_curves(points, out_dir) if out_dir and not points.empty else []
    return format_recall_report(points, trend_tests(scores), recall_needed(scores), where_misses_hurt(points), paths)
