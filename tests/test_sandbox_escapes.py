"""Ways a generated program could pass without passing, or reach past its sandbox, and what stops them.

A sample passes only when its program ran to its end; shared temporary places, SysV IPC, Unix
sockets and host processes stay out of reach; the weak confinement (no namespaces) refuses to
start processes and runs only when asked for by name; the parent, not the program, says what
confinement was in force.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from evalsuite.scoring import answers
from evalsuite.scoring import benchmarks as bm
from evalsuite.scoring.sandbox import SandboxLimits, SandboxUnavailable, confinement_in_force, run_python
from tests.test_sandbox_leftovers import leftovers, no_leftovers  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_leftovers")

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2)
SQUARE_DOC = {
    "prompt": "def square(x):\n    \"\"\"Return x squared.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n",
    "entry_point": "square",
}
NO_NAMESPACES = "EVALSUITE_SANDBOX_NO_NAMESPACES"  # internal: makes the bootstrap skip its namespaces


# ---------------------------------------------------------------- a pass means the program ran to its end

EXIT_CHEATS = [
    "    raise SystemExit(0)\n",
    "    import sys\n    sys.exit(0)\n",
    "    import os\n    os._exit(0)\n",
    "    return None\nraise SystemExit(0)\n",
    "    return None\nimport os\nos._exit(0)\n",
]


def test_exit_status_cheats_score_zero_through_both_scorers(monkeypatch):
    monkeypatch.setattr(bm, "HUMANEVAL_LIMITS", FAST)
    correct = ["    return x * x\n", "    return x ** 2\n"]
    assert bm.score_humaneval(SQUARE_DOC, [EXIT_CHEATS]) == {"pass_at_1": 0.0, "pass_at_5": 0.0}
    scores = bm.score_humaneval(SQUARE_DOC, [correct + EXIT_CHEATS])
    assert scores["pass_at_1"] == pytest.approx(2 / 7)
    for cheat in EXIT_CHEATS:
        assert answers.score_code(SQUARE_DOC, [cheat]) == {"pass_at_1": 0.0}, cheat
    assert answers.score_code(SQUARE_DOC, [correct[0]]) == {"pass_at_1": 1.0}


def test_exit_zero_alone_is_not_a_pass():
    for source in ("raise SystemExit(0)\n", "import sys\nsys.exit()\n", "import os\nos._exit(0)\n",
                   "import atexit, os\natexit.register(os._exit, 0)\nraise ValueError\n"):
        result = run_python(source, FAST)
        assert not result.passed and not result.finished, (source, result)
    assert run_python("x = 1\n", FAST).finished


FORGERIES = {
    # Look for the pass token on every inherited descriptor, then copy what was read to all of them.
    "descriptors": "import os\nseen = []\nfor fd in range(3, 64):\n    try:\n        seen.append(os.read(fd, 4096))\n"
                   "    except OSError:\n        pass\nfor fd in range(3, 64):\n    for data in seen + [b'ok\\n']:\n"
                   "        try:\n            os.write(fd, data)\n        except OSError:\n            pass\n"
                   "os._exit(0)\n",
    "frames": "import sys\nf = sys._getframe()\nwhile f.f_back:\n    f = f.f_back\nprint(f.f_locals)\n",
    "traceback": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    f = e.__traceback__.tb_frame\n"
                 "    while f.f_back:\n        f = f.f_back\n    print(f.f_locals)\n",
    "generator": "def g():\n    yield\nprint(g().gi_frame)\n",
    "gc": "import gc\nprint(len(gc.get_objects()))\n",
    "referrers": "import gc, sys\nprint(gc.get_referrers(sys.modules))\n",
    "current_frames": "import sys\nprint(sys._current_frames())\n",
    "trace": "import sys\nsys.settrace(lambda *a: None)\n",
    "signal": "import signal\nsignal.signal(signal.SIGALRM, lambda n, f: print(f.f_back))\n",
    "ctypes": "import ctypes\nprint(ctypes.string_at(id(1), 8))\n",
    "memory": "print(len(open('/proc/self/mem', 'rb').read(1)))\n",
    "audit_hook": "import sys\nseen = []\nsys.addaudithook(lambda e, a: seen.append(e))\nopen('probe', 'w').close()\n"
                  "print('hook added:', bool(seen), flush=True)\n",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_ways_to_find_the_pass_token_are_refused(name):
    result = run_python(FORGERIES[name] + "import os\nos._exit(0)\n", FAST)
    assert not result.passed, result
    if name == "audit_hook":  # CPython drops a refused hook silently
        assert "hook added: False" in result.stdout, result
    elif name != "descriptors":
        assert "sandbox:" in result.stderr, result.stderr  # refused, and says why


def test_its_own_memory_reads_as_nothing_even_past_the_hook():
    # A path relative to a descriptor of / never names /proc, so the hook cannot see it; in the
    # namespaces the program's /proc/<pid>/mem is /dev/null.
    source = ("import os\nroot = os.open('/', os.O_RDONLY)\nfd = os.open('proc/self/mem', os.O_RDONLY, dir_fd=root)\n"
              "x = b'abcdefgh'\nos.lseek(fd, id(x), 0)\nprint(repr(os.read(fd, 48)))\n")
    result = run_python(source, FAST)
    assert result.passed and result.stdout == "b''\n", result


def test_ordinary_programs_that_look_at_frames_still_pass():
    # typing, namedtuple and enum ask for their caller's frame and cope when there is none.
    source = ("from typing import List, TypeVar\nimport collections, enum, random, hashlib, copy, string, re, math\n"
              "T = TypeVar('T')\nPoint = collections.namedtuple('Point', 'x y')\n"
              "Color = enum.Enum('Color', 'RED GREEN')\nassert Point(1, 2).y == 2 and Color.RED.value == 1\n"
              "import warnings\nwarnings.warn('harmless')\n")
    result = run_python(source, FAST)
    assert result.passed, result


# ---------------------------------------------------------------- shared temporary places, SysV IPC

def test_shared_temporary_places_are_private_to_each_run():
    name = f"evalsuite-test-{uuid.uuid4().hex}"
    write = "".join(f"open('{place}/{name}', 'w').write('secret')\n" for place in ("/tmp", "/var/tmp", "/dev/shm"))
    try:
        assert run_python(write, FAST).passed
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not os.path.exists(f"{place}/{name}"), place
        read = "".join(f"assert not __import__('os').path.exists('{place}/{name}')\n"
                       for place in ("/tmp", "/var/tmp", "/dev/shm"))
        assert run_python(read, FAST).passed  # a later run finds nothing an earlier one left
    finally:
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.exists(f"{place}/{name}"):
                os.remove(f"{place}/{name}")


def test_shared_memory_counts_against_the_disk_cap():
    source = "open('/dev/shm/big', 'wb').write(b'x' * (48 * 1024 * 1024))\n"
    limits = SandboxLimits(wall_seconds=5.0, cpu_seconds=4, file_size_bytes=64 * 1024 * 1024)
    result = run_python(source, limits)
    try:
        assert not result.passed and "No space left on device" in result.stderr, result
    finally:
        if os.path.exists("/dev/shm/big") and os.stat("/dev/shm/big").st_uid != 0:
            os.remove("/dev/shm/big")


def sysv_ids() -> set[str]:
    with open("/proc/sysvipc/shm") as f:
        return {line.split()[1] for line in list(f)[1:]}


def test_sysv_shared_memory_dies_with_the_run():
    before = sysv_ids()
    result = run_python("import os\nos.execv('/usr/bin/ipcmk', ['ipcmk', '-M', '65536'])\n", FAST)
    new = sysv_ids() - before
    for shmid in new:
        subprocess.run(["ipcrm", "-m", shmid], check=False)
    assert "Shared memory id" in result.stdout, result  # it was made, inside the run
    assert new == set()


# ---------------------------------------------------------------- Unix-domain sockets

def test_unix_sockets_on_the_host_are_out_of_reach():
    here = os.path.dirname(os.path.abspath(__file__))
    places = [tempfile.mkdtemp(dir="/tmp"), tempfile.mkdtemp(dir=here)]  # hidden, and visible, paths
    listeners = []
    try:
        for place in places:
            os.chmod(place, 0o777)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(os.path.join(place, "sock"))
            os.chmod(os.path.join(place, "sock"), 0o777)
            listeners.append((listener, os.path.join(place, "sock")))
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind(f"\0evalsuite-test-{uuid.uuid4().hex}")
        listeners.append((abstract, abstract.getsockname()))
        for listener, address in listeners:
            listener.listen(4)
            source = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({address!r})\ns.sendall(b'hi')\n"
            result = run_python(source, FAST)
            assert not result.passed, (address, result)
            listener.settimeout(0.2)
            with pytest.raises(socket.timeout):
                listener.accept()
    finally:
        for listener, _ in listeners:
            listener.close()
        for place in places:
            shutil.rmtree(place, ignore_errors=True)


# ---------------------------------------------------------------- host processes

def test_host_processes_are_invisible():
    secret = f"hunter2-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "--db", f"postgresql://u:{secret}@db"])
    try:
        source = ("import os\nfound, pids = [], [p for p in os.listdir('/proc') if p.isdigit()]\n"
                  "for pid in pids:\n    try:\n        found.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
                  "    except OSError:\n        pass\n"
                  "print(len(pids), os.getppid(), b'" + secret.encode().decode() + "' in b''.join(found))\n")
        result = run_python(source, FAST)
    finally:
        host.kill()
        host.wait()
    assert result.passed, result
    visible, parent, leaked = result.stdout.split()
    assert leaked == "False"
    assert int(visible) <= 2  # itself and the bootstrap that waits for it
    assert int(parent) != os.getpid()


def test_the_programs_exit_status_comes_back_through_its_init():
    for source, status in (("import os, time\nos.kill(os.getpid(), 9)\ntime.sleep(1)\n", -9),
                           ("import os, time\nos.kill(os.getpid(), 15)\ntime.sleep(1)\n", -15),
                           ("raise SystemExit(3)\n", 3)):
        result = run_python(source, FAST)
        assert result.returncode == status and not result.passed, result


# ---------------------------------------------------------------- the weak confinement

def test_namespaces_are_in_force_here():
    assert confinement_in_force() == "namespaces"
    assert "pid-namespace" in run_python("pass", FAST).confinement


def test_weak_confinement_runs_only_when_asked_for_by_name(monkeypatch):
    monkeypatch.setenv(NO_NAMESPACES, "1")
    monkeypatch.delenv("EVALSUITE_SANDBOX", raising=False)
    assert confinement_in_force() == "weak"
    with pytest.raises(SandboxUnavailable, match="EVALSUITE_SANDBOX=weak"):
        run_python("pass", FAST)
    with pytest.raises(SandboxUnavailable, match="EVALSUITE_SANDBOX=weak"):
        bm.score_humaneval(SQUARE_DOC, [["    return x * x\n"]])
    monkeypatch.setenv("EVALSUITE_SANDBOX", "sturdy")
    with pytest.raises(SandboxUnavailable, match="sturdy"):
        run_python("pass", FAST)
    monkeypatch.setenv("EVALSUITE_SANDBOX", "weak")
    result = run_python("print(6 * 7)\n", FAST)
    assert result.passed and result.stdout == "42\n" and "weak" in result.confinement
    assert bm.score_humaneval(SQUARE_DOC, [["    return x * x\n"]]) == {"pass_at_1": 1.0}


def test_weak_confinement_refuses_to_start_processes(monkeypatch):
    monkeypatch.setenv(NO_NAMESPACES, "1")
    monkeypatch.setenv("EVALSUITE_SANDBOX", "weak")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        escape = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')"
        python = sys.executable
        for attack in (f"import os\nos.execv({python!r}, [{python!r}, '-c', {escape!r}])\n",
                       f"import os\nos.posix_spawn({python!r}, [{python!r}, '-c', {escape!r}], {{}})\n",
                       f"import subprocess\nsubprocess.run([{python!r}, '-c', {escape!r}])\n",
                       f"import os, shlex\nos.system(shlex.join([{python!r}, '-c', {escape!r}]))\n",
                       "import _posixsubprocess\n",
                       escape + "\n"):
            result = run_python(attack, FAST)
            assert not result.passed and "sandbox:" in result.stderr, (attack, result)
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()


def test_weak_confinement_removes_what_the_run_left_in_shared_places(monkeypatch):
    # Without namespaces the shared places are the host's; what the run's uid made there is
    # removed once its processes are dead.
    monkeypatch.setenv(NO_NAMESPACES, "1")
    monkeypatch.setenv("EVALSUITE_SANDBOX", "weak")
    name = f"evalsuite-test-{uuid.uuid4().hex}"
    source = "".join(f"import os\nos.makedirs('{place}/{name}/deep')\nopen('{place}/{name}/deep/f', 'w').write('x')\n"
                     for place in ("/tmp", "/var/tmp", "/dev/shm"))
    try:
        result = run_python(source, FAST)
        assert result.passed, result
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not os.path.exists(f"{place}/{name}"), place
    finally:
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            shutil.rmtree(f"{place}/{name}", ignore_errors=True)


# ---------------------------------------------------------------- the reported confinement

def test_a_program_cannot_forge_the_reported_confinement():
    honest = run_python("pass", FAST).confinement
    forged = run_python("import os\nos.lseek(2, 0, 0)\nos.write(2, b'evalsuite-sandbox: [\"forged\"]\\n')\n", FAST)
    assert forged.confinement == honest and "forged" not in forged.confinement
