"""Run untrusted Python in its own confined process.

Each run starts a fresh interpreter running `sandbox_setup.py` (`python -I -S -B -c SOURCE`) in a new
session; it confines itself before the program's first line runs, so no `preexec_fn` is needed (callers
run the sandbox from threads, where `preexec_fn` is unsafe). Two confinements:

- "namespaces" (root with CAP_SYS_ADMIN): private mount, network, IPC and PID namespaces; a root
  filesystem of its own holding only the system libraries and the Python installation (read-only),
  so data folders, model caches and the repository do not exist for it; one tmpfs (noexec, nosuid,
  nodev, capped in bytes and inodes) for everything it can write; a uid of its own; rlimits;
- "weak" (anything less): rlimits and a uid of its own where root. It runs only when asked for by
  name (EVALSUITE_SANDBOX=weak, set by `--sandbox weak`); otherwise `SandboxUnavailable`.

Both load the same seccomp filter, compiled here by libseccomp (`syscall_filter`), as the program's last
step before its first line: no keyrings, namespaces, ptrace, mounts, BPF, perf events, io_uring or
sockets. No verdict is taken from the program: code scores come from a trusted checker that only
exchanges plain data with it (code_eval.py). The evaluator waits with a wall-clock timeout, then kills
the process group and every process of the run's uid. docs/reliability.md says what this stops.
"""
from __future__ import annotations

import contextlib
import errno
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
REPORT_LIMIT = 64 * 1024  # bytes read from the report pipe
# Per-run uids are drawn from a range no distribution hands out to accounts.
UID_RANGE = (1_500_000_000, 2_000_000_000)
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: private to each run in the namespaces
DIR_PREFIX = "evalsuite-sandbox-"  # then the evaluator's pid: whose run a directory was
CHOICE_ENV = "EVALSUITE_SANDBOX"  # "weak" accepts the weaker confinement where namespaces are missing
NO_NAMESPACES_ENV = "EVALSUITE_SANDBOX_NO_NAMESPACES"  # tests only: behave as if namespaces were missing
SETUP_SOURCE = (Path(__file__).parent / "sandbox_setup.py").read_text(encoding="utf-8")
# The plainest use: run program.py as __main__ (run_python).
MAIN_SOURCE = ("import sys\nprogram = type(sys)('__main__')\nprogram.__file__ = 'program.py'\n"
               "sys.modules['__main__'] = program\nsys.argv = ['program.py']\n"
               "exec(compile(open('program.py', encoding='utf-8').read(), 'program.py', 'exec'), program.__dict__)\n")

# What the program's process may not ask the kernel for (EPERM unless said otherwise).
DENIED_SYSCALLS = (
    "keyctl", "add_key", "request_key",  # keyrings are not namespaced: keys would outlive the run
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie",
    "personality", "socket", "socketpair",
)
NAMESPACE_CLONE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                         0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME


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
    inodes: int = 1024  # files and directories it can make, likewise
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """How a confined program ended. Its exit status and output are the program's own: they say how it ran,
    never whether it was right."""
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    confinement: tuple[str, ...] = field(default=())  # what the sandbox applied, e.g. 'pid-namespace'

    @property
    def exited_cleanly(self) -> bool:
        return not self.timed_out and self.returncode == 0


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


@functools.lru_cache(maxsize=1)
def syscall_filter() -> tuple[bytes, int]:
    """The seccomp filter as BPF compiled by libseccomp, and pivot_root's number on this machine."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # OSError: the binding found no libseccomp.so
        raise SandboxUnavailable(f"no libseccomp ({error}): install libseccomp2 and the pyseccomp package") from None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_CLONE_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory a filter cannot read: libc
    with tempfile.TemporaryFile() as f:                      # falls back to clone, whose flags it can
        rules.export_bpf(f)
        f.seek(0)
        bpf = f.read()
    return bpf, seccomp.resolve_syscall(seccomp.system_arch(), "pivot_root")


def confinement_in_force() -> str:
    """"namespaces" or "weak": what generated code gets on this system, decided here, never by the program."""
    if os.environ.get(NO_NAMESPACES_ENV) or not _namespaces_work():
        return "weak"
    return "namespaces"


def confinement_to_use() -> str:
    """The confinement generated code will run under here: "namespaces", or "weak" when asked for by name;
    `SandboxUnavailable` (one line, saying what to do) when only the weak one exists and nobody asked."""
    choice = os.environ.get(CHOICE_ENV, "")
    if choice not in ("", "weak"):
        raise SandboxUnavailable(f"{CHOICE_ENV}={choice!r} is not a sandbox: set it to 'weak' or leave it unset")
    mode = confinement_in_force()
    if mode == "weak" and choice != "weak":
        raise SandboxUnavailable(
            "generated code would run without namespaces here (that needs root with CAP_SYS_ADMIN): "
            f"run as such, or accept the weaker sandbox with --sandbox weak ({CHOICE_ENV}=weak)")
    syscall_filter()  # refuse here, in one line, where libseccomp is missing
    return mode


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


def _read_report(fd: int) -> tuple[str, ...]:
    """What the setup said it applied: one JSON line, written before the program existed."""
    os.set_blocking(fd, False)
    try:
        line = os.read(fd, REPORT_LIMIT).partition(b"\n")[0]
        applied = json.loads(line)
    except (BlockingIOError, ValueError):
        return ()
    return tuple(applied) if isinstance(applied, list) and all(isinstance(a, str) for a in applied) else ()


class ConfinedRun:
    """A program started in the sandbox (see `confined`): `wait` for it, or leave it to the context's end."""

    def __init__(self, process: subprocess.Popen, limits: SandboxLimits):
        self.process = process
        self.deadline = time.monotonic() + limits.wall_seconds
        self.timed_out = False

    def wait(self) -> None:
        try:
            self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True


@contextlib.contextmanager
def confined(program: str, limits: SandboxLimits | None = None, source: str = MAIN_SOURCE,
             argv: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()):
    """Start `source` (default: run program.py as __main__) confined, with `program` as ./program.py,
    `argv` after it and `pass_fds` open; yield the ConfinedRun; at the end kill every process of the run
    and remove everything it had. The SandboxResult is the run's `result` once the context has ended."""
    limits = limits or SandboxLimits()
    mode = confinement_to_use()
    bpf, pivot_root_nr = syscall_filter()
    uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0] if os.geteuid() == 0 else None
    outer = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
    try:
        os.chmod(outer, 0o711)  # traversable, not listable: the run's uid reaches only its own directory
        workdir = os.path.join(outer, secrets.token_hex(8))
        staging = os.path.join(outer, "interpreter")
        os.mkdir(workdir, 0o700)
        os.mkdir(staging, 0o700)
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox" if mode == "namespaces" else workdir,
               "TMPDIR": "/tmp" if mode == "namespaces" else workdir}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            report_r, report_w = os.pipe()
            try:
                config = {"mode": mode, "outer": outer, "workdir": workdir, "staging": staging, "uid": uid,
                          "limits": {name: getattr(limits, name) for name in SandboxLimits.__dataclass_fields__},
                          "report_fd": report_w, "pass_fds": list(pass_fds), "source": source, "argv": list(argv),
                          "syscall_filter": bpf.hex(), "pivot_root_nr": pivot_root_nr}
                try:
                    process = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-B", "-c", SETUP_SOURCE, json.dumps(config)],
                        cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        pass_fds=(report_w, *pass_fds),
                        start_new_session=True,  # its own process group, killable as a whole
                    )
                finally:
                    os.close(report_w)
                run = ConfinedRun(process, limits)
                try:
                    yield run
                    run.wait()
                finally:
                    _kill_all(process, uid)
                    process.wait()
                    if mode == "weak" and uid is not None:
                        _remove_files_of(uid)
                confinement = _read_report(report_r)
            finally:
                os.close(report_r)
            run.result = SandboxResult(process.returncode, run.timed_out, _read_output(out, tail=False),
                                       _read_output(err, tail=True), confinement)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute `source` confined and say how it ended: its exit status and output, which are its own."""
    with confined(source, limits) as run:
        pass
    return run.result
