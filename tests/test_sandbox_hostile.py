"""Hostile generated programs: each is contained, scored as a failure, and leaves the evaluator intact.

The evaluations at the end mix hostile completions with correct ones and go through the same
scorers the code tasks use (HumanEval's pass@k and the project's code task), run in threads.
"""
import os
import resource
import shutil
import socket
import tempfile
import time
import uuid

import pytest

from evalsuite.scoring import answers
from evalsuite.scoring.code_eval import check, problem_from_doc
from evalsuite.scoring import benchmarks as bm
from evalsuite.scoring.code_eval import pass_at_k
from evalsuite.scoring.sandbox import OUTPUT_LIMIT, SandboxLimits, run_python
from tests.test_sandbox_leftovers import no_leftovers  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_leftovers")

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2)
CONFINEMENT = run_python("pass", FAST).confinement
OWN_UID = "own-uid" in CONFINEMENT
needs_own_uid = pytest.mark.skipif(not OWN_UID, reason="not running as root: the sandbox cannot give the program "
                                                       f"a uid of its own (applied: {CONFINEMENT})")


def contained(source, limits=FAST, budget_s=None):
    """Run `source`; it must fail, and within its wall-clock limit (plus process start-up)."""
    start = time.perf_counter()
    result = run_python(source, limits)
    elapsed = time.perf_counter() - start
    assert not result.exited_cleanly, result
    assert elapsed < (budget_s or limits.wall_seconds + 2.0)
    return result


def processes_with_argument(argument: str) -> list[int]:
    """Live (non-zombie) host processes with `argument` on their command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/status") as f:
                zombie = "State:\tZ" in f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if argument.encode() in argv and not zombie:
            found.append(int(pid))
    return found


def test_a_plain_program_still_passes():
    result = run_python("import math, hashlib, json, re, collections\nprint(math.factorial(5))", FAST)
    assert result.exited_cleanly and result.stdout == "120\n"


def test_fork_bomb_is_refused():
    result = contained("import os\nwhile True:\n    os.fork()\n", budget_s=3.0)
    assert not result.timed_out and "Resource temporarily unavailable" in result.stderr


@needs_own_uid
def test_forked_processes_that_leave_the_group_are_killed():
    # With room for a few processes, children start their own sessions (out of reach of the
    # process-group kill) and become `sleep` with a mark of this run; every one of them must be
    # gone when the run returns. (Their pids are the run's own: the host sees them by the mark.)
    mark = f"60.{uuid.uuid4().int % 10**9}"
    source = ("import os, sys, time\n"
              "for _ in range(4):\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        os.setsid()\n"
              f"        os.execv('/bin/sleep', ['sleep', '{mark}'])\n"
              "    print(pid, flush=True)\n"
              "while True:\n"
              "    try:\n"
              "        os.fork()\n"
              "    except OSError:\n"
              "        time.sleep(0.01)\n")
    result = contained(source, SandboxLimits(wall_seconds=1.5, cpu_seconds=2, max_processes=8))
    assert result.timed_out
    assert len(result.stdout.split()) == 4
    assert not processes_with_argument(mark)


def test_memory_bomb_fails_with_memory_error():
    result = contained("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n", budget_s=4.0)
    assert not result.timed_out and "MemoryError" in result.stderr


def test_infinite_loop_is_killed_on_time():
    result = contained("while True:\n    pass\n", SandboxLimits(wall_seconds=1.0, cpu_seconds=5))
    assert result.timed_out


def test_cpu_limit_stops_a_busy_program_before_the_wall_clock():
    result = contained("while True:\n    pass\n", SandboxLimits(wall_seconds=10.0, cpu_seconds=1), budget_s=6.0)
    assert not result.timed_out and result.returncode < 0  # SIGXCPU / SIGKILL from the kernel


@needs_own_uid
def test_files_outside_its_directory_are_out_of_reach(tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("precious")
    outside = tmp_path / "planted.txt"
    for attack in (f"import os\nos.remove({str(canary)!r})\n",
                   f"open({str(canary)!r}, 'w').write('overwritten')\n",
                   f"print(open({str(canary)!r}).read())\n",
                   f"open({str(outside)!r}, 'w').write('planted')\n",
                   f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
                   f"import os\nos.chmod({str(canary)!r}, 0o777)\n"):
        result = contained(attack)
        assert "precious" not in result.stdout
    assert canary.read_text() == "precious" and oct(canary.stat().st_mode & 0o777) != "0o777"
    assert not outside.exists()


def test_files_it_writes_vanish_with_its_directory():
    result = run_python("import os\nopen('left.txt', 'w').write('x')\nprint(os.path.abspath('left.txt'))", FAST)
    assert result.exited_cleanly
    assert not os.path.exists(result.stdout.strip())


@pytest.mark.skipif("disk-quota" not in CONFINEMENT,
                    reason=f"no mount namespace: the working directory has no size cap (applied: {CONFINEMENT})")
def test_filling_the_disk_stops_at_the_quota():
    source = "for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * (1024 * 1024 - 1))\n"
    result = contained(source, SandboxLimits(wall_seconds=5.0, cpu_seconds=4, disk_bytes=8 * 1024 * 1024))
    assert "No space left on device" in result.stderr


def test_no_connection_reaches_a_local_listener():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        for attack in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n",
                       f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                       f"s.sendto(b'hi', ('127.0.0.1', {port}))\n",
                       "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:%d/' % " + str(port) +
                       ", timeout=1)\n"):
            contained(attack)
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()


def test_parent_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("EVALSUITE_TEST_SECRET", "hunter2-do-not-leak")
    # Passes only if the secret is found: through its own environment or its parent's /proc entry.
    source = ("import os\n"
              "found = 'hunter2' in str(os.environ)\n"
              "try:\n"
              "    found = found or b'hunter2' in open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
              "except OSError as exc:\n"
              "    print('refused:', exc)\n"
              "print(sorted(os.environ))\n"
              "assert found\n")
    result = contained(source)
    assert "hunter2" not in result.stdout + result.stderr
    assert "EVALSUITE_TEST_SECRET" not in result.stdout


def test_printing_gigabytes_is_cut_off():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for stream in ("stdout", "stderr"):
        result = contained(f"import sys\nwhile True:\n    sys.{stream}.write('x' * (1 << 20))\n", budget_s=4.0)
        assert len(result.stdout) <= OUTPUT_LIMIT and len(result.stderr) <= OUTPUT_LIMIT
        assert not result.timed_out  # stopped by the file-size limit, long before the wall clock
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024


@needs_own_uid
def test_killing_its_parent_or_everyone_fails_and_the_evaluator_survives():
    me = os.getpid()
    for attack in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
                   f"import os, signal\nos.kill({me}, signal.SIGKILL)\n",
                   "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n",
                   "import os, signal\nos.kill(-1, signal.SIGKILL)\nimport time\ntime.sleep(5)\n"):
        contained(attack)
    assert os.getpid() == me  # still here to check


def test_changing_directory_does_not_move_the_evaluator():
    before = os.getcwd()
    contained("import os\nos.chdir('/')\nos.chdir('..')\nraise SystemExit(os.getcwd())\n")
    assert os.getcwd() == before


SQUARE_DOC = {
    "prompt": "def square(x):\n    \"\"\"Return x squared.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n",
    "entry_point": "square",
}
CORRECT = ["    return x * x\n", "    return x ** 2\n"]


# Bodies that would pass their tests only if the grader trusted the program: they end it early with
# a clean exit status (HumanEval's stop sequences keep top-level code after `return`), wrap the tests,
# or depend on what the sandbox hides.
CHEATS = [
    "    raise SystemExit(0)\n",
    "    import sys\n    sys.exit(0)\n",
    "    import os\n    os._exit(0)\n",
    "    return None\nraise SystemExit(0)\n",
    "    return None\nimport os\nos._exit(0)\n",
    "    return None\n@lambda f: lambda c: None\n",  # a decorator that would replace `check`
    "    open('/dev/shm/big', 'wb').write(b'x' * (48 << 20))\n    return x * x\n",
    "    import os\n    assert len([p for p in os.listdir('/proc') if p.isdigit()]) > 2\n    return x * x\n",
]


def hostile_bodies(canary: str, port: int, unix_socket: str) -> list[str]:
    """Function bodies that attack instead of answering (indented: HumanEval's stop sequences keep them)."""
    return CHEATS + [
        f"    import socket\n    s = socket.socket(socket.AF_UNIX)\n    s.connect({unix_socket!r})\n"
        "    s.sendall(b'hi')\n    return x * x\n",
        "    import os\n    while True:\n        os.fork()\n",
        "    chunks = []\n    while True:\n        chunks.append(bytearray(50 * 1024 * 1024))\n",
        "    while True:\n        pass\n",
        f"    import os\n    os.remove({canary!r})\n    return x * x\n",
        f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return x * x\n",
        "    import os\n    assert 'EVALSUITE_TEST_SECRET' in os.environ\n    return x * x\n",
        "    import sys\n    while True:\n        sys.stdout.write('x' * (1 << 20))\n",
        "    import os\n    os.chdir('/')\n    return x + x\n",
    ] + (["    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n    return x * x\n"] if OWN_UID else [])


def test_evaluation_mixing_hostile_and_correct_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "HUMANEVAL_LIMITS", SandboxLimits(wall_seconds=2.0, cpu_seconds=2))
    monkeypatch.setenv("EVALSUITE_TEST_SECRET", "hunter2")
    canary = tmp_path / "canary.txt"
    canary.write_text("precious")
    cwd = os.getcwd()
    shared = tempfile.mkdtemp(dir="/tmp")  # a world-writable place on the host, with a listener in it
    os.chmod(shared, 0o777)
    try:
        with socket.socket() as listener, socket.socket(socket.AF_UNIX) as unix_listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            unix_listener.bind(os.path.join(shared, "sock"))
            os.chmod(os.path.join(shared, "sock"), 0o777)
            unix_listener.listen(4)
            hostile = hostile_bodies(str(canary), listener.getsockname()[1], os.path.join(shared, "sock"))
            samples = CORRECT + hostile + CORRECT
            start = time.perf_counter()
            scores = bm.score_humaneval(SQUARE_DOC, [samples])
            elapsed = time.perf_counter() - start
            for each in (listener, unix_listener):
                each.settimeout(0.1)
                with pytest.raises(socket.timeout):
                    each.accept()
    finally:
        shutil.rmtree(shared)
    passed = bm.run_completions(SQUARE_DOC, samples, SandboxLimits(wall_seconds=2.0, cpu_seconds=2))
    assert passed == [True] * 2 + [False] * len(hostile) + [True] * 2
    assert scores["pass_at_1"] == pytest.approx(4 / len(samples))
    assert scores["pass_at_5"] == pytest.approx(pass_at_k(len(samples), 4, 5))
    assert elapsed < 30
    if OWN_UID:
        assert canary.read_text() == "precious"
    assert os.getcwd() == cwd


def test_code_task_scorer_with_hostile_completions():
    good = {"pass_at_1": 1.0}
    bad = {"pass_at_1": 0.0}
    completions = ["    return x * x\n", "    import os\n    while True:\n        os.fork()\n",
                   "    import sys\n    sys.stderr.write('e' * (1 << 30))\n", *CHEATS, "    return x ** 2\n"]
    limits = SandboxLimits(wall_seconds=2.0, cpu_seconds=2)
    verdicts = [check(problem_from_doc(SQUARE_DOC, c), limits).passed for c in completions]
    assert verdicts == [True] + [False] * (len(completions) - 2) + [True]
    assert answers.score_code(SQUARE_DOC, [completions[0]]) == good
    for cheat in completions[1:-1]:
        assert answers.score_code(SQUARE_DOC, [cheat]) == bad, cheat
