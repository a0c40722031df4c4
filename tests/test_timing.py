"""One timing protocol for every TPOT: threads pinned and recorded, the machine recorded, a warm-up,
TPOT with its spread, and timings from a busy machine flagged instead of printed bare."""
import gc
import json

import pytest
import torch

from evalsuite import timing
from evalsuite.generate import load_model
from evalsuite.perf.decode import greedy, random_prompt
from evalsuite.lm.suite import format_rows, run_suite
from evalsuite.results import ResultsDB

from .helpers import shipped_model


def row(**values):
    base = {"model": "m", "mode": "on-demand", "task": "t", "metric": "exact_match,none", "accuracy": 0.5,
            "recall": None, "hit_rate": 0.4, "tpot_ms": 5.0, "tpot_p10": 4.5, "tpot_p90": 6.25, "busy": None,
            "identical_share": 1.0, "run": 1, "seconds": 1.0}
    return {**base, **values}


def test_the_table_names_the_metric_gives_the_spread_and_flags_a_busy_machine():
    quiet = format_rows([row()])
    assert "exact_match,none" in quiet and "5.00 [4.50-6.25]" in quiet and "busy" not in quiet
    busy = format_rows([row(), row(mode="resident", busy=3.5)])
    assert "5.00 [4.50-6.25]*" in busy and "load average up to 3.5" in busy


def test_the_table_flags_tpots_timed_while_the_machine_changed_speed():
    steady = format_rows([row(probes=[10.0, 10.5]), row(mode="resident", probes=[10.2, 10.1])])
    assert "!" not in steady
    # under the flag's mark the table still says how far apart the model's modes were timed
    assert "speed varied by up to 5 % (m) while" in steady
    drifted = format_rows([row(probes=[10.0, 10.5]), row(mode="resident", probes=[16.0, 15.0]),
                           row(model="other", probes=[10.0, 10.8])])
    assert "5.00 [4.50-6.25]!" in drifted and "m: this machine's speed changed by up to 60 %" in drifted
    assert "other:" not in drifted  # each model's rows are compared among themselves
    assert "up to 8 % (other) while" in drifted and "(m) while" not in drifted
    assert "timing.probe" not in format_rows([row()])  # no probes (a device's timing): nothing to say


def test_the_table_says_in_one_line_how_its_modes_were_compared():
    measured = format_rows([row(probes=[10.0, 10.5]), row(mode="resident", probes=[10.2, 10.1])]).splitlines()
    assert measured[-1].startswith("modes compared: each mode timed over all its tasks in turn (in --modes order, "
                                   "resident first), not interleaved")
    replayed = format_rows([row(replayed=True), row(mode="resident", replayed=True)]).splitlines()
    assert replayed[-1].startswith("modes compared: ~ rows replayed from one cost measurement per model")
    assert "in turn" not in replayed[-1]
    both = timing.order_line([row(), row(replayed=True)])
    assert "in turn" in both and "~ rows replayed" in both and "\n" not in both
    assert timing.order_line([row(tpot_ms=None)]) is None and "modes compared" not in format_rows([row(tpot_ms=None)])


def test_the_probe_times_a_fixed_piece_of_work(monkeypatch):
    assert 0 < timing.probe() < 1e3
    assert timing.probe("cuda") is None  # a device's timing is not the CPU's to vouch for

    def pieces(seconds):  # perf_counter around each piece of the probe
        assert len(seconds) == timing.PROBE_REPEATS
        ticks = iter([t for i, piece in enumerate(seconds) for t in (float(i), i + piece)])
        monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))

    pieces([0.010, 0.004, 0.0041, 0.0042, 0.030, 0.0043, 0.004, 0.0044, 0.0045])
    assert timing.probe() == pytest.approx(4.3)  # the median piece: two interruptions do not count
    pieces([0.004] + [0.009] * (timing.PROBE_REPEATS - 1))  # the core shared with other work: most pieces slow
    assert timing.probe() == pytest.approx(9.0)  # which the fastest piece alone would hide
    assert timing.spread([4.0, 4.4]) == pytest.approx(1.1) and timing.spread([4.0, None, 6.0]) == pytest.approx(1.5)
    assert timing.spread([None, None]) is None


def test_a_cpu_timing_is_busy_when_the_load_leaves_no_core_per_thread(monkeypatch):
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    assert timing.busy("cpu") is None  # two of four cores busy: the compute thread has one of its own
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (3.9, 3.0, 3.0))
    assert timing.busy("cpu") == 3.9
    with pytest.raises(ValueError, match="--threads 0"):
        timing.pin(0)


def test_a_frozen_heap_keeps_what_was_alive_from_the_collector_until_it_ends():
    assert gc.get_freeze_count() == 0
    class Cycle:  # garbage only a collection reclaims
        pass
    before = Cycle()
    before.me = before
    with timing.frozen_heap():
        assert gc.get_freeze_count() > 0  # everything alive on entry, `before` included
        made = Cycle()
        made.me = made
        del made
        assert gc.collect() >= 1  # what the frozen work allocated is still collected
        with timing.frozen_heap():  # a caller's frozen heap is left as it is
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # back in the collector's reach
    del before
    assert gc.collect() >= 1


def test_the_bench_decodes_with_a_frozen_heap():
    model, _ = load_model(shipped_model())
    frozen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: frozen.append(gc.get_freeze_count() > 0))
    greedy(model, random_prompt(model, 4), 3)
    hook.remove()
    assert frozen == [True] * 3 and gc.get_freeze_count() == 0


def test_eval_pins_threads_records_them_and_the_machine_and_warms_up(tmp_path, monkeypatch):
    monkeypatch.setattr("evalsuite.lm.request.git_commit", lambda: "0" * 40)
    warmed = []
    real = timing.warm_up
    monkeypatch.setattr(timing, "warm_up", lambda *a: (warmed.append(a[2].mode), real(*a)))
    probe, frozen = timing.probe, []  # taken around each task, inside its frozen heap
    monkeypatch.setattr(timing, "probe", lambda *a: (frozen.append(gc.get_freeze_count() > 0), probe(*a))[1])
    torch.set_num_threads(2)
    db = tmp_path / "r.db"
    rows = run_suite([shipped_model()], ["resident", "on-demand"], ["evalsuite_yesno"], 2, db_url=f"sqlite:///{db}",
                     out_dir=str(tmp_path / "json"), progress=lambda *_: None, threads=1)
    assert torch.get_num_threads() == 1 and warmed == ["resident", "on-demand"]
    assert frozen == [True] * 4 and gc.get_freeze_count() == 0  # the tasks are timed with the start-up heap frozen
    with ResultsDB(f"sqlite:///{db}") as results:
        configs = [json.loads(c) if isinstance(c, str) else c for c in results.runs()["config"]]
    assert all(c["threads"] == 1 and c["machine"]["cores"] >= 1 and c["machine"]["device"] == "cpu" for c in configs)
    # the warm-up's timings are not the task's: one request per document, none extra
    engines = [json.loads(p.read_text())["engine"]["evalsuite_yesno"] for p in (tmp_path / "json").iterdir()]
    assert [e["requests"] for e in engines] == [2, 2]
    assert all(r["tpot_p10"] <= r["tpot_ms"] <= r["tpot_p90"] for r in rows)
    assert all(len(r["probes"]) == 2 and min(r["probes"]) > 0 for r in rows)  # the machine's speed around each task
