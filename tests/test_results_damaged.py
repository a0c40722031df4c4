"""Damaged results databases: refused at open in one line, before any model is loaded; a full disk
stops a write with one line and keeps what was stored."""
import sqlite3

import pytest
from sqlalchemy import event

from evalsuite.cli import main
from evalsuite.results import ResultsDB

from .helpers import shipped_model
from .results_data import make_run, open_db


def _stored(tmp_path, runs=3):
    db = open_db(tmp_path)
    for _ in range(runs):
        make_run(db, correct=tuple(i % 2 for i in range(200)))
    db.close()
    return tmp_path / "results.db"


def _corrupt_page(path, page: int) -> None:
    with sqlite3.connect(path) as conn:
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        assert conn.execute("PRAGMA page_count").fetchone()[0] > page
    with open(path, "r+b") as f:
        f.seek(size * (page - 1) + 8)
        f.write(b"\x17" * 600)


def _drop_table(path, table: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute(f"DROP TABLE {table}")
    conn.commit()
    conn.close()  # the last connection folds the WAL into the file: what follows must leave it as it is


@pytest.mark.parametrize("damage, message", [
    (lambda path: _corrupt_page(path, 6), "damaged .*quick_check"),
    (lambda path: _drop_table(path, "engine_metrics"), "missing table engine_metrics"),
])
def test_a_damaged_database_is_refused_at_open_without_changes(tmp_path, damage, message):
    path = _stored(tmp_path)
    damage(path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message) as caught:
        ResultsDB(str(path))
    assert "\n" not in str(caught.value)
    assert path.read_bytes() == before


@pytest.mark.parametrize("damage", [lambda path: _corrupt_page(path, 6),
                                    lambda path: _drop_table(path, "samples")])
def test_eval_on_a_damaged_database_exits_2_before_loading_a_model(tmp_path, damage, capsys, monkeypatch):
    import transformers

    path = _stored(tmp_path)
    damage(path)
    before = path.read_bytes()

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_model)
    code = main(["eval", "--model", shipped_model("tiny-qwen3-moe"), "--modes", "resident", "--tasks",
                 "evalsuite_yesno", "--limit", "1", "--db", str(path), "--out", str(tmp_path / "json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("evalsuite: error: results database")
    assert path.read_bytes() == before


def _fill_up(db) -> None:
    """From now on the file cannot grow: SQLite's max_page_count, as a full disk would."""
    @event.listens_for(db.sql_engine, "connect")
    def _full(dbapi_conn, _record):
        pages = dbapi_conn.execute("PRAGMA page_count").fetchone()[0]
        dbapi_conn.execute(f"PRAGMA max_page_count={pages}")

    db.sql_engine.dispose()  # pooled connections reconnect with the limit


def test_a_full_disk_stops_a_write_in_one_line_and_keeps_what_was_stored(tmp_path):
    db = open_db(tmp_path)
    kept = make_run(db)
    running = db.start_run({"model": "m"})
    _fill_up(db)
    samples = [{"doc_id": d, "metric": "acc", "score": 1.0, "prediction": "x" * 5000} for d in range(400)]
    with pytest.raises(ValueError, match="results database .* is full") as caught:
        db.add_task(running, "big", [{"metric": "acc", "value": 1.0}], [], samples)
    assert "\n" not in str(caught.value)
    assert db.samples([running]).empty and db.task_metrics([running]).empty  # nothing half-written
    assert db.task_metrics([kept])["value"].tolist() == [0.75] and len(db.samples([kept])) == 4
    assert sorted(db.runs()["id"]) == [kept, running]
