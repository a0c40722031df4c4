"""The candidate's side of a code check: runs inside the sandbox after wire.py's text, as `python -I -S -B -c`.

It runs program.py (the prompt and the model's completion: untrusted) as `__main__`, says whether that
worked, then answers calls: each request names a function of the program and carries plain-data
arguments; the answer is the plain-data result, or the name of the exception raised. Nothing here is
trusted by the checker: the program may replace any of it and write anything on the channel. All that
matters is that the tests, the verdict and the data are not in this process, and what crosses is data.
"""
import sys


def serve(requests, answers):
    program = type(sys)("__main__")
    program.__file__ = "program.py"
    sys.modules["__main__"] = program
    sys.argv = ["program.py"]
    try:
        with open("program.py", encoding="utf-8") as f:
            exec(compile(f.read(), "program.py", "exec"), program.__dict__)
    except BaseException as error:  # the program did not load: the checker fails it with the reason
        send(answers, ["raised", type(error).__name__, str(error)[:500]])
        return
    send(answers, ["ready"])
    while True:
        try:
            name, args, kwargs = receive(requests)
        except WireError:
            return  # the checker is done (or gone)
        function = program.__dict__.get(name)
        try:
            if not callable(function):
                raise NameError(f"the program defines no function {name!r}")
            result = function(*decode(args), **decode(kwargs))
            reply = ["returned", encode(result)]
        except BaseException as error:  # SystemExit too: the call did not return a value
            reply = ["raised", type(error).__name__, str(error)[:500]]
        try:
            send(answers, reply)
        except WireError as error:
            send(answers, ["raised", "WireError", str(error)])


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
