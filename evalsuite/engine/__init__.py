"""The offload engine: expert store, device cache, transfers, and their wiring into a model."""
from .offload import MODES, Engine, offload

__all__ = ["MODES", "Engine", "offload"]
