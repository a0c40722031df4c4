"""Whether two stored runs measured the same thing: model, task set, limit, few-shot, seed, batch size,
generation arguments and chat template.

A difference in any of them makes an accuracy delta meaningless (another model, other documents, other
prompts, other decoding), or a TPOT delta (per batched step at another batch size), so `compare` refuses
unless forced. Each setting is read from the run's `config` JSON (falling back
to the `runs` column of the same name); a run stored before a key was recorded leaves it unknown, which is
reported but not refused.
"""
from __future__ import annotations

import math

from .database import stored_config

UNKNOWN = object()


def _present(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _from(run: dict, key: str):
    """config[key] when the config has the key (None there means 'none'), else the runs column, else UNKNOWN."""
    config = stored_config(run.get("config"))
    if key in config:
        return config[key]
    return run[key] if _present(run.get(key)) else UNKNOWN


def _known(run: dict, key: str):
    value = _from(run, key)
    return value if _present(value) else UNKNOWN


def _model(run: dict):
    """The model fingerprint (configuration and router weights)."""
    return _known(run, "model_fingerprint")


def _model_name(run: dict):
    return _known(run, "model")


def _tasks(run: dict):
    tasks = stored_config(run.get("config")).get("tasks")
    return frozenset(tasks) if isinstance(tasks, (list, tuple)) else UNKNOWN


def _limit(run: dict):
    limit = _from(run, "limit")
    return limit if limit is UNKNOWN or limit is None else float(limit)


def _fewshot(run: dict):
    """num_fewshot as the run was configured, else lm-eval's per-task n-shot, else unknown."""
    config = stored_config(run.get("config"))
    if "num_fewshot" in config:
        return config["num_fewshot"]
    n_shot = (config.get("lm_eval") or {}).get("n-shot")
    return {task: int(n) for task, n in n_shot.items()} if isinstance(n_shot, dict) and n_shot else UNKNOWN


def _seed(run: dict):
    seed = _from(run, "seed")
    return seed if seed is UNKNOWN or seed is None else int(seed)


def _batch_size(run: dict):
    size = _from(run, "batch_size")
    return size if size is UNKNOWN or size is None else int(size)


def _gen_kwargs(run: dict):
    """The generation arguments as one canonical text (a dict would be compared key by key, like per-task
    few-shot, and {} would then match anything)."""
    value = _from(run, "gen_kwargs")
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items())) or None
    return value


SETTINGS = (("model fingerprint", _model), ("task set", _tasks), ("limit", _limit), ("few-shot", _fewshot),
            ("seed", _seed), ("batch size", _batch_size), ("generation arguments", _gen_kwargs),
            ("chat template", lambda run: _from(run, "apply_chat_template")))


def _restricted(value, tasks):
    """A task set or per-task few-shot narrowed to the tasks being compared."""
    if tasks is None:
        return value
    if isinstance(value, frozenset):
        return value & frozenset(tasks)
    if isinstance(value, dict):
        return {t: n for t, n in value.items() if t in tasks}
    return value


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):  # per-task few-shot: tasks both ran
        return all(a[t] == b[t] for t in set(a) & set(b))
    if isinstance(a, dict) != isinstance(b, dict):  # one number against per-task numbers
        number, per_task = (b, a) if isinstance(a, dict) else (a, b)
        return all(n == number for n in per_task.values())
    return a == b


def _shown(value) -> str:
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "(none)"
    if isinstance(value, dict):
        return ",".join(f"{t}:{n}" for t, n in sorted(value.items()))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)


def differences(run_a: dict, run_b: dict, tasks=None) -> tuple[list[str], list[str]]:
    """(what differs between the runs, what could not be checked), one phrase each; `tasks` narrows the
    task-set and few-shot checks to the tasks being compared. Without both fingerprints the model names
    are compared instead."""
    differ, unknown = [], []
    for name, read in SETTINGS:
        a, b = _restricted(read(run_a), tasks), _restricted(read(run_b), tasks)
        missing = [str(run["id"]) for run, value in ((run_a, a), (run_b, b)) if value is UNKNOWN]
        if missing and name == "model fingerprint":
            a, b = _model_name(run_a), _model_name(run_b)
            named = a is not UNKNOWN and b is not UNKNOWN
            unknown.append(f"model fingerprint unknown for run {' and '.join(missing)} (stored before it was "
                           f"recorded): {'compared model names instead' if named else 'not checked'}")
            if named and a != b:
                differ.append(f"model ({a} vs {b})")
        elif missing:
            unknown.append(f"{name} unknown for run {' and '.join(missing)} (stored before it was recorded): "
                           "not checked")
        elif not _same(a, b):
            differ.append(f"{name} ({_shown(a)} vs {_shown(b)})")
    return differ, unknown
