"""PostgreSQL round trip, against the server named by EVALSUITE_TEST_POSTGRES_URL.

Each test works in a schema of its own, dropped afterwards, so the database's other contents are never touched.
Without the variable the tests skip (no server); with it set, an unreachable server is a failure.
"""
import os
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from evalsuite.results import ResultsDB
from evalsuite.results.compare import compare
from evalsuite.results.schema import LATEST_VERSION

from .results_data import make_run

SERVER = os.environ.get("EVALSUITE_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not SERVER, reason="no PostgreSQL server: set EVALSUITE_TEST_POSTGRES_URL="
                                "postgresql+psycopg://user:password@host/db to run the PostgreSQL round trip")


@pytest.fixture
def postgres_url():
    schema = f"evalsuite_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(make_url(SERVER).set(drivername="postgresql+psycopg"))
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    url = make_url(SERVER).set(drivername="postgresql+psycopg").update_query_dict(
        {"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def test_round_trip_of_runs_metrics_samples_and_engine_rows(postgres_url):
    db = ResultsDB(postgres_url)
    assert db.sql_engine.dialect.name == "postgresql" and db.schema_version_found == 0
    base = make_run(db, mode="resident", correct=[1] * 12 + [0] * 3, tpot_ms=9.0, layer_recall=None)
    spec = make_run(db, mode="speculative", predictor="quasi", correct=[1] * 10 + [0] * 5, tpot_ms=6.5,
                    recall=0.9, layer_recall=[0.95, 0.85])
    running = db.start_run({"model": "tiny", "mode": "on-demand", "config_extra": {"nested": [1, 2]}})
    again = ResultsDB(postgres_url)  # a second connection sees everything and does not migrate again
    assert again.schema_version_found == LATEST_VERSION
    runs = again.runs().set_index("id")
    assert runs.loc[[base, spec, running], "status"].tolist() == ["complete", "complete", "running"]
    assert runs.loc[running, "config"]["config_extra"] == {"nested": [1, 2]}
    assert runs.loc[spec, "cache_capacity"] == "0.5" and runs.loc[spec, "seed"] == 1234
    samples = again.samples([spec])
    assert len(samples) == 15 and samples["correct"].sum() == 10 and samples["prediction"][0] == "answer 0"
    engine = again.engine_metrics([spec])
    assert engine["layer"].isna().sum() == 1 and engine.dropna(subset=["layer"])["recall_at_k"].tolist() == [0.95, 0.85]
    row = compare(again, base, spec).iloc[0]
    assert row["delta"] == pytest.approx(-2 / 15) and row["tpot_ms_delta"] == pytest.approx(-2.5)
    assert row["p_value"] == pytest.approx(0.5)  # two discordant pairs, both for A


def test_record_lm_eval_on_postgres(postgres_url):
    db = ResultsDB(postgres_url)
    results = {"results": {"arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": 0.5}},
               "n-samples": {"arc": {"original": 10, "effective": 2}},
               "samples": {"arc": [{"doc_id": i, "target": 0, "filter": "none", "metrics": ["acc"], "acc": float(i == 0),
                                    "filtered_resps": [[-1.0, True]]} for i in range(2)]}}
    run_id = db.record_lm_eval({"model": "tiny", "mode": "resident"}, results)
    assert db.task_metrics([run_id])[["metric", "value", "stderr", "n"]].values.tolist() == [["acc", 0.5, 0.5, 2]]
    assert db.samples([run_id])["correct"].tolist() == [True, False]
