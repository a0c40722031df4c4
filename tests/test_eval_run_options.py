"""`evalsuite eval`'s device, dtype, batch size, few-shot, generation arguments, chat template and seed reach
lm-eval and the adapter, are stored on the run, and make a run with other settings a different run."""
import json
import os
import shutil
import subprocess

import pytest

from evalsuite.cli import main
from evalsuite.lm.run_options import RunOptions
from evalsuite.results import ResultsDB

from .helpers import REPO, eval_request, shared_data, shipped_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _one_code_version(monkeypatch):
    # the checkout is shared: a commit landing between two evaluations would change their configuration
    monkeypatch.setattr("evalsuite.lm.request.git_commit", lambda: "0" * 40)


def suite(db, out, **options):
    from evalsuite.lm.suite import run_suite

    return run_suite([shipped_model()], ["on-demand"], ["evalsuite_yesno"], 3, db_url=f"sqlite:///{db}",
                     out_dir=str(out), progress=lambda *_: None, **eval_request(**options))


def stored(db) -> list[dict]:
    with ResultsDB(f"sqlite:///{db}") as results:
        return [json.loads(c) if isinstance(c, str) else c for c in results.runs().sort_values("id")["config"]]


def lm_eval_json(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.iterdir(), key=lambda p: p.stat().st_mtime)]


def test_settings_reach_lm_eval_and_the_stored_run_and_tell_runs_apart(tmp_path):
    db, out = tmp_path / "r.db", tmp_path / "json"
    suite(db, out, batch_size=2, gen_kwargs="max_gen_toks=4", seed=3)
    config = stored(db)[0]
    assert (config["batch_size"], config["gen_kwargs"], config["seed"]) == (2, {"max_gen_toks": 4}, 3)
    assert config["device"] == "cpu"
    assert config["num_fewshot"] is None and config["apply_chat_template"] is False
    results = lm_eval_json(out)[0]
    assert results["config"]["random_seed"] == 3
    assert results["config"]["fewshot_seed"] == 3 and results["config"]["torch_seed"] == 3
    sample = results["samples"]["evalsuite_yesno"][0]
    assert sample["arguments"][0][1]["max_gen_toks"] == 4  # the task's own 96 overridden
    # 3 documents at batch 2 reach the model as 2 batched generate calls (at batch 1 they would be 3)
    assert results["engine"]["evalsuite_yesno"]["requests"] == 2

    assert suite(db, out, batch_size=2, gen_kwargs="max_gen_toks=4", seed=3)[0]["run"] == 1  # resumed, not re-run
    for changed in ({"batch_size": 1}, {"gen_kwargs": "max_gen_toks=5"}, {"seed": 4}, {"dtype": "bfloat16"}):
        suite(db, out, **{"batch_size": 2, "gen_kwargs": "max_gen_toks=4", "seed": 3, **changed})
    configs = stored(db)
    assert len(configs) == 5  # each differing setting made a run of its own
    assert configs[0]["dtype"] == "float32" and configs[4]["dtype"] == "bfloat16"  # the checkpoint's own, then asked


@pytest.mark.skipif(shared_data() is None, reason="benchmark data directory (../shared/data) not found")
def test_num_fewshot_sets_the_examples_and_a_task_that_fixes_zero_is_refused(tmp_path, monkeypatch):
    from evalsuite.lm.suite import run_suite

    monkeypatch.setenv("EVALSUITE_DATA_DIR", shared_data())
    db, out = tmp_path / "r.db", tmp_path / "json"
    run_suite([shipped_model()], ["resident"], ["gsm8k_es_5shot"], 1, db_url=f"sqlite:///{db}", out_dir=str(out),
              run=RunOptions(num_fewshot=1, gen_kwargs="max_gen_toks=4"), progress=lambda *_: None)
    results = lm_eval_json(out)[0]
    assert results["n-shot"] == {"gsm8k_es_5shot": 1} and stored(db)[0]["num_fewshot"] == 1
    # lm-eval would silently keep 0 shots for a task whose config says 0: refused before anything is stored
    with pytest.raises(ValueError, match="evalsuite_arith fix\\(es\\) num_fewshot: 0") as refused:
        run_suite([shipped_model()], ["resident"], ["evalsuite_arith"], 1, db_url=f"sqlite:///{db}",
                  run=RunOptions(num_fewshot=2))
    assert "\n" not in str(refused.value) and len(stored(db)) == 1


def test_apply_chat_template_formats_the_prompts(tmp_path):
    model = tmp_path / "chatty"
    shutil.copytree(shipped_model(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    from evalsuite.lm.suite import run_suite

    db, out = tmp_path / "r.db", tmp_path / "json"
    run_suite([str(model)], ["resident"], ["evalsuite_yesno"], 1, db_url=f"sqlite:///{db}", out_dir=str(out),
              run=RunOptions(apply_chat_template=True), progress=lambda *_: None)
    prompt = lm_eval_json(out)[0]["samples"]["evalsuite_yesno"][0]["arguments"][0][0]
    assert prompt.startswith("<|user|>") and prompt.endswith("<|assistant|>")
    assert stored(db)[0]["apply_chat_template"] is True
    # the shipped tokenizer has no template: refused in one line, before a model loads
    assert main(["eval", "--model", shipped_model(), "--modes", "resident", "--tasks", "evalsuite_yesno",
                 "--limit", "1", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--apply-chat-template"]) == 2
    assert not (tmp_path / "x.db").exists() or stored(tmp_path / "x.db") == []


@pytest.mark.parametrize("flags, said", [
    (["--batch-size", "0"], "--batch-size 0 must be a whole number of at least 1"),
    (["--dtype", "float8"], "--dtype 'float8' is not one of: auto, float32, bfloat16, float16"),
    (["--gen-kwargs", "temperature"], "--gen-kwargs 'temperature': give name=value pairs"),
    (["--num-fewshot", "-1"], "--num-fewshot -1 must be a whole number of at least 0"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device")])
def test_bad_settings_get_one_line_naming_the_flag(tmp_path, capsys, flags, said):
    db = tmp_path / "r.db"
    code = main(["eval", "--model", shipped_model(), "--modes", "resident", "--tasks", "evalsuite_yesno",
                 "--limit", "1", "--db", f"sqlite:///{db}", *flags])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert not db.exists() or stored(db) == []


def test_make_eval_passes_every_setting():
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", "eval", "DEVICE=cuda:1", "DTYPE=bfloat16", "BATCH=4",
                          "FEWSHOT=5", "GEN_KWARGS=temperature=0.7,do_sample=True", "SEED=7", "CHAT_TEMPLATE=1"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "evalsuite eval" in line)
    for flag in ("--device cuda:1", "--dtype bfloat16", "--batch-size 4", "--num-fewshot 5",
                 "--gen-kwargs 'temperature=0.7,do_sample=True'", "--seed 7", "--apply-chat-template "):
        assert flag in line, line
    default = subprocess.run(["make", "-n", "-W", "pyproject.toml", "eval"], cwd=REPO, env=ENV, capture_output=True,
                             text=True, check=True).stdout
    assert "--device cpu" in default and "--batch-size 1" in default and "--apply-chat-template" not in default
