"""Where a run came from (hardware, versions, git commit) and who is writing it (pid, host, start token)."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the checkout evalsuite runs from, with '+dirty' when it has uncommitted changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [f"{platform.system()} {platform.release()}", f"{cpu} x{os.cpu_count()}"]
    torch = sys.modules.get("torch")  # only when the caller already uses torch: importing it costs seconds
    if torch is not None and torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return "; ".join(parts)


def run_defaults() -> dict:
    """Filled into a new run where the caller left them out."""
    return {"hardware": hardware(), "evalsuite_version": package_version("evalsuite"),
            "lm_eval_version": package_version("lm_eval") or package_version("lm-eval"), "git_commit": git_commit()}


def host() -> str:
    return socket.gethostname()


def process_start(pid: int) -> str | None:
    """The kernel's start time of a process (Linux): a pid reused by a new process gets a different one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name in parentheses may hold spaces


def process_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    if start is not None:
        now = process_start(pid)
        if now is not None and now != start:
            return False
        if now is None and os.path.isdir("/proc"):
            return False
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    # a SIGKILLed child of a still-running parent stays a zombie until reaped: it writes nothing more
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
