"""`EngineConfig`: every option of the engine, in one frozen dataclass that checks itself.

`offload()` takes one (or its fields as keywords); the lm-eval adapters' model_args (`model_args()`,
`parse_model_args()`), the `evalsuite` commands' engine flags (`add_arguments()`) and the options table of
docs/eval.md (`markdown()`, printed by `python -m evalsuite.engine.config`) are all derived from the fields
below, so an option is written once. A bad value gets a one-line ValueError naming the option, the value and
what would do, before any model is touched.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from numbers import Real

import torch

from evalsuite.engine.cache.slots import POLICIES, capacity_in_experts
from evalsuite.engine.link import parse_link
from evalsuite.engine.modes import MODES, names_where
from evalsuite.engine.placement.store import EXPERT_BITS
from evalsuite.engine.prediction import PREDICTORS

STORES = ("host", "disk")
POOLS = ("global", "per-layer")
# the oracles read the routing of the pass they predict (a look-ahead pass, a recorded run): nothing to shadow
NOT_SHADOWS = ("oracle", "trace-oracle")


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _whole_list(value, least: int) -> bool:
    return isinstance(value, (list, tuple, set, frozenset)) and all(_is_whole(v, least) for v in value)


def check_device(value) -> None:
    """A device this machine has: refused in one line before any model loads, never a traceback from the
    first copy onto it. `cuda` without CUDA (or a CPU-only torch) and `cuda:N` past the last GPU are refused."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={value!r} is not a device: use e.g. device=cpu, device=cuda or device=cuda:1") \
            from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if count == 0:
        cuda = device.type == "cuda"
        build = " (this torch is a CPU-only build)" if cuda and torch.version.cuda is None else ""
        wheel = " and a torch built for it, e.g. make TORCH=torch==2.13.0+cu128" if cuda else ""
        raise ValueError(f"device={value!r}: this machine has no {device.type.upper()} device{build}; use device=cpu, "
                         f"or run on a machine with one{wheel}")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device={value!r}: this machine has {count} {device.type.upper()} device(s), "
                         f"{device.type}:0 to {device.type}:{count - 1}")


# ---- the rules: value -> the reason it is refused (None: accepted) ------------------------------------------
def _one_of(choices):
    rule = lambda v: None if v in choices else f"is not one of: {', '.join(choices)}"  # noqa: E731
    rule.choices = lambda: choices  # what a flag offers (argparse `choices=`)
    return rule


def _predictor(v):
    # the registry is filled when evalsuite.predict loads
    return None if v is None or v in PREDICTORS else f"is not one of: {PREDICTORS.shown()}"


_predictor.choices = lambda: PREDICTORS


def _predictors(v):
    ok = isinstance(v, (list, tuple)) and all(n in PREDICTORS and n not in NOT_SHADOWS for n in v)
    fits = [n for n in PREDICTORS if n not in NOT_SHADOWS] + list(PREDICTORS.families)
    return None if ok else "must be a list of predictors among: " + ", ".join(fits)


def _flag(v):
    return None if isinstance(v, bool) else "must be True or False"


def _capacity(v):
    try:
        capacity_in_experts(v, total_experts=1, expert_bytes=1)  # the cache's own rule
    except ValueError as exc:
        return str(exc).split(" ", 1)[1] if str(exc).startswith("cache_capacity=") else str(exc)
    return None


def _link(v):
    try:
        parse_link(v)
    except ValueError as exc:
        return str(exc).split(" ", 1)[1] if str(exc).startswith("link=") else str(exc)
    return None


def _device(v):
    if v is None:
        return None
    try:
        check_device(v)
    except ValueError as exc:
        return str(exc).split(" ", 1)[1]
    return None


def option(default, doc: str, rule=None, *, flag: bool = False, model_arg: bool = True, kind: str = "value"):
    """One engine option: its default, what it means (the docs table and --help), its rule, whether the
    `evalsuite` commands take it as a flag, whether the lm-eval adapters take it as a model_arg, and how a
    model_arg's text becomes a value (`kind`: value, int, or ints or names: lists separated by ';')."""
    meta = {"doc": doc, "rule": rule, "flag": flag, "model_arg": model_arg, "kind": kind}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """Every option of the engine, checked when made; `replace(...)` makes a changed copy, checked again."""

    mode: str = option("on-demand", "resident (the reference), on-demand, router-preserving, speculative, hybrid "
                       "(evalsuite.engine.modes)", _one_of(MODES))
    cache_capacity: int | float | str = option(
        0.5, "device expert slots: a count, a fraction of all experts, a size such as '512MiB', or 'all'",
        _capacity, flag=True)
    cache_policy: str = option("lru", "eviction order: lru, lfu, least-stale, predicted (docs/performance.md)",
                               _one_of(POLICIES), flag=True)
    cache_pools: str = option("global", "one pool of slots for all layers (global) or one per layer (per-layer)",
                              _one_of(POOLS), flag=True)
    link: str | None = option(None, "emulated link: a profile (pcie4, ufs4, sdcard, ...) or '8GB/s+20us'; "
                              "none: real copies", _link, flag=True)
    store: str = option("host", "where offloaded experts live: host (pinned memory) or disk (read from the "
                        "checkpoint's safetensors when fetched)", _one_of(STORES), flag=True)
    expert_bits: int = option(16, "bits per expert weight: 16 (the checkpoint's own), 8 or 4 (HQQ, in groups along "
                              "each weight's input; packed in the store, over the link and in the cache; resident "
                              "runs the dequantised weights)",
                              lambda v: None if v in EXPERT_BITS and _is_whole(v, 1) else
                              f"is not one of: {', '.join(map(str, EXPERT_BITS))}", flag=True, kind="int")
    expert_group_size: int | None = option(
        None, "quantised experts: weights per scale and zero (default: 64, or the largest power of two below it "
        "that divides every expert's input width)",
        lambda v: None if v is None or _is_whole(v, 1) else "must be a whole number of at least 1, e.g. 64",
        flag=True, kind="int")
    checkpoint: str | None = option(None, "the safetensors checkpoint the disk store reads (default: the model's "
                                    "directory)", model_arg=False)
    device: str | None = option(None, "where the non-expert weights and the expert cache go (default: where the "
                                "non-expert weights are)", _device, model_arg=False)
    predictor: str | None = option(None, "gate, quasi, adapter, adapter-shared, estimator, frequency, oracle, "
                                   "trace-oracle, hybrid, or a controlled-recall recall-R[-near][-early|-middle|-late] "
                                   "(default: the mode's own; in resident it only measures recall)", _predictor,
                                   flag=True)
    predictor_path: str | None = option(None, "the predictor's calibration artifact (evalsuite calibrate; default: "
                                        "the model's own predictor.safetensors)", flag=True)
    recall_seed: int = option(0, "the seed of a controlled-recall predictor's errors (recall-R)",
                              lambda v: None if _is_whole(v, 0) else "must be a whole number of at least 0",
                              flag=True, kind="int")
    horizon: int = option(1, "sparse layers ahead a prediction targets (speculation: 1)",
                          lambda v: None if _is_whole(v, 1) else "must be a whole number of at least 1 "
                          "(sparse layers ahead)")
    prefetch_budget: int | None = option(
        None, "experts considered per prediction (default: top-k)",
        lambda v: None if v is None or _is_whole(v, 1) else "must be a whole number of at least 1 "
        "(experts considered per prediction)")
    window: bool = option(True, "the scheduler's expected-saving test decides what to prefetch (False: "
                          "prefetch every candidate)", _flag)
    recall_k: tuple | None = option(
        None, "k of recall@k, top-k always among them (default: K/2, K, 4K/3)",
        lambda v: None if v is None or (_whole_list(v, 1) and len(v) > 0) else
        "must be a list of whole numbers of at least 1, e.g. [1, 2, 4]", kind="ints")
    drift_layers: tuple | None = option(
        None, "hybrid: the layers its estimators repair (default: from drift_threshold)",
        lambda v: None if v is None or _whole_list(v, 0) else "must be a list of decoder layer numbers",
        kind="ints")
    drift_threshold: float = option(
        0.6, "hybrid: repair the layers whose calibration recall is below this",
        lambda v: None if _is_number(v) and 0 <= v <= 1 else "must be a number in [0, 1] (a recall)")
    preserve_layers: tuple = option(
        (), "speculating modes: layers that run their router's own choice",
        lambda v: None if _whole_list(v, 0) else "must be a list of decoder layer numbers", kind="ints")
    transfer_timeout_s: float = option(
        60.0, "a copy not done by then raises instead of hanging",
        lambda v: None if _is_number(v) and v > 0 else "must be a number of seconds above 0, e.g. "
        "transfer_timeout_s=60")
    shadows: tuple = option((), "predictors scored beside the run without acting on it (Engine.take_shadows)",
                            _predictors, kind="names")
    row_predictors: tuple = option((), "speculating modes: the batch's rows in equal groups, group g executing "
                                   "row_predictors[g]", _predictors, kind="names")
    keep_experts: bool = option(False, "every expert stays in the model (nothing moves): speculation's accuracy "
                                "alone", _flag)
    trace: bool = option(False, "record the routing of batch-1 decode steps (Engine.routing_trace)", _flag,
                         model_arg=False)

    def __post_init__(self):
        check_options(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # as given
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (list, set, frozenset)):  # kept as tuples: the config is frozen and hashable
                object.__setattr__(self, f.name, tuple(sorted(value) if isinstance(value, (set, frozenset)) else value))
        mode = MODES[self.mode]
        if self.row_predictors and not mode.speculates:
            raise ValueError(f"row_predictors: mode {self.mode!r} executes no prediction, so its rows need no "
                             f"predictor each; use it with {' or '.join(names_where(speculates=True))}")
        if self.predictor is not None and mode.offloads and not mode.predicts:
            raise ValueError(f"mode {self.mode!r} uses no predictor; choose one of: "
                             f"{', '.join(names_where(predicts=True))}")
        if mode.speculates and self.horizon != 1:
            raise ValueError("speculative execution predicts one layer ahead: use horizon=1")
        self._check_at_target(mode)

    def _check_at_target(self, mode) -> None:
        """A controlled-recall predictor proposes a layer's experts from that layer's own routing: it can only be
        executed, in a speculating mode, by rows of its own (not beside predictors that predict ahead), and
        scored as the shadow of the rows that execute it."""
        executed = [n for n in (self.predictor, *self.row_predictors) if n is not None]
        at_target = [n for n in executed if PREDICTORS[n].at_target]
        speculating = " or ".join(names_where(speculates=True))
        if at_target and not mode.speculates:
            raise ValueError(f"predictor {at_target[0]!r} reads each layer's own routing, so it can only be executed: "
                             f"use mode {speculating}")
        ahead = [n for n in self.row_predictors if not PREDICTORS[n].at_target]
        if at_target and ahead:
            raise ValueError(f"row_predictors: {at_target[0]!r} reads each layer's own routing and {ahead[0]!r} "
                             "predicts a layer ahead; run them in separate passes")
        alone = [n for n in self.shadows if PREDICTORS[n].at_target and n not in executed]
        if alone:
            raise ValueError(f"shadows: {alone[0]!r} reads each layer's own routing, so it is scored only beside the "
                             f"rows that execute it: give it as predictor or row_predictors too (mode {speculating})")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def offloads(self) -> bool:
        """Experts leave the model (a cache, a store and a link are built)."""
        return MODES[self.mode].offloads and not self.keep_experts

    # ---- derived interfaces --------------------------------------------------------------------------------
    @staticmethod
    def model_args() -> tuple[str, ...]:
        """The options the lm-eval adapters take as model_args."""
        return tuple(f.name for f in dataclasses.fields(EngineConfig) if f.metadata["model_arg"])

    @staticmethod
    def parse_model_args(args: dict) -> dict:
        """model_args as lm-eval hands them (comma-separated, so a list's items are separated by ';':
        `recall_k=1;2;8`, `shadows=gate;quasi`) -> option values. Unknown names are left out."""
        kinds = {f.name: f.metadata["kind"] for f in dataclasses.fields(EngineConfig)}
        parsed = {}
        for name, value in args.items():
            if kinds.get(name) == "ints":
                parsed[name] = _ints(name, value)
            elif kinds.get(name) == "names":
                parsed[name] = tuple(n for n in str(value).split(";") if n)
            else:
                parsed[name] = value
        return parsed

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, skip=()) -> None:
        """The options the `evalsuite` commands take, as --flags whose defaults are the engine's."""
        for f in dataclasses.fields(EngineConfig):
            if not f.metadata["flag"] or f.name in skip:
                continue
            rule, flag = f.metadata["rule"], "--" + f.name.replace("_", "-")
            if hasattr(rule, "choices"):  # a name from a registry (its families too): argparse lists its names
                parser.add_argument(flag, default=f.default, choices=rule.choices(), help=f.metadata["doc"])
            else:
                parser.add_argument(flag, default=f.default, help=f.metadata["doc"],
                                    type=_flag_type(f.name, rule, f.name == "cache_capacity",
                                                    whole=f.metadata["kind"] == "int"))

    @staticmethod
    def markdown() -> str:
        """The options table of docs/eval.md."""
        lines = ["| option | default | what it is | model_arg | flag |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(EngineConfig):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "none" if default is None else ("()" if default == () else repr(default).strip("'"))
            flag = "`--" + f.name.replace("_", "-") + "`" if f.metadata["flag"] else ""
            lines.append(f"| `{f.name}` | {shown} | {f.metadata['doc'].replace('|', '/')} | "
                         f"{'yes' if f.metadata['model_arg'] else ''} | {flag} |")
        return "\n".join(lines)


def check_options(**options) -> None:
    """Each option given against its own rule alone (the rules between options need a whole EngineConfig):
    for callers that know only some options yet, such as a request's pre-flight. ValueError for the first
    refused; a name that is no option is a TypeError, as in EngineConfig(...)."""
    rules = {f.name: f.metadata["rule"] for f in dataclasses.fields(EngineConfig)}
    for name, value in options.items():
        if name not in rules:
            raise TypeError(f"{name!r} is not an engine option")
        refused = rules[name](value) if rules[name] is not None else None
        if refused:
            raise ValueError(f"{name}={value!r} {refused}")


def _ints(name: str, value) -> tuple[int, ...]:
    """`1;2;8` (or a single number, which lm-eval has already made an int) -> (1, 2, 8)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    try:
        return tuple(int(item) for item in str(value).split(";"))
    except ValueError:
        raise ValueError(f"{name}={value!r} must be whole numbers separated by ';', e.g. {name}=1;2;8") from None


def capacity_value(text: str):
    """'8' -> 8 experts, '0.25' -> a quarter of all experts, '512MiB' / 'all' kept as text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _flag_type(name, rule, capacity: bool, whole: bool = False):
    """An argparse `type=` that applies the option's rule: a bad value is argparse's one-line usage error.
    `whole`: the option is a whole number, read from the flag's text first."""
    def parse(text: str):
        if capacity:  # its rule needs the model's expert count and size: checked with the request
            return capacity_value(text)
        if whole:
            try:
                text = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        refused = rule(text) if rule is not None else None
        if refused:
            raise argparse.ArgumentTypeError(f"{text!r} {refused}")
        return text
    parse.__name__ = name.replace("_", "-")
    return parse


if __name__ == "__main__":
    print(EngineConfig.markdown())
