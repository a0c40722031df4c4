"""The trusted side of a code check: runs after wire.py's text, as `python -I -S -B -c`, outside the sandbox.

It reads its job on stdin (the test program, the entry point, the statement that runs the tests, the
time limits), waits for the candidate's process to say its program loaded, runs the test program with
the entry point bound to a proxy, and writes the verdict on a pipe only this process holds. Each call
of the proxy sends the arguments to the candidate's process as plain data and waits, within a time
limit, for a plain-data result or the name of an exception. So the tests, their expected values and
this verdict never exist where the candidate runs, an always-equal object cannot come back, and a
module the candidate patches is the candidate's copy.

A call that cannot be made as plain data (a test passing a function, a result too large, a time-out, a
broken channel) fails the check whatever the test does with the exception: it fails closed.
"""
import builtins
import ctypes
import json
import sys
import time

PR_SET_DUMPABLE = 4


class CandidateRaised(Exception):
    """The candidate raised an exception that is not one of Python's built-in ones."""


class CallFailed(BaseException):
    """A call that could not be made as plain data; BaseException so that `except Exception` in a test
    cannot swallow it (the verdict fails regardless)."""


class Candidate:
    """Stands in for the candidate's function inside the test program."""

    def __init__(self, name, requests, answers, call_seconds, deadline):
        self.__name__ = name
        self._requests, self._answers = requests, answers
        self._call_seconds, self._deadline = call_seconds, deadline
        self.failure = None  # why a call could not be made: the check fails
        self.timed_out = False

    def __call__(self, *args, **kwargs):
        try:
            if self.failure:
                raise WireError(self.failure)
            try:
                request = [self.__name__, encode(list(args)), encode(kwargs)]
            except WireError as error:
                raise WireError(f"the test passes something that is not plain data ({error})") from None
            send(self._requests, request)
            answer = receive(self._answers, min(self._deadline, time.monotonic() + self._call_seconds))
            if type(answer) is list and len(answer) == 2 and answer[0] == "returned":
                return decode(answer[1])
            if type(answer) is list and len(answer) == 3 and answer[0] == "raised" and all(
                    type(part) is str for part in answer[1:]):
                raise exception_named(answer[1], answer[2])
            raise WireError("an answer that is neither a result nor an exception")
        except (WireError, OSError) as error:
            self.timed_out = self.timed_out or str(error) == "timed out"
            self.failure = self.failure or f"calling {self.__name__}: {error}"
            raise CallFailed(self.failure) from None


def exception_named(name, message):
    """A built-in exception of that name (ValueError, ...), else CandidateRaised: never a class of the candidate's."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return CandidateRaised(f"{name}: {message}")


def check(job, requests, answers):
    """(passed, timed out, detail)."""
    deadline = time.monotonic() + job["total_seconds"]
    try:
        loaded = receive(answers, deadline)
    except WireError as error:
        return False, str(error) == "timed out", f"the program never came up ({error})"
    if loaded != ["ready"]:
        what = loaded[1:] if type(loaded) is list and len(loaded) == 3 else ["an unreadable answer", ""]
        return False, False, f"the program raised {what[0]} as it loaded: {what[1]}"
    candidate = Candidate(job["entry_point"], requests, answers, job["call_seconds"], deadline)
    namespace = {"__name__": "__test__"}
    try:
        exec(compile(job["test"], "test.py", "exec"), namespace)
        namespace[job["entry_point"]] = candidate
        exec(compile(job["run"], "test.py", "exec"), namespace)
    except CallFailed:
        pass
    except BaseException as error:
        return False, False, f"{type(error).__name__}: {error}"[:500]
    if candidate.failure:
        return False, candidate.timed_out, candidate.failure
    return True, False, "passed"


def main():
    job = json.loads(sys.stdin.read())
    try:  # a candidate with the evaluator's uid (weak mode, not root) cannot read or write this memory
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    passed, timed_out, detail = check(job, job["requests_fd"], job["answers_fd"])
    send(job["verdict_fd"], {"passed": passed, "timed_out": timed_out, "detail": detail})


if __name__ == "__main__":
    main()
