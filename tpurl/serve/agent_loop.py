"""The agents' side of `tpurl.serve.agents.run_agents`: every episode's agent run against the
endpoint's URL, on an event loop of the calling process or in worker processes of their own.

An episode is a `Job` (its problem and its session, the path of its client's base URL); its agent
gets an `openai.AsyncOpenAI` client of that base URL and the problem, and its `Outcome` is the
reward components it returned or why it has none (it raised, ran past `AgentLimits.timeout_s`, or
returned something that is not a finite reward).

`AgentLimits.processes` = 0 runs the agents on an event loop of a thread of their own, in the
endpoint's process. k >= 1 runs them in k processes of their own, each with its share of the episodes and of
the concurrency: the agents' Python (the `openai` client's request building and parsing, the
user's code) no longer contends for the interpreter lock with the engine's thread and the HTTP
server, and an agent that crashes its interpreter fails only the unfinished episodes of its
process. A `timeout_s` bounds an agent at its awaits; one that blocks without awaiting (a
synchronous call, `time.sleep`) holds its event loop only until the share's deadline
(`share_deadline`), when its unfinished episodes fail and the rollout goes on: a worker is killed,
the event loop's thread in the endpoint's process is left to end when its agents do. In
workers, the agent and the problems travel to the workers pickled: the agent must be a module-level
function (as `AgentConfig.agent`, named by import path, always is). Workers fork from
`multiprocessing`'s fork server (a clean process, never one that runs JAX), which imports `openai`,
the agent's module and the problems' once, when it starts: a rollout's workers start in
milliseconds and end with the rollout.

This module imports neither JAX nor the engine, so that a worker starts light.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import pickle
import signal
import ssl
import sys
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Awaitable, Callable, Coroutine, Sequence

from tpurl.config_types import check_types

Agent = Callable[[Any, Any], Awaitable[Any]]
EPISODES_PER_POOL = 16
MAX_PROCESSES = 64  # each costs the trainer ~8 file descriptors and 2 threads
DEADLINE_GRACE_S = 30.0  # beyond the time a share's episodes may take (`share_deadline`): a worker's start


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentLimits:
    """How agents run: at most `concurrency` episodes at once, each within `timeout_s` seconds, in
    `processes` worker processes (0: on an event loop of the endpoint's process)."""

    concurrency: int = 32
    timeout_s: float = 300.0
    processes: int = 0

    def __post_init__(self):
        check_types(self)
        check_limits(self, "AgentLimits")


def check_limits(limits, owner: str) -> None:
    """Raise a one-line ValueError naming `owner` where `limits` (an object with `concurrency`,
    `timeout_s` and `processes`: an `AgentLimits`, or the config that makes one) are out of range."""
    if limits.concurrency < 1 or not 0 < limits.timeout_s <= 86400:
        raise ValueError(f"{owner}: need concurrency >= 1 and 0 < timeout_s <= 86400, got {limits.concurrency}, "
                         f"{limits.timeout_s}")
    if not 0 <= limits.processes <= MAX_PROCESSES:
        raise ValueError(f"{owner}.processes={limits.processes}: need 0 (agents in the trainer's process) to "
                         f"{MAX_PROCESSES}")


@dataclasses.dataclass(frozen=True)
class Job:
    """One episode to run: its problem and its session (its client's base URL is
    `<url>/sessions/<session>/v1`)."""

    problem: Any
    session: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an episode's agent ended: its reward components, or None and why (`error`)."""

    reward: dict[str, float] | None
    error: str | None
    seconds: float


def reward_components(value: Any) -> dict[str, float]:
    """An agent's return value as reward components (a number is the component "reward"); a
    one-line ValueError for anything else, or a value that is not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ValueError(f"the agent returned {type(value).__name__} {value!r:.80}; return a number or a dict of "
                         "named numbers")
    comps = {"reward": value} if not isinstance(value, dict) else value
    out = {}
    for name, v in comps.items():
        if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"the agent's reward {name!r}: {v!r:.80} is not a finite number")
        out[name] = float(v)
    return out


def check_portable(agent: Agent, problems: Sequence[Any], limits: AgentLimits) -> None:
    """With `limits.processes` >= 1: a one-line ValueError if the agent or a problem cannot reach
    a worker process (it does not pickle, or it lives in a `__main__` that a worker cannot import:
    a notebook, a REPL, a script read from stdin)."""
    if limits.processes == 0:
        return
    name = getattr(_function(agent), "__qualname__", type(agent).__name__)
    fix = "make the agent a module-level function of a module or script, or run agents in this process (processes=0)"
    if not _main_reaches_workers(_module(agent) == "__main__"):
        raise ValueError(f"AgentLimits.processes={limits.processes}: a worker process cannot import this program's "
                         f"main module, which the agent {name} or the workers need; {fix}")
    try:
        pickle.dumps((agent, list({type(p): p for p in problems}.values())))  # one problem of each type
    except Exception as e:
        raise ValueError(f"AgentLimits.processes={limits.processes}: the agent {name} or a problem cannot be sent to "
                         f"a worker process ({type(e).__name__}: {e}); {fix}") from None


def _main_reaches_workers(agent_in_main: bool) -> bool:
    """Whether a worker gets this program's main module as `multiprocessing` prepares it: run from
    a file (a script read from stdin is not one, and breaks every worker), or, for an agent that
    lives there, not skipped (`python -m pkg` runs `pkg.__main__`, which workers do not import; a
    notebook or a REPL has no file)."""
    main = sys.modules.get("__main__")
    spec = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if spec is None and path is not None and not os.path.isfile(path):
        return False
    return not agent_in_main or (spec is None and path is not None)


def _function(agent: Agent) -> Any:
    return getattr(agent, "func", agent)  # a functools.partial's function


def _module(agent: Agent) -> str | None:
    return getattr(_function(agent), "__module__", None)


def run_jobs(agent: Agent, jobs: Sequence[Job], url: str, limits: AgentLimits) -> list[Outcome]:
    """Every job's agent against the endpoint at `url`, at most `limits.concurrency` at once: on
    an event loop thread of its own, or in `limits.processes` worker processes; outcomes in order."""
    if not jobs:
        return []
    if limits.processes == 0:
        return _on_thread(agent, list(jobs), url, limits)
    return _in_processes(agent, jobs, url, limits)


def _on_thread(agent: Agent, jobs: list[Job], url: str, limits: AgentLimits) -> list[Outcome]:
    """`run_jobs` on an event loop of a thread of its own, waited for until the share's deadline
    (`share_deadline`). Past it (an agent blocked without awaiting), the episodes that had not
    ended fail with the reason and the thread is left behind: a thread cannot be killed. It ends
    when its running agents return or time out; the episodes still waiting for their turn do not
    start (one that a slot was freed for just before the deadline may)."""
    ended: dict[int, Outcome] = {}
    share: concurrent.futures.Future = concurrent.futures.Future()
    abandoned = threading.Event()

    def run() -> None:
        try:
            share.set_result(run_share(agent, jobs, url, limits.concurrency, limits.timeout_s, ended, abandoned))
        except BaseException as e:
            share.set_exception(e)

    threading.Thread(target=run, name="tpurl-agents-loop", daemon=True).start()
    with contextlib.suppress(concurrent.futures.TimeoutError):
        return share.result(timeout=share_deadline(len(jobs), limits.concurrency, limits.timeout_s))
    if share.done():  # run_share's own error, or the share ended just now
        return share.result()
    abandoned.set()  # the episodes still waiting for their turn do not start
    error = ("the agents' event loop ran past its deadline: an agent blocked without awaiting (a synchronous "
             "call, time.sleep), which AgentLimits.timeout_s cannot interrupt; its thread is left behind "
             "(AgentLimits.processes >= 1 kills such agents)")
    return _ended_else(ended, error, len(jobs))


def _event_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """`main` on a new event loop: uvloop's where it is installed (the `serve` extra; uvicorn
    serves on it too), asyncio's own otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _in_processes(agent: Agent, jobs: Sequence[Job], url: str, limits: AgentLimits) -> list[Outcome]:
    """`run_jobs` in worker processes: process r runs jobs r, r + k, ... with its share of the
    concurrency. A process that dies, or runs past its share's deadline (`share_deadline`: an
    agent that blocks without awaiting; it is killed, not the processes its agents started), fails
    the episodes of its share that had not ended, with the reason (`run_share`'s record keeps the
    others)."""
    k = min(limits.processes, limits.concurrency, len(jobs))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_preload(agent, jobs))
    workers: list[_Worker] = []
    try:  # the workers' records of their outcomes; without a temporary directory, none (a whole share fails)
        records = tempfile.TemporaryDirectory(prefix="tpurl-agents-", ignore_cleanup_errors=True)
    except OSError:
        records = None
    try:
        for r in range(k):
            executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
            record = None if records is None else os.path.join(records.name, f"share{r}.jsonl")
            workers.append(_Worker(executor, record))
            concurrency = limits.concurrency // k + (r < limits.concurrency % k)
            workers[-1].start(agent, list(jobs[r::k]), url, concurrency, limits.timeout_s)
        outcomes: list[Outcome | None] = [None] * len(jobs)
        for r, worker in enumerate(workers):
            outcomes[r::k] = worker.outcomes(r, len(jobs[r::k]))
        return outcomes
    finally:
        for worker in workers:  # first, so that no shutdown below waits on a blocked agent
            worker.kill_unfinished()
        for worker in workers:
            worker.executor.shutdown(wait=True, cancel_futures=True)
        if records is not None:
            records.cleanup()


def share_deadline(jobs: int, concurrency: int, timeout_s: float) -> float:
    """Seconds within which a share of `jobs` episodes (a worker's, or the agents' thread's) ends
    when its agents await: each within `timeout_s`, `concurrency` at once (at most
    jobs / concurrency + 1 episodes' time one after another), plus `DEADLINE_GRACE_S`."""
    return (jobs / concurrency + 1) * timeout_s + DEADLINE_GRACE_S


class _Worker:
    """One worker process (an executor of one) and its share: the share's future, its deadline,
    the file its outcomes are recorded in as they end, and the process id (asked for ahead of the
    share) to kill it by."""

    def __init__(self, executor: concurrent.futures.ProcessPoolExecutor, record: str | None):
        self.executor, self.record = executor, record
        self.pid = self.share = None
        self.deadline = math.inf

    def start(self, agent, jobs: list[Job], url: str, concurrency: int, timeout_s: float) -> None:
        self.pid = _submit(self.executor, os.getpid)
        self.share = _submit(self.executor, run_share, agent, jobs, url, concurrency, timeout_s, self.record)
        self.deadline = time.monotonic() + share_deadline(len(jobs), concurrency, timeout_s)

    def outcomes(self, r: int, n: int) -> list[Outcome]:
        """The share's outcomes by its deadline; past it, or when the share failed, the recorded
        ones and, for the other episodes, failed ones saying why."""
        try:
            return self.share.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception:
            if self.share.done():  # the process died (or its share could not reach it): the reason
                return self._failed(r, n)
            killed = "was killed" if self.kill() else "could not be killed"
            error = (f"the agents' worker process {r} ran past its deadline and {killed}: an agent blocked without "
                     f"awaiting (a synchronous call, time.sleep), which AgentLimits.timeout_s cannot interrupt")
        return _ended_else(_recorded(self.record), error, n)

    def _failed(self, r: int, n: int) -> list[Outcome]:
        """The share's outcomes, or (it failed) those recorded and failed ones with the reason."""
        try:
            return self.share.result()
        except Exception as e:
            error = f"the agents' worker process {r} failed: {type(e).__name__}: {e}"
            if isinstance(e, BrokenProcessPool):
                error += (" (an agent ended it, or it could not start: its traceback is on stderr; a script that runs "
                          "agents in processes needs its work under `if __name__ == '__main__':`)")
            return _ended_else(_recorded(self.record), error, n)


    def kill(self) -> bool:
        """SIGKILL the worker process; whether it could."""
        if self.pid is not None and self.pid.done() and self.pid.exception() is None:
            pids = [self.pid.result()]
        else:  # the worker never ran its first call: the executor's own record of its process
            pids = list(getattr(self.executor, "_processes", None) or ())
        killed = False
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed = True
        return killed

    def kill_unfinished(self) -> None:
        """Kill the worker if it is still running its share (the caller left early)."""
        if self.share is not None and not self.share.done():
            self.kill()


def _submit(worker, fn, *args) -> concurrent.futures.Future:
    """`fn(*args)`'s future in the worker; a failure to hand it over (the fork server did not
    start) is the future's."""
    try:
        return worker.submit(fn, *args)
    except Exception as e:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(e)
        return future


def _preload(agent: Agent, jobs: Sequence[Job]) -> list[str]:
    """What the fork server imports once, when it starts, so that no worker does: `openai`,
    `uvloop` (if installed), this module, and the modules of the agent and of the problems' types
    (a task's problem type may import much: JAX, imported there but never started). A module whose import raises there
    (anything but an ImportError, which the fork server skips) makes every worker fail to start,
    which `_Worker.outcomes` reports."""
    modules = ["openai", "uvloop", __name__, _module(agent), *(type(job.problem).__module__ for job in jobs)]
    return [m for m in dict.fromkeys(modules) if m and m not in ("builtins", "__main__")]


def run_share(agent: Agent, jobs: list[Job], url: str, concurrency: int, timeout_s: float,
              record: str | dict | None = None, abandoned: threading.Event | None = None) -> list[Outcome]:
    """A share of the jobs (a worker process's, or all of them in this process): their agents on
    an event loop of its own. `record`: a file each outcome is appended to as its episode ends (a
    JSON line with its index in the share), so that a worker killed mid-share keeps those, or a
    dict it is put in by index (the share's thread may be left behind). Once `abandoned` is set,
    no episode that has not started starts its agent."""
    log = _Record(record)
    try:
        return _event_loop(_episodes(agent, jobs, url, concurrency, timeout_s, log, abandoned))
    finally:
        log.close()


class _Record:
    """A share's outcomes as they end: put in a dict, or appended to a file at best (a file that
    cannot be opened or written, a full disk, stops the record, never the share)."""

    def __init__(self, to: str | dict | None):
        self.file = None
        self.memo = to if isinstance(to, dict) else None
        if isinstance(to, str):
            with contextlib.suppress(OSError):
                self.file = open(to, "a")

    def add(self, k: int, outcome: Outcome) -> None:
        if self.memo is not None:
            self.memo[k] = outcome
        if self.file is None:
            return
        try:
            self.file.write(json.dumps({"k": k, "reward": outcome.reward, "error": outcome.error,
                                        "seconds": outcome.seconds}) + "\n")
            self.file.flush()
        except OSError:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None


def _ended_else(ended: dict[int, Outcome], error: str, n: int) -> list[Outcome]:
    """The `n` outcomes of a share that ended early: those recorded as their episodes ended
    (`run_share`'s record, by index), the others failed with `error`."""
    return [ended.get(k, Outcome(None, error, 0.0)) for k in range(n)]


def _recorded(record: str | None) -> dict[int, Outcome]:
    """The outcomes `run_share` recorded, by index (a line cut short by a kill is skipped)."""
    out: dict[int, Outcome] = {}
    if record is None:
        return out
    with contextlib.suppress(OSError), open(record) as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                d = json.loads(line)
                out[int(d["k"])] = Outcome(d["reward"], d["error"], float(d["seconds"]))
    return out


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS context of every agent client of this process, made once: unused on http://, but
    each client would load the CA store (~20 ms) for one of its own."""
    return ssl.create_default_context()


async def _episodes(agent: Agent, jobs: Sequence[Job], url: str, concurrency: int, timeout_s: float,
                    log: _Record, abandoned: threading.Event | None) -> list[Outcome]:
    import openai  # the optional extra: the agents' client

    gate = asyncio.Semaphore(concurrency)
    # A connection pool per EPISODES_PER_POOL episodes: a client of its own per episode would build
    # an HTTP client each time, and one pool for hundreds of concurrent requests spends its time
    # matching requests to connections (a scan of every connection per request). The pools share
    # the process's TLS context (`_tls`). Each episode's copy of its pool's client has its
    # session's base URL.
    shared = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="tpurl", max_retries=0, timeout=timeout_s,
                                 http_client=openai.DefaultAsyncHttpxClient(verify=_tls()))
              for _ in range(-(-min(len(jobs), concurrency) // EPISODES_PER_POOL))]

    async def one(k: int, job: Job) -> Outcome:
        async with gate:
            if abandoned is not None and abandoned.is_set():
                return Outcome(None, "the rollout ended before this episode started", 0.0)
            client = shared[k % len(shared)].with_options(base_url=f"{url}/sessions/{job.session}/v1")
            start = time.monotonic()
            reward = error = None
            deadline = asyncio.timeout(timeout_s)

            def late() -> bool:
                return deadline.expired() or time.monotonic() - start > timeout_s

            try:  # the agent starts in this task, right after the check above (wait_for would start a task)
                async with deadline:
                    value = await _no_exit(agent, client, job.problem)
                if late():  # it caught the timeout's cancellation, or blocked past it, and returned anyway
                    raise TimeoutError
                reward = reward_components(value)
            except (Exception, asyncio.CancelledError) as e:  # the agent's failure is its episode's, not the run's
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # the share itself is being cancelled
                error = (f"the agent ran past AgentLimits.timeout_s={timeout_s:g} s" if late()
                         else f"agent: {type(e).__name__}: {e}")
            outcome = Outcome(reward, error, time.monotonic() - start)
            log.add(k, outcome)
            return outcome

    try:
        return list(await asyncio.gather(*(one(k, job) for k, job in enumerate(jobs))))
    finally:
        for client in shared:
            await client.close()


async def _no_exit(agent: Agent, client, problem) -> Any:
    """The agent's episode, with a `sys.exit` inside it (a tool that calls it) raised as the
    episode's failure, where asyncio would stop the whole event loop for it."""
    try:
        return await agent(client, problem)
    except SystemExit as e:
        raise RuntimeError(f"SystemExit: {e}") from None
