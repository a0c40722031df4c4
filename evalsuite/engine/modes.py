"""The execution modes: one registry, which every part of evalsuite reads. A new mode is one entry here.

resident           the experts stay in the model: the reference every other mode is compared against
on-demand          route, fetch the missing experts, compute
router-preserving  a predictor prefetches; the native router decides what runs. By default SpecPrefetch's
                   trained low-rank adapter (`adapter`)
speculative        from the second sparse layer on, decode tokens run the predicted experts. By default
                   Speculating Experts' quasi-hidden state (`quasi`)
hybrid             speculative, with Speculating Experts' estimator on high-drift layers and quasi elsewhere
The trained defaults read the model's calibration artifact (`predictor.safetensors` beside the checkpoint,
or `predictor_path`); `gate` (FATE's rule: layer l+1's router on layer l's input) needs none.
(evalsuite.engine.prediction.driver has the details.)
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
    Mode("router-preserving", offloads=True, predicts=True, speculates=False, exact=True, predictor="adapter"),
    Mode("speculative", offloads=True, predicts=True, speculates=True, exact=False, predictor="quasi"),
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


def predictor_choice(predictor) -> dict[str | None, list[str]]:
    """--predictor, as groups separated by ';': a group 'NAME,NAME' is for every predicting mode a group does
    not name, a group 'MODE=NAME,NAME' for that mode alone. 'gate,quasi,adapter;speculative=gate' ->
    {None: ['gate', 'quasi', 'adapter'], 'speculative': ['gate']}; a list of names -> {None: names};
    none given -> {}. Refuses, in one line, a group that names nothing, an unknown mode, a mode named twice
    and two groups for every mode."""
    if predictor is None:
        return {}
    if not isinstance(predictor, str):
        names = [str(name).strip() for name in predictor if str(name).strip()]
        return {None: names} if names else {}
    choice: dict[str | None, list[str]] = {}
    for group in (g.strip() for g in predictor.split(";")):
        if not group:
            continue
        mode, _, listed = group.rpartition("=")
        mode = mode.strip() or None
        names = [name.strip() for name in listed.split(",") if name.strip()]
        if not names:
            raise ValueError(f"--predictor {predictor!r}: {group!r} names no predictor; give e.g. "
                             "'gate,quasi' or 'gate,quasi;speculative=gate'")
        if mode is not None and mode not in MODES:
            raise ValueError(f"--predictor {predictor!r}: {mode!r} is no mode; a group 'MODE=NAMES' names one of "
                             f"{', '.join(MODES)}")
        if mode in choice:
            which = f"mode {mode}" if mode else "every mode"
            raise ValueError(f"--predictor {predictor!r}: two groups for {which}; give each mode one group")
        choice[mode] = names
    return choice
