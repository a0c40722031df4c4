"""Bad input to every command: one line on stderr, exit code 2, and the stored results untouched.

Most cases call `evalsuite.cli.main([...])` in this process (each `evalsuite` start imports torch
and lm-eval); a few run the installed console scripts to check the real entry points.
"""
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys

import pytest

from evalsuite.cli import main

from .helpers import TASKS, shipped_model
from .results_data import make_run, open_db

UNREACHABLE_DB = "postgresql://nobody@127.0.0.1:1/x"
BIN = os.path.dirname(sys.executable)
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm lines on stderr are progress, not messages


def message_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if line.strip() and not PROGRESS_BAR.search(line)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A results database with two finished runs, and a snapshot of its bytes and rows."""
    folder = tmp_path_factory.mktemp("results")
    db = open_db(folder)
    make_run(db, mode="resident", correct=[1, 1, 0, 1])
    make_run(db, mode="speculative", predictor="quasi", correct=[1, 0, 0, 1], recall=0.7)
    db.close()
    path = folder / "results.db"
    return path, snapshot(path)


def snapshot(path):
    """Every row of every table (read-only), and the database file's bytes."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        tables = [name for (name,) in connection.execute("select name from sqlite_master where type='table'")]
        rows = {t: sorted(map(repr, connection.execute(f'select * from "{t}"'))) for t in tables}
    connection.close()
    return rows, path.read_bytes()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "empty.jsonl").write_text("")
    (folder / "blank-rows.jsonl").write_text('{"other": 1}\n{"text": "   "}\n')
    (folder / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (folder / "gates-broken.yaml").write_text("- {name: x, where: [unclosed\n")
    (folder / "gates-unknown.yaml").write_text("- {name: x, metric: nonsense, min: 2}\n")
    (folder / "not-a-model").mkdir()
    (folder / "predictor.safetensors").write_bytes(b"\x00" * 32)
    (folder / "a-file").write_text("occupied")
    (folder / "gates-nan.yaml").write_text("- {name: floor, where: {mode: resident}, metric: exact_match, min: .nan}\n")
    (folder / "gates-text.yaml").write_text("- {name: floor, where: {mode: resident}, metric: exact_match, min: high}\n")
    truncated = copy_model(folder / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for name, top_k in (("top-k-zero", 0), ("top-k-too-many", 17)):
        config_path = copy_model(folder / name) / "config.json"
        config = json.loads(config_path.read_text())
        config["num_experts_per_tok"] = top_k
        config_path.write_text(json.dumps(config))
    for name, fields in SWEEPS.items():
        cell = {"name": name, "models": [shipped_model()], "modes": ["resident", "on-demand"], "tasks": ["evalsuite_arith"],
                "limit": 1, "out": str(folder / "sweep-out"), **fields}
        (folder / f"sweep-{name}.yaml").write_text(json.dumps(cell))
    return folder


def copy_model(folder):
    shutil.copytree(shipped_model(), folder)
    return folder


# sweeps whose first cell (resident) is fine and whose later cells are not
SWEEPS = {"capacity": {"cache_capacities": [-1]}, "predictor": {"modes": ["resident", "speculative"],
                                                                 "predictors": ["psychic"]},
          "link": {"links": ["carrier-pigeon"]}, "task": {"tasks": ["evalsuite_arith", "no_such_task"]},
          "model": {"models": [shipped_model(), "/nonexistent/model"]}}


def cases(f, db):
    """(command line, words the one-line message should contain)."""
    tiny = ["--model", "tiny:qwen3_moe"]
    quick = ["--model", shipped_model(), "--modes", "resident", "--limit", "1"]
    return {
        # generate
        "generate: wrong type": (["generate", "--max-new-tokens", "many"], "invalid int value"),
        "generate: negative tokens": (["generate", *tiny, "--max-new-tokens", "-3"], "max_new_tokens"),
        "generate: missing model": (["generate", "--model", str(f / "nope")], "nope"),
        "generate: not a model": (["generate", "--model", str(f / "not-a-model")], "not-a-model"),
        "generate: capacity zero": (["generate", *tiny, "--cache-capacity", "0"], "cache_capacity"),
        "generate: capacity nonsense": (["generate", *tiny, "--cache-capacity", "lots"], "cache_capacity"),
        "generate: unknown mode": (["generate", *tiny, "--modes", "resident,warp"], "warp"),
        "generate: unknown link": (["generate", *tiny, "--link", "carrier-pigeon"], "unknown link"),
        "generate: unknown dtype": (["generate", *tiny, "--dtype", "int3"], "invalid choice"),
        "generate: missing artifact": (["generate", *tiny, "--modes", "router-preserving", "--predictor", "quasi",
                                        "--predictor-path", str(f / "missing.safetensors")], "predictor"),
        "generate: garbage artifact": (["generate", *tiny, "--modes", "router-preserving", "--predictor", "quasi",
                                        "--predictor-path", str(f / "predictor.safetensors")], "predictor"),
        "generate: json into a folder": (["generate", *tiny, "--max-new-tokens", "1", "--json", str(f / "nope" / "x")],
                                         "nope"),
        # calibrate
        "calibrate: empty dataset": (["calibrate", *tiny, "--out", str(f / "out"), "--data", str(f / "empty.jsonl")],
                                     "no calibration text"),
        "calibrate: rows without text": (["calibrate", *tiny, "--out", str(f / "out"),
                                          "--data", str(f / "blank-rows.jsonl")], "no calibration text"),
        "calibrate: broken jsonl": (["calibrate", *tiny, "--out", str(f / "out"), "--data", str(f / "broken.jsonl")],
                                    "broken.jsonl"),
        "calibrate: missing dataset": (["calibrate", *tiny, "--out", str(f / "out"),
                                        "--data", str(f / "missing.jsonl")], "missing.jsonl"),
        "calibrate: zero prompts": (["calibrate", *tiny, "--out", str(f / "out"), "--prompts", "0"], "prompts"),
        "calibrate: wrong type": (["calibrate", *tiny, "--out", str(f / "out"), "--epochs", "ten"],
                                  "invalid int value"),
        "calibrate: horizon out of range": (["calibrate", *tiny, "--out", str(f / "out"), "--horizon", "3"],
                                            "invalid choice"),
        "calibrate: out is a file": (["calibrate", *tiny, "--out", str(f / "a-file"), "--prompts", "2",
                                      "--epochs", "0", "--predictor", "frequency"], "a-file"),
        "calibrate: missing --out": (["calibrate", *tiny], "--out"),
        # eval
        "eval: missing model": (["eval", "--model", str(f / "nope"), "--db", db], "no model directory"),
        "eval: wrong type": (["eval", "--limit", "some", "--db", db], "invalid int value"),
        "eval: negative limit": (["eval", "--model", str(f / "not-a-model"), "--limit", "-4", "--db", db], "limit"),
        "eval: unreachable database": (["eval", "--model", str(f / "not-a-model"), "--db", UNREACHABLE_DB],
                                       "database"),
        "eval: unknown task": (["eval", "--model", str(f / "not-a-model"), "--tasks", "no_such_task", "--db", db],
                               "no_such_task"),
        "eval: empty task list": (["eval", *quick, "--tasks", "", "--db", db], "--tasks"),
        "eval: task list of commas": (["eval", *quick, "--tasks", ",", "--db", db], "--tasks"),
        "eval: empty model list": (["eval", "--model", "", "--tasks", "evalsuite_arith", "--db", db], "--model"),
        "eval: code task unconfirmed": (["eval", *quick, "--tasks", "evalsuite_arith,evalsuite_code", "--db", db],
                                        "--confirm-run-unsafe-code"),
        "eval: group with a code task unconfirmed": (["eval", *quick, "--tasks", "evalsuite_arith,evalsuite_tiny",
                                                      "--db", db], "--confirm-run-unsafe-code"),
        "eval: unknown predictor after a resident run": (["eval", *quick, "--modes", "resident,speculative",
                                                          "--predictor", "psychic", "--tasks", "evalsuite_arith",
                                                          "--db", db], "psychic"),
        "eval: unknown link after a resident run": (["eval", *quick, "--modes", "resident,on-demand", "--link",
                                                     "carrier-pigeon", "--tasks", "evalsuite_arith", "--db", db],
                                                    "carrier-pigeon"),
        "eval: capacity below one expert": (["eval", *quick, "--modes", "resident,on-demand", "--cache-capacity", "-1",
                                             "--tasks", "evalsuite_arith", "--db", db], "--cache-capacity -1"),
        "eval: truncated checkpoint": (["eval", "--model", str(f / "truncated"), "--modes", "resident", "--limit", "1",
                                        "--tasks", "evalsuite_arith", "--db", db], "model.safetensors"),
        "eval: top-k zero": (["eval", "--model", str(f / "top-k-zero"), "--modes", "resident", "--limit", "1",
                              "--tasks", "evalsuite_arith", "--db", db], "num_experts_per_tok=0"),
        "eval: top-k above the experts": (["eval", "--model", str(f / "top-k-too-many"), "--modes", "resident",
                                           "--limit", "1", "--tasks", "evalsuite_arith", "--db", db],
                                          "num_experts_per_tok=17"),
        # results
        "runs: unreachable database": (["runs", "--db", UNREACHABLE_DB], "cannot open results database"),
        "runs: wrong type": (["runs", "--last", "few", "--db", db], "invalid int value"),
        "runs: unknown status": (["runs", "--status", "lost", "--db", db], "invalid choice"),
        "runs: database in a missing folder": (["runs", "--db", str(f / "nope" / "r.db")], "nope"),
        "runs: database that is not one": (["runs", "--db", str(f / "gates-broken.yaml")], "gates-broken.yaml"),
        "report: unreachable database": (["report", "--db", UNREACHABLE_DB, "--out", str(f / "rep")], "database"),
        "report: out is a file": (["report", "--db", db, "--out", str(f / "a-file")], "a-file"),
        "compare: unknown run": (["compare", "1", "99", "--db", db], "no run with id 99"),
        "compare: wrong type": (["compare", "one", "2", "--db", db], "one"),
        "compare: unreachable database": (["compare", "1", "2", "--db", UNREACHABLE_DB], "database"),
        "gate: missing rules": (["gate", "--config", str(f / "nope.yaml"), "--db", db], "not found"),
        "gate: broken yaml": (["gate", "--config", str(f / "gates-broken.yaml"), "--db", db], "gates-broken.yaml"),
        "gate: unknown rule": (["gate", "--config", str(f / "gates-unknown.yaml"), "--db", db], "needs exactly one of"),
        "gate: threshold not a number": (["gate", "--config", str(f / "gates-nan.yaml"), "--db", db], "'floor': min"),
        "gate: threshold text": (["gate", "--config", str(f / "gates-text.yaml"), "--db", db], "'floor': min"),
        **{f"sweep: bad {name}": (["sweep", str(f / f"sweep-{name}.yaml"), "--db", db], words)
           for name, words in (("capacity", "cache_capacity=-1"), ("predictor", "psychic"),
                               ("link", "carrier-pigeon"), ("task", "no_such_task"), ("model", "/nonexistent/model"))},
        "gate: unreachable database": (["gate", "--config", str(f / "gates-unknown.yaml"), "--db", UNREACHABLE_DB],
                                       "database"),
    }


CASE_NAMES = list(cases(__import__("pathlib").Path("f"), "db"))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_gets_one_line_and_exit_2(name, stored, files, capsys):
    db_path, before = stored
    argv, words = cases(files, str(db_path))[name]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse exits by itself
        code = exit_.code
    lines = message_lines(capsys.readouterr().err)
    shown = "\n".join(lines)[-1500:]
    assert code == 2, f"exit code {code}; stderr: {shown}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{shown}"
    assert lines[0].startswith("evalsuite") and "error" in lines[0]
    assert words.lower() in lines[0].lower(), lines[0]
    assert snapshot(db_path) == before, "a stored result changed"


def test_installed_evalsuite_command(stored):
    db_path, before = stored
    result = subprocess.run([os.path.join(BIN, "evalsuite"), "runs", "--db", UNREACHABLE_DB, "--last", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(message_lines(result.stderr)) == 1, result.stderr
    assert "cannot open results database" in result.stderr
    assert snapshot(db_path) == before


@pytest.mark.parametrize("model_args,words", [
    ("pretrained=tiny-nowhere,mode=fast", "mode='fast'"),
    (f"pretrained={shipped_model()},mode=on-demand,transfer_timeout_s=abc", "transfer_timeout_s='abc'"),
    (f"pretrained={shipped_model()},mode=on-demand,transfer_timeout_s=inf", "transfer_timeout_s=inf"),
    (f"pretrained={shipped_model()},mode=on-demand,horizon=0", "horizon=0"),
    ("pretrained=/nonexistent/model,mode=on-demand", "/nonexistent/model"),
])
def test_lm_eval_command_with_bad_model_args(tmp_path, model_args, words):
    result = subprocess.run([os.path.join(BIN, "evalsuite-lm-eval"), "--model", "specmoe", "--model_args", model_args,
                             "--tasks", "evalsuite_arith", "--include_path", TASKS,
                             "--limit", "1", "--output_path", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path)
    # lm-eval logs INFO lines on stderr; the error itself must be one line, with no traceback
    lines = [line for line in message_lines(result.stderr) if "error" in line.lower()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "out").exists()
