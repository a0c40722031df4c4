"""The program's own interpreter: the last step of the sandbox, run as `python -I -S -B -c SOURCE`.

It reads the run's pass token from an inherited pipe and closes that pipe, installs an audit hook
that refuses what could find the token or reach past the sandbox, runs program.py as `__main__`,
and only if the program returned normally writes the token on the result pipe. Exit status and
output are the program's to forge; the token is not, so the evaluator counts a pass only when the
token comes back. The token lives in `main`'s frame alone: the hook refuses every way CPython 3.11
offers to reach another frame or every object (frames, tracebacks' and generators' frames, gc,
tracing, signal handlers, ctypes, reading this process's memory through /proc).

Nothing here may come from the evaluator: this file is passed as source text, never imported.
"""
import os
import sys
import types  # noqa: F401  (reads a traceback's frame as it loads: it must load before the hook)

# Modules whose import would hand the program raw memory, other frames, or another interpreter.
REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes", "signal", "_signal", "_testcapi", "_testinternalcapi",
                             "_xxsubinterpreters", "_xxinterpchannels", "_posixsubprocess"})
REFUSED_EVENTS = frozenset({"sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                            "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
# Where namespaces are missing, starting any other process would start it without this hook.
PROCESS_EVENTS = frozenset({"os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.system",
                            "subprocess.Popen", "pty.spawn"})


def refusals(weak: bool):
    """The audit hook. It touches its arguments only after checking their types: a program's own
    objects must not get to run code inside the hook."""
    realpath = os.path.realpath

    def hook(event, args):
        if event in REFUSED_EVENTS or event.startswith("socket.") or (weak and event in PROCESS_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "sys._getframe":  # AttributeError: the stdlib reads it as "this Python has no frames"
            raise AttributeError("sandbox: sys._getframe is not available")
        if event == "object.__getattr__" and type(args[1]) is str and args[1].endswith("_frame"):
            raise AttributeError(f"sandbox: {args[1]} is not available")
        if event == "import" and type(args[0]) is str and args[0].partition(".")[0] in REFUSED_IMPORTS:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and type(args[0]) in (str, bytes):
            path = realpath(os.fsdecode(args[0]))
            if path.startswith("/proc/") and path.endswith("/mem"):
                raise PermissionError(f"sandbox: reading process memory ({path}) is not allowed")

    return hook


def main():
    mode, token_fd, result_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    token = os.read(token_fd, 256)
    os.close(token_fd)
    os.set_inheritable(result_fd, False)  # a program that execs something else loses the channel
    write = os.write
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    sys.modules.pop("_signal", None)  # loaded at start-up; importing it again is refused
    sys.addaudithook(refusals(weak=mode == "weak"))
    program = type(sys)("__main__")
    program.__file__ = "program.py"
    sys.modules["__main__"] = program
    sys.argv = ["program.py"]
    exec(compile(source, "program.py", "exec"), program.__dict__)
    write(result_fd, token)  # reached only when the program returned normally


if __name__ == "__main__":
    main()
