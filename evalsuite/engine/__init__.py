"""The offload engine: expert store, device cache, transfers, and their wiring into a model."""
from .loading import load_offloaded, load_skeleton
from .modes import MODES, Mode
from .offload import Engine, offload

__all__ = ["MODES", "Mode", "Engine", "load_offloaded", "load_skeleton", "offload"]
