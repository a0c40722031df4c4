"""The sandbox runs wherever the evaluator's Python is reached from, e.g. a virtual environment inside a
checkout under /tmp, which each run's private /tmp would otherwise hide from the program's interpreter."""
import subprocess
import sys

from evalsuite.scoring.sandbox import run_python


def test_a_venv_under_tmp_still_runs_programs(tmp_path, monkeypatch):
    venv = tmp_path / "venv"  # pytest's tmp_path lies under /tmp
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    result = run_python("import json\nprint(json.dumps([1, 2]))")
    assert result.exited_cleanly, result
    assert result.stdout == "[1, 2]\n"
