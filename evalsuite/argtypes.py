"""Command-line values checked against the registries that define them (modes, predictors, cache
policies, links), for `choices=` and `type=`: a new registry entry needs no edit to any command."""
from __future__ import annotations

import argparse

from . import predict  # noqa: F401  (fills the engine's predictor registry)
from .engine.cache.eviction import POLICIES
from .engine.modes import MODES, predictor_choice
from .engine.prediction import PREDICTORS
from .engine.link.profiles import LINKS, parse_link

__all__ = ["LINKS", "MODES", "POLICIES", "PREDICTORS", "link", "link_list", "names_in"]


def _split(text: str, what: str, valid: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no {what}: give a comma-separated list of {valid}")
    return names


def names_in(choices, what: str):
    """A `type=` for a comma-separated list flag (`--modes a,b`), which `choices=` cannot check: each name
    must be one of `choices`; the value becomes the list of names."""
    def parse(text: str) -> list[str]:
        valid = ", ".join(choices)
        names = _split(text, what, valid)
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}: give a comma-separated list of "
                                             f"{valid}")
        return names
    return parse


def predictor_groups(text: str) -> str:
    """--predictor of `evalsuite eval`: 'NAME,NAME' and 'MODE=NAME,NAME' groups separated by ';'
    (evalsuite.engine.modes.predictor_choice), each name a predictor; the value stays the text."""
    try:
        choice = predictor_choice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not choice:
        raise argparse.ArgumentTypeError(f"{text!r} names no predictor: give a comma-separated list of "
                                         f"{PREDICTORS.shown()}")
    unknown = [name for names in choice.values() for name in names if name not in PREDICTORS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown predictor {', '.join(unknown)}: give a comma-separated list of "
                                         f"{PREDICTORS.shown()}")
    return text


def link(text: str) -> str:
    """A link profile, 'native' or a bandwidth such as '8GB/s+20us' (the engine's rule, parse_link)."""
    try:
        parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def link_list(text: str) -> list[str]:
    """Comma-separated links, each as `link` takes it."""
    return [link(name) for name in _split(text, "link", f"{', '.join(LINKS)}, native or e.g. 8GB/s+20us")]
