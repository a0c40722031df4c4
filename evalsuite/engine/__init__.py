"""The offload engine: expert store, device cache, transfers, and their wiring into a model."""
from .loading import load_offloaded, load_skeleton
from .offload import MODES, Engine, offload

__all__ = ["MODES", "Engine", "load_offloaded", "load_skeleton", "offload"]
