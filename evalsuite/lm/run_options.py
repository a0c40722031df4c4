"""An eval request's options besides its models, modes and tasks: the engine every run uses (EVAL_ENGINE unless
told otherwise) and what the adapter and lm-eval are handed (RunOptions)."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import EngineConfig

SEED = 0  # every seed lm-eval takes (Python, numpy, torch, few-shot sampling), as its `--seed N` sets them
# `evalsuite eval`'s engine unless told otherwise: EngineConfig's defaults, at a quarter of the experts
EVAL_ENGINE = EngineConfig(cache_capacity=0.25)


@dataclass(frozen=True)
class RunOptions:
    """What `evalsuite eval` hands the adapter (device, dtype, batch size) and lm-eval (the rest), named as in
    lm_eval; checked by evalsuite.lm.preflight.check_run_options."""

    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's own
    batch_size: int = 1
    num_fewshot: int | None = None  # None: each task's own
    gen_kwargs: object = None  # lm-eval's 'name=value,...' or a dict
    apply_chat_template: bool | str = False  # True, or a template's name
    seed: int = SEED
