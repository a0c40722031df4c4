"""Release gates: a YAML list of rules checked against the latest matching complete runs.

Rule kinds (see docs/results.md):
  compare            accuracy of candidate vs baseline: fails when a task's metric drops more than max_drop,
                     unless the drop is not significant at or_not_significant
  where + min/max    a metric (engine_metric or metric) of one run, checked per task
  ratio + min/max    numerator run's metric / denominator run's metric, per task
  identical_samples  every paired sample's prediction is the same in both runs
A rule whose selectors match no run fails and says so.
"""
from __future__ import annotations

import math

import pandas as pd

from ..table import Column, format_table
from ..yaml_file import read_yaml
from .compare import compare, headline_k

_RUN_SELECTOR_KEYS = {"id", "model", "model_fingerprint", "mode", "predictor", "predictor_artifact", "cache_capacity",
                      "cache_policy", "link", "dtype", "device", "hardware", "evalsuite_version", "git_commit",
                      "lm_eval_version", "seed", "limit"}
_KINDS = ("compare", "where", "ratio", "identical_samples")
_THRESHOLDS = ("min", "max", "max_drop", "or_not_significant")


class RuleError(ValueError):
    pass


def load_rules(config_path: str) -> list[dict]:
    rules = read_yaml(config_path, "gates file", "docs/results.md")
    if isinstance(rules, dict) and "gates" in rules:
        rules = rules["gates"]
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise ValueError(f"gates file {config_path} must hold a list of rules (mappings)")
    for number, rule in enumerate(rules, 1):
        rule.setdefault("name", f"rule {number}")
        kinds = [k for k in _KINDS if k in rule]
        if len(kinds) != 1:
            raise ValueError(f"gate {rule['name']!r} needs exactly one of {', '.join(_KINDS)}")
        for key in _THRESHOLDS:  # checked here: a NaN bound passes every comparison, text breaks them
            value = rule.get(key)
            if key in rule and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not math.isfinite(value)):
                raise ValueError(f"gate {rule['name']!r}: {key} must be a finite number, not {value!r}; "
                                 f"fix it in {config_path}")
    return rules


def _select(runs: pd.DataFrame, selector: dict, rule: str) -> pd.DataFrame:
    if not isinstance(selector, dict):
        raise RuleError(f"gate {rule!r}: a run selector is a mapping of run columns, e.g. {{mode: resident}}")
    unknown = set(selector) - _RUN_SELECTOR_KEYS
    if unknown:
        raise RuleError(f"gate {rule!r}: unknown run column {', '.join(sorted(unknown))}")
    chosen = runs
    for key, wanted in selector.items():
        allowed = [_text_of(v) for v in (wanted if isinstance(wanted, list) else [wanted])]
        chosen = chosen[chosen[key].map(_text_of).isin(allowed)]
    return chosen


def _text_of(value) -> str:
    """Selector values and column values compared as text: 3, 3.0 and '3' are one value."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _latest(runs, selector, rule, like=None, same=()) -> dict:
    """The newest complete run matching selector (and sharing the `same` columns with `like`)."""
    chosen = _select(runs, selector, rule)
    for key in same:
        chosen = chosen[chosen[key].map(_text_of) == _text_of(like[key])]
    if chosen.empty:
        extra = f" with the same {', '.join(same)} as run {like['id']}" if like is not None and same else ""
        raise RuleError(f"no complete run matches {selector}{extra}")
    return chosen.iloc[0].to_dict()  # runs come newest first


def _tasks(rule) -> set | None:
    task = rule.get("task")
    return None if task is None else set(task if isinstance(task, list) else [task])


def _pair(runs, rule) -> tuple[dict, dict]:
    spec = rule[next(k for k in ("compare", "identical_samples") if k in rule)]
    same = tuple(rule.get("same", ["model"]))
    candidate = _latest(runs, spec.get("candidate", {}), rule["name"])
    baseline = _latest(runs, spec.get("baseline", {}), rule["name"], like=candidate, same=same)
    return baseline, candidate


def _check_compare(db, runs, rule) -> dict:
    baseline, candidate = _pair(runs, rule)
    try:
        table = compare(db, baseline["id"], candidate["id"])
    except ValueError as exc:  # the pair measured different things, or shares no task: the rule cannot pass
        raise RuleError(str(exc)) from None
    table = table[table["metric"] == rule["metric"]]
    if "filter" in rule:
        table = table[table["filter"] == rule["filter"]]
    if _tasks(rule) is not None:
        table = table[table["task"].isin(_tasks(rule))]
    runs_text = f"{baseline['id']} -> {candidate['id']}"
    if table.empty:
        return {"passed": False, "runs": runs_text, "detail": f"neither run pair has metric {rule['metric']!r}"}
    max_drop, alpha = float(rule.get("max_drop", 0.0)), rule.get("or_not_significant")
    drops = -table["delta"]
    significant = table["p_value"].isna() | (table["p_value"] < alpha) if alpha is not None else True
    failing = table[(drops > max_drop) & significant]
    worst = table.loc[drops.idxmax()]
    detail = f"worst {worst['task']}: drop {-worst['delta']:.4f}, p={worst['p_value']:.3g}"
    if not failing.empty:
        detail = f"{len(failing)} task(s) fail; " + detail
    return {"passed": failing.empty, "value": -worst["delta"], "limit": f"drop <= {max_drop}"
            + (f" or p >= {alpha}" if alpha is not None else ""), "runs": runs_text, "detail": detail}


def _values(db, run_id, rule) -> pd.Series:
    """Per task: the whole-model engine metric (or a layer's, with `layer:`), or a task metric."""
    if "engine_metric" in rule:
        rows = db.engine_metrics([run_id])
        column = rule["engine_metric"]
        rows = rows[rows["layer"] == rule["layer"]] if "layer" in rule else rows[rows["layer"].isna()]
        rows = rows[rows["k"] == rule["k"]] if "k" in rule else headline_k(rows, "task")
    elif "metric" in rule:
        rows = db.task_metrics([run_id])
        rows = rows[(rows["metric"] == rule["metric"]) & (rows["filter"].fillna("none") == rule.get("filter", "none"))]
        column = "value"
    else:
        raise RuleError(f"gate {rule['name']!r} needs engine_metric or metric")
    if _tasks(rule) is not None:
        rows = rows[rows["task"].isin(_tasks(rule))]
    rows = rows.dropna(subset=[column])
    return rows.groupby(rows["task"].fillna("(all)"))[column].mean()


def _bounds(rule, values: pd.Series, runs_text: str, what: str) -> dict:
    if values.empty:
        return {"passed": False, "runs": runs_text, "detail": f"no {what} stored for the matching run(s)"}
    low, high = rule.get("min"), rule.get("max")
    if low is None and high is None:
        raise RuleError(f"gate {rule['name']!r} needs min and/or max")
    bad = values[((values < low) if low is not None else False) | ((values > high) if high is not None else False)]
    # show the first failing task, else the one nearest its bound
    worst_task = bad.index[0] if not bad.empty else (values.idxmin() if low is not None else values.idxmax())
    limit = " and ".join(f"{sign} {bound}" for sign, bound in ((">=", low), ("<=", high)) if bound is not None)
    return {"passed": bad.empty, "value": float(values[worst_task]), "limit": limit, "runs": runs_text,
            "detail": f"{len(bad)} of {len(values)} task(s) out of bounds; shown: {worst_task}"}


def _check_where(db, runs, rule) -> dict:
    run = _latest(runs, rule["where"], rule["name"])
    what = rule.get("engine_metric", rule.get("metric"))
    return _bounds(rule, _values(db, run["id"], rule), str(run["id"]), str(what))


def _check_ratio(db, runs, rule) -> dict:
    spec = rule["ratio"]
    numerator = _latest(runs, spec.get("numerator", {}), rule["name"])
    denominator = _latest(runs, spec.get("denominator", {}), rule["name"], like=numerator,
                          same=tuple(rule.get("same", ["model"])))
    top, bottom = _values(db, numerator["id"], rule), _values(db, denominator["id"], rule)
    ratio = (top / bottom.where(bottom != 0)).dropna()
    what = f"{rule.get('engine_metric', rule.get('metric'))} in both runs"
    return _bounds(rule, ratio, f"{numerator['id']} / {denominator['id']}", what)


def _check_identical(db, runs, rule) -> dict:
    baseline, candidate = _pair(runs, rule)
    keys = ["task", "doc_id", "filter"]
    a = db.samples([baseline["id"]]).fillna({"filter": ""}).drop_duplicates(keys)
    b = db.samples([candidate["id"]]).fillna({"filter": ""}).drop_duplicates(keys)
    if _tasks(rule) is not None:
        a, b = a[a["task"].isin(_tasks(rule))], b[b["task"].isin(_tasks(rule))]
    paired = a[keys + ["prediction"]].merge(b[keys + ["prediction", "identical_share"]], on=keys,
                                             suffixes=("_a", "_b"))
    runs_text = f"{baseline['id']} -> {candidate['id']}"
    if paired.empty:
        return {"passed": False, "runs": runs_text, "detail": "no paired samples with predictions"}
    differs = (paired["prediction_a"] != paired["prediction_b"]) | (paired["identical_share"].fillna(1.0) < 1.0)
    share = 1.0 - differs.mean()
    detail = f"{int(differs.sum())} of {len(paired)} sample(s) differ"
    if differs.any():
        first = paired[differs].iloc[0]
        detail += f"; first: {first['task']} doc {first['doc_id']}"
    return {"passed": not differs.any(), "value": share, "limit": "identical share = 1", "runs": runs_text,
            "detail": detail}


_CHECKS = {"compare": _check_compare, "where": _check_where, "ratio": _check_ratio,
           "identical_samples": _check_identical}


def evaluate_gates(db, rules: list[dict]) -> pd.DataFrame:
    """One row per rule: name, passed, value, limit, runs, detail."""
    runs = db.runs(status="complete")
    rows = []
    for rule in rules:
        kind = next(k for k in _KINDS if k in rule)
        try:
            outcome = _CHECKS[kind](db, runs, rule)
        except RuleError as exc:
            outcome = {"passed": False, "detail": str(exc)}
        rows.append({"name": rule["name"], "kind": kind, "passed": outcome["passed"],
                     "value": outcome.get("value", math.nan), "limit": outcome.get("limit", ""),
                     "runs": outcome.get("runs", ""), "detail": outcome.get("detail", "")})
    return pd.DataFrame(rows, columns=["name", "kind", "passed", "value", "limit", "runs", "detail"])


def format_gates(table: pd.DataFrame) -> str:
    columns = ["gate", "result", Column("value", ".4g"), Column("limit", max_width=26),
               Column("runs", max_width=12), "detail"]
    cells = [[row.name, "PASS" if row.passed else "FAIL", row.value, row.limit, row.runs, row.detail]
             for row in table.itertuples(index=False)]
    failed = int((~table["passed"]).sum())
    return format_table(cells, columns) + f"\n{len(table) - failed} passed, {failed} failed"


def gate(db, config_path: str, out=print) -> int:
    """Check every rule of the YAML file; print the table; 0 when all pass, 1 otherwise."""
    table = evaluate_gates(db, load_rules(config_path))
    out(format_gates(table))
    return 0 if len(table) and table["passed"].all() else 1
