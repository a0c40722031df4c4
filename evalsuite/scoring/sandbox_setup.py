"""The sandbox's first process, run as `python -I -S -B -c SOURCE CONFIG` by evalsuite.scoring.sandbox.

In "namespaces" mode (root with CAP_SYS_ADMIN) it takes new mount, network, IPC and PID
namespaces, mounts one size-capped tmpfs that holds the working directory and private /tmp,
/var/tmp, /dev/shm and /run, and forks the namespace's init (pid 1), which mounts a fresh /proc
and forks the program's process. Processes:

    setup (host pid namespace; waits, forwards the exit status)
      -> init, pid 1 (root; waits, reports the program's status; its death ends the namespace)
           -> program (own uid, rlimits; execs the runner, a fresh interpreter with no ctypes)

pid 1 ignores signals it has no handler for, so the program never runs as pid 1: the kernel's
rlimit signals and the program's own kill() behave as they do anywhere. In "weak" mode there are
no namespaces: this process itself becomes the program's process.

The program's process writes what was applied on the result pipe before it execs the runner,
so everything the program could append comes after it. Nothing here may come from the evaluator:
this file is passed as source text, never imported.
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SHARED_PLACES = {"/tmp": 0o1777, "/var/tmp": 0o1777, "/dev/shm": 0o1777, "/run": 0o755}
REFUSED = 126  # exit status when the sandbox cannot be set up as asked

libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def refuse(why: str):
    sys.stderr.write(f"sandbox: {why}; refusing to run the program\n")
    os._exit(REFUSED)


def traversable_by_others(path):
    parts = os.path.realpath(path).split(os.sep)
    return all(os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001 for i in range(2, len(parts) + 1))


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


def private_places(outer, disk_bytes):
    """One tmpfs of `disk_bytes` over the run's directory holds everything the program can write:
    /tmp, /var/tmp, /dev/shm and /run are bound to directories inside it (/tmp last: the run's
    directory usually lives under it), and it vanishes with the mount namespace."""
    mount("tmpfs", outer, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=0755")
    for place, mode in sorted(SHARED_PLACES.items(), key=lambda item: item[0] == "/tmp"):
        inside = os.path.join(outer, place.strip("/").replace("/", "-"))
        os.mkdir(inside)
        os.chmod(inside, mode)
        if os.path.isdir(place):
            mount(inside, place, None, MS_BIND | MS_NOSUID | MS_NODEV)


def wait_for(pid) -> int:
    """The child's exit status as Popen reports it: negative for a signal."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def exit_like(status: int):
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be set
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


def enter_namespaces(cfg, applied):
    """Returns in the program's process; the setup and init processes wait here and never return."""
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID) != 0:
        refuse(f"no namespaces ({os.strerror(ctypes.get_errno())})")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    if not traversable_by_others(sys.base_prefix):
        expose(sys.base_prefix, cfg["staging"])
    private_places(cfg["outer"], cfg["disk_bytes"])
    applied += ["network-namespace", "ipc-namespace", "pid-namespace", "private-tmp", "disk-quota"]
    status_r, status_w = os.pipe()  # init -> setup: the program's exit status, signals included
    init = os.fork()
    if init:
        os.close(status_w)
        os.close(cfg["token_fd"])
        os.close(cfg["result_fd"])
        init_status = wait_for(init)
        reported = os.read(status_r, 32)
        exit_like(int(reported) if reported else init_status)
    os.close(status_r)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    program = os.fork()
    if program:
        os.close(cfg["token_fd"])
        os.close(cfg["result_fd"])
        os.write(status_w, str(wait_for(program)).encode())
        os._exit(0)  # the namespace ends with its init: every process left in it is killed
    os.close(status_w)
    pid = os.getpid()
    for mem in (f"/proc/{pid}/mem", f"/proc/{pid}/task/{pid}/mem"):  # its memory holds the pass token
        mount("/dev/null", mem, None, MS_BIND)


def drop_to_own_uid(cfg, applied):
    if os.geteuid() != 0:
        return
    if not traversable_by_others(sys.base_prefix):
        # Never run untrusted code as root: no process limit binds it, it could kill the evaluator.
        if libc.unshare(CLONE_NEWNS) != 0:
            refuse("the interpreter is unreadable to an unprivileged uid and no mount namespace can expose it")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        expose(sys.base_prefix, cfg["staging"])
    uid = cfg["uid"]
    os.chown(".", uid, uid)
    os.chown("program.py", uid, uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    applied.append("own-uid")


def main():
    cfg = json.loads(sys.argv[1])
    applied = [cfg["mode"]]
    # The runner is started from the interpreter itself, not from a virtual environment's link to it: a
    # venv under /tmp (a checkout there) is hidden once the private /tmp is mounted.
    interpreter = os.path.realpath(sys.executable)
    if cfg["mode"] == "namespaces":
        hidden = [place for place in SHARED_PLACES for path in (interpreter, os.path.realpath(sys.base_prefix))
                  if path == place or path.startswith(place + os.sep)]
        if hidden:
            refuse(f"the Python installation ({interpreter}) lives under {hidden[0]}, which each run gets a private "
                   "copy of; use a Python installed elsewhere")
    with open(os.path.join(cfg["workdir"], "program.py"), encoding="utf-8") as f:
        source = f.read()
    if cfg["mode"] == "namespaces":
        enter_namespaces(cfg, applied)
    os.makedirs(cfg["workdir"], mode=0o700, exist_ok=True)  # inside the tmpfs, if one was mounted
    os.chdir(cfg["workdir"])
    with open("program.py", "w", encoding="utf-8") as f:
        f.write(source)
    drop_to_own_uid(cfg, applied)
    os.umask(0o077)
    limits = cfg["limits"]
    for name, value, hard in (("RLIMIT_CPU", limits["cpu_seconds"], limits["cpu_seconds"] + 1),
                              ("RLIMIT_AS", limits["address_space_bytes"], None),
                              ("RLIMIT_FSIZE", limits["file_size_bytes"], None),
                              ("RLIMIT_NOFILE", limits["open_files"], None),
                              ("RLIMIT_NPROC", limits["max_processes"], None),
                              ("RLIMIT_CORE", 0, None)):
        resource.setrlimit(getattr(resource, name), (value, value if hard is None else hard))
    applied += ["rlimits", "audit-hook"]
    os.write(cfg["result_fd"], json.dumps(applied).encode() + b"\n")
    for fd in (cfg["token_fd"], cfg["result_fd"]):
        os.set_inheritable(fd, True)
    os.execv(interpreter, [interpreter, "-I", "-S", "-B", "-c", cfg["runner"], cfg["mode"],
                           str(cfg["token_fd"]), str(cfg["result_fd"])])


if __name__ == "__main__":
    main()
