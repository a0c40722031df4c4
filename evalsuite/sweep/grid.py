"""A sweep file (YAML) and the cells of its grid.

    name: tiny-grid                      # names the sweep in the database
    models: [models/tiny-qwen3-moe]      # directories (or hub names where the Hub is reachable)
    modes: [resident, on-demand, router-preserving, speculative]
    predictors:                          # for the modes that use one
      - gate
      - {name: adapter, path: "calib/{model}/predictor.safetensors"}   # {model}: the model's folder name
    cache_capacities: [0.25, 0.5]
    links: [ufs4]
    tasks: [evalsuite_arith, evalsuite_yesno]
    limit: 10
    seeds: [0]
    expert_bits: [16, 4]                 # the experts' precision (docs/quantised-experts.md)
    retries: 1                           # extra attempts for a failed cell
    workers: 1                           # local cells at once (processes)
    resources: {num_cpus: 1, num_gpus: 0, memory_gb: 4}   # per cell, on Ray
    db: sqlite:///results/sweep.db       # PostgreSQL for a team's Ray cluster

A cell is one (model, mode, predictor, cache, link, seed, expert bits) over all tasks: one run in the database.
Axes a mode ignores collapse (resident has no predictor, cache or link; on-demand no predictor), so
the grid holds no duplicate runs.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass, field

from ..engine.modes import MODES
from ..yaml_file import read_yaml

FIELDS = {"name", "models", "modes", "predictors", "cache_capacities", "links", "tasks", "limit", "seeds",
          "expert_bits", "retries", "workers", "resources", "db", "out", "confirm_run_unsafe_code"}


@dataclass(frozen=True)
class Cell:
    model: str
    mode: str
    predictor: str | None
    predictor_path: str | None
    cache_capacity: float | int | str | None
    link: str | None
    seed: int
    tasks: tuple[str, ...]
    limit: int
    expert_bits: int = 16

    @property
    def key(self) -> str:
        """Identifies the cell across invocations (and machines): a hash of everything that defines it (16-bit
        experts left out, so cells stored before the bits axis keep their keys)."""
        spec = {**asdict(self), "model": os.path.basename(self.model.rstrip("/"))}
        if spec["expert_bits"] == 16:
            del spec["expert_bits"]
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def label(self) -> str:
        parts = [os.path.basename(self.model.rstrip("/")), self.mode]
        parts += [p for p in (self.predictor, self.cache_capacity and f"cache {self.cache_capacity}", self.link,
                              self.expert_bits != 16 and f"{self.expert_bits}-bit experts") if p]
        return " / ".join(str(p) for p in parts) + f" / seed {self.seed}"


@dataclass
class Sweep:
    name: str
    models: list[str]
    modes: list[str]
    tasks: list[str]
    predictors: list[dict] = field(default_factory=lambda: [{"name": "gate", "path": None}])
    cache_capacities: list = field(default_factory=lambda: [0.25])
    links: list[str] = field(default_factory=lambda: ["ufs4"])
    limit: int = 10
    seeds: list[int] = field(default_factory=lambda: [0])
    expert_bits: list[int] = field(default_factory=lambda: [16])
    retries: int = 1
    workers: int = 1
    resources: dict = field(default_factory=lambda: {"num_cpus": 1})
    db: str | None = None
    out: str = os.path.join("results", "sweeps")
    confirm_run_unsafe_code: bool = False

    def cells(self) -> list[Cell]:
        """Every distinct cell, in the order the axes are written."""
        seen, cells = set(), []
        for model, mode, predictor, capacity, link, seed, bits in itertools.product(
                self.models, self.modes, self.predictors, self.cache_capacities, self.links, self.seeds,
                self.expert_bits):
            predicting, offloaded = MODES[mode].predicts, MODES[mode].offloads
            path = predictor["path"] if predicting else None
            cell = Cell(model=os.path.abspath(model) if os.path.isdir(model) else model, mode=mode,
                        predictor=predictor["name"] if predicting else None,
                        predictor_path=path.format(model=os.path.basename(model.rstrip("/"))) if path else None,
                        cache_capacity=capacity if offloaded else None, link=link if offloaded else None,
                        seed=seed, tasks=tuple(self.tasks), limit=self.limit, expert_bits=bits)
            if cell.key not in seen:
                seen.add(cell.key)
                cells.append(cell)
        return cells


def check_cells(cells: list[Cell], confirm_run_unsafe_code: bool, model_files: bool = True) -> None:
    """Check every cell as `evalsuite eval` checks its own request (evalsuite.lm.preflight), before
    any cell runs: one bad cell fails the sweep at once, naming the cell, and nothing is stored."""
    from ..lm.preflight import check_eval, task_manager

    manager = task_manager()  # built once for all cells
    for cell in cells:
        try:
            check_eval([cell.model], [cell.mode], list(cell.tasks), cell.limit, engine=cell_engine(cell),
                       predictor=cell.predictor, confirm_run_unsafe_code=confirm_run_unsafe_code, manager=manager,
                       open_db=False, model_files=model_files)
        except (ValueError, OSError) as exc:
            kind = FileNotFoundError if isinstance(exc, OSError) else ValueError
            raise kind(f"sweep cell {cell.label()}: {exc}") from None


def cell_engine(cell: Cell):
    """The engine a cell runs on, its mode and predictor aside (a resident cell has no cache capacity: it runs
    with eval's default, which a resident engine never reads)."""
    from ..lm.run_options import EVAL_ENGINE

    capacity = cell.cache_capacity if cell.cache_capacity is not None else EVAL_ENGINE.cache_capacity
    return EVAL_ENGINE.replace(cache_capacity=capacity, link=cell.link, predictor_path=cell.predictor_path,
                               expert_bits=cell.expert_bits)


def _list(raw: dict, name: str, default=None) -> list:
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"sweep file: `{name}` is required (a list)")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_sweep(path: str) -> Sweep:
    """Read and check a sweep file; every mistake is a one-line ValueError naming the field."""
    raw = read_yaml(path, "sweep file", "docs/sweeps.md")
    if not isinstance(raw, dict):
        raise ValueError(f"sweep file {path} must be a mapping of fields (models, modes, tasks, ...)")
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise ValueError(f"sweep file: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(FIELDS))}")
    modes = _list(raw, "modes")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"sweep file: unknown mode(s) {', '.join(bad)}; the modes are {', '.join(MODES)}")
    predictors = []
    for entry in _list(raw, "predictors", ["gate"]):
        entry = {"name": entry} if isinstance(entry, str) else dict(entry)
        if "name" not in entry or set(entry) - {"name", "path"}:
            raise ValueError(f"sweep file: a predictor is a name or {{name: ..., path: ...}}, not {entry}")
        predictors.append({"name": entry["name"], "path": entry.get("path")})
    sweep = Sweep(name=str(raw.get("name") or os.path.splitext(os.path.basename(path))[0]),
                  models=_list(raw, "models"), modes=modes, tasks=_list(raw, "tasks"), predictors=predictors,
                  cache_capacities=_list(raw, "cache_capacities", [0.25]), links=_list(raw, "links", ["ufs4"]),
                  seeds=[int(s) for s in _list(raw, "seeds", [0])], expert_bits=_list(raw, "expert_bits", [16]))
    for name in ("limit", "retries", "workers"):
        if name in raw:
            value = raw[name]
            if not isinstance(value, int) or value < (0 if name == "retries" else 1):
                raise ValueError(f"sweep file: `{name}` must be a whole number "
                                 f"{'of 0 or more' if name == 'retries' else 'of at least 1'}")
            setattr(sweep, name, value)
    for name in ("resources", "db", "out", "confirm_run_unsafe_code"):
        if name in raw:
            setattr(sweep, name, raw[name])
    if not isinstance(sweep.resources, dict):
        raise ValueError("sweep file: `resources` is a mapping like {num_cpus: 1, num_gpus: 1, memory_gb: 16}")
    return sweep
