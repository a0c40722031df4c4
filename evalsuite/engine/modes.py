"""The execution modes: one registry, which every part of evalsuite reads. A new mode is one entry here.

resident           the experts stay in the model: the reference every other mode is compared against
on-demand          route, fetch the missing experts, compute
router-preserving  a predictor prefetches; the native router decides what runs
speculative        from the second sparse layer on, decode tokens run the predicted experts
hybrid             speculative, with the estimator on high-drift layers and quasi elsewhere
(evalsuite.engine.prediction has the details.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    offloads: bool  # experts live off the device: a store, a cache and a link
    predicts: bool  # a predictor runs ahead of each router and its prediction is prefetched
    speculates: bool  # decode tokens execute the predicted experts, not the router's (from the second sparse layer)
    exact: bool  # output bit-identical to resident whatever the predictor
    predictor: str | None = None  # the predictor it runs when none is given
    own_predictor: bool = False  # it runs only `predictor`, which no other mode runs


MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("resident", offloads=False, predicts=False, speculates=False, exact=True),
    Mode("on-demand", offloads=True, predicts=False, speculates=False, exact=True),
    Mode("router-preserving", offloads=True, predicts=True, speculates=False, exact=True, predictor="gate"),
    Mode("speculative", offloads=True, predicts=True, speculates=True, exact=False, predictor="gate"),
    Mode("hybrid", offloads=True, predicts=True, speculates=True, exact=False, predictor="hybrid",
         own_predictor=True),
)}
REFERENCE = "resident"  # the mode whose output the others are compared with


def mode_named(name: str) -> Mode:
    """The registered mode `name`; anything else is a one-line ValueError listing the modes."""
    if name not in MODES:
        raise ValueError(f"mode={name!r} is not one of: {', '.join(MODES)}")
    return MODES[name]


def names_where(**flags: bool) -> tuple[str, ...]:
    """The modes whose flags have these values, in registry order: names_where(predicts=True)."""
    return tuple(name for name, mode in MODES.items() if all(getattr(mode, f) == v for f, v in flags.items()))


def default_predictor(mode: str, predictor: str | None = None) -> str | None:
    """The predictor `mode` runs: the one given where the mode predicts, else the mode's own (none for a
    mode that does not predict)."""
    return (predictor or MODES[mode].predictor) if MODES[mode].predicts else None
