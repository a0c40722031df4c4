"""A failed evaluation stores why; a task whose generations cannot fit the model's context is refused first."""
import lm_eval
import pytest

from evalsuite.lm.suite import run_suite
from evalsuite.results import ResultsDB
from evalsuite.results.cli import cmd_runs

from .helpers import shipped_model


class Args:
    status, last = None, 50

    def __init__(self, db):
        self.db = db


def test_a_failed_run_stores_the_error_and_runs_lists_it(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'results.db'}"

    def explode(*args, **kwargs):
        raise RuntimeError("kernel exploded\nwith a long traceback-like tail")

    monkeypatch.setattr(lm_eval, "simple_evaluate", explode)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        run_suite([shipped_model("tiny-qwen3-moe")], ["resident"], ["evalsuite_yesno"], 2, db_url=url,
                  out_dir=str(tmp_path / "json"), progress=lambda *_: None)
    run = ResultsDB(url).run(1)
    assert (run["status"], run["error"]) == ("failed", "RuntimeError: kernel exploded")
    assert cmd_runs(Args(url)) == 0
    assert "RuntimeError: kernel exploded" in capsys.readouterr().out


def test_a_task_generating_more_tokens_than_the_context_holds_is_refused_before_any_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with pytest.raises(ValueError, match="humaneval_es generates up to 512 tokens.*context of 512") as caught:
        run_suite([shipped_model("tiny-qwen3-moe")], ["resident"], ["humaneval_es"], 2, db_url=url,
                  out_dir=str(tmp_path / "json"), progress=lambda *_: None, confirm_run_unsafe_code=True)
    assert "\n" not in str(caught.value)
    assert ResultsDB(url).runs().empty  # no empty 'failed' run left behind
