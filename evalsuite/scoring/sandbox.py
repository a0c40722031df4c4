"""Run an untrusted Python program in a separate, resource-limited subprocess.

Every run gets a fresh temporary working directory, a scrubbed environment, an
isolated interpreter (-I: no user site, no PYTHON* variables) and rlimits on CPU
time, address space, file size and process count; a wall-clock timeout kills
the whole process group. This is containment for small generated programs, not
a security boundary against a determined attacker.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

try:
    import resource
except ImportError:  # non-POSIX: run without rlimits
    resource = None

OUTPUT_LIMIT = 4096  # characters of stdout/stderr kept for diagnostics


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    address_space_bytes: int = 512 * 1024 * 1024
    file_size_bytes: int = 1024 * 1024
    max_processes: int = 1


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return not self.timed_out and self.returncode == 0


def _apply_limits(limits: SandboxLimits):
    def preexec() -> None:
        if resource is None:
            return
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return preexec


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute `source` with a fresh interpreter; the exit status says whether it ran cleanly."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="evalsuite-sandbox-") as workdir:
        script = os.path.join(workdir, "program.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(source)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", script],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group, so a timeout kills any children too
            preexec_fn=_apply_limits(limits),
            text=True,
            errors="replace",
        )
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = process.communicate()
        return SandboxResult(
            returncode=process.returncode,
            timed_out=timed_out,
            stdout=stdout[:OUTPUT_LIMIT],
            stderr=stderr[-OUTPUT_LIMIT:],
        )
