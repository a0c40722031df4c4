"""The engine's options and the one rule for each: `offload()` / `Engine`, the lm-eval adapters and
the `evalsuite` commands all check options through `check_options`, before any model is touched.

A bad value gets a one-line ValueError naming the option, the value and what would do.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from .cache import POLICIES, capacity_in_experts
from .modes import MODES
from .prediction import PREDICTORS
from .links import parse_link

STORES = ("host", "disk")
POOLS = ("global", "per-layer")
# the oracles read the routing of the pass they predict (a look-ahead pass, a recorded run): nothing to shadow
NOT_SHADOWS = ("oracle", "trace-oracle")


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_list_of_whole(value, least: int) -> bool:
    return isinstance(value, (list, tuple, set, frozenset)) and all(_is_whole(v, least) for v in value)


def _one_of(choices, optional: bool = False):
    return (lambda v: (optional and v is None) or v in choices), f"is not one of: {', '.join(choices)}"


# a list of predictors that score a token from the model's own pass (not the oracles' look-ahead)
PREDICTOR_LIST = (lambda v: isinstance(v, (list, tuple)) and all(n in PREDICTORS and n not in NOT_SHADOWS for n in v),
                  lambda: "must be a list of predictors among: " + ", ".join(n for n in PREDICTORS if n not in NOT_SHADOWS))
# option -> (test, what a value failing the test must be instead)
RULES = {
    "mode": _one_of(MODES),
    "store": _one_of(STORES),
    "cache_pools": _one_of(POOLS),
    "cache_policy": _one_of(POLICIES),
    "predictor": (lambda v: v is None or v in PREDICTORS,  # the registry is filled when evalsuite.predict loads
                  lambda: f"is not one of: {', '.join(PREDICTORS)}"),
    "shadows": PREDICTOR_LIST,
    "row_predictors": PREDICTOR_LIST,
    "transfer_timeout_s": (lambda v: _is_number(v) and v > 0,
                           "must be a number of seconds above 0, e.g. transfer_timeout_s=60"),
    "horizon": (lambda v: _is_whole(v, 1), "must be a whole number of at least 1 (sparse layers ahead)"),
    "prefetch_budget": (lambda v: v is None or _is_whole(v, 1),
                        "must be a whole number of at least 1 (experts considered per prediction)"),
    "window": (lambda v: isinstance(v, bool), "must be True or False"),
    "trace": (lambda v: isinstance(v, bool), "must be True or False"),
    "keep_experts": (lambda v: isinstance(v, bool), "must be True or False"),
    "drift_threshold": (lambda v: _is_number(v) and 0 <= v <= 1, "must be a number in [0, 1] (a recall)"),
    "recall_k": (lambda v: v is None or (_is_list_of_whole(v, 1) and len(v) > 0),
                 "must be a list of whole numbers of at least 1, e.g. [1, 2, 4]"),
    "drift_layers": (lambda v: v is None or _is_list_of_whole(v, 0), "must be a list of decoder layer numbers"),
    "preserve_layers": (lambda v: _is_list_of_whole(v, 0), "must be a list of decoder layer numbers"),
}


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


def check_options(**options) -> None:
    """Raise ValueError for the first option of the wrong type or out of range. Options this module
    has no rule for are left to their consumer (an unknown name fails as a TypeError there)."""
    for name, value in options.items():
        if name == "cache_capacity":
            capacity_in_experts(value, total_experts=1, expert_bytes=1)  # the cache's own rule
        elif name == "link":
            parse_link(value)
        elif name == "device":
            check_device(value)
        elif name in RULES:
            valid, must = RULES[name]
            if not valid(value):
                raise ValueError(f"{name}={value!r} {must() if callable(must) else must}")
