"""EngineConfig is the engine's options written once: offload(), the lm-eval adapters' model_args, the
`evalsuite` flags and the docs table all come from it."""
import argparse
import copy
import dataclasses
import re
from pathlib import Path

import pytest

import evalsuite
from evalsuite.engine.config import EngineConfig
from evalsuite.lm.specmoe import ENGINE_ARGS, _engine_args
from .helpers import reference_model

DOCS = Path(__file__).resolve().parent.parent / "docs" / "eval.md"


def fresh():
    return copy.deepcopy(reference_model("qwen3_moe"))


def test_the_docs_table_is_the_config_s_own():
    text = DOCS.read_text()
    assert EngineConfig.markdown() in text, "docs/eval.md's options table is stale: paste `python -m " \
                                            "evalsuite.engine.config` over it"


def test_every_option_is_a_row_of_the_docs_table():
    rows = re.findall(r"^\| `(\w+)` \|", DOCS.read_text(), flags=re.M)
    assert [f.name for f in dataclasses.fields(EngineConfig)] == [r for r in rows if r in
                                                                  {f.name for f in dataclasses.fields(EngineConfig)}]


def test_offload_takes_a_config_or_its_fields_and_runs_as_it_says():
    config = EngineConfig(mode="router-preserving", predictor="gate", cache_capacity=0.5, link="pcie4")
    with evalsuite.offload(fresh(), config) as by_object:
        described = by_object.describe()
    with evalsuite.offload(fresh(), "router-preserving", predictor="gate", cache_capacity=0.5, link="pcie4") as by_kw:
        assert by_kw.describe() == described
        assert by_kw.config == config
    assert described["mode"] == "router-preserving" and described["predictor"] == "gate"
    assert described["link"] == "pcie4"


def test_a_config_is_frozen_and_replace_checks_again():
    config = EngineConfig(mode="speculative", predictor="gate")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "resident"
    with pytest.raises(ValueError, match="horizon=1"):
        config.replace(horizon=2)
    assert config.replace(cache_capacity=8).cache_capacity == 8 and config.cache_capacity == 0.5


@pytest.mark.parametrize("options,message", [
    (dict(mode="on-demand", predictor="gate"), "uses no predictor"),
    (dict(mode="router-preserving", row_predictors=["gate"]), "executes no prediction"),
    (dict(cache_policy="fifo"), "cache_policy='fifo' is not one of"),
    (dict(link="fast"), "link='fast'"),
])
def test_bad_options_are_one_line_before_any_model(options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        EngineConfig(**options)
    assert "\n" not in str(raised.value)


def test_model_args_are_the_config_s_fields_and_parse_into_one():
    kwargs = {"recall_k": "1;2;8", "shadows": "gate;quasi", "window": False, "store": "host", "batch_size": 4}
    args = _engine_args(kwargs, "router-preserving", 0.25)
    assert kwargs == {"batch_size": 4, "device": "cpu"}  # lm-eval's own arguments stay with lm-eval
    assert set(args) <= set(ENGINE_ARGS) == set(EngineConfig.model_args())
    config = EngineConfig(**args)
    assert config.recall_k == (1, 2, 8) and config.shadows == ("gate", "quasi") and config.window is False


def test_the_cli_flags_are_the_config_s_flag_options_with_its_defaults():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    flagged = [f for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]]
    defaults = vars(parser.parse_args([]))
    assert defaults == {f.name: f.default for f in flagged}
    parsed = vars(parser.parse_args(["--cache-capacity", "8", "--link", "ufs4", "--cache-policy", "lfu"]))
    assert EngineConfig(**parsed) == EngineConfig(cache_capacity=8, link="ufs4", cache_policy="lfu")
