"""math-verify in child processes: a check that runs past its time is killed, not waited for.

A completion is untrusted text, and sympy can spend unbounded time (or memory) on some of it
(`10^{10^{10^{10}}}`) inside C code that neither a signal nor a thread can interrupt. So each
check runs in a worker process (`python -m tpurl.tasks.math_verify_worker`): one JSON line in
(`[answer, reference, timeout_s]`), one out (`{"equal": bool}` or `{"error": ...}`). A worker that
does not answer within the timeout is killed and replaced on the next check. A worker's address
space is capped (`MEMORY_LIMIT_BYTES`), and so is each check's CPU time (the soft RLIMIT_CPU is
moved to just past it, so a worker whose parent died mid-check still ends); an idle worker exits
at the end of its input. Workers start on the first check and are shared by every thread that
grades.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import resource
import select
import subprocess
import sys
import threading
import time

MEMORY_LIMIT_BYTES = 4 << 30
START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine
THIN_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,!;: ]|~)(?=\d{3})")


def sympy_ready(answer: str) -> str:
    """`answer` boxed for math-verify, with what its LaTeX parser misreads removed first:
    markdown emphasis and thousands separators (`1{,}000`, `1\\,000`)."""
    s = THIN_THOUSANDS.sub("", answer.replace("**", "").replace("{,}", ","))
    return "\\boxed{" + s + "}"


def verdict(answer: str, reference: str) -> bool:
    """math-verify's verdict on `answer` against `reference`, its own (signal) timeouts off."""
    from math_verify import parse, verify
    gold = parse(sympy_ready(reference), parsing_timeout=None)
    got = parse(sympy_ready(answer), parsing_timeout=None)
    return bool(gold) and bool(got) and verify(gold, got, timeout_seconds=None)


class Worker:
    """One worker process and the pipes to it."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)
        if self._line(START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError("the math-verify worker did not start")

    def _line(self, timeout_s: float) -> str | None:
        """The worker's next line, None when it said nothing within `timeout_s` or exited."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        return line.strip() if line else None

    def check(self, answer: str, reference: str, timeout_s: float) -> dict | None:
        """The worker's reply to one check, None when it ran past `timeout_s` or died."""
        try:
            self.proc.stdin.write(json.dumps([answer, reference, timeout_s]) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        line = self._line(timeout_s)
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class WorkerPool:
    """Up to `size` workers; a check takes an idle one (starting one when none is idle and the
    pool is not full) and kills it when the check runs past its time."""

    def __init__(self, size: int):
        self.size, self.killed = size, 0
        self._idle: queue.SimpleQueue[Worker] = queue.SimpleQueue()
        self._started, self._lock = 0, threading.Lock()

    def _take(self) -> Worker:
        while True:
            with self._lock:
                start = self._idle.empty() and self._started < self.size
                self._started += start
            if not start:
                try:
                    return self._idle.get(timeout=0.05)
                except queue.Empty:  # all busy: one may be killed, freeing a place
                    continue
            try:
                return Worker()
            except BaseException:
                with self._lock:
                    self._started -= 1
                raise

    def check(self, answer: str, reference: str, timeout_s: float) -> tuple[bool, str | None]:
        """Whether `answer` equals `reference` by math-verify, and why not decided (None when it was)."""
        worker = self._take()
        start = time.monotonic()
        reply = worker.check(answer, reference, timeout_s)
        if reply is None:
            worker.kill()
            with self._lock:
                self._started -= 1
                self.killed += 1
            late = time.monotonic() - start >= timeout_s
            return False, f"math-verify timed out after {timeout_s:g} s" if late else "the math-verify worker died"
        self._idle.put(worker)
        return (bool(reply["equal"]), None) if "equal" in reply else (False, f"math-verify raised {reply['error']}")


def _serve() -> None:
    """The worker: answer checks from stdin until it closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that its timeouts are off
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    verdict("1", "1")  # import and warm sympy before saying ready
    print("ready", flush=True)
    for line in sys.stdin:
        answer, reference, timeout_s = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        budget = math.ceil(used.ru_utime + used.ru_stime + timeout_s) + 1  # SIGXCPU ends the worker past it
        resource.setrlimit(resource.RLIMIT_CPU, (budget, resource.RLIM_INFINITY))
        try:
            reply = {"equal": verdict(answer, reference)}
        except (Exception, MemoryError) as e:  # noqa: BLE001 - reported as the sample's grading error
            reply = {"error": type(e).__name__}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _serve()
