"""A device this machine lacks (`cuda` without CUDA) is one line, before any model loads, in every interface."""
import os
import subprocess
import sys

import lm_eval
import pytest
import torch
import transformers

from evalsuite.cli import main

from .helpers import TASKS, shipped_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# a device this machine does not have: cuda on a machine without CUDA, one past the last GPU elsewhere
ABSENT = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the refusal must come first."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the device was checked")

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(auto, "from_pretrained", load)
        monkeypatch.setattr(auto, "from_config", load)


def test_eval_refuses_the_device_in_one_line_naming_the_flag(tmp_path, capsys, no_loading):
    db = tmp_path / "r.db"
    code = main(["eval", "--model", shipped_model(), "--modes", "resident", "--tasks", "evalsuite_yesno",
                 "--limit", "1", "--device", ABSENT, "--db", f"sqlite:///{db}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--device '{ABSENT}'" in err and "--device cpu" in err and "device=" not in err


@pytest.mark.parametrize("adapter", ["specmoe", "specmoe-vlm"])
def test_the_adapters_refuse_the_device_model_arg_before_loading(adapter, no_loading):
    model = shipped_model("tiny-qwen3-vl-moe" if adapter == "specmoe-vlm" else "tiny-qwen3-moe")
    with pytest.raises(ValueError, match=f"specmoe: device='{ABSENT}': .*use device=cpu") as refused:
        lm_eval.simple_evaluate(model=adapter, model_args=f"pretrained={model},mode=on-demand,device={ABSENT}",
                                tasks=["evalsuite_yesno"], limit=1)
    assert "\n" not in str(refused.value)


def test_lm_eval_command_with_device_gets_one_line():
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "evalsuite-lm-eval"), "--model", "specmoe", "--model_args",
         f"pretrained={shipped_model()},mode=on-demand", "--device", ABSENT, "--include_path", TASKS,
         "--tasks", "evalsuite_yesno", "--limit", "1"], capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"evalsuite-lm-eval: error: specmoe: device='{ABSENT}'")
