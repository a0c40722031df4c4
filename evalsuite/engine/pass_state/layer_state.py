"""What a predictor may read at a sparse layer: the engine's interface to predictors (evalsuite.predict)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)  # (made at every sparse layer: slots make it and its reads cheaper)
class LayerState:
    """What a predictor may read at sparse layer `pos` while it runs."""

    pos: int  # position among the sparse layers
    x: torch.Tensor  # router input [T, H]
    residual: torch.Tensor  # residual stream after this layer's attention [..., T, H], as the layer got it
    ids: torch.Tensor  # experts this layer executes [T, K]
    weights: torch.Tensor  # their routing weights [T, K]
