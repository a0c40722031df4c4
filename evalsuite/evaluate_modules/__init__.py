"""evalsuite's scorers as `evaluate` metric modules, loaded by path so they work offline.

    import evaluate
    from evalsuite.evaluate_modules import module_path

    code_eval = evaluate.load(module_path("sandboxed_code_eval"))   # HumanEval pass@k, in the sandbox
    recall = evaluate.load(module_path("expert_recall"))            # recall@k of an expert predictor

`evaluate.load("code_eval")` and the other Hub metrics are fetched from the Hugging Face Hub on first
use, which an offline machine cannot do, and the Hub's code_eval runs candidates in the evaluating
process itself. Each module here is a thin wrapper over the function evalsuite scores with.
"""
from __future__ import annotations

import os

MODULES_DIR = os.path.dirname(os.path.abspath(__file__))
MODULES = ("sandboxed_code_eval", "expert_recall")


def module_path(name: str) -> str:
    """The folder to hand to `evaluate.load`."""
    if name not in MODULES:
        raise ValueError(f"no evalsuite metric module {name!r}: choose one of {', '.join(MODULES)}")
    return os.path.join(MODULES_DIR, name)
