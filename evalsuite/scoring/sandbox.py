"""Run an untrusted Python program in its own, confined process, and say whether it ran to its end.

Each run starts a fresh interpreter running `sandbox_setup.py` (`python -I -S -B -c SOURCE`) in a
new session; it confines itself before the program's first line runs, so no `preexec_fn` is
needed (callers run the sandbox from threads, where `preexec_fn` is unsafe). Two confinements:

- "namespaces" (root with CAP_SYS_ADMIN): private mount, network, IPC and PID namespaces; one
  size-capped tmpfs holds the working directory and private /tmp, /var/tmp, /dev/shm and /run;
  a fresh /proc that shows only the run's own processes; a uid of its own for this run; rlimits;
- "weak" (anything less): rlimits, a uid of its own where root, and an audit hook that also
  refuses every way to start a process. It runs only when asked for by name
  (EVALSUITE_SANDBOX=weak, set by `--sandbox weak`); otherwise `SandboxUnavailable`.

In both, the program runs in a fresh interpreter (`sandbox_runner.py`) whose audit hook refuses
sockets, ctypes, signal handlers and every way to reach another frame. A run passes only when
that interpreter writes this run's random token on a private pipe after the program returned
normally: exit status and output are the program's to forge, the token is not. The first line
on that pipe, written before the program exists, says what confinement was applied.

The evaluator waits with a wall-clock timeout, then kills the process group and every process
of the run's uid. See docs/reliability.md for what this does and does not stop.
"""
from __future__ import annotations

import functools
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
from pathlib import Path

OUTPUT_LIMIT = 4096  # characters of stdout/stderr kept for diagnostics
REPORT_LIMIT = 64 * 1024  # bytes read from the result pipe
# Per-run uids are drawn from a range no distribution hands out to accounts.
UID_RANGE = (1_500_000_000, 2_000_000_000)
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm")
DIR_PREFIX = "evalsuite-sandbox-"  # then the evaluator's pid: whose run a directory was  # world-writable: private to each run in the namespaces
CHOICE_ENV = "EVALSUITE_SANDBOX"  # "weak" accepts the weaker confinement where namespaces are missing
NO_NAMESPACES_ENV = "EVALSUITE_SANDBOX_NO_NAMESPACES"  # tests only: behave as if namespaces were missing
SETUP_SOURCE = (Path(__file__).parent / "sandbox_setup.py").read_text(encoding="utf-8")
RUNNER_SOURCE = (Path(__file__).parent / "sandbox_runner.py").read_text(encoding="utf-8")


class SandboxUnavailable(RuntimeError):
    """The sandbox this system offers is weaker than what was asked for."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    address_space_bytes: int = 512 * 1024 * 1024
    file_size_bytes: int = 1024 * 1024  # any one file, stdout and stderr included
    max_processes: int = 1  # the program itself: no fork, no threads
    disk_bytes: int = 16 * 1024 * 1024  # everything it can write, where a tmpfs can be mounted
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    confinement: tuple[str, ...] = field(default=())  # what the sandbox applied, e.g. 'pid-namespace'
    finished: bool = False  # the program returned normally: its interpreter sent the run's token

    @property
    def passed(self) -> bool:
        return self.finished and not self.timed_out and self.returncode == 0


# Can this process give a child its own namespaces and mounts? Asked once, in a throwaway child.
NAMESPACE_PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ok = os.geteuid() == 0 and libc.unshare(0x00020000 | 0x08000000 | 0x20000000 | 0x40000000) == 0
ok = ok and libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
ok = ok and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=64k") == 0
os._exit(0 if ok else 1)
"""


@functools.lru_cache(maxsize=1)
def _namespaces_work() -> bool:
    probe = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", NAMESPACE_PROBE], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    return probe.returncode == 0


def confinement_in_force() -> str:
    """"namespaces" or "weak": what generated code gets on this system, decided here, never by the program."""
    if os.environ.get(NO_NAMESPACES_ENV) or not _namespaces_work():
        return "weak"
    return "namespaces"


def confinement_to_use() -> str:
    """The confinement generated code will run under here: "namespaces", or "weak" when asked for by name;
    `SandboxUnavailable` (one line, saying what to do) when only the weak one exists and nobody asked."""
    return _mode_to_use()


def _mode_to_use() -> str:
    choice = os.environ.get(CHOICE_ENV, "")
    if choice not in ("", "weak"):
        raise SandboxUnavailable(f"{CHOICE_ENV}={choice!r} is not a sandbox: set it to 'weak' or leave it unset")
    mode = confinement_in_force()
    if mode == "weak" and choice != "weak":
        raise SandboxUnavailable(
            "generated code would run without namespaces here (that needs root with CAP_SYS_ADMIN): "
            f"run as such, or accept the weaker sandbox with --sandbox weak ({CHOICE_ENV}=weak)")
    return mode


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


def _remove_files_of(uid: int) -> None:
    """The weak confinement has no private temporary places: remove what the run's uid left in the
    host's (its processes are dead by now, and nothing it made is followed through a link)."""
    for place in SHARED_PLACES:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _read_output(handle, tail: bool) -> str:
    """The first (or last) OUTPUT_LIMIT characters written."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, size - OUTPUT_LIMIT * 4) if tail else 0)
    text = handle.read(OUTPUT_LIMIT * 4).decode("utf-8", errors="replace")
    return text[-OUTPUT_LIMIT:] if tail else text[:OUTPUT_LIMIT]


def _read_report(fd: int) -> bytes:
    """What is waiting on the result pipe; its writers are dead, or are not waited for."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < REPORT_LIMIT:
        try:
            chunk = os.read(fd, REPORT_LIMIT - size)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _parse_report(report: bytes, token: bytes) -> tuple[tuple[str, ...], bool]:
    """The confinement line the sandbox wrote before the program existed, and whether exactly the
    token followed it (anything the program wrote itself makes the run a failure)."""
    first, _, rest = report.partition(b"\n")
    try:
        applied = json.loads(first)
    except ValueError:
        return (), False
    if not isinstance(applied, list) or not all(isinstance(item, str) for item in applied):
        return (), False
    return tuple(applied), secrets.compare_digest(rest, token)


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute `source` in a confined interpreter; passed only if it ran to its end, within its limits."""
    limits = limits or SandboxLimits()
    mode = _mode_to_use()
    uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0] if os.geteuid() == 0 else None
    token = secrets.token_hex(32).encode()
    outer = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
    try:
        os.chmod(outer, 0o711)  # traversable, not listable: the run's uid reaches only its own directory
        workdir = os.path.join(outer, secrets.token_hex(8))
        staging = os.path.join(outer, "interpreter")
        os.mkdir(workdir, 0o700)
        os.mkdir(staging, 0o700)
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            result_r, result_w = os.pipe()  # the private channel: the confinement line, then the token
            try:
                token_r, token_w = os.pipe()
                try:
                    os.write(token_w, token)
                    config = {"mode": mode, "outer": outer, "workdir": workdir, "staging": staging, "uid": uid,
                              "disk_bytes": limits.disk_bytes, "limits": _limits_dict(limits),
                              "token_fd": token_r, "result_fd": result_w, "runner": RUNNER_SOURCE}
                    process = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-B", "-c", SETUP_SOURCE, json.dumps(config)],
                        cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        pass_fds=(token_r, result_w),
                        start_new_session=True,  # its own process group, killable as a whole
                    )
                finally:  # the child holds its own copies
                    for fd in (token_r, token_w, result_w):
                        os.close(fd)
                timed_out = False
                try:
                    process.wait(timeout=limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_all(process, uid)
                    process.wait()
                    if mode == "weak" and uid is not None:
                        _remove_files_of(uid)
                confinement, finished = _parse_report(_read_report(result_r), token)
            finally:
                os.close(result_r)
            stdout = _read_output(out, tail=False)
            stderr = _read_output(err, tail=True)
        return SandboxResult(process.returncode, timed_out, stdout, stderr, confinement, finished)
    finally:
        shutil.rmtree(outer, ignore_errors=True)
