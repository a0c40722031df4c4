"""evalsuite: accuracy, expert recall, cache hit rate and TPOT of offloaded MoE inference.

    import evalsuite
    engine = evalsuite.offload(model, mode="on-demand", cache_capacity=0.25, link="pcie4")
    model.generate(...)
    engine.stats()

Nothing else is imported: lm-eval and its `specmoe` model come with `import evalsuite.lm`.
"""
from .engine import MODES, Engine, EngineConfig, offload
from . import predict  # noqa: F401  (registers the predictors with the engine)

__version__ = "0.1.0"
__all__ = ["MODES", "Engine", "EngineConfig", "offload", "__version__"]
