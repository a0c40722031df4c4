"""Ways a generated program could pass without passing, or reach past its sandbox, and what stops them.

A clean exit is not a pass; shared temporary places, SysV IPC, Unix sockets, host processes, the
host's files, keyrings and new namespaces stay out of reach; the weak confinement (no namespaces)
starts no process that reaches the network and runs only when asked for by name; the parent, not the
program, says what confinement was in force.
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


def test_ordinary_programs_that_look_at_frames_still_pass():
    # typing, namedtuple and enum ask for their caller's frame and cope when there is none.
    source = ("from typing import List, TypeVar\nimport collections, enum, random, hashlib, copy, string, re, math\n"
              "T = TypeVar('T')\nPoint = collections.namedtuple('Point', 'x y')\n"
              "Color = enum.Enum('Color', 'RED GREEN')\nassert Point(1, 2).y == 2 and Color.RED.value == 1\n"
              "import warnings\nwarnings.warn('harmless')\n")
    result = run_python(source, FAST)
    assert result.exited_cleanly, result


# ---------------------------------------------------------------- shared temporary places, SysV IPC

def test_shared_temporary_places_are_private_to_each_run():
    name = f"evalsuite-test-{uuid.uuid4().hex}"
    write = "".join(f"open('{place}/{name}', 'w').write('secret')\n" for place in ("/tmp", "/var/tmp", "/dev/shm"))
    try:
        assert run_python(write, FAST).exited_cleanly
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not os.path.exists(f"{place}/{name}"), place
        read = "".join(f"assert not __import__('os').path.exists('{place}/{name}')\n"
                       for place in ("/tmp", "/var/tmp", "/dev/shm"))
        assert run_python(read, FAST).exited_cleanly  # a later run finds nothing an earlier one left
    finally:
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.exists(f"{place}/{name}"):
                os.remove(f"{place}/{name}")


def test_shared_memory_counts_against_the_disk_cap():
    source = "open('/dev/shm/big', 'wb').write(b'x' * (48 * 1024 * 1024))\n"
    limits = SandboxLimits(wall_seconds=5.0, cpu_seconds=4, file_size_bytes=64 * 1024 * 1024)
    result = run_python(source, limits)
    try:
        assert not result.exited_cleanly and "No space left on device" in result.stderr, result
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
            assert not result.exited_cleanly, (address, result)
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
    assert result.exited_cleanly, result
    visible, parent, leaked = result.stdout.split()
    assert leaked == "False"
    assert int(visible) <= 2  # itself and the bootstrap that waits for it
    assert int(parent) != os.getpid()


def test_the_programs_exit_status_comes_back_through_its_init():
    for source, status in (("import os, time\nos.kill(os.getpid(), 9)\ntime.sleep(1)\n", -9),
                           ("import os, time\nos.kill(os.getpid(), 15)\ntime.sleep(1)\n", -15),
                           ("raise SystemExit(3)\n", 3)):
        result = run_python(source, FAST)
        assert result.returncode == status and not result.exited_cleanly, result


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
    assert result.exited_cleanly and result.stdout == "42\n" and "weak" in result.confinement
    assert bm.score_humaneval(SQUARE_DOC, [["    return x * x\n"]]) == {"pass_at_1": 1.0}


def test_weak_confinement_starts_no_process_that_reaches_the_network(monkeypatch):
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
                       f"import os, shlex\nassert os.system(shlex.join([{python!r}, '-c', {escape!r}])) == 0\n",
                       escape + "\n"):
            result = run_python(attack, FAST)
            assert not result.exited_cleanly, (attack, result)
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
        assert result.exited_cleanly, result
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


# ---------------------------------------------------------------- the kernel's shared surface

# Each line prints what the kernel said to one request, from a fresh interpreter started by exec (one
# that never saw anything the sandbox set up in Python): keyrings are not namespaced, so a key added
# here would outlive the run and reach a later one.
KERNEL_REQUESTS = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def said(result):
    return 'ok' if result >= 0 else errno.errorcode[ctypes.get_errno()]
key = said(libc.syscall(248, b'user', sys.argv[1].encode(), b'x', 1, -4))   # add_key to the user keyring
print('add_key', key)
print('keyctl', said(libc.syscall(250, 0, -4, 0)))                         # KEYCTL_GET_KEYRING_ID
print('unshare', said(libc.unshare(0x10000000)))                           # CLONE_NEWUSER
print('ptrace', said(libc.ptrace(0, 0, 0, 0)))                             # PTRACE_TRACEME
print('mount', said(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))
print('bpf', said(libc.syscall(321, 0, 0, 0)))
print('perf_event_open', said(libc.syscall(298, 0, 0, -1, -1, 0)))
print('socket', said(libc.socket(1, 1, 0)))                                # AF_UNIX
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64's")
def test_keyrings_namespaces_ptrace_mounts_bpf_perf_and_sockets_are_refused():
    description = f"evalsuite-test-{uuid.uuid4().hex}"
    python = os.path.realpath(sys.executable)
    source = f"import os\nos.execv({python!r}, [{python!r}, '-I', '-S', '-c', {KERNEL_REQUESTS!r}, {description!r}])\n"
    result = run_python(source, FAST)
    said = dict(line.split() for line in result.stdout.splitlines())
    assert said == {name: "EPERM" for name in ("add_key", "keyctl", "unshare", "ptrace", "mount", "bpf",
                                               "perf_event_open", "socket")}, result
    with open("/proc/keys") as f:
        assert description not in f.read()
    assert "seccomp" in result.confinement


def test_the_hosts_files_do_not_exist_inside(tmp_path):
    # Data folders, model caches and the repository are simply not in the program's root.
    here = os.path.dirname(os.path.abspath(__file__))
    visible = [here, os.path.dirname(here), os.path.expanduser("~/.cache"), os.path.join(here, "..", "..", "shared")]
    source = f"import os\nprint([p for p in {visible!r} if os.path.exists(p) and os.listdir(p)])\n"
    result = run_python(source, FAST)
    assert result.exited_cleanly and result.stdout == "[]\n", result
    assert "own-root" in result.confinement


def test_making_inodes_stops_at_the_cap_and_leaves_nothing():
    limits = SandboxLimits(wall_seconds=20.0, cpu_seconds=15)
    source = ("import os\nmade = 0\ntry:\n    while made < 100_000:\n        os.mkdir(f'/tmp/d{made}')\n"
              "        made += 1\nexcept OSError as error:\n    print(made, error.errno)\n")
    result = run_python(source, limits)
    made, error = map(int, result.stdout.split())
    assert error == 28 and made < limits.inodes, result  # ENOSPC, below the cap
    assert not any(name.startswith("d") and name[1:].isdigit() for name in os.listdir("/tmp"))
