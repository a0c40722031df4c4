"""Projected decode TPOT of a real model on real hardware, from a recorded (or synthetic) trace.

A trace recorded on a model with the target's shape is replayed as is. A trace from another
model (a shipped tiny one, say) cannot be, since its layers and experts differ: its measured
temporal reuse, predictor recall and predicted-set reuse are carried over to a synthetic trace
of the target's shape instead (see perf.synthetic), and the output says so.
"""
from __future__ import annotations

from dataclasses import replace

from .profiles import Profile, costs
from .shapes import ModelShape
from .simulate import PERFECT_PREFETCH, SIMULATED_MODES, gap_closed, overlap_bound, simulate
from .synthetic import synthetic_trace
from ..engine.trace import RoutingTrace
from ..table import Column, format_table

# every mode that can run the one predictor charged (a mode with its own predictor cannot), then the ideal
PROJECTED_MODES = tuple(name for name, mode in SIMULATED_MODES.items() if not mode.own_predictor)


def fit_trace(trace: RoutingTrace | None, shape: ModelShape, steps: int = 64, reuse: float | None = None,
              recall: float | None = None, seed: int = 0,
              predicted_reuse: float | None = None) -> tuple[RoutingTrace, str]:
    """The trace to replay for `shape`, and a line saying where it came from. A trace of another
    shape gives its measured statistics to those not given; predicted reuse defaults to the
    routing's (see synthetic_trace) where neither gives it."""
    if trace is not None and (trace.experts, trace.top_k, len(trace.layers)) == (
            shape.experts, shape.top_k, shape.sparse_layers):
        return trace, f"recorded trace ({len(trace.steps)} decode steps)"
    if trace is not None:
        reuse = trace.reuse() if reuse is None else reuse
        recall = trace.recall() if recall is None else recall
        predicted_reuse = trace.predicted_reuse() if predicted_reuse is None else predicted_reuse
    if reuse is None or recall is None:
        raise ValueError("give a trace recorded with a predictor (evalsuite bench --out DIR writes them), "
                         "or both --reuse and --recall")
    fitted = synthetic_trace(shape.experts, shape.top_k, shape.sparse_layers, steps, reuse, recall, seed,
                             predicted_reuse)
    meta = fitted.meta
    predicted = "{:.3f}{}".format(meta["predicted_reuse"], "" if predicted_reuse is not None else " (the routing's)")
    if "predicted_reuse_reached" in meta:
        predicted = "{:.3f} ({:.3f} asked; the nearest this reuse and recall allow)".format(
            meta["predicted_reuse_reached"], meta["predicted_reuse"])
    source = f", measured on {trace.meta.get('model', 'a recorded trace')}" if trace else ""
    origin = "synthetic trace with reuse {:.3f}, recall@{} {:.3f} and predicted reuse {}{}".format(
        reuse, shape.top_k, recall, predicted, source)
    return fitted, origin


def project(trace: RoutingTrace, shape: ModelShape | None, profile: Profile, capacity: float,
            predictor: str | None, modes=PROJECTED_MODES, policy: str = "lru") -> list[dict]:
    """One row per mode (plus the overlap bound): TPOT and its breakdown, in milliseconds, with
    the engine's eviction `policy`. Without a shape the trace is its own model, and the profile
    must hold measured costs."""
    if shape is None and profile.measured is None:
        raise ValueError("a hardware profile with rates needs a model shape (--model); "
                         "only a measured profile can replay a trace of its own model")
    total = shape.total_experts if shape is not None else trace.experts * len(trace.layers)
    slots = max(trace.top_k, round(capacity * total)) if capacity <= 1 else int(capacity)
    base = costs(profile, shape, predictor)
    rows, on_demand = [], None
    for mode in modes:
        perfect, predicts = mode == PERFECT_PREFETCH.name, SIMULATED_MODES[mode].predicts
        c = costs(profile, shape, predictor, mode) if predicts and not perfect else replace(base, predictor_s=0.0)
        p = simulate(trace, c, slots, mode, policy=policy)
        on_demand = p.tpot_s if mode == "on-demand" else on_demand
        rows.append({"mode": mode, "predictor": ("perfect" if perfect else predictor) if predicts else None,
                     **_ms(p.as_dict())})
    bound = overlap_bound(trace, replace(base, predictor_s=0.0), slots, policy)
    rows.append({"mode": "overlap bound", "predictor": "perfect", "tpot_ms": bound * 1e3})
    moves_nothing = {name for name, mode in SIMULATED_MODES.items() if not mode.offloads}  # nothing to compare
    for row in rows:
        row["cache_experts"] = slots
        if on_demand is not None and row["mode"] not in moves_nothing:
            row["vs_on_demand"] = row["tpot_ms"] / (on_demand * 1e3) - 1
            row["gap_closed"] = gap_closed(on_demand, row["tpot_ms"] / 1e3, bound)
    return rows


def _ms(d: dict) -> dict:
    return {(k.replace("_s", "_ms") if k.endswith("_s") else k): (v * 1e3 if k.endswith("_s") else v)
            for k, v in d.items() if k != "mode"}


def format_projection(rows: list[dict], title: str) -> str:
    columns = [Column("mode"), Column("predictor"), Column("TPOT ms", ".2f"), Column("compute", ".2f"),
               Column("exposed", ".2f"), Column("predict", ".2f"), Column("hit", ".3f"), Column("copies", ".1f"),
               Column("vs on-demand", "+.1%"), Column("gap closed", ".2f")]
    keys = ("tpot_ms", "compute_ms", "exposed_transfer_ms", "predictor_ms", "hit_rate", "transfers_per_token",
            "vs_on_demand", "gap_closed")
    cells = [[r["mode"], r["predictor"]] + [r.get(k) for k in keys] for r in rows]
    return title + "\n" + format_table(cells, columns)
