"""The report's plots as a reader sees them: labels apart, legends off the data, one unit per axis, titles that
say what was averaged."""
import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text

from evalsuite.results import plots


def _summary(n=36, seed=0) -> pd.DataFrame:
    """Crowded runs: two models, several runs on one spot, capacities as shares, counts and sizes."""
    rng = np.random.default_rng(seed)
    accuracy = rng.choice([0.7, 0.75, 0.8], n)
    tpot = rng.uniform(10, 14, n).round(1)
    accuracy[:4], tpot[:4] = 0.8, 12.0  # four runs on one point
    return pd.DataFrame({
        "id": range(1, n + 1), "model": ["Qwen/Qwen3-30B-A3B", "allenai/OLMoE-1B-7B-0924"] * (n // 2),
        "mode": ["speculative", "router-preserving", "on-demand"] * (n // 3), "predictor": ["gate", "quasi"] * (n // 2),
        "cache_capacity": ["0.25", "0.5", "8", "16", "512MiB", "all"] * (n // 6), "cache_policy": "lru",
        "accuracy": accuracy, "tpot_ms": tpot, "hit_rate": rng.uniform(0.3, 0.9, n)})


def _boxes(fig, artists):
    renderer = fig.canvas.get_renderer()
    return [Text.get_window_extent(a, renderer) for a in artists]


def test_run_labels_overlap_nothing_and_name_every_run_once():
    summary = _summary()
    fig = plots.accuracy_vs_tpot_figure(summary)
    fig.canvas.draw()
    labels = [t for ax in fig.axes for t in ax.texts]
    named = [name for t in labels for name in t.get_text().split(",")]
    assert sorted(named) == sorted(f"#{i}" for i in summary["id"])  # coincident runs share one label
    assert "#1,#3" in [t.get_text() for t in labels] or "#2,#4" in [t.get_text() for t in labels]
    boxes = _boxes(fig, labels)
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    legend = fig.legends[0].get_window_extent(fig.canvas.get_renderer())
    assert not any(legend.overlaps(ax.get_window_extent()) for ax in fig.axes)  # the legend is off the data
    assert not any(legend.overlaps(box) for box in boxes)
    assert "mean over the run's tasks" in fig._suptitle.get_text()


def test_hit_rate_axes_have_one_capacity_unit_each():
    summary = _summary()
    fig = plots.hit_rate_vs_capacity_figure(summary)
    fig.canvas.draw()  # lays the figure out, as saving does
    units = {ax.get_xlabel() for ax in fig.axes}
    assert units == {f"cache capacity ({u})" for u in plots.CAPACITY_UNITS}
    for ax in fig.axes:
        x = np.concatenate([line.get_xdata() for line in ax.lines]) if ax.lines else np.array([])
        if "share" in ax.get_xlabel():
            assert ((0 < x) & (x <= 1)).all() and ax.get_xlim()[1] <= 1.05
        elif "experts held" in ax.get_xlabel():
            assert set(x) <= {8.0, 16.0}
    legend = fig.legends[0].get_window_extent(fig.canvas.get_renderer())
    assert not any(legend.overlaps(ax.get_window_extent()) for ax in fig.axes)
    assert "mean over the run's tasks" in fig._suptitle.get_text()


@pytest.mark.parametrize("stored, parsed", [("0.25", ("share of all experts", 0.25)), ("1.0", ("share of all experts", 1.0)),
                                            ("all", ("share of all experts", 1.0)), ("8", ("experts held", 8.0)),
                                            ("512MiB", ("MiB of experts", 512.0)), ("2GiB", ("MiB of experts", 2048.0)),
                                            ("lots", None), (None, None), ("0", None)])
def test_stored_capacities_are_read_in_their_own_unit(stored, parsed):
    assert plots.capacity_unit(stored) == parsed


def test_recall_heatmap_title_and_rows_say_what_was_averaged():
    layers = pd.DataFrame({"run_id": [1, 1, 2, 2, 3, 3], "model": "m", "predictor": ["gate"] * 4 + ["quasi"] * 2,
                           "layer": [0, 1] * 3, "k": 2, "recall_at_k": [0.9, 0.8, 0.7, 0.6, 0.95, 0.9]})
    fig = plots.recall_heatmap_figure(layers)
    ax = fig.axes[0]
    assert ax.get_title() == "recall@2 per layer: mean over each row's runs and tasks"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gate (2 runs)", "quasi (1 run)"]
    assert ax.images[0].get_array()[0, 0] == pytest.approx(0.8)  # gate, layer 0: mean of 0.9 and 0.7


def test_share_correct_is_read_per_recall_bin_with_thin_bins_open():
    # speculative: the low-recall samples are wrong, the high-recall ones right; one lone sample at 0.55
    recall = [0.12] * 6 + [0.93] * 6 + [0.55]
    samples = pd.DataFrame({"model": "m", "mode": ["speculative"] * 13 + ["router-preserving"] * 13,
                            "predictor": "gate", "k": 2, "recall_at_k": recall * 2,
                            "correct": ([False] * 6 + [True] * 6 + [True]) + [True, False] * 6 + [True]})
    fig = plots.accuracy_vs_recall_figure(samples)
    fig.canvas.draw()
    top, bottom = fig.axes[0], fig.axes[1]
    preserving, speculative = top.lines  # settings in name order
    assert [line.get_xdata().tolist() for line in top.lines] == [pytest.approx([0.15, 0.55, 0.95])] * 2
    assert speculative.get_ydata().tolist() == [0.0, 1.0, 1.0] and preserving.get_ydata().tolist() == [0.5, 1.0, 0.5]
    assert [line.get_ydata().tolist() for line in bottom.lines] == [[6, 1, 6]] * 2
    lone = [c for c in top.collections if c.get_offsets().tolist() == [[0.55, 1.0]]]
    assert len(lone) == 2 and all(c.get_facecolor()[0].tolist() == [1, 1, 1, 1] for c in lone)  # open: one sample
    assert (top.get_ylabel(), bottom.get_ylabel()) == ("share of samples correct", "samples in the bin")
    assert bottom.get_xlabel() == "the sample's own recall@2 (bins of 0.1)"
    legend = fig.legends[0].get_window_extent(fig.canvas.get_renderer())
    assert not any(legend.overlaps(ax.get_window_extent()) for ax in fig.axes)
    assert "mean over its decode tokens and target layers" in " ".join(fig._suptitle.get_text().split())
    assert plots.accuracy_vs_recall_figure(samples.assign(recall_at_k=None)).startswith("accuracy vs per-sample")
