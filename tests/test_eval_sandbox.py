"""Every stored run that scores generated code records the confinement that was in force; a system that
offers only the weak sandbox is refused before anything runs, unless the weak one is asked for by name."""
import os
import sqlite3

import pytest

from evalsuite.cli import main
from evalsuite.lm.suite import run_suite
from evalsuite.results import ResultsDB
from evalsuite.results.database import stored_config
from evalsuite.scoring.sandbox import CHOICE_ENV, NO_NAMESPACES_ENV, confinement_in_force

from .helpers import shipped_model


@pytest.fixture(autouse=True)
def _no_sandbox_choice(monkeypatch):
    for name in (CHOICE_ENV, NO_NAMESPACES_ENV):  # set, then removed: teardown removes what a test set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_a_code_run_records_the_confinement_and_other_runs_record_none(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    common = dict(db_url=url, out_dir=str(tmp_path / "json"), progress=lambda *_: None, confirm_run_unsafe_code=True)
    run_suite([shipped_model("tiny-qwen3-moe")], ["resident"], ["evalsuite_code"], 1, **common)
    run_suite([shipped_model("tiny-qwen3-moe")], ["resident"], ["evalsuite_yesno"], 1, **common)
    with ResultsDB(url) as db:
        configs = {row["tasks"][0]: row for row in (stored_config(db.run(i)["config"]) for i in (1, 2))}
    assert configs["evalsuite_code"]["sandbox"] == confinement_in_force() == "namespaces"
    assert configs["evalsuite_yesno"]["sandbox"] is None


def test_weak_only_system_is_refused_before_anything_is_stored(tmp_path, monkeypatch, capsys):
    db = tmp_path / "results.db"
    monkeypatch.setenv(NO_NAMESPACES_ENV, "1")  # behave as a container without CAP_SYS_ADMIN
    code = main(["eval", "--model", shipped_model("tiny-qwen3-moe"), "--modes", "resident", "--tasks",
                 "evalsuite_yesno,evalsuite_code", "--limit", "1", "--db", f"sqlite:///{db}",
                 "--out", str(tmp_path / "json"), "--confirm-run-unsafe-code"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--sandbox weak" in err
    if db.exists():  # opened to check the URL at most: no run, no task
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_weak_sandbox_by_name_runs_and_is_recorded(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    monkeypatch.setenv(NO_NAMESPACES_ENV, "1")
    code = main(["eval", "--model", shipped_model("tiny-qwen3-moe"), "--modes", "resident", "--tasks",
                 "evalsuite_code", "--limit", "1", "--db", url, "--out", str(tmp_path / "json"),
                 "--confirm-run-unsafe-code", "--sandbox", "weak"])
    assert code == 0 and os.environ[CHOICE_ENV] == "weak"
    with ResultsDB(url) as db:
        run = db.run(1)
    assert run["status"] == "complete" and stored_config(run["config"])["sandbox"] == "weak"
