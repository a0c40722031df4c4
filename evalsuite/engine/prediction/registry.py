"""The predictor registry: predictors register a builder under a name (evalsuite.predict does), so the engine
never imports them; and where a checkpoint's own calibration artifact lives. A family of predictors whose names
carry their parameters (`recall-0.8-near`) registers a pattern instead of a name."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PredictorKind:
    """How the engine builds a predictor it knows by name (registered by evalsuite.predict)."""

    build: Callable  # (name, layers, family, artifact, horizon, drift_layers, drift_threshold, device) -> predictor
    load: Callable  # (path, model, layers) -> the artifact `build` takes
    needs_artifact: bool = False  # it cannot run without a calibration artifact
    # it proposes a layer's experts from that layer's own routing (a controlled-recall instrument): it can only be
    # executed (a speculating mode), never prefetched one layer ahead (Predictor.at_target)
    at_target: bool = False


# A model's own calibration artifact, shipped in its checkpoint directory (`evalsuite calibrate --out DIR`
# writes this name): what a predictor that needs one reads when no other is given.
ARTIFACT_FILE = "predictor.safetensors"


def artifact_beside(model_dir) -> str | None:
    """The calibration artifact shipped with the checkpoint in `model_dir`, or None."""
    path = os.path.join(str(model_dir), ARTIFACT_FILE) if model_dir else None
    return path if path and os.path.isfile(path) else None


class PredictorRegistry(dict):
    """name -> PredictorKind, and the families registered by pattern: `name in PREDICTORS` and
    `PREDICTORS[name]` know both; iterating lists the plain names (the families are named in `families`)."""

    def __init__(self):
        super().__init__()
        self.families: dict[str, tuple[re.Pattern, PredictorKind]] = {}  # shown form -> (pattern, kind)

    def family_of(self, name) -> PredictorKind | None:
        if isinstance(name, str):
            for pattern, kind in self.families.values():
                if pattern.fullmatch(name):
                    return kind
        return None

    def __contains__(self, name) -> bool:
        return super().__contains__(name) or self.family_of(name) is not None

    def __missing__(self, name):
        kind = self.family_of(name)
        if kind is None:
            raise KeyError(name)
        return kind

    def get(self, name, default=None):
        return self[name] if name in self else default

    def shown(self) -> str:
        """The names and families, for a one-line error or --help."""
        return ", ".join([*self, *self.families])


# name -> PredictorKind: predictors register here, so the engine never imports them
PREDICTORS = PredictorRegistry()


def register_predictor(name: str, build: Callable, load: Callable, needs_artifact: bool = False) -> None:
    PREDICTORS[name] = PredictorKind(build, load, needs_artifact)


def register_predictor_family(shown: str, pattern: str, build: Callable, load: Callable, at_target: bool = False) -> None:
    """A family of predictors named by `pattern` (a regular expression matched in full), `shown` as e.g.
    `recall-R[-near][-early|-middle|-late]` in errors and docs."""
    PREDICTORS.families[shown] = (re.compile(pattern), PredictorKind(build, load, False, at_target))


def experts_in(ids: torch.Tensor) -> set[int]:
    """The experts named anywhere in [T, K] `ids` (one tensor call: each costs the hot path a dispatch)."""
    return {e for row in ids.tolist() for e in row}


def ranked_scores(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """[T, E] scores K, K-1, ... at each row's `ids` [T, K] in order, 0 elsewhere: their top-K is `ids`, in order."""
    k = ids.shape[1]
    ranks = torch.arange(k, 0, -1, dtype=torch.float32, device=ids.device).expand(ids.shape[0], -1)
    return torch.zeros(ids.shape[0], experts, device=ids.device).scatter(1, ids, ranks)
