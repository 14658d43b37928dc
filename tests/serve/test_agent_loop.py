"""The agents' side without an engine (`tpurl.serve.agent_loop`): worker processes get their shares
of the jobs and of the concurrency, outcomes come back in the jobs' order, and an agent's
`sys.exit` is its episode's failure, not the run's; the module imports no JAX."""

import os
import subprocess
import sys

import pytest

import worker_agents
from tpurl.serve.agent_loop import AgentLimits, Job, run_jobs

URL = "http://127.0.0.1:9"  # never called


@pytest.mark.parametrize("processes,concurrency,jobs", [(3, 2, 5), (4, 8, 3), (2, 5, 7)])
def test_outcomes_in_order_from_their_processes(processes, concurrency, jobs):
    out = run_jobs(worker_agents.echo, [Job(i, f"s{i}") for i in range(jobs)], URL,
                   AgentLimits(processes=processes, concurrency=concurrency))
    assert [o.reward["reward"] for o in out] == list(range(jobs)) and all(o.error is None for o in out)
    k = min(processes, concurrency, jobs)
    pids = [o.reward["pid"] for o in out]
    assert [pids[r::k] == [pids[r]] * len(pids[r::k]) for r in range(k)] == [True] * k  # job i in process i mod k
    assert len(set(pids)) == k and os.getpid() not in pids
    assert {o.reward["uvloop"] for o in out} == {1.0}  # the serve extra's loop, in the workers too


def test_an_agent_that_calls_sys_exit_fails_its_episode():
    for processes in (0, 1):
        (out,) = run_jobs(worker_agents.exits, [Job(7, "s")], URL, AgentLimits(processes=processes))
        assert out.reward is None and out.error == "agent: RuntimeError: SystemExit: tool gave up on 7"


def test_an_agents_own_timeout_error_is_its_failure_not_the_deadline():
    async def agent(client, problem):
        raise TimeoutError("the tool timed out")

    (out,) = run_jobs(agent, [Job(0, "s")], URL, AgentLimits(timeout_s=60))
    assert out.reward is None and out.error == "agent: TimeoutError: the tool timed out"


def test_past_timeout_s_an_agent_fails_however_it_meets_the_cancellation():
    """An agent that awaits past `timeout_s` fails with the timeout, also one that catches the
    cancellation and returns or raises, and one that blocks past it and returns; one that raises a
    CancelledError of its own fails only its episode."""
    import asyncio

    async def agent(client, problem):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if problem == "returns":
                return 1.0
            if problem == "raises":
                raise ValueError("cleanup failed")
            raise
        return 1.0

    async def own_cancel(client, problem):
        raise asyncio.CancelledError("a subtask was cancelled")

    async def blocks_then_returns(client, problem):
        import time

        time.sleep(0.4)  # a synchronous call past timeout_s: no await for the timeout to cancel
        return 1.0

    out = run_jobs(agent, [Job(p, f"s{i}") for i, p in enumerate(("awaits", "returns", "raises"))], URL,
                   AgentLimits(timeout_s=0.2))
    out += run_jobs(blocks_then_returns, [Job(0, "s")], URL, AgentLimits(timeout_s=0.2))
    assert [o.reward for o in out] == [None] * 4
    assert {o.error for o in out} == {"the agent ran past AgentLimits.timeout_s=0.2 s"}
    (own,) = run_jobs(own_cancel, [Job(0, "s")], URL, AgentLimits())
    assert own.reward is None and own.error == "agent: CancelledError: a subtask was cancelled"


def test_the_agents_side_imports_no_jax():
    code = "import sys, tpurl.serve.agent_loop; print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _main(monkeypatch, spec, path):
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = None if spec is None else importlib.machinery.ModuleSpec(spec, None)
    if path is not None:
        main.__file__ = path
    monkeypatch.setitem(sys.modules, "__main__", main)


@pytest.mark.parametrize("spec,path,agent_in_main,ok", [
    (None, __file__, True, True),                  # a script: workers import it
    ("pkg.__main__", __file__, False, True),       # python -m: an agent of another module
    ("pkg.__main__", __file__, True, False),       # ... but not one of pkg/__main__.py
    (None, "<stdin>", False, False),               # a script read from stdin breaks every worker
    (None, None, False, True),                     # a notebook, a REPL: an agent of a module
    (None, None, True, False),                     # ... but not one defined there
])
def test_which_main_modules_reach_the_workers(monkeypatch, spec, path, agent_in_main, ok):
    from tpurl.serve.agent_loop import _main_reaches_workers

    _main(monkeypatch, spec, path)
    assert _main_reaches_workers(agent_in_main) is ok


def test_agents_run_on_asyncio_without_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: asyncio's own loop
    out = run_jobs(worker_agents.echo, [Job(i, f"s{i}") for i in range(3)], URL, AgentLimits(concurrency=2))
    assert [o.reward["reward"] for o in out] == [0.0, 1.0, 2.0] and {o.reward["pid"] for o in out} == {os.getpid()}
    assert {o.reward["uvloop"] for o in out} == {0.0}


@pytest.mark.slow
def test_a_worker_blocked_past_its_deadline_is_killed_and_the_rollout_goes_on(monkeypatch, tmp_path):
    """An agent that blocks its worker's event loop without awaiting (a synchronous call, which
    `timeout_s` cannot interrupt) fails once its worker's deadline passes, and that worker is
    killed; the episode its worker finished before keeps its outcome, and the other worker's
    episodes finish as usual."""
    import time

    from tpurl.serve import agent_loop

    monkeypatch.setattr(agent_loop, "DEADLINE_GRACE_S", 5.0)
    assert agent_loop.share_deadline(4, 2, 0.5) == (4 / 2 + 1) * 0.5 + 5.0
    start = time.monotonic()
    pid_file = tmp_path / "pid"
    # Worker 0 runs jobs 0 and 2 (job 0 ends before job 2 blocks), worker 1 job 1.
    jobs = [Job("ok", "s0"), Job("ok", "s1"), Job(str(pid_file), "s2")]
    before, other, blocked = run_jobs(worker_agents.blocks, jobs, URL,
                                      AgentLimits(processes=2, concurrency=4, timeout_s=1.0))
    assert time.monotonic() - start < 30  # the agent blocks for 60 s
    assert blocked.reward is None and "ran past its deadline and was killed" in blocked.error
    assert before.error is None and other.error is None and before.reward["reward"] == other.reward["reward"] == 1.0
    assert before.reward["pid"] == int(pid_file.read_text()) != other.reward["pid"]
    stat = f"/proc/{int(pid_file.read_text())}/stat"  # the blocked worker: gone (or a zombie)
    assert not os.path.exists(stat) or open(stat).read().split(")")[-1].split()[0] in ("Z", "X")


def test_a_worker_that_dies_keeps_the_outcomes_of_the_episodes_that_ended():
    ended, died = run_jobs(worker_agents.dies_after_a_while, [Job("ok", "s0"), Job("x", "s1")], URL,
                           AgentLimits(processes=1, concurrency=2))
    assert ended.error is None and ended.reward == {"reward": 1.0}
    assert died.reward is None and "worker process 0 failed: BrokenProcessPool" in died.error


def test_a_record_that_cannot_be_written_stops_the_record_not_the_share():
    """A full disk (/dev/full) under the outcomes' record: every episode still ends as usual."""
    from tpurl.serve.agent_loop import run_share

    out = run_share(worker_agents.echo, [Job(i, f"s{i}") for i in range(3)], URL, 2, 5.0, record="/dev/full")
    assert [o.reward["reward"] for o in out] == [0.0, 1.0, 2.0] and all(o.error is None for o in out)


@pytest.mark.slow
def test_an_agent_that_blocks_the_event_loop_thread_fails_at_the_deadline_and_the_rollout_goes_on(monkeypatch):
    """processes = 0: an agent that blocks the agents' event loop without awaiting fails when the
    share's deadline passes; the episode that ended before keeps its outcome, and the loop's thread
    (which cannot be killed) is left behind until the agent returns; the episode that was waiting
    for its turn never starts."""
    import threading
    import time

    from tpurl.serve import agent_loop

    monkeypatch.setattr(agent_loop, "DEADLINE_GRACE_S", 1.0)
    release, started = threading.Event(), []

    async def agent(client, problem):
        started.append(problem)
        if problem == "blocks":
            release.wait(60)  # a synchronous call
        return 1.0

    before, start = set(threading.enumerate()), time.monotonic()
    jobs = [Job("ok", "s0"), Job("blocks", "s1"), Job("waits", "s2")]  # one at a time
    ended, blocked, waited = run_jobs(agent, jobs, URL, AgentLimits(timeout_s=0.5, concurrency=1))
    assert time.monotonic() - start < 15  # the deadline: (3 / 1 + 1) x 0.5 s + 1 s; the agent blocks for 60 s
    assert ended.error is None and ended.reward == {"reward": 1.0}
    assert blocked.reward is None and "event loop ran past its deadline" in blocked.error
    assert waited.reward is None and "event loop ran past its deadline" in waited.error
    (left,) = set(threading.enumerate()) - before
    assert left.name == "tpurl-agents-loop" and left.is_alive()
    release.set()
    left.join(10)
    assert not left.is_alive() and started == ["ok", "blocks"]


def test_past_the_deadline_no_episode_starts_its_agent_even_one_that_had_a_slot():
    """Two at once: the first agent blocks before its first await, so the second, which has its
    slot, has not started its agent when the deadline passes; it never does."""
    import threading

    from tpurl.serve import agent_loop

    release, started = threading.Event(), []

    async def agent(client, problem):
        started.append(problem)
        if problem == "blocks":
            release.wait(60)  # a synchronous call, before any await
        return 1.0

    import importlib

    importlib.import_module("openai")  # ahead: the agents' loop imports it before the first agent starts

    limits = AgentLimits(timeout_s=0.2, concurrency=2)
    before = set(threading.enumerate())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(agent_loop, "DEADLINE_GRACE_S", 2.0)
        blocked, second = run_jobs(agent, [Job("blocks", "s0"), Job("second", "s1")], URL, limits)
    (loop,) = set(threading.enumerate()) - before
    release.set()
    loop.join(10)
    assert blocked.reward is None and second.reward is None and started == ["blocks"]


def test_a_cancelled_share_is_cancelled_not_recorded_as_failed_episodes():
    """A cancellation of the share itself (its event loop stopping) reaches the share, and the
    episodes it stopped are not recorded as the agents' failures."""
    import asyncio

    from tpurl.serve.agent_loop import _episodes, _Record

    async def agent(client, problem):
        await asyncio.sleep(30)
        return 1.0

    ended: dict = {}

    async def main():
        share = asyncio.ensure_future(_episodes(agent, [Job(0, "s0"), Job(1, "s1")], URL, 2, 60.0, _Record(ended),
                                                None))
        await asyncio.sleep(0.2)
        share.cancel()
        with pytest.raises(asyncio.CancelledError):
            await share

    asyncio.run(main())
    assert ended == {}
