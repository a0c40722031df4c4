"""Run an untrusted Python program in its own, confined process.

Each run starts a fresh interpreter (`python -I -S -B -c BOOTSTRAP`) in a new session. The
bootstrap confines itself before the program's first line runs, so no `preexec_fn` is needed
(callers run the sandbox from threads, where `preexec_fn` is unsafe):

- rlimits on CPU seconds, address space, file size (which also caps stdout/stderr: they go to
  files, and writing past the limit kills the program), open files, processes, no core dumps;
- a private network namespace with no interface up (no network at all); where the system does
  not allow one, an audit hook that refuses every socket before the program starts;
- as root: a private mount namespace whose working directory is a size-capped tmpfs, and a
  fresh unprivileged uid for this run only (root ignores RLIMIT_NPROC; a uid of its own makes
  the process limit bind, keeps concurrent runs out of each other's files and lets the
  evaluator kill every process the run left behind, even ones that left its process group);
- an environment holding only PATH, LANG, HOME and TMPDIR; a throwaway working directory.

The evaluator waits with a wall-clock timeout, then kills the process group and every process
of the run's uid. See docs/reliability.md for what this does and does not stop.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

OUTPUT_LIMIT = 4096  # characters of stdout/stderr kept for diagnostics
STATUS_MARKER = "evalsuite-sandbox: "  # first stderr line: the confinement the bootstrap applied
# Per-run uids are drawn from a range no distribution hands out to accounts.
UID_RANGE = (1_500_000_000, 2_000_000_000)


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    address_space_bytes: int = 512 * 1024 * 1024
    file_size_bytes: int = 1024 * 1024  # any one file, stdout and stderr included
    max_processes: int = 1  # the program itself: no fork, no threads
    disk_bytes: int = 16 * 1024 * 1024  # the whole working directory, where a tmpfs can be mounted
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    confinement: tuple[str, ...] = field(default=())  # what the bootstrap applied, e.g. 'network-namespace'

    @property
    def passed(self) -> bool:
        return not self.timed_out and self.returncode == 0


# Runs as the child's first code, with nothing imported from the evaluator. Order matters:
# namespaces and mounts need root, so they come before the uid is dropped.
BOOTSTRAP = r'''
import ctypes, json, os, resource, runpy, sys

cfg = json.loads(sys.argv[1])
applied = []
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)

def traversable_by_others(path):
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001:
            return False
    return True

def expose(tree, staging):
    """Make `tree` readable to an unprivileged uid: hide its closed ancestor under a tmpfs and bind the tree back."""
    tree = os.path.realpath(tree)
    parts = tree.split(os.sep)
    closed = next(os.sep.join(parts[:i]) for i in range(2, len(parts) + 1)
                  if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001)
    mount(tree, staging, None, MS_BIND | MS_REC)
    mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    os.makedirs(tree, mode=0o755, exist_ok=True)
    mount(staging, tree, None, MS_BIND | MS_REC)
    mount(None, tree, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)

workdir, uid = cfg["workdir"], cfg["uid"]
with open(os.path.join(workdir, "program.py"), encoding="utf-8") as f:
    source = f.read()

as_root = os.geteuid() == 0
if as_root and libc.unshare(CLONE_NEWNET | CLONE_NEWNS) == 0:
    applied.append("network-namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    try:
        mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={cfg['disk_bytes']},mode=0700,uid={uid},gid={uid}")
        applied.append("disk-quota")
        if not traversable_by_others(sys.base_prefix):
            expose(sys.base_prefix, cfg["staging"])
    except OSError as exc:
        sys.stderr.write(f"sandbox mount failed: {exc}\n")
elif not as_root and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
    applied.append("network-namespace")

os.umask(0o077)
os.chdir(workdir)  # the tmpfs, if one was mounted over the directory Popen started in
with open("program.py", "w", encoding="utf-8") as f:
    f.write(source)

if as_root:
    if traversable_by_others(sys.base_prefix):
        os.chown(".", uid, uid)
        os.chown("program.py", uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        applied.append("own-uid")
    else:  # never run untrusted code as root: no process limit binds it, it could kill the evaluator
        sys.stderr.write("sandbox: the interpreter is unreadable to an unprivileged uid and no mount "
                         "namespace can expose it; refusing to run the program as root\n")
        sys.exit(126)

limits = cfg["limits"]
for name, value, hard in (("RLIMIT_CPU", limits["cpu_seconds"], limits["cpu_seconds"] + 1),
                          ("RLIMIT_AS", limits["address_space_bytes"], None),
                          ("RLIMIT_FSIZE", limits["file_size_bytes"], None),
                          ("RLIMIT_NOFILE", limits["open_files"], None),
                          ("RLIMIT_NPROC", limits["max_processes"], None),
                          ("RLIMIT_CORE", 0, None)):
    resource.setrlimit(getattr(resource, name), (value, value if hard is None else hard))
applied.append("rlimits")

if "network-namespace" not in applied:
    def refuse_network(event, args):
        if event.startswith("socket.") or event in ("ctypes.dlopen", "ctypes.dlsym"):
            raise PermissionError(f"sandbox: {event} is not allowed")
    sys.addaudithook(refuse_network)  # cannot be removed by the program
    applied.append("socket-audit-hook")

sys.stderr.write("evalsuite-sandbox: " + json.dumps(applied) + "\n")
sys.stderr.flush()
del cfg, libc, limits, source
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
'''


def _limits_dict(limits: SandboxLimits) -> dict:
    return {name: getattr(limits, name) for name in SandboxLimits.__dataclass_fields__}


def _processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(status.get("Uid", "-1 ").split()[0]) == uid and not status.get("State", "").strip().startswith("Z"):
            found.append(int(entry))
    return found


def _kill_all(process: subprocess.Popen, uid: int | None) -> None:
    """Kill the run's process group and, when it had a uid of its own, every process of that uid."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None or not os.path.isdir("/proc"):
        return
    for _ in range(100):  # a fork bomb may still be forking: repeat until nothing is left
        survivors = _processes_of(uid)
        if not survivors:
            return
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _read_output(handle, tail: bool, start: int = 0) -> str:
    """The first (or last) OUTPUT_LIMIT characters written from byte `start` on."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(start, size - OUTPUT_LIMIT * 4) if tail else start)
    text = handle.read(OUTPUT_LIMIT * 4).decode("utf-8", errors="replace")
    return text[-OUTPUT_LIMIT:] if tail else text[:OUTPUT_LIMIT]


def _split_status(handle) -> tuple[tuple[str, ...], int]:
    """The bootstrap's status line at the head of stderr, and where the program's own stderr starts."""
    handle.seek(0)
    first = handle.readline(OUTPUT_LIMIT)
    if first.startswith(STATUS_MARKER.encode()):
        try:
            return tuple(json.loads(first[len(STATUS_MARKER):])), len(first)
        except ValueError:
            pass
    return (), 0


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute `source` in a confined interpreter; the exit status says whether it ran cleanly."""
    limits = limits or SandboxLimits()
    uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0] if os.geteuid() == 0 else None
    outer = tempfile.mkdtemp(prefix="evalsuite-sandbox-")
    try:
        os.chmod(outer, 0o711)  # traversable, not listable: the run's uid reaches only its own directory
        workdir = os.path.join(outer, secrets.token_hex(8))
        staging = os.path.join(outer, "interpreter")
        os.mkdir(workdir, 0o700)
        os.mkdir(staging, 0o700)
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        config = {"workdir": workdir, "staging": staging, "uid": uid, "disk_bytes": limits.disk_bytes,
                  "limits": _limits_dict(limits)}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, json.dumps(config)],
                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,  # its own process group, killable as a whole
            )
            timed_out = False
            try:
                process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_all(process, uid)
                process.wait()
            confinement, program_stderr_at = _split_status(err)
            stdout = _read_output(out, tail=False)
            stderr = _read_output(err, tail=True, start=program_stderr_at)
        return SandboxResult(process.returncode, timed_out, stdout, stderr, confinement)
    finally:
        shutil.rmtree(outer, ignore_errors=True)
