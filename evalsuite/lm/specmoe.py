"""`specmoe` and `specmoe-vlm`: lm-eval's HF models with their experts offloaded by the engine.

Every argument of lm-eval's `hf` (text) or `hf-multimodal` (vision-language) model keeps
working; the engine's options are extra model_args. lm-eval hands the model all tasks'
requests at once, interleaved; these adapters run each task's requests as their own group, so
the engine's measurements are attributed to the task that caused them.
"""
from __future__ import annotations

from collections import defaultdict

from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import HFMultimodalLM
from lm_eval.models.huggingface import HFLM

from ..engine import offload
from ..engine.options import check_options
from ..engine.metrics import EngineRecord
from ..predict import fingerprint
from .results import TASK_SUMMARIES

ENGINE_ARGS = ("mode", "predictor", "predictor_path", "cache_capacity", "cache_policy", "cache_pools", "link",
               "store", "horizon", "prefetch_budget", "window", "drift_threshold", "transfer_timeout_s",
               "recall_k", "drift_layers", "preserve_layers")
# model_args are comma-separated, so a list value separates its items with ';': recall_k=1;2;8
LIST_ARGS = ("recall_k", "drift_layers", "preserve_layers")


def parse_list(name: str, value) -> list[int]:
    """`1;2;8` (or a single number, which lm-eval has already made an int) -> [1, 2, 8]."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    try:
        return [int(item) for item in str(value).split(";")]
    except ValueError:
        raise ValueError(f"{name}={value!r} must be whole numbers separated by ';', e.g. {name}=1;2;8") from None


def check_engine_args(args: dict) -> None:
    """The engine's own option rules (evalsuite.engine.options), applied before any model is loaded."""
    try:
        check_options(**{k: v for k, v in args.items() if k != "predictor_path"})
    except ValueError as exc:
        raise ValueError(f"specmoe: {exc}") from None


class EngineAdapter:
    """What both adapters add to their lm-eval base class: the engine, and metrics per task."""

    def _offload(self, engine_args: dict, experts_implementation: str) -> None:
        # The engine reproduces the eager kernel bit for bit; compare with `hf` running eager too.
        self.model.set_experts_implementation(experts_implementation)
        self.engine = offload(self.model, **engine_args)
        self.engine_args = engine_args
        self.records: dict[str, EngineRecord] = defaultdict(EngineRecord)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().generate_until, requests, disable_tqdm)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().loglikelihood_rolling, requests, disable_tqdm)

    def _by_task(self, run, requests, disable_tqdm):
        groups = defaultdict(list)
        for position, request in enumerate(requests):
            groups[request.task_name].append(position)
        results = [None] * len(requests)
        for task, positions in groups.items():
            # each task starts from a cold cache, so its engine metrics do not depend on what ran before
            self.engine.clear_cache()
            self.engine.take_record()  # whatever ran before belongs to no task
            outputs = run([requests[p] for p in positions], disable_tqdm=disable_tqdm)
            self.records[task].merge(self.engine.take_record())
            for p, out in zip(positions, outputs):
                results[p] = out
        return results

    def engine_summaries(self) -> dict[str, dict]:
        """Per task: the engine's summary (see evalsuite.engine.metrics) and configuration."""
        describe = self.engine.describe()
        return {task: {**record.summary(), **describe} for task, record in self.records.items()}

    def fingerprint(self) -> str:
        """A hash of the model's configuration and router weights (see evalsuite.predict)."""
        return fingerprint(self.model, self.engine.layers)

    def get_model_info(self) -> dict:
        """lm-eval merges this into results["config"]: the engine's configuration, and the per-task engine
        summaries that `add_engine_metrics` moves into the results."""
        info = super().get_model_info()
        info["evalsuite_engine"] = {**{k: str(v) for k, v in self.engine_args.items()}, **self.engine.describe()}
        info[TASK_SUMMARIES] = self.engine_summaries()
        return info


def _engine_args(kwargs: dict, mode, cache_capacity) -> dict:
    engine_args = {k: kwargs.pop(k) for k in ENGINE_ARGS if k in kwargs}
    try:
        engine_args.update({k: parse_list(k, engine_args[k]) for k in LIST_ARGS if k in engine_args})
    except ValueError as exc:
        raise ValueError(f"specmoe: {exc}") from None
    # lm-eval parses model_args: '0.25' arrives as 0.25, '8' as 8, '512MiB' and 'all' as text
    engine_args.update(mode=mode, cache_capacity=cache_capacity)
    check_engine_args(engine_args)
    kwargs.setdefault("device", "cpu")
    return engine_args


@register_model("specmoe")
class SpecMoELM(EngineAdapter, HFLM):
    """model_args: pretrained, mode, predictor, predictor_path, cache_capacity, cache_policy,
    cache_pools, link, store, horizon, prefetch_budget, window, recall_k, drift_layers, preserve_layers (lists:
    `recall_k=1;2;8`), ... plus every HFLM argument."""

    def __init__(self, pretrained, mode: str = "on-demand", cache_capacity=0.5, experts_implementation="eager",
                 **kwargs):
        engine_args = _engine_args(kwargs, mode, cache_capacity)
        super().__init__(pretrained=pretrained, **kwargs)
        self._offload(engine_args, experts_implementation)


@register_model("specmoe-vlm")
class SpecMoEVLM(EngineAdapter, HFMultimodalLM):
    """The vision-language counterpart (lm-eval's hf-multimodal): same engine model_args, plus
    every hf-multimodal argument. Metrics are also split by token kind (image vs text)."""

    def __init__(self, pretrained, mode: str = "on-demand", cache_capacity=0.5, experts_implementation="eager",
                 **kwargs):
        engine_args = _engine_args(kwargs, mode, cache_capacity)
        super().__init__(pretrained=pretrained, **kwargs)
        self._offload(engine_args, experts_implementation)
