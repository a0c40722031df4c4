"""Nothing a sandboxed run makes outlives it: no files in the host's shared temporary places, no
SysV IPC objects, no mounts, no sandbox directories.

`no_leftovers` snapshots those before a test module and compares after; the sandbox test modules
use it. The checks look only at what the sandbox could have made (entries owned by a per-run
uid, this process's run directories, mounts under any run directory), so other processes on the
machine do not disturb them.
"""
import os

import pytest

from evalsuite.scoring.sandbox import DIR_PREFIX, SHARED_PLACES, UID_RANGE, SandboxLimits, run_python

SYSV_TABLES = ("/proc/sysvipc/shm", "/proc/sysvipc/msg", "/proc/sysvipc/sem")


def _sandbox_uid(uid: int) -> bool:
    return UID_RANGE[0] <= uid < UID_RANGE[1]


def leftovers() -> set[str]:
    """What sandboxed runs could have left on the host, as readable strings. Run directories count
    only when this process made them: other processes on the machine may be mid-run."""
    mine = f"{DIR_PREFIX}{os.getpid()}-"
    found = set()
    for place in SHARED_PLACES:
        for entry in os.scandir(place):
            try:
                owner = entry.stat(follow_symlinks=False).st_uid
            except FileNotFoundError:
                continue
            if _sandbox_uid(owner) or entry.name.startswith(mine):
                found.add(f"file {entry.path} (uid {owner})")
    for table in SYSV_TABLES:
        with open(table) as f:
            header = f.readline().split()
            for line in f:
                row = dict(zip(header, line.split()))
                if _sandbox_uid(int(row["uid"])) or _sandbox_uid(int(row.get("cuid", -1))):
                    found.add(f"sysv {table} {line.strip()}")
    with open("/proc/self/mountinfo") as f:
        found |= {f"mount {line.split()[4]}" for line in f if DIR_PREFIX in line}
    return found


@pytest.fixture(scope="module")
def no_leftovers():
    before = leftovers()
    yield
    assert leftovers() - before == set()


def test_runs_that_write_everywhere_leave_nothing_behind(no_leftovers):
    before = leftovers()
    source = ("import os\n"
              "for place in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n"
              "    try:\n"
              "        open(os.path.join(place, 'left-behind'), 'w').write('x')\n"
              "    except OSError as exc:\n"
              "        print('refused', place, exc)\n"
              "os.execv('/usr/bin/ipcmk', ['ipcmk', '-M', '4096'])\n")
    for _ in range(2):
        run_python(source, SandboxLimits(wall_seconds=3.0, cpu_seconds=2))
    assert leftovers() - before == set()
