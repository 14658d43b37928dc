"""The grading harness: runs inside the sandbox, after `confine.py`, in the candidate's process.

This file is not imported by the parent: its source text is the program `grading.grade` runs in
the sandbox (standard library only, Python 3.8+). It reads a job from stdin, runs the candidate's
solution as module `solution`, then runs the test units the parent rewrote (`plan.py`) in the same
namespace, and writes JSON-lines frames to the result channel (descriptor `CHANNEL_FD`):

    {"t": "solution", "ok": bool, "error": str}       the solution ran (or raised)
    {"t": "check", "i": unit, "c": check, "v": [...]}  the values of one check's probes
    {"t": "check", "i": unit, "c": check, "error": s}  a probe value could not be reported
    {"t": "unit", "i": unit, "ok": bool, "error": s}   a unit ran to its end (or raised)

The harness holds no expected values and decides nothing: the candidate runs in this process and
could rewrite every frame, so the parent trusts a frame only as "the candidate claims these values"
and compares them itself. Values are reported by `encode`, which accepts builtin data only and
reads containers and numbers through their builtin base methods, so an object with a rigged
`__eq__`, `__iter__` or `__index__` is either refused or reported as the data it really holds.
"""

import builtins
import json
import os
import sys
import types

_MAX_DEPTH = 100


def encode(value, depth=0):
    """`value` as tagged JSON (None, bools and strings as themselves, everything else `[tag, ...]`);
    TypeError for anything but builtin data types and their subclasses."""
    if depth > _MAX_DEPTH:
        raise ValueError("the value is nested more than %d deep" % _MAX_DEPTH)
    if value is None or value is True or value is False:
        return value
    d = depth + 1
    if isinstance(value, int):
        return ["int", format(int.__index__(value), "x")]
    if isinstance(value, float):
        return ["float", float.hex(value)]
    if isinstance(value, complex):
        return ["complex", float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return ["bytes", bytes.hex(value)]
    if isinstance(value, bytearray):
        return ["bytearray", bytearray.hex(value)]
    for base in (list, tuple, set, frozenset):
        if isinstance(value, base):
            return [base.__name__, [encode(x, d) for x in base.__iter__(value)]]
    if isinstance(value, dict):
        return ["dict", [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]]
    raise TypeError("a %s value cannot be reported: tests may compare builtin data types only"
                    % type(value).__name__)


def _describe(error):
    try:
        text = "%s: %s" % (type(error).__name__, error)
    except BaseException:  # noqa: BLE001 -- the candidate's exception may refuse to print
        text = type(error).__name__
    return text[:300]


class _Raises:
    """`with pytest.raises(E)` / `self.assertRaises(E)`: reports the exception's class chain and message."""

    def __init__(self, recorder, check, expected):
        self._recorder, self._check, self._expected = recorder, check, expected
        self.type = self.value = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._recorder.check(self._check, [None])
            return False
        self.type, self.value, self.exception = exc_type, exc, exc
        try:
            chain = ["%s.%s" % (c.__module__, c.__qualname__) for c in type.mro(exc_type)]
            self._recorder.check(self._check, [chain, _describe(exc).split(": ", 1)[-1]])
        except BaseException as e:  # noqa: BLE001
            self._recorder.fail(self._check, e)
        try:
            return isinstance(exc, self._expected)
        except TypeError:
            return False


class Recorder:
    """`__tpurl__` in the tests' namespace: the calls the parent's rewrite put in place of asserts."""

    def __init__(self, send):
        self._send = send
        self.unit = None

    def check(self, check, values):
        try:
            frame = {"t": "check", "i": self.unit, "c": check, "v": [encode(v) for v in values]}
        except BaseException as e:  # noqa: BLE001
            return self.fail(check, e)
        self._send(frame)

    def fail(self, check, error):
        self._send({"t": "check", "i": self.unit, "c": check, "error": _describe(error)})

    def raises(self, check, expected):
        return _Raises(self, check, expected)

    def run_method(self, cls, name):
        """Run test method `name` of class `cls` (a unittest.TestCase or a plain pytest-style class)."""
        unittest = sys.modules.get("unittest")
        is_case = unittest is not None and isinstance(cls, type) and issubclass(cls, unittest.TestCase)
        obj = cls(name) if is_case else cls()
        for setup in ("setUp", "setup_method"):
            if callable(getattr(obj, setup, None)):
                getattr(obj, setup)() if setup == "setUp" else getattr(obj, setup)(getattr(obj, name))
        try:
            getattr(obj, name)()
        finally:
            for teardown in ("tearDown", "teardown_method"):
                if callable(getattr(obj, teardown, None)):
                    getattr(obj, teardown)() if teardown == "tearDown" else getattr(obj, teardown)(getattr(obj, name))


def _sender(fd):
    write, dumps = os.write, json.dumps

    def send(frame):
        data = (dumps(frame) + "\n").encode()
        while data:
            data = data[write(fd, data):]
    return send


def main(channel_fd):
    job = json.loads(sys.stdin.buffer.read().decode())  # all of it, before any candidate code runs
    send = _sender(channel_fd)
    module = types.ModuleType(job["modules"][0])
    for name in job["modules"]:
        sys.modules[name] = module
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    try:
        exec(compile(job["solution"], "solution.py", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 -- SystemExit too: exiting early is a failure
        send({"t": "solution", "ok": False, "error": _describe(e)})
        return
    send({"t": "solution", "ok": True})
    recorder = Recorder(send)
    namespace["__tpurl__"] = recorder
    for i, source in enumerate(job["units"]):
        recorder.unit = i
        try:
            exec(compile(source, "tests.py", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001
            send({"t": "unit", "i": i, "ok": False, "error": _describe(e)})
        else:
            send({"t": "unit", "i": i, "ok": True})


if __name__ == "__main__":
    main(CHANNEL_FD)  # noqa: F821 -- defined by the sandbox prologue
