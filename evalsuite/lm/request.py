"""What one configuration of an eval request is: the request and its model (`Request`, `Target`), the
adapter's model_args, the loaded lm-eval model, and the configuration a run is stored under."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import __version__, timing
from ..engine.modes import MODES, default_predictor
from ..results.provenance import git_commit
from ..predict.artifact import predictor_parameters
from .runs import engine_config, file_hash


def model_args(model: str, mode: str, predictor: str | None, predictor_path: str | None, cache_capacity,
               link: str | None, extra: str = "", dtype: str | None = None, **engine_options) -> str:
    """lm-eval's model_args for one run: the mode's own predictor where none is given, and only the options
    the mode uses; `engine_options` (cache_policy, cache_pools, store) go to every offloading mode."""
    args = [f"pretrained={model}", f"mode={mode}", f"cache_capacity={cache_capacity}"]
    if dtype is not None:
        args.append(f"dtype={dtype}")
    predictor = default_predictor(mode, predictor)
    if predictor:
        args.append(f"predictor={predictor}")
    if predictor_path and MODES[mode].predicts:
        args.append(f"predictor_path={predictor_path}")
    if link and MODES[mode].offloads:
        args.append(f"link={link}")
    if MODES[mode].offloads:
        args += [f"{name}={value}" for name, value in engine_options.items() if value is not None]
    return ",".join(args + ([extra] if extra else []))


@dataclass
class Request:
    """Everything of an eval request that is the same for every model."""

    modes: list
    predictor: object
    predictor_path: str | None
    limit: int
    cache_capacity: object
    link: str | None
    engine_options: dict  # cache_policy, cache_pools, store
    options: dict  # lm-eval's: num_fewshot, gen_kwargs, apply_chat_template, seed
    device: str
    dtype: str | None
    batch_size: int
    threads: int
    out_dir: str
    fresh: bool
    confirm_run_unsafe_code: bool
    progress: object
    extra_config: dict
    manager: object


@dataclass
class Target:
    """One model of the request."""

    name: str
    path: str
    adapter: str
    tokenizer: object
    tasks: list
    sandbox: str | None


def load_adapter(request: Request, target: Target, mode: str, predictor: str | None, batch_size: int | None = None,
                 cache_capacity=None, link="request", extra: str = ""):
    """The lm-eval model of one configuration (model_args as `model_args` writes them, the request's cache and
    link unless given) and those args."""
    from lm_eval.api.registry import get_model

    args = model_args(target.path, mode, predictor, request.predictor_path, cache_capacity or request.cache_capacity,
                      request.link if link == "request" else link, extra=extra, dtype=request.dtype,
                      **request.engine_options)
    lm = get_model(target.adapter).create_from_arg_string(
        args, {"batch_size": batch_size or request.batch_size, "device": request.device})
    return lm, args


def run_config(request: Request, target: Target, lm, mode: str, args: str, **extra) -> dict:
    """The stored configuration of one run: what tells it apart from every other (see run_suite)."""
    engine = lm.engine.describe()
    return {"model": target.name, "model_path": os.path.abspath(target.path),
            "mode": mode, "predictor": engine["predictor"],
            "predictor_artifact": file_hash(engine["predictor_artifact"]),
            "predictor_parameters": predictor_parameters(engine["predictor_artifact"], engine["predictor"]),
            "seed": request.options["seed"],
            "cache_capacity": str(request.cache_capacity) if MODES[mode].offloads else None,
            **engine_config(lm.engine), "link": request.link if MODES[mode].offloads else None, "limit": request.limit,
            "dtype": str(lm.model.dtype).replace("torch.", ""), "device": request.device,
            "batch_size": request.batch_size, "num_fewshot": request.options["num_fewshot"],
            "gen_kwargs": request.options["gen_kwargs"], "apply_chat_template": request.options["apply_chat_template"],
            "model_fingerprint": lm.fingerprint(), "model_args": args, "tasks": list(target.tasks),
            "sandbox": target.sandbox, "git_commit": git_commit(), "evalsuite_version": __version__,
            "threads": request.threads, "machine": timing.machine(request.device), "engine_metrics": "measured",
            **request.extra_config, **extra}
