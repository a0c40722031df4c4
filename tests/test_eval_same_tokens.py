"""The "same tok" column of `evalsuite eval`: every non-resident row compared with a resident run, whatever the
order of --modes, from a stored resident run of the same configuration when the invocation ran none, and under
--plan replay; rows in the order the modes were asked for."""
from evalsuite.lm.suite import run_suite
from evalsuite.results import ResultsDB

from .helpers import eval_request, shipped_model

TASK = "evalsuite_arith"


def _suite(db, modes, limit=3, **options):
    return run_suite([shipped_model("tiny-qwen3-moe")], modes, [TASK], limit, db_url=f"sqlite:///{db}",
                     out_dir=str(db.parent / "out"), progress=lambda *_: None, **eval_request(**options))


def _label(row) -> str:
    return row["mode"] + (f"/{row['predictor']}" if row.get("predictor") else "")


def _shares(rows) -> dict:
    return {r["mode"]: r["identical_share"] for r in rows}


def test_resident_asked_for_last_is_still_the_reference_and_rows_keep_the_asked_order(tmp_path):
    db = tmp_path / "r.db"
    rows = _suite(db, ["speculative", "on-demand", "resident"])
    assert [r["mode"] for r in rows] == ["speculative", "on-demand", "resident"]
    shares = _shares(rows)
    assert shares["on-demand"] == 1.0 and 0.0 <= shares["speculative"] <= 1.0 and shares["resident"] is None
    with ResultsDB(f"sqlite:///{db}") as store:
        speculative = next(r.id for r in store.runs().itertuples() if r.mode == "speculative")
        assert store.samples([speculative])["identical_share"].notna().all()


def test_a_stored_resident_run_of_the_same_configuration_is_the_reference(tmp_path):
    db = tmp_path / "r.db"
    _suite(db, ["resident"])
    assert _shares(_suite(db, ["on-demand"]))["on-demand"] == 1.0
    # another limit is another configuration: no stored resident run fits, so no comparison is shown
    assert _shares(_suite(db, ["on-demand"], limit=2))["on-demand"] is None


def test_replayed_rows_are_compared_in_the_asked_order(tmp_path):
    db = tmp_path / "r.db"
    modes = ["speculative", "router-preserving", "on-demand", "resident"]
    rows = _suite(db, modes, limit=4, plan="replay", batch_size=4)
    # each mode runs its own method: SpecPrefetch's adapter, Speculating Experts' quasi state
    assert [_label(r) for r in rows] == ["speculative/quasi", "router-preserving/adapter", "on-demand", "resident"]
    shares = _shares(rows)
    assert shares["on-demand"] == shares["router-preserving"] == 1.0 and shares["resident"] is None
    assert 0.0 <= shares["speculative"] <= 1.0
    # a speculative pass alone compares with the resident pass stored above (same batch, limit, ...)
    again = _suite(db, ["speculative"], limit=4, plan="replay", batch_size=4, fresh=True)
    assert _shares(again)["speculative"] == shares["speculative"]
