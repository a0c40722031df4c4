"""The report's PNG plots. Each public function returns None when it drew the plot, else a note why it did not;
the *_figure functions return the figure (or the note) for callers that want to look at it before saving.

Every plot keeps its legend outside the data, gives each axis one unit, says in its title what was averaged,
and writes run labels where they overlap no other label and no point.
"""
from __future__ import annotations

import math
import re
import textwrap

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

MARKERS = "osD^vP*Xh<>"
DPI = 110
ACCURACY = "accuracy: mean over the run's tasks of each task's main metric"
TPOT = "TPOT: median over requests, mean over the run's tasks"


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


def _save(figure, path: str) -> str | None:
    if isinstance(figure, str):
        return figure
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return None


def _title(fig, text: str) -> None:
    """A figure title wrapped to the figure's width (about 7 pt per character at 9 pt)."""
    fig.suptitle(textwrap.fill(text, width=int(fig.get_figwidth() * 72 / 5.2)), fontsize=9)


def _freeze_layout(fig) -> None:
    """Lay the figure out now and keep it: labels are placed in pixels of this layout."""
    fig.canvas.draw()
    fig.set_layout_engine("none")


# ---- run labels that overlap nothing ---------------------------------------------------------------------------
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1.4), (0, -1.4), (1.4, 0), (-1.4, 0))


def _clusters(pixels: np.ndarray, radius: float) -> list[list[int]]:
    """Indices of points within `radius` pixels of a cluster's first point, greedily: one label per cluster."""
    clusters, seen = [], np.zeros(len(pixels), bool)
    for i in range(len(pixels)):
        if not seen[i]:
            near = np.flatnonzero(~seen & (np.hypot(*(pixels - pixels[i]).T) <= radius))
            seen[near] = True
            clusters.append(near.tolist())
    return clusters


def place_labels(ax, xs, ys, names, fontsize: float = 7) -> list:
    """Annotate points with their names (near-coincident points share one label), each label where it overlaps
    no label placed before, no point and stays inside the axes; returns the annotations."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    pixels = ax.transData.transform(np.c_[np.asarray(xs, float), np.asarray(ys, float)])
    frame = ax.get_window_extent(renderer)
    taken = [Bbox.from_extents(x - 6, y - 6, x + 6, y + 6) for x, y in pixels]  # the markers
    placed = []
    for members in _clusters(pixels, radius=8):
        text = ",".join(names[i] for i in sorted(members, key=lambda i: (len(names[i]), names[i])))
        x, y = np.asarray(xs, float)[members[0]], np.asarray(ys, float)[members[0]]
        label = None
        for step in (7, 14, 24, 36, 50):
            for dx, dy in _DIRECTIONS:
                label = ax.annotate(text, (x, y), xytext=(dx * step, dy * step), textcoords="offset points",
                                    ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                    va="bottom" if dy > 0 else "top" if dy < 0 else "center", fontsize=fontsize,
                                    color="0.25", arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6,
                                                                  shrinkA=0, shrinkB=4))
                label.update_positions(renderer)
                box = Text.get_window_extent(label, renderer).padded(1)  # the text, without its leader line
                if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) and \
                        not any(box.overlaps(other) for other in taken):
                    taken.append(box)
                    break
                label.remove()
                label = None
            if label is not None:
                break
        if label is not None:
            placed.append(label)
    return placed


# ---- accuracy vs TPOT --------------------------------------------------------------------------------------------
def accuracy_vs_tpot_figure(summary: pd.DataFrame):
    data = summary.dropna(subset=["accuracy", "tpot_ms"])
    if data.empty:
        return "accuracy vs TPOT: no run has both a task accuracy and a whole-model TPOT"
    data = data.assign(panel=_panels(data))
    models = sorted(data["panel"].unique())
    modes = sorted(data["mode"].map(_label).unique())
    predictors = sorted(data["predictor"].map(_label).unique())
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(modes)}
    columns = min(3, len(models))
    rows = math.ceil(len(models) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns + 2.2, 4.4 * rows + 0.6), squeeze=False,
                             layout="constrained", dpi=DPI)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        part = data[data["panel"] == model]
        for row in part.itertuples(index=False):
            ax.scatter(row.tpot_ms, row.accuracy, color=colors[_label(row.mode)], s=45, zorder=3,
                       marker=MARKERS[predictors.index(_label(row.predictor)) % len(MARKERS)])
        front = part.iloc[pareto_front(part["tpot_ms"], part["accuracy"])]
        ax.step(front["tpot_ms"], front["accuracy"], where="post", color="0.3", linestyle="--", linewidth=1,
                zorder=2)
        ax.scatter(front["tpot_ms"], front["accuracy"], s=170, facecolors="none", edgecolors="black", zorder=4)
        ax.set(title=model, xlabel="TPOT (ms per output token)", ylabel="accuracy (main metric, mean over tasks)")
        ax.margins(0.12)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[m], marker="o", linestyle="", label=f"mode {m}") for m in modes]
    handles += [plt.Line2D([], [], color="0.2", marker=MARKERS[i % len(MARKERS)], linestyle="",
                           label=f"predictor {p}") for i, p in enumerate(predictors)]
    handles.append(plt.Line2D([], [], color="0.3", linestyle="--", marker="o", markerfacecolor="none",
                              markeredgecolor="black", markersize=10, label="Pareto front"))
    fig.legend(handles=handles, fontsize=8, loc="outside right center", title="#N: run id", title_fontsize=8)
    _title(fig, f"Accuracy vs TPOT, one point per run ({ACCURACY}; {TPOT})")
    _freeze_layout(fig)
    for ax, model in zip(axes.flat, models):
        part = data[data["panel"] == model]
        place_labels(ax, part["tpot_ms"], part["accuracy"], [f"#{i}" for i in part["id"]])
    return fig


def _panels(data: pd.DataFrame) -> pd.Series:
    """One panel per model, task set and limit (as the report's Pareto fronts): its title names the three."""
    panel = data["model"].map(_label)
    if "tasks" not in data:
        return panel
    limits = data["limit"].map(limit_text) if "limit" in data else "none"
    return panel + "\ntasks " + data["tasks"].map(_label) + ", limit " + limits


def limit_text(value) -> str:
    """A run's limit (documents per task) as shown: '5', or 'none' (every document)."""
    return f"{value:g}" if isinstance(value, (int, float)) and value == value else "none"


def accuracy_vs_tpot(summary: pd.DataFrame, path: str) -> str | None:
    return _save(accuracy_vs_tpot_figure(summary), path)


# ---- recall per layer ----------------------------------------------------------------------------------------------
def recall_heatmap_figure(layers: pd.DataFrame):
    data = layers.dropna(subset=["recall_at_k"])
    if data.empty:
        return "recall@K per layer: no per-layer recall stored"
    data = data.assign(k=data["k"].map(lambda k: "?" if pd.isna(k) else str(int(k))),
                       row=data["predictor"].map(_label) + (" / " + data["model"].map(_label)
                                                            if data["model"].nunique() > 1 else ""))
    runs = data.groupby("row")["run_id"].nunique()
    ks = sorted(data["k"].unique(), key=lambda k: (k == "?", int(k) if k != "?" else 0))
    fig, axes = plt.subplots(1, len(ks), figsize=(max(5.0, 0.55 * data["layer"].nunique() + 4) * len(ks),
                                                   1.6 + 0.5 * data["row"].nunique()), squeeze=False,
                             layout="constrained", dpi=DPI)
    for ax, k in zip(axes[0], ks):
        table = data[data["k"] == k].pivot_table(index="row", columns="layer", values="recall_at_k", aggfunc="mean")
        image = ax.imshow(table.to_numpy(float), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        step = max(1, math.ceil(table.shape[1] / 24))  # at most ~24 layer ticks
        ax.set_xticks(range(0, table.shape[1], step), [str(int(c)) for c in table.columns[::step]])
        ax.set_yticks(range(table.shape[0]), [f"{r} ({runs[r]} run{'s' if runs[r] > 1 else ''})" for r in table.index])
        ax.set(title=f"recall@{k} per layer: mean over each row's runs and tasks", xlabel="layer")
        if table.size <= 400:
            for (i, j), value in np.ndenumerate(table.to_numpy(float)):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if value < 0.6 else "black")
        fig.colorbar(image, ax=ax, fraction=0.04, label=f"recall@{k}")
    return fig


def recall_heatmap(layers: pd.DataFrame, path: str) -> str | None:
    return _save(recall_heatmap_figure(layers), path)


# ---- hit rate vs cache capacity ----------------------------------------------------------------------------------
CAPACITY_UNITS = ("share of all experts", "experts held", "MiB of experts")
_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
_MIB = {"k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 ** 2}


def capacity_unit(value) -> tuple[str, float] | None:
    """A stored cache capacity as (unit, number): '0.25' and 'all' are shares of all experts, '8' a count of
    experts, '512MiB' a size; None when it is none of these."""
    text = _label(value).strip()
    if text == "all":
        return CAPACITY_UNITS[0], 1.0
    size = _SIZE.match(text)
    if size:
        return CAPACITY_UNITS[2], float(size.group(1)) * _MIB[size.group(2)[0].lower()]
    try:
        number = float(text)
    except ValueError:
        return None
    if re.fullmatch(r"\d+", text) and number >= 1:
        return CAPACITY_UNITS[1], number
    return (CAPACITY_UNITS[0], number) if 0 < number <= 1 else None


def hit_rate_vs_capacity_figure(summary: pd.DataFrame):
    parsed = summary["cache_capacity"].map(capacity_unit)
    data = summary.assign(unit=parsed.map(lambda p: p and p[0]), capacity=parsed.map(lambda p: p and p[1]))
    data = data.dropna(subset=["hit_rate", "capacity"])
    if data.empty:
        return "hit rate vs cache capacity: no run has a whole-model hit rate and a cache capacity"
    keys = ["mode", "predictor", "cache_policy"]
    data = data.assign(**{k: data[k].map(_label) for k in keys + ["model"]})
    models = sorted(data["model"].unique())
    units = [u for u in CAPACITY_UNITS if u in set(data["unit"])]
    settings = sorted(data.groupby(keys).groups)
    palette = plt.cm.tab10 if len(settings) <= 10 else plt.cm.tab20
    colors = {s: palette(i % palette.N) for i, s in enumerate(settings)}
    fig, axes = plt.subplots(len(models), len(units), figsize=(4.6 * len(units) + 2.6, 3.6 * len(models) + 0.6),
                             squeeze=False, layout="constrained", dpi=DPI)
    for r, model in enumerate(models):
        for c, unit in enumerate(units):
            ax, part = axes[r][c], data[(data["model"] == model) & (data["unit"] == unit)]
            for setting, group in part.groupby(keys, sort=True):
                line = group.groupby("capacity")["hit_rate"].mean()
                ax.plot(line.index, line.to_numpy(), marker=MARKERS[settings.index(setting) % len(MARKERS)],
                        color=colors[setting])
            ax.set(title=model, xlabel=f"cache capacity ({unit})", ylabel="hit rate (fraction of expert uses)",
                   ylim=(0, 1.02))
            if unit == CAPACITY_UNITS[0]:
                ax.set_xlim(0, 1.05)
            elif not part.empty:  # counts and sizes from zero, so a lone capacity is not stretched over the axis
                ax.set_xlim(0, part["capacity"].max() * 1.1)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if part.empty:
                ax.text(0.5, 0.5, "no runs", transform=ax.transAxes, ha="center", va="center", color="0.5")
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[s], marker=MARKERS[i % len(MARKERS)], label=" / ".join(s))
               for i, s in enumerate(settings)]
    fig.legend(handles=handles, fontsize=8, loc="outside right center", title="mode / predictor / policy",
               title_fontsize=8)
    _title(fig, "Cache hit rate vs capacity (whole model, mean over the run's tasks; runs of one setting and "
                "capacity averaged)")
    return fig


def hit_rate_vs_capacity(summary: pd.DataFrame, path: str) -> str | None:
    return _save(hit_rate_vs_capacity_figure(summary), path)


# ---- accuracy vs per-sample recall -------------------------------------------------------------------------------
RECALL_BINS = np.linspace(0.0, 1.0, 11)  # recall@k in tenths
THIN_BIN = 5  # a bin with fewer samples is drawn with an open marker: its share is mostly noise


def accuracy_vs_recall_figure(samples: pd.DataFrame):
    """`samples`: one row per scored sample with its run's model, mode and predictor, its own `recall_at_k` (at
    `k`) and whether it was `correct`. One line per model, mode and predictor over the samples' recall bins: the
    share correct (top) and how many samples each bin holds (bottom, so a thin bin reads as one)."""
    data = samples.dropna(subset=["recall_at_k", "correct"])
    if data.empty:
        return "accuracy vs per-sample recall: no sample has both its own recall@k and a right/wrong score"
    keys = ["mode", "predictor"]
    data = data.assign(**{c: data[c].map(_label) for c in keys + ["model"]},
                       bin=pd.cut(data["recall_at_k"].clip(0, 1), RECALL_BINS, include_lowest=True),
                       correct=data["correct"].astype(float))
    ks = sorted({int(k) for k in data["k"].dropna()})
    models = sorted(data["model"].unique())
    settings = sorted(data.groupby(keys).groups)
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(settings)}
    fig, axes = plt.subplots(2, len(models), figsize=(5.0 * len(models) + 2.6, 6.2), squeeze=False, sharex=True,
                             height_ratios=(3, 1.3), layout="constrained", dpi=DPI)
    centres = (RECALL_BINS[:-1] + RECALL_BINS[1:]) / 2
    for c, model in enumerate(models):
        top, bottom = axes[0][c], axes[1][c]
        for setting, group in data[data["model"] == model].groupby(keys, sort=True):
            per_bin = group.groupby("bin", observed=False)["correct"].agg(["mean", "size"])
            color, marker = colors[setting], MARKERS[settings.index(setting) % len(MARKERS)]
            sizes, shares = per_bin["size"].to_numpy(), per_bin["mean"].to_numpy()
            shown, thin = sizes > 0, (sizes > 0) & (sizes < THIN_BIN)
            top.plot(centres[shown], shares[shown], color=color)
            top.scatter(centres[shown & ~thin], shares[shown & ~thin], color=color, marker=marker, zorder=3)
            top.scatter(centres[thin], shares[thin], facecolors="white", edgecolors=color, marker=marker, zorder=3)
            bottom.plot(centres[shown], sizes[shown], color=color, marker=marker)
        top.set(title=model, ylabel="share of samples correct", ylim=(-0.03, 1.03), xlim=(0, 1))
        bottom.set(xlabel=f"the sample's own recall@{'/'.join(map(str, ks)) or 'k'} (bins of 0.1)",
                   ylabel="samples in the bin")
        bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
        bottom.set_ylim(bottom=0)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[s], marker=MARKERS[i % len(MARKERS)], label=" / ".join(s))
               for i, s in enumerate(settings)]
    handles.append(plt.Line2D([], [], color="0.3", marker="o", markerfacecolor="white", linestyle="",
                              label=f"open: < {THIN_BIN} samples in the bin"))
    fig.legend(handles=handles, fontsize=8, loc="outside right center", title="mode / predictor", title_fontsize=8)
    _title(fig, "Share of samples correct vs each sample's own recall@k (recall: mean over its decode tokens and "
                "target layers; samples of every task and run of a mode and predictor pooled per bin)")
    return fig


def accuracy_vs_recall(samples: pd.DataFrame, path: str) -> str | None:
    return _save(accuracy_vs_recall_figure(samples), path)
