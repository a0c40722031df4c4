"""Pre-flight: everything an eval request can get wrong, checked before any model is loaded.

`evalsuite eval` checks its request with `check_eval`, and a sweep checks every cell with it before
the first cell runs, so a bad model, checkpoint, task, option or database fails at once with one
line that says what to do, and nothing is stored. The checks read only configs, task YAMLs and
safetensors headers: a second or two (most of it building lm-eval's task index, once).
"""
from __future__ import annotations

import functools
import json
import os

from ..engine import arch
from ..engine.modes import MODES, names_where, predictor_choice
from ..engine.config import check_options
from ..engine.prediction import ARTIFACT_FILE, PREDICTORS, artifact_beside
from ..hub import local_model

CONFIRM = "pass --confirm-run-unsafe-code (in a sweep file: confirm_run_unsafe_code: true)"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def split_names(text: str, flag: str) -> list[str]:
    """'a,b' -> ['a', 'b']; a list that names nothing ('' or ',') is refused, not read as the default."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r} names nothing: give a comma-separated list, or leave {flag} out "
                         "for the defaults")
    return names


def predictor_names(predictor) -> list[str]:
    """Every predictor name --predictor gives, in any group, once each, in order."""
    return list(dict.fromkeys(name for names in predictor_choice(predictor).values() for name in names))


def predictors_for(mode: str, predictor) -> list[str | None]:
    """The predictors `mode` runs, one run each: a mode's own group if --predictor names it; else a mode with
    its own predictor runs that one, the others each one of the common group that no mode owns; none given, the
    mode's default; [None] where the mode predicts nothing."""
    spec = MODES[mode]
    if not spec.predicts:
        return [None]
    choice = predictor_choice(predictor)
    if mode in choice:
        return choice[mode]
    names = choice.get(None, [])
    if spec.own_predictor or not names:
        return [spec.predictor]
    return [name for name in names if name not in _owned()]


def requested_runs(modes, predictor) -> list[tuple[str, str | None]]:
    """Every (mode, predictor) run a request asks for, in the order asked for (the order of the printed table)."""
    return [(mode, chosen) for mode in modes for chosen in predictors_for(mode, predictor)]


def _owned() -> set[str]:
    return {mode.predictor for mode in MODES.values() if mode.own_predictor}


def check_predictor(modes, predictor) -> None:
    """Every predictor given exists; each predicting mode gets one that fits it, and each one given is run."""
    choice = predictor_choice(predictor)
    for name in predictor_names(predictor):
        check_options(predictor=name)
    for mode, names in choice.items():
        _check_at_target(names, [mode] if mode is not None else
                         [m for m in modes if m not in choice and MODES[m].predicts and not MODES[m].own_predictor])
    for mode, names in choice.items():
        if mode is not None:
            _check_mode_group(mode, names, modes)
    names = choice.get(None)
    if names:
        _check_common_group(names, [mode for mode in modes if mode not in choice])


def _check_at_target(names: list[str], modes) -> None:
    """A controlled-recall predictor (it reads each layer's own routing) only for modes that execute predictions."""
    at_target = [name for name in names if PREDICTORS[name].at_target]
    exact = [mode for mode in modes if not MODES[mode].speculates]
    if at_target and exact:
        raise ValueError(f"--predictor: {at_target[0]} reads each layer's own routing, so it can only be executed, "
                         f"not by {exact[0]}; give it to speculative alone: --predictor 'speculative={at_target[0]}'")


def _check_mode_group(mode: str, names: list[str], modes) -> None:
    """A group 'MODE=NAMES': the mode is asked for, predicts, and every name fits it."""
    given = f"--predictor {mode}={','.join(names)}"
    spec = MODES[mode]
    if mode not in modes:
        raise ValueError(f"{given}: {mode} is not among --modes {','.join(modes)}; add it, or leave the group out")
    if not spec.predicts:
        raise ValueError(f"{given}: mode {mode} uses no predictor; leave the group out")
    if spec.own_predictor and names != [spec.predictor]:
        raise ValueError(f"{given}: mode {mode} runs the {spec.predictor} predictor only; leave the group out")
    owned = [name for name in names if name in _owned() and not spec.own_predictor]
    if owned:
        owner = next(m.name for m in MODES.values() if m.own_predictor and m.predictor == owned[0])
        raise ValueError(f"{given}: the {owned[0]} predictor belongs to mode {owner}; leave it out of the group")


def _check_common_group(names: list[str], modes) -> None:
    """The group for every mode no group names."""
    given = ",".join(names)
    predicting = [mode for mode in modes if MODES[mode].predicts]
    if not predicting:
        raise ValueError(f"--predictor {given}: mode(s) {', '.join(modes) or '(none left)'} use no predictor; leave "
                         f"--predictor out, or add one of {', '.join(names_where(predicts=True))} to --modes")
    free = [name for name in names if name not in _owned()]
    for mode in (MODES[name] for name in predicting if MODES[name].own_predictor):
        if mode.predictor not in names:
            raise ValueError(f"mode {mode.name} runs the {mode.predictor} predictor, not {given}: leave --predictor "
                             f"out (each mode then runs its own) or run {mode.name} separately")
    others = [name for name in predicting if not MODES[name].own_predictor]
    for owner in (mode for mode in MODES.values() if mode.own_predictor and mode.predictor in names):
        if owner.name not in predicting or (others and not free):
            raise ValueError(f"the {owner.predictor} predictor belongs to mode {owner.name}, not "
                             f"{', '.join(sorted(set(predicting) - {owner.name}))}: leave --predictor out, and each "
                             "mode runs its own")
    if free and not others:
        raise ValueError(f"mode(s) {', '.join(predicting)} run their own predictor, not {','.join(free)}: leave "
                         "--predictor out")


def parse_gen_kwargs(text: str | dict | None) -> dict | None:
    """lm-eval's `--gen_kwargs` syntax, 'temperature=0.7,do_sample=True' -> a dict (values typed as lm-eval
    types them); each item needs a name and a value."""
    if text is None or isinstance(text, dict):
        return text or None
    from lm_eval.utils import simple_parse_args_string

    items = [item for item in text.split(",") if item.strip()]
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad or not items:
        raise ValueError(f"gen_kwargs={text!r}: give name=value pairs separated by commas, "
                         "e.g. gen_kwargs=temperature=0.7,do_sample=True")
    return simple_parse_args_string(text)


def check_run_options(device="cpu", dtype=None, batch_size=1, num_fewshot=None, gen_kwargs=None, seed=0) -> None:
    """What lm-eval and the adapter are handed besides the engine options: refused in one line, spelled as
    model_args (`batch_size=0`; the CLI shows its own flags), before any model loads."""
    check_options(device=device)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
    for name, value, least in (("batch_size", batch_size, 1), ("num_fewshot", num_fewshot, 0), ("seed", seed, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name}={value!r} must be a whole number of at least {least}")
    parse_gen_kwargs(gen_kwargs)


@functools.cache
def task_manager():
    """lm-eval's index of its tasks and the project's (tasks/, evalsuite.tasks), built once per process: reading every
    task YAML lm-eval ships takes ~10 s here, and the index does not change while a process runs."""
    from lm_eval.tasks import TaskManager

    from ..tasks import TASKS_DIR

    return TaskManager(include_path=TASKS_DIR)


def check_eval(models, modes, tasks, limit, *, engine=None, predictor=None, run=None, db_url=None,
               confirm_run_unsafe_code=False, manager=None, open_db=True, model_files=True) -> None:
    """Refuse a bad eval request (the arguments of `run_suite`: `engine` an EngineConfig, `run` its RunOptions)
    with a one-line ValueError or FileNotFoundError. `open_db=False` leaves the database to the caller (a sweep
    opens it once); `model_files=False` skips what only the machine running the model can check (a Ray cluster's:
    its models, Hub ids resolved there, and its devices)."""
    from .run_options import EVAL_ENGINE, RunOptions

    engine, run = engine or EVAL_ENGINE, run or RunOptions()
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"--limit must be a whole number of at least 1, not {limit!r}")
    if not models:
        raise ValueError("no model to evaluate: pass --model DIR[,DIR]")
    if not modes:
        raise ValueError("no mode to run: pass --modes resident,on-demand,...")
    for mode in modes:
        check_options(mode=mode)
    check_predictor(modes, predictor)
    check_run_options(run.device if model_files else "cpu", run.dtype, run.batch_size, run.num_fewshot,
                      run.gen_kwargs, run.seed)
    if open_db:
        from ..results import ResultsDB

        ResultsDB(db_url).close()  # a bad or unreachable URL fails here, before the task index is built (seconds)
    manager = manager or task_manager()
    tasks_of = tasks if isinstance(tasks, dict) else {model: list(tasks) for model in models}
    requested = _known_tasks(tasks_of, manager)
    if run.num_fewshot is not None:
        check_fewshot(requested, run.num_fewshot, manager)
    # a missing model is named before the code tasks its defaults would bring; a Hub id is resolved here
    paths = [local_model(model) for model in models] if model_files else []
    unsafe = unsafe_tasks(requested, manager)
    if unsafe and not confirm_run_unsafe_code:
        raise ValueError(f"{', '.join(unsafe)} run(s) model-written code (in the sandbox): {CONFIRM}")
    if unsafe:
        from ..scoring.sandbox import SandboxUnavailable, confinement_to_use

        try:  # a system that offers only the weak sandbox is refused here, not after earlier tasks stored
            confinement_to_use()
        except SandboxUnavailable as exc:
            raise ValueError(str(exc)) from None
    for path in paths:
        check_model(path)
        if run.apply_chat_template:
            check_chat_template(path, run.apply_chat_template)
    if model_files:
        artifact = engine.predictor_path
        if artifact and any(MODES[mode].predicts for mode in modes) and not os.path.isfile(artifact):
            raise FileNotFoundError(f"no predictor artifact {artifact!r}: run `evalsuite calibrate --model M "
                                    "--out DIR` and pass --predictor-path DIR/predictor.safetensors")
        for model, path in zip(models, paths):
            check_artifact(model, path, modes, predictor, engine.predictor_path)
            if engine.expert_bits != 16:
                check_quantised_experts(path, engine, any(MODES[mode].offloads for mode in modes))


def check_artifact(model: str, path: str, modes, predictor, predictor_path) -> None:
    """Every predictor the request runs on `model` that needs a calibration artifact has one: the one given, or
    the model's own (ARTIFACT_FILE in its directory). Refused in one line naming how to get one, or `gate`."""
    if predictor_path or artifact_beside(path):
        return
    for mode, name in requested_runs(modes, predictor):
        if name is not None and PREDICTORS[name].needs_artifact:
            default = "" if predictor_names(predictor) else f" (mode {mode}'s default)"
            raise FileNotFoundError(
                f"predictor {name}{default} needs a calibration artifact and {model} ships none: run `evalsuite "
                f"calibrate --model {model} --out {path}` (it writes {ARTIFACT_FILE} there), pass --predictor-path, "
                "or run the training-free --predictor gate")


def check_quantised_experts(path: str, engine, offloads: bool) -> None:
    """The experts of the model in `path` at engine.expert_bits: a group size that divides their widths, and for
    the disk store the packed file (evalsuite pack-experts); read from the model built on the meta device, with
    none of its weights loaded."""
    from ..engine.placement.loading import meta_model
    from ..engine.placement.packed import pack_command, packed_path
    from ..engine.placement.quantised import layout_for
    from ..engine.placement.store import ExpertLayout

    dense = ExpertLayout.of(arch.sparse_layers(meta_model(path))[0].experts)
    layout = layout_for(dense, engine.expert_bits, engine.expert_group_size)
    if offloads and engine.store == "disk" and not os.path.isfile(packed_path(path, layout)):
        raise FileNotFoundError(f"--store disk --expert-bits {layout.bits}: no experts packed in {path}; run "
                                f"`{pack_command(path, layout)}` first")


def _known_tasks(tasks_of: dict, manager) -> list[str]:
    """Every task requested for any model, each known to lm-eval, and none of the lists empty."""
    if any(not names for names in tasks_of.values()):
        raise ValueError("no task to run: pass --tasks TASK[,TASK] (docs/tasks.md)")
    requested = sorted({task for names in tasks_of.values() for task in names})
    unknown = [task for task in requested if task not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown task {', '.join(unknown)}: the tasks are listed in docs/tasks.md "
                         "(or `lm_eval ls tasks --include_path \"$(python -m evalsuite.tasks)\"`)")
    return requested


def check_fewshot(names, num_fewshot: int, manager) -> None:
    """lm-eval never overrides a task whose config fixes `num_fewshot: 0`: asking for examples there would be
    silently ignored, and the run stored with a few-shot it did not use."""
    fixed = sorted({task for name in names for task, cfg in task_configs(name, manager) if cfg.get("num_fewshot") == 0})
    if fixed and num_fewshot != 0:
        raise ValueError(f"num_fewshot={num_fewshot}: {', '.join(fixed)} fix(es) num_fewshot: 0 in the task config, "
                         "which lm-eval never overrides; leave num_fewshot out for them, or choose a few-shot task "
                         "(e.g. gsm8k_es_5shot)")


def unsafe_tasks(names, manager) -> list[str]:
    """The names (tasks, groups, tags) among `names` that are, or contain, a task with `unsafe_code: true`."""
    return [name for name in names if any(cfg.get("unsafe_code") for _, cfg in task_configs(name, manager))]


def task_configs(name, manager, seen=None):
    """(name, config) of every task `name` stands for, from lm-eval's task index: the task itself, or the
    members of a tag or a group, groups of groups and a group's inline configs included (includes are
    already resolved in the index's configs)."""
    seen = set() if seen is None else seen
    entry = manager.task_index.get(name) if isinstance(name, str) else None
    if entry is None or name in seen:
        return
    seen.add(name)
    if entry.cfg is None:  # a tag: its member tasks
        for member in entry.tags:
            yield from task_configs(member, manager, seen)
    elif "group" in entry.cfg:
        children = entry.cfg.get("task") or []
        for child in children if isinstance(children, list) else [children]:
            if isinstance(child, dict):  # an inline config: itself, and the task or group it names
                yield child.get("task"), child
                child = child.get("task", child.get("group"))
            yield from task_configs(child, manager, seen)
    else:
        yield name, entry.cfg


def check_model_directory(model: str) -> None:
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"no model directory {model!r} (with a config.json): pass --model DIR or a Hub id "
                                "(make eval MODEL=...), or train the shipped ones with `make tiny-models`")


def check_chat_template(model: str, template) -> None:
    """--apply-chat-template needs a tokenizer with a chat template (the named one, when a name is given)."""
    from transformers import AutoTokenizer

    templates = AutoTokenizer.from_pretrained(model).chat_template
    if not templates:
        raise ValueError(f"apply_chat_template: the tokenizer of {model!r} has no chat template; leave "
                         "apply_chat_template out for this model")
    if isinstance(template, str) and isinstance(templates, dict) and template not in templates:
        raise ValueError(f"apply_chat_template={template!r}: the tokenizer of {model!r} has the templates "
                         f"{', '.join(templates)}")


def check_model(model: str) -> None:
    """A model directory with a config evalsuite can offload and a checkpoint that is whole."""
    from transformers import AutoConfig

    check_model_directory(model)
    try:
        config = AutoConfig.from_pretrained(model)
    except (ValueError, OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{os.path.join(model, 'config.json')} cannot be read ({first}); fix or replace it") from None
    arch.check_config(config, os.path.join(model, "config.json"))
    check_checkpoint(model)


def check_checkpoint(model: str) -> None:
    """Every safetensors file of the checkpoint (one file, or the shards its index names) is whole."""
    index = os.path.join(model, "model.safetensors.index.json")
    single = os.path.join(model, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is damaged (not JSON with a weight_map): copy it again from its source") from None
        for shard in shards:
            path = os.path.join(model, shard)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}, named in {index}, is missing: copy the model again from its source")
            check_safetensors(path)
    elif os.path.isfile(single):
        check_safetensors(single)
    else:
        raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {model!r}: evalsuite "
                                "reads safetensors checkpoints, as save_pretrained writes them")


def check_safetensors(path: str) -> None:
    """The file holds what its header promises: an 8-byte little-endian header length, a JSON header
    of tensors with data_offsets, then exactly the data those offsets span."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or 8 + length > size:
            raise ValueError(f"{path} is truncated ({size} bytes, shorter than its own header): "
                             "copy it again from its source")
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ValueError(f"{path} is damaged (its safetensors header does not parse): "
                             "copy it again from its source") from None
    expected = 8 + length + end
    if size != expected:
        state = "truncated" if size < expected else "damaged (longer than its header says)"
        raise ValueError(f"{path} is {state}: {size} bytes where its header promises {expected}; "
                         "copy it again from its source")
