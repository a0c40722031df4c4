"""The report's PNG plots. Each function returns None when it drew the plot, else a note why it did not."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

MARKERS = "osD^vP*Xh<>"


def pareto_front(tpot, accuracy) -> np.ndarray:
    """Indices of the points no other point beats on both lower TPOT and higher accuracy, by rising TPOT."""
    tpot, accuracy = np.asarray(tpot, float), np.asarray(accuracy, float)
    order = np.lexsort((-accuracy, tpot))
    front, best = [], -math.inf
    for i in order:
        if accuracy[i] > best:
            front.append(i)
            best = accuracy[i]
    return np.array(front, dtype=int)


def _label(value) -> str:
    return "none" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def accuracy_vs_tpot(summary: pd.DataFrame, path: str) -> str | None:
    data = summary.dropna(subset=["accuracy", "tpot_ms"])
    if data.empty:
        return "accuracy vs TPOT: no run has both a task accuracy and a whole-model TPOT"
    models = sorted(data["model"].map(_label).unique())
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    modes = sorted(data["mode"].map(_label).unique())
    predictors = sorted(data["predictor"].map(_label).unique())
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(modes)}
    for ax, model in zip(axes[0], models):
        part = data[data["model"].map(_label) == model]
        for row in part.itertuples(index=False):
            ax.scatter(row.tpot_ms, row.accuracy, color=colors[_label(row.mode)], s=55, zorder=3,
                       marker=MARKERS[predictors.index(_label(row.predictor)) % len(MARKERS)])
            ax.annotate(f"#{row.id}", (row.tpot_ms, row.accuracy), textcoords="offset points", xytext=(5, 4),
                        fontsize=7, color="0.35")
        front = part.iloc[pareto_front(part["tpot_ms"], part["accuracy"])]
        ax.step(front["tpot_ms"], front["accuracy"], where="post", color="0.3", linestyle="--", linewidth=1,
                zorder=2, label="Pareto front")
        ax.scatter(front["tpot_ms"], front["accuracy"], s=190, facecolors="none", edgecolors="black", zorder=4)
        ax.set(title=f"{model}: accuracy vs TPOT", xlabel="TPOT (ms per output token)",
               ylabel="mean task accuracy")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[m], marker="o", linestyle="", label=f"mode {m}") for m in modes]
    handles += [plt.Line2D([], [], color="0.2", marker=MARKERS[i % len(MARKERS)], linestyle="",
                           label=f"predictor {p}") for i, p in enumerate(predictors)]
    handles.append(plt.Line2D([], [], color="0.3", linestyle="--", marker="o", markerfacecolor="none",
                              markersize=10, label="Pareto front"))
    axes[0][-1].legend(handles=handles, fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def recall_heatmap(layers: pd.DataFrame, path: str) -> str | None:
    data = layers.dropna(subset=["recall_at_k"])
    if data.empty:
        return "recall@K per layer: no per-layer recall stored"
    data = data.assign(k=data["k"].map(lambda k: "?" if pd.isna(k) else str(int(k))),
                       row=data["predictor"].map(_label) + (" / " + data["model"].map(_label)
                                                            if data["model"].nunique() > 1 else ""))
    ks = sorted(data["k"].unique(), key=lambda k: (k == "?", int(k) if k != "?" else 0))
    fig, axes = plt.subplots(1, len(ks), figsize=(max(5.0, 0.55 * data["layer"].nunique() + 3) * len(ks),
                                                   1.2 + 0.5 * data["row"].nunique()), squeeze=False)
    for ax, k in zip(axes[0], ks):
        table = data[data["k"] == k].pivot_table(index="row", columns="layer", values="recall_at_k", aggfunc="mean")
        image = ax.imshow(table.to_numpy(float), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(table.shape[1]), [str(int(c)) for c in table.columns])
        ax.set_yticks(range(table.shape[0]), table.index)
        ax.set(title=f"recall@{k} per layer (mean over runs and tasks)", xlabel="layer")
        if table.size <= 400:
            for (i, j), value in np.ndenumerate(table.to_numpy(float)):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if value < 0.6 else "black")
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _capacity_number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # '512MiB', 'all': no position on a numeric axis


def hit_rate_vs_capacity(summary: pd.DataFrame, path: str) -> str | None:
    data = summary.assign(capacity=summary["cache_capacity"].map(_capacity_number)).dropna(
        subset=["hit_rate", "capacity"])
    if data.empty:
        return "hit rate vs cache capacity: no run has a whole-model hit rate and a numeric cache capacity"
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    keys = ["model", "mode", "predictor", "cache_policy"]
    labelled = data.assign(**{k: data[k].map(_label) for k in keys})
    for i, (key, group) in enumerate(labelled.groupby(keys, sort=True)):
        line = group.groupby("capacity")["hit_rate"].mean()
        ax.plot(line.index, line.to_numpy(), marker=MARKERS[i % len(MARKERS)], label=" / ".join(key))
    ax.set(title="cache hit rate vs capacity", xlabel="cache capacity (experts, or share of all experts if < 1)",
           ylabel="hit rate", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(title="model / mode / predictor / policy", fontsize=7, title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
