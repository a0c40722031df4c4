"""Runs written by other processes: one killed mid-run, and two writing one SQLite file at once."""
import multiprocessing
import os
import signal
import time

from evalsuite.results import ResultsDB

# forked writers start at once: a fresh interpreter would spend seconds importing torch via evalsuite
FORK = multiprocessing.get_context("fork")


def _write_run(url, name, tasks, samples, hang, run_ids):
    db = ResultsDB(url)
    run_id = db.start_run({"model": "tiny", "mode": name})
    for t in range(tasks):
        rows = [{"doc_id": d, "metric": "acc", "score": float((d + t) % 2), "prediction": f"{name} {t} {d}"}
                for d in range(samples)]
        db.add_task(run_id, f"task{t}", [{"metric": "acc", "value": 0.5, "n": samples}],
                    [{"layer": None, "tpot_ms": 1.0 + t}], rows)
    if hang:
        run_ids.put(run_id)
        time.sleep(600)  # killed here, before finish_run
    db.finish_run(run_id)
    run_ids.put(run_id)


def _writer(url, name, tasks, samples, hang=False):
    # one queue per child: a queue's write lock is shared by its writers, and a child killed just after a
    # put may die holding it, which would block every other writer of that queue for good
    run_ids = FORK.Queue()
    # daemon: a test that fails before reaping its children must not leave pytest waiting on them at exit
    process = FORK.Process(target=_write_run, args=(url, name, tasks, samples, hang, run_ids), daemon=True)
    process.start()
    return process, run_ids


def test_killed_writer_leaves_an_incomplete_run_with_its_finished_tasks(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    writer, run_ids = _writer(url, "speculative", tasks=3, samples=20, hang=True)
    run_id = run_ids.get(timeout=120)  # sent after three tasks were committed
    db = ResultsDB(url)
    assert db.run(run_id)["status"] == "running"  # alive: not mistaken for dead
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(timeout=30)
    assert ResultsDB(url).runs().set_index("id").loc[run_id, "status"] == "incomplete"
    assert sorted(db.task_metrics([run_id])["task"]) == ["task0", "task1", "task2"]
    assert len(db.samples([run_id])) == 3 * 20
    assert db.engine_metrics([run_id])["tpot_ms"].tolist() == [1.0, 2.0, 3.0]


def test_a_killed_child_not_yet_reaped_counts_as_dead(tmp_path):
    # between SIGKILL and wait() the child is a zombie: its pid still answers kill(pid, 0)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    writer, run_ids = _writer(url, "speculative", tasks=1, samples=2, hang=True)
    run_id = run_ids.get(timeout=120)
    os.kill(writer.pid, signal.SIGKILL)
    deadline = time.time() + 20
    while ResultsDB(url).run(run_id)["status"] == "running" and time.time() < deadline:
        time.sleep(0.1)
    assert ResultsDB(url).run(run_id)["status"] == "incomplete"
    writer.join(timeout=30)


def test_two_processes_writing_one_sqlite_file_lose_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"  # created by whichever writer opens it first
    tasks, samples = 60, 50
    writers = [_writer(url, name, tasks, samples) for name in ("resident", "on-demand")]
    written = sorted(run_ids.get(timeout=300) for _, run_ids in writers)
    for process, _ in writers:
        process.join(timeout=60)
    assert [process.exitcode for process, _ in writers] == [0, 0]
    db = ResultsDB(url)
    runs = db.runs()
    assert sorted(runs["id"]) == written
    assert set(runs["status"]) == {"complete"}
    for run_id, mode in runs[["id", "mode"]].itertuples(index=False):
        stored = db.samples([run_id])
        assert len(stored) == tasks * samples and len(db.task_metrics([run_id])) == tasks
        assert stored["prediction"].str.startswith(mode + " ").all()


# ---- two evaluations of one configuration started at once: one claims it, the other waits ------------
CONFIG = {"model": "tiny", "mode": "resident", "limit": 2, "tasks": ["task0", "task1", "task2"]}


def _claim_and_write(url, start, hang_after, after, claimed, log):
    from evalsuite.lm.runs import open_run

    db = ResultsDB(url)
    (after or start).wait()  # both claim at the same moment, or this one once the other has claimed
    messages = []
    claimed_run = open_run(db, dict(CONFIG), False, messages.append)
    claimed.set()
    run_id, done = claimed_run[0], claimed_run[-1]
    for n, task in enumerate(t for t in CONFIG["tasks"] if t not in done):
        if n == hang_after:
            log.put((run_id, sorted(done), messages))
            time.sleep(600)  # killed here
        time.sleep(0.3)  # the evaluation
        db.add_task(run_id, task, [{"metric": "acc", "value": 1.0, "n": 2}])
    db.finish_run(run_id)
    log.put((run_id, sorted(done), messages))


def _claimers(url, hang_after=(None, None), ordered=False):
    """Two processes evaluating CONFIG, each reporting on its own queue (see `_writer`); `ordered`: the second
    claims only once the first has (a machine under load could otherwise start the second first)."""
    start = FORK.Event()
    logs = [FORK.Queue(), FORK.Queue()]
    claimed = [FORK.Event(), FORK.Event()]
    after = [None, claimed[0] if ordered else None]
    processes = [FORK.Process(target=_claim_and_write, args=(url, start, hang, after[i], claimed[i], logs[i]),
                              daemon=True)
                 for i, hang in enumerate(hang_after)]
    for process in processes:
        process.start()
    start.set()
    return processes, logs


def test_two_evaluations_of_one_configuration_store_one_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    ResultsDB(url).close()
    processes, logs = _claimers(url)
    outcomes = sorted((log.get(timeout=120) for log in logs), key=lambda o: len(o[1]))
    for process in processes:
        process.join(timeout=60)
    assert [p.exitcode for p in processes] == [0, 0]
    runs = ResultsDB(url).runs()
    assert runs["id"].tolist() == [1] and runs["status"].tolist() == ["complete"]
    assert sorted(ResultsDB(url).task_metrics([1])["task"]) == CONFIG["tasks"]  # each task once
    (first, first_done, _), (second, second_done, waited) = outcomes
    assert first == second == 1 and first_done == [] and second_done == CONFIG["tasks"]
    assert any("waiting" in m for m in waited), waited


def test_a_waiting_evaluation_resumes_the_claim_of_one_that_died(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    ResultsDB(url).close()
    processes, logs = _claimers(url, hang_after=(1, None), ordered=True)
    run_id, _, _ = logs[0].get(timeout=120)  # the first claimer hangs after one task
    os.kill(processes[0].pid, signal.SIGKILL)
    resumed, done, messages = logs[1].get(timeout=120)
    for process in processes:
        process.join(timeout=60)
    assert resumed == run_id and done == ["task0"]
    runs = ResultsDB(url).runs()
    assert runs["id"].tolist() == [run_id] and runs["status"].tolist() == ["complete"]
    assert sorted(ResultsDB(url).task_metrics([run_id])["task"]) == CONFIG["tasks"]
