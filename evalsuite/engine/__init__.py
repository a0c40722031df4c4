"""The offload engine: expert store, device cache, transfers, and their wiring into a model."""
from evalsuite.engine.placement.loading import load_offloaded, load_skeleton
from evalsuite.engine.config import EngineConfig
from evalsuite.engine.modes import MODES, Mode
from evalsuite.engine.offload import Engine, offload

__all__ = ["MODES", "Mode", "Engine", "EngineConfig", "load_offloaded", "load_skeleton", "offload"]
