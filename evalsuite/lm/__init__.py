"""lm-eval integration: the `specmoe` models and engine metrics in lm-eval's results.

Importing this package (`evalsuite-lm-eval` and `evalsuite eval` do) registers the models
(`specmoe`, `specmoe-vlm`) with lm-eval, and the tiny VL model's processor with AutoProcessor (so
`hf-multimodal` loads it too); `import evalsuite` alone imports none of lm-eval. From Python:

    import lm_eval
    import evalsuite.lm

    results = evalsuite.lm.add_engine_metrics(lm_eval.simple_evaluate(model="specmoe", model_args=..., tasks=...))
"""
from ..zoo import vl_processor  # noqa: F401  (AutoProcessor.register)
from .engine_metrics import add_engine_metrics
from .specmoe import SpecMoELM, SpecMoEVLM  # (lm-eval's register_model)

__all__ = ["SpecMoELM", "SpecMoEVLM", "add_engine_metrics"]
