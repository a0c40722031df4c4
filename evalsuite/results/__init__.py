"""Results store: runs, task and engine metrics, per-sample scores; comparisons, gates and reports on them."""
from .database import ResultsDB

__all__ = ["ResultsDB"]
