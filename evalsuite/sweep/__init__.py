"""Sweeps: a declarative grid of models x modes x predictors x caches x links x seeds over tasks,
run here or on a Ray cluster, every cell one run in the results database (docs/sweeps.md)."""
from .grid import Cell, Sweep, load_sweep
from .runner import Outcome, run_sweep

__all__ = ["Cell", "Outcome", "Sweep", "load_sweep", "run_sweep"]
