"""--predictor groups: one request can run each predicting mode with its own list of predictors
('gate,quasi,adapter,estimator;speculative=gate,quasi'), so a whole grid is one invocation with one cost
measurement for every mode's replayed TPOT."""
import os
import subprocess
import sys

import pytest

from evalsuite.cli import build_parser
from evalsuite.lm.plan import plan_passes
from evalsuite.engine.modes import predictor_choice
from evalsuite.lm.preflight import check_predictor, requested_runs

GRID = ["resident", "on-demand", "router-preserving", "speculative"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_mode_group_replaces_the_common_list_for_that_mode_alone():
    spec = "gate,quasi,adapter,estimator;speculative=gate,quasi"
    assert predictor_choice(spec) == {None: ["gate", "quasi", "adapter", "estimator"], "speculative": ["gate", "quasi"]}
    assert requested_runs(GRID, spec) == [
        ("resident", None), ("on-demand", None), ("router-preserving", "gate"), ("router-preserving", "quasi"),
        ("router-preserving", "adapter"), ("router-preserving", "estimator"), ("speculative", "gate"),
        ("speculative", "quasi")]
    check_predictor(GRID, spec)
    # the plan: one resident pass with four shadows, one speculative pass for the two predictors
    assert [(p.label, p.shadows) for p in plan_passes(GRID, spec)] == [
        ("resident", ["gate", "quasi", "adapter", "estimator"]), ("speculative/gate+quasi", ["gate", "quasi"])]
    # a mode no group names runs its default; a list of names is the common group, as before
    assert requested_runs(["router-preserving", "speculative"], "speculative=quasi") == [
        ("router-preserving", "adapter"), ("speculative", "quasi")]
    assert requested_runs(["speculative"], ["gate", "quasi"]) == [("speculative", "gate"), ("speculative", "quasi")]
    assert requested_runs(["hybrid", "speculative"], "hybrid=hybrid;speculative=adapter") == [
        ("hybrid", "hybrid"), ("speculative", "adapter")]


@pytest.mark.parametrize("spec,modes,words", [
    ("gate;", GRID, None),  # an empty group is nothing: accepted
    ("speculative=", GRID, "names no predictor"),
    ("warp=gate", GRID, "'warp' is no mode"),
    ("speculative=gate;speculative=quasi", GRID, "two groups for mode speculative"),
    ("gate;quasi", GRID, "two groups for every mode"),
    ("hybrid=gate", ["hybrid", "speculative"], "runs the hybrid predictor only"),
    ("speculative=hybrid", ["hybrid", "speculative"], "belongs to mode hybrid"),
    ("router-preserving=gate", ["speculative"], "not among --modes"),
    ("resident=gate", ["resident", "speculative"], "uses no predictor"),
    ("gate;speculative=quasi", ["resident", "speculative"], "use no predictor"),  # the common group runs nowhere
    ("speculative=psychic", GRID, "psychic"),
])
def test_bad_groups_are_refused_in_one_line(spec, modes, words):
    if words is None:
        check_predictor(modes, spec)
        return
    with pytest.raises(ValueError) as refused:
        check_predictor(modes, spec)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_the_eval_flag_and_make_eval_pass_the_groups_on():
    parse = next(a for a in build_parser()._actions if a.dest == "command").choices["eval"] \
        ._option_string_actions["--predictor"].type
    assert parse("gate,quasi;speculative=gate") == "gate,quasi;speculative=gate"
    with pytest.raises(Exception, match="unknown predictor psychic"):
        parse("gate;speculative=psychic")
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", "eval", "PREDICTOR=gate,quasi;speculative=gate"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    assert "--predictor 'gate,quasi;speculative=gate'" in out  # quoted: the shell would end the command at ';'
