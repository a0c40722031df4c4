"""lm-eval integration: the `specmoe` model and engine metrics in lm-eval's results.

Importing this module (done by `import evalsuite`) registers the models (`specmoe`, `specmoe-vlm`) with lm-eval,
and the tiny VL model's processor with AutoProcessor (so `hf-multimodal` loads it too).
"""
from ..zoo import vl_processor  # noqa: F401  (AutoProcessor.register)
from . import results  # noqa: F401  (wraps lm_eval.evaluator.evaluate)
from .specmoe import SpecMoELM, SpecMoEVLM

__all__ = ["SpecMoELM", "SpecMoEVLM"]
