"""Next-layer expert predictors and their calibration artifacts."""
from __future__ import annotations

import functools

from ..engine.prediction import register_predictor, register_predictor_family
from ..engine.trace import RoutingTrace
from .artifact import Artifact, ArtifactError, fingerprint
from .controlled import NAME as RECALL_NAME, SHOWN as RECALL_SHOWN, ControlledRecallPredictor
from .predictors import NEEDS_ARTIFACT, PREDICTORS, HybridPredictor, LayerState, Predictor

PREDICTOR_NAMES = tuple(PREDICTORS) + ("hybrid",)


def build_predictor(name: str, layers, family, artifact: Artifact | None = None, horizon: int = 1,
                    drift_layers=None, drift_threshold: float = 0.6, device=None, seed: int = 0) -> Predictor:
    """A predictor by name; `hybrid` picks its high-drift layers from the artifact's calibration
    recall of the quasi predictor (below `drift_threshold`) unless `drift_layers` are given. An
    artifact is moved to `device` (where the engine computes). `seed`: a controlled-recall predictor's
    (recall-R, evalsuite.predict.controlled)."""
    if RECALL_NAME.fullmatch(name):
        if horizon != 1:
            raise ValueError(f"predictor {name!r} is executed at the layer it predicts: horizon must be 1")
        return ControlledRecallPredictor(layers, family, name, seed)
    if isinstance(artifact, Artifact) and device is not None:
        artifact = artifact.to(device)
    if name not in PREDICTOR_NAMES:
        raise ValueError(f"predictor={name!r} is not one of: {', '.join(PREDICTOR_NAMES)}")
    if name in NEEDS_ARTIFACT and artifact is None:
        raise ValueError(f"predictor {name!r} needs a calibration artifact: run `evalsuite calibrate --model M "
                         f"--predictor {name} --out DIR` and pass predictor_path=DIR/predictor.safetensors")
    if name == "trace-oracle":
        if not isinstance(artifact, RoutingTrace):
            raise ValueError("predictor 'trace-oracle' replays a recorded routing trace: record one with "
                             "offload(model, mode='resident', trace=True) and pass predictor_path=TRACE.json")
        predictor = PREDICTORS[name](layers, family, artifact)
    elif name == "hybrid":
        if drift_layers is None:
            recall = artifact.meta.get("recall", {}).get("quasi", {})
            drift_layers = [int(layer) for layer, value in recall.items() if value < drift_threshold]
        predictor = HybridPredictor(layers, family, artifact, drift_layers)
    else:
        predictor = PREDICTORS[name](layers, family, artifact)
    if horizon not in predictor.horizons:
        raise ValueError(f"predictor {name!r} predicts horizons {predictor.horizons}, not {horizon}")
    if predictor.parts:
        artifact.check(layers, predictor.parts, horizon)  # a damaged artifact fails here, not mid-run
    return predictor


def load_artifact(name: str, path, model, layers):
    """What `predictor_path` holds for predictor `name`: a routing trace for trace-oracle, else a
    calibration artifact."""
    return RoutingTrace.load(path) if name == "trace-oracle" else Artifact.load(path, model, layers)


for _name in PREDICTOR_NAMES:  # the engine builds predictors by name through its registry
    register_predictor(_name, build_predictor, functools.partial(load_artifact, _name),
                       needs_artifact=_name in NEEDS_ARTIFACT)
# controlled-recall instruments (evalsuite.predict.controlled): named by their parameters, executed where they predict
register_predictor_family(RECALL_SHOWN, RECALL_NAME.pattern, build_predictor, lambda path, model, layers: None,
                          at_target=True)

__all__ = ["Artifact", "ArtifactError", "LayerState", "Predictor", "PREDICTOR_NAMES", "build_predictor", "fingerprint"]
