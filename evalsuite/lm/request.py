"""What one configuration of an eval request is: the request and its model (`Request`, `Target`), the
adapter's model_args, the loaded lm-eval model, and the configuration a run is stored under."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import __version__, timing
from ..engine.config import EngineConfig
from ..engine.modes import MODES, default_predictor
from ..results.provenance import git_commit
from ..predict.artifact import predictor_parameters
from .preflight import parse_gen_kwargs
from .run_options import RunOptions
from .runs import engine_config, file_hash


# the engine options an eval request passes to every offloading mode besides cache and link
OFFLOAD_OPTIONS = ("cache_policy", "cache_pools", "store")


def model_args(model: str, mode: str, predictor: str | None, engine: EngineConfig, extra: str = "",
               dtype: str | None = None) -> str:
    """lm-eval's model_args for one run: the mode's own predictor where none is given, and only the options
    the mode uses; OFFLOAD_OPTIONS go to every offloading mode."""
    args = [f"pretrained={model}", f"mode={mode}", f"cache_capacity={engine.cache_capacity}"]
    if dtype is not None:
        args.append(f"dtype={dtype}")
    predictor = default_predictor(mode, predictor)
    if predictor:
        args.append(f"predictor={predictor}")
    if engine.predictor_path and MODES[mode].predicts:
        args.append(f"predictor_path={engine.predictor_path}")
    if engine.link and MODES[mode].offloads:
        args.append(f"link={engine.link}")
    if MODES[mode].offloads:
        args += [f"{name}={getattr(engine, name)}" for name in OFFLOAD_OPTIONS]
    if engine.expert_bits != 16:  # every mode, resident included: the reference runs at the same bits
        args.append(f"expert_bits={engine.expert_bits}")
        if engine.expert_group_size is not None:
            args.append(f"expert_group_size={engine.expert_group_size}")
    return ",".join(args + ([extra] if extra else []))


@dataclass
class Request:
    """Everything of an eval request that is the same for every model: its modes and predictors, the engine
    they run on (mode and predictor aside), lm-eval's and the adapter's options, and where results go."""

    modes: list
    predictor: object
    limit: int
    engine: EngineConfig
    run: RunOptions
    threads: int
    out_dir: str
    fresh: bool
    confirm_run_unsafe_code: bool
    progress: object
    extra_config: dict
    manager: object

    @property
    def lm_eval(self) -> dict:
        """What lm-eval's evaluate takes of `run`: few-shot, generation arguments (parsed), chat template, seed."""
        run = self.run
        return dict(num_fewshot=run.num_fewshot, gen_kwargs=parse_gen_kwargs(run.gen_kwargs),
                    apply_chat_template=run.apply_chat_template, seed=run.seed)


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

    engine = request.engine.replace(cache_capacity=cache_capacity or request.engine.cache_capacity,
                                    link=request.engine.link if link == "request" else link)
    args = model_args(target.path, mode, predictor, engine, extra=extra, dtype=request.run.dtype)
    lm = get_model(target.adapter).create_from_arg_string(
        args, {"batch_size": batch_size or request.run.batch_size, "device": request.run.device})
    return lm, args


def run_config(request: Request, target: Target, lm, mode: str, args: str, **extra) -> dict:
    """The stored configuration of one run: what tells it apart from every other (see run_suite)."""
    engine = lm.engine.describe()
    return {"model": target.name, "model_path": os.path.abspath(target.path),
            "mode": mode, "predictor": engine["predictor"],
            "predictor_artifact": file_hash(engine["predictor_artifact"]),
            "predictor_parameters": predictor_parameters(engine["predictor_artifact"], engine["predictor"]),
            "seed": request.run.seed,
            "cache_capacity": str(request.engine.cache_capacity) if MODES[mode].offloads else None,
            "expert_bits": engine["expert_bits"], "expert_group_size": engine["expert_group_size"],
            **engine_config(lm.engine), "link": request.engine.link if MODES[mode].offloads else None,
            "limit": request.limit, "dtype": str(lm.model.dtype).replace("torch.", ""), "device": request.run.device,
            "batch_size": request.run.batch_size, "num_fewshot": request.run.num_fewshot,
            "gen_kwargs": parse_gen_kwargs(request.run.gen_kwargs), "apply_chat_template": request.run.apply_chat_template,
            "model_fingerprint": lm.fingerprint(), "model_args": args, "tasks": list(target.tasks),
            "sandbox": target.sandbox, "git_commit": git_commit(), "evalsuite_version": __version__,
            "threads": request.threads, "machine": timing.machine(request.run.device), "engine_metrics": "measured",
            **request.extra_config, **extra}
