"""The sandbox's first process, run as `python -I -S -B -c SOURCE CONFIG` by evalsuite.scoring.sandbox.

In "namespaces" mode (root with CAP_SYS_ADMIN) it takes new mount, network, IPC and PID namespaces and
forks the namespace's init (pid 1). init builds a new root filesystem and pivots into it, so that the
host's files (data folders, model caches, the repository, results) do not exist for the program:

    /usr /lib* /bin /sbin, the Python installation, /etc/ld.so.cache   read-only binds of the host's
    /dev/{null,zero,full,random,urandom}                               binds of the host's devices
    /sandbox (the program's directory), /tmp, /var/tmp, /dev/shm, /run in one tmpfs: noexec, nosuid,
                                                                       nodev, capped in bytes and inodes
    /proc                                                              a fresh one: the run's processes

then mounts /proc and forks the program's process. Processes:

    setup (host pid namespace; waits, forwards the exit status)
      -> init, pid 1 (root; waits, reports the program's status; its death ends the namespace)
           -> program (own uid, rlimits, seccomp filter; execs the given source in a fresh interpreter)

pid 1 ignores signals it has no handler for, so the program never runs as pid 1. In "weak" mode there
are no namespaces: this process itself becomes the program's process (own uid where root, rlimits,
the same seccomp filter).

The seccomp filter arrives as BPF that libseccomp compiled in the evaluator (sandbox.syscall_filter); it
is loaded last, just before exec, and stays through every later exec. The program's process writes
what was applied on the report pipe and closes it before it execs: the program cannot write there.
Nothing here may come from the evaluator's modules: this file is passed as source text, never imported.
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
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SYSTEM_TREES = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "full", "random", "urandom")
WRITABLE = {"tmp": 0o1777, "var/tmp": 0o1777, "dev/shm": 0o1777, "run": 0o755}
WORKDIR = "/sandbox"  # the program's directory inside the new root
REFUSED = 126  # exit status when the sandbox cannot be set up as asked

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), target)


def refuse(why: str):
    sys.stderr.write(f"sandbox: {why}; refusing to run the program\n")
    os._exit(REFUSED)


def traversable_by_others(path):
    parts = os.path.realpath(path).split(os.sep)
    return all(os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001 for i in range(2, len(parts) + 1))


def bind_read_only(source, target):
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def expose(tree, staging):
    """Weak mode as root: make `tree` readable to an unprivileged uid by hiding its closed ancestor
    under a tmpfs and binding the tree back."""
    tree = os.path.realpath(tree)
    parts = tree.split(os.sep)
    closed = next(os.sep.join(parts[:i]) for i in range(2, len(parts) + 1)
                  if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001)
    mount(tree, staging, None, MS_BIND | MS_REC)
    mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    os.makedirs(tree, mode=0o755, exist_ok=True)
    mount(staging, tree, None, MS_BIND | MS_REC)
    mount(None, tree, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(cfg, interpreter):
    """A new root in a fresh tmpfs at cfg["outer"] holding only what the interpreter needs; pivot into it."""
    root = cfg["outer"]
    limits = cfg["limits"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={limits['disk_bytes']},nr_inodes={limits['inodes']},mode=0755")
    inside = lambda path: os.path.join(root, path.lstrip("/"))
    python_trees = {os.path.realpath(sys.base_prefix), os.path.dirname(interpreter)}
    bound = []
    for tree in SYSTEM_TREES + tuple(sorted(python_trees)):
        if not os.path.lexists(tree) or any(tree == b or tree.startswith(b + "/") for b in bound):
            continue
        if os.path.islink(tree):  # /bin -> usr/bin on a merged /usr
            os.symlink(os.readlink(tree), inside(tree))
            continue
        os.makedirs(inside(tree), mode=0o755, exist_ok=True)
        bind_read_only(os.path.realpath(tree), inside(tree))
        bound.append(tree)
    for path in SYSTEM_FILES + tuple(f"/dev/{name}" for name in DEVICES):
        if os.path.exists(path):
            os.makedirs(os.path.dirname(inside(path)), mode=0o755, exist_ok=True)
            open(inside(path), "w").close()
            mount(path, inside(path), None, MS_BIND)
    for place, mode in WRITABLE.items():
        os.makedirs(inside(place), exist_ok=True)
        os.chmod(inside(place), mode)
    os.makedirs(inside(WORKDIR), mode=0o700)
    os.makedirs(inside("/proc"), mode=0o555)
    os.chdir(root)
    check(libc.syscall(cfg["pivot_root_nr"], b".", b"."), "pivot_root")  # the old root lands on top of the new
    check(libc.umount2(b".", MNT_DETACH), "umount old root")  # and is detached: the host is gone
    os.chdir("/")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def wait_for(pid) -> int:
    """The child's exit status as Popen reports it: negative for a signal."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def exit_like(status: int):
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be set
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


def close_all(fds):
    for fd in fds:
        os.close(fd)


def enter_namespaces(cfg, applied, interpreter):
    """Returns in the program's process, inside the new root; setup and init wait here and never return."""
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID) != 0:
        refuse(f"no namespaces ({os.strerror(ctypes.get_errno())})")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    inherited = [cfg["report_fd"], *cfg["pass_fds"]]
    status_r, status_w = os.pipe()  # init -> setup: the program's exit status, signals included
    init = os.fork()
    if init:
        os.close(status_w)
        close_all(inherited)  # the program's copies are the only ones left open
        init_status = wait_for(init)
        reported = os.read(status_r, 32)
        exit_like(int(reported) if reported else init_status)
    os.close(status_r)
    try:
        build_root(cfg, interpreter)
    except OSError as error:
        refuse(f"cannot build the program's root ({error})")
    applied += ["network-namespace", "ipc-namespace", "pid-namespace", "own-root", "private-tmp", "disk-quota"]
    program = os.fork()
    if program:
        close_all(inherited)
        os.write(status_w, str(wait_for(program)).encode())
        os._exit(0)  # the namespace ends with its init: every process left in it is killed
    os.close(status_w)


def drop_to_own_uid(cfg, applied):
    if os.geteuid() != 0:
        return
    if cfg["mode"] == "weak" and not traversable_by_others(sys.base_prefix):
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


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_syscall_filter(bpf: bytes, applied):
    """Install the libseccomp-compiled filter (8 bytes an instruction); no_new_privs first, as the kernel asks."""
    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = SockFprog(len(bpf) // 8, ctypes.cast(program, ctypes.c_void_p))
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
    applied.append("seccomp")


def main():
    cfg = json.loads(sys.argv[1])
    applied = [cfg["mode"]]
    # The interpreter itself, not a virtual environment's link to it: the venv is not in the new root.
    interpreter = os.path.realpath(sys.executable)
    with open(os.path.join(cfg["workdir"], "program.py"), encoding="utf-8") as f:
        source = f.read()
    if cfg["mode"] == "namespaces":
        enter_namespaces(cfg, applied, interpreter)
        workdir = WORKDIR
    else:
        workdir = cfg["workdir"]
    os.chdir(workdir)
    if cfg["mode"] == "namespaces":
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
    applied.append("rlimits")
    try:
        load_syscall_filter(bytes.fromhex(cfg["syscall_filter"]), applied)
    except OSError as error:
        refuse(f"cannot load the syscall filter ({error})")
    os.write(cfg["report_fd"], json.dumps(applied).encode() + b"\n")
    os.close(cfg["report_fd"])
    for fd in cfg["pass_fds"]:
        os.set_inheritable(fd, True)
    os.execv(interpreter, [interpreter, "-I", "-S", "-B", "-c", cfg["source"], *cfg["argv"]])


if __name__ == "__main__":
    main()
