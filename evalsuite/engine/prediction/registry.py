"""The predictor registry: predictors register a builder under a name (evalsuite.predict does), so the engine
never imports them; and where a checkpoint's own calibration artifact lives."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PredictorKind:
    """How the engine builds a predictor it knows by name (registered by evalsuite.predict)."""

    build: Callable  # (name, layers, family, artifact, horizon, drift_layers, drift_threshold, device) -> predictor
    load: Callable  # (path, model, layers) -> the artifact `build` takes
    needs_artifact: bool = False  # it cannot run without a calibration artifact


# A model's own calibration artifact, shipped in its checkpoint directory (`evalsuite calibrate --out DIR`
# writes this name): what a predictor that needs one reads when no other is given.
ARTIFACT_FILE = "predictor.safetensors"


def artifact_beside(model_dir) -> str | None:
    """The calibration artifact shipped with the checkpoint in `model_dir`, or None."""
    path = os.path.join(str(model_dir), ARTIFACT_FILE) if model_dir else None
    return path if path and os.path.isfile(path) else None


# name -> PredictorKind: predictors register here, so the engine never imports them
PREDICTORS: dict[str, PredictorKind] = {}


def register_predictor(name: str, build: Callable, load: Callable, needs_artifact: bool = False) -> None:
    PREDICTORS[name] = PredictorKind(build, load, needs_artifact)


def experts_in(ids: torch.Tensor) -> set[int]:
    """The experts named anywhere in [T, K] `ids` (one tensor call: each costs the hot path a dispatch)."""
    return {e for row in ids.tolist() for e in row}
