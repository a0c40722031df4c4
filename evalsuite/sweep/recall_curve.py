"""`evalsuite recall-curve`: accuracy as a function of recall, in one command.

Speculative execution runs with controlled-recall predictors (evalsuite.predict.controlled: `recall-R`, the
router's own choice with a seeded share replaced) at each level, error model and layer range asked for, and
with the real predictors beside them, over the tasks; every configuration is an ordinary stored run. The
replay plan (evalsuite.lm.plan) generates them from the fewest batched passes: one resident pass, one pass
whose row groups execute every controlled level at once, one for the real predictors that predict ahead, and
one for hybrid (on a vision-language model, one pass per predictor). The report
(evalsuite.results.recall_curve) reads the stored runs back: accuracy against recall@K with paired intervals
against resident, the trend test, the recall each task needs, where misses hurt, and one plot per model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..predict.controlled import ERRORS, RANGES, recall_name

LEVELS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
REAL_PREDICTORS = ("gate", "quasi", "adapter", "estimator")  # speculative; hybrid is a mode of its own


@dataclass(frozen=True)
class CurveGrid:
    """The controlled configurations of a curve: every level with every error model over every layer range
    (a level of 1.0 makes no errors: one run, whatever the model and range)."""

    levels: tuple[float, ...] = LEVELS
    errors: tuple[str, ...] = ("uniform", "near")
    layers: tuple[str, ...] = ("all",)
    range_levels: tuple[float, ...] = (0.5,)  # the levels the confined ranges (early, middle, late) run at
    real: tuple[str, ...] = REAL_PREDICTORS
    hybrid: bool = True

    def __post_init__(self):
        bad = [level for level in (*self.levels, *self.range_levels) if not 0 <= level <= 1]
        if bad:
            raise ValueError(f"recall level {bad[0]} is not in [0, 1]; give levels such as 1.0,0.9,0.8")
        for given, known, what in ((self.errors, ERRORS, "error model"), (self.layers, RANGES, "layer range")):
            unknown = [name for name in given if name not in known]
            if unknown:
                raise ValueError(f"{what} {unknown[0]!r} is not one of: {', '.join(known)}")

    def controlled(self) -> list[str]:
        """The controlled predictors' names, the curve's levels first."""
        names = [recall_name(level, errors) for errors in self.errors for level in self.levels]
        names += [recall_name(level, errors, layers) for layers in self.layers if layers != "all"
                  for errors in self.errors for level in self.range_levels]
        return list(dict.fromkeys(recall_name(1.0) if name.startswith("recall-1.0") else name for name in names))

    def predictor_spec(self) -> str:
        """--predictor of `evalsuite eval` for the grid (every name for speculative alone)."""
        return "speculative=" + ",".join(self.controlled() + list(self.real))

    def modes(self) -> list[str]:
        return ["resident", "speculative"] + (["hybrid"] if self.hybrid else [])


def run_recall_curve(models, tasks, limit, grid: CurveGrid, *, engine, run, db_url, out_dir, plot_dir,
                     confirm_run_unsafe_code=False, fresh=False, threads=1, progress=print) -> tuple[str, float]:
    """Run (or resume) the grid through the replay plan and report it: (the report's text, the wall seconds)."""
    from ..lm.preflight import check_eval
    from ..lm.suite import run_suite
    from ..results import ResultsDB
    from ..results.recall_curve import recall_curve_report

    modes, predictor = grid.modes(), grid.predictor_spec()
    check_eval(models, modes, tasks, limit, engine=engine, predictor=predictor, run=run, db_url=db_url,
               confirm_run_unsafe_code=confirm_run_unsafe_code)
    started = time.perf_counter()
    rows = run_suite(models, modes, tasks, limit, engine=engine, predictor=predictor, run=run, db_url=db_url,
                     out_dir=out_dir, confirm_run_unsafe_code=confirm_run_unsafe_code, fresh=fresh,
                     progress=progress, threads=threads, plan="replay")
    wall_s = time.perf_counter() - started
    runs = sorted({row["run"] for row in rows if row.get("run") is not None})
    with ResultsDB(db_url) as db:
        report = recall_curve_report(db, runs=runs, out_dir=plot_dir)
    return report, wall_s
