"""Agents as rollouts: a user's agent program, written against the OpenAI API, run against the
endpoint on the rollout engine; what the endpoint saw becomes the episode's training sequences.

An agent is an async function of an `openai.AsyncOpenAI` client and a problem that returns the
episode's reward, a number or named components (`{"correct": 1.0, "format": 0.5}`):

    async def solve(client, problem) -> float | dict[str, float]:
        r = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...

`run_agents` samples `n` episodes of every problem: it serves the endpoint on 127.0.0.1 (a free
port, uvicorn on a thread of its own) over a `Service` that runs on the calling thread with the
caller's KV pool and weights (so a rollout window's thread keeps owning its engine, and in-flight
weight updates reach the requests as in `generate`), runs the agents on an event loop thread or in
worker processes (`tpurl.serve.agent_loop`, `AgentLimits.processes`), at most
`AgentLimits.concurrency` at once, each within `timeout_s`, and stops when the last one has
returned (in a multi-process run, on process 0; the other processes run the same batch,
`tpurl.generate.lockstep`, and get episodes without calls). Each episode's client has a base URL
of its own (`/sessions/<id>/v1`), so every call is recorded with its episode
(`tpurl.serve.sessions`). An agent that raises, times out or returns
something that is not a finite reward gets zero reward and its error is recorded; the others go
on. The model name the agents use is not checked against anything but `model_name`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tpurl.generate.engine import Engine
from tpurl.generate.pool import KVPool
from tpurl.generate.service import Service
from tpurl.generate.weights import WeightSlot
from tpurl.serve.agent_loop import Agent, AgentLimits, Job, check_portable, run_jobs
from tpurl.serve.app import Endpoint
from tpurl.serve.server import bind, make_server, url_of
from tpurl.serve.sessions import Call, sequences
from tpurl.sharding.host import is_writer, on_writer


@dataclasses.dataclass
class AgentEpisode:
    """One episode: its reward components (None: the agent failed, `error` says why), the calls
    the endpoint recorded, and the seconds the agent ran."""

    session: str
    reward: dict[str, float] | None = None
    error: str | None = None
    calls: list[Call] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @functools.cached_property
    def sequences(self):
        """The episode's training sequences (read once its agent has returned)."""
        return sequences(self.calls)


def call_seed(seed: int, problem: int, sample: int, call: int) -> int:
    """The seed of call `call` of episode (problem, sample) in a rollout seeded `seed` (a hash)."""
    return int(np.random.SeedSequence([seed, problem, sample, call]).generate_state(1)[0])


def run_agents(agent: Agent, problems: Sequence[Any], n: int, *, engine: Engine, weights: WeightSlot, pool: KVPool,
               tokenizer, context_length: int, limits: AgentLimits = AgentLimits(), model_name: str = "policy",
               temperature: float | None = None, seed: int | None = None,
               before_round: Callable[[], None] | None = None) -> list[list[AgentEpisode]]:
    """`n` episodes of every problem, `[problem][sample]` (see the module docstring). For a
    rollout, `temperature` and `seed` fix every call's sampling and seed (`Endpoint`);
    `before_round()` runs on the calling thread before each round of the batch (an in-flight
    weight sync, as `generate`'s `before_step`)."""
    importlib.import_module("openai")  # the agents' client, an optional extra: missing, fail before starting

    check_portable(agent, problems, limits)
    # A call of an earlier rollout's agent (left behind) is not this one's. Each process draws its
    # own tag; only process 0's sessions are served (the others' episodes get no calls).
    rollout = uuid.uuid4().hex[:8]
    episodes = [[AgentEpisode(session=f"{rollout}p{i}s{j}") for j in range(n)] for i in range(len(problems))]
    where = {e.session: (i, j) for i, row in enumerate(episodes) for j, e in enumerate(row)}
    seed_for = None if seed is None else (lambda session, k: call_seed(seed, *where[session], k)
                                          if session in where else None)

    def record(session: str, call: Call) -> None:
        if session in where:  # an agent may call a base URL of its own making: not recorded
            i, j = where[session]
            episodes[i][j].calls.append(call)

    service = Service(engine, weights, tokenizer=tokenizer, background=False)
    if not is_writer():  # another process of a multi-process run: the batch, with process 0's requests
        own = None
        try:
            service.run_until(concurrent.futures.Future(), pool, before_round=before_round)
        except BaseException as e:  # (the engine's, as on process 0): raised after process 0's word
            own = e
        finally:
            service.close()
        _raise_together(None, engine)  # every process ends here once: process 0's failure is raised on all
        if own is not None:
            raise own
        return episodes
    endpoint = functools.partial(Endpoint, service, tokenizer, name=model_name, context_length=context_length,
                                 recorder=record, temperature=temperature, seed_for=seed_for)
    try:
        _serve(agent, problems, episodes, service, endpoint, pool, limits, before_round)
    except BaseException as e:
        with contextlib.suppress(Exception):
            _raise_together(e, engine)  # the other processes raise it too
        raise
    _raise_together(None, engine)
    return episodes


def _serve(agent, problems, episodes, service: Service, endpoint, pool: KVPool, limits: AgentLimits,
           before_round) -> None:
    """Process 0's part: the endpoint (`endpoint()` makes it) on a free port of 127.0.0.1, the
    agents on their thread, the batch on this one until the last agent returns. A failure to start
    ends the batch at once (on every process of a multi-process run) before it is raised."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    sock = None
    try:
        sock = bind("127.0.0.1", 0)
        url, server = url_of(sock), make_server(endpoint())
    except BaseException as e:
        done.set_exception(e)
        try:
            service.run_until(done, pool, before_round=before_round)
        finally:
            service.close()
            if sock is not None:
                sock.close()
        raise
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tpurl-agents-http", daemon=True)
    runner = threading.Thread(target=_run_all, name="tpurl-agents", daemon=True,
                              args=(agent, problems, episodes, url, limits, http, server, done))
    try:
        http.start()
        runner.start()
    except BaseException as e:  # a thread did not start: the batch ends at once (on every process)
        done.set_exception(e)
    try:
        service.run_until(done, pool, before_round=before_round)
        done.result()
    finally:
        service.close()
        server.stop()
        for thread in (http, runner):
            if thread.ident is not None:
                thread.join()
        sock.close()


def _raise_together(error: BaseException | None, engine: Engine) -> None:
    """Raise process 0's `error` (None: there is none) on every process of a multi-process run at
    once (the others a one-line ValueError, `tpurl.sharding.host.on_writer`); here, in one process.
    Every process calls it once per rollout, however the rollout ended. An error that is not an
    `Exception` (an interrupt) goes out as a RuntimeError naming it."""
    def check() -> dict:
        if isinstance(error, Exception):
            raise error
        if error is not None:
            raise RuntimeError(f"process 0: {type(error).__name__}")
        return {}

    if jax.process_count() == 1:
        check()
    else:
        on_writer(check, mesh=engine.mesh)


def _run_all(agent, problems, episodes, url, limits, http, server, done) -> None:
    """The agents' thread: wait for the server, run every episode (`tpurl.serve.agent_loop`),
    say so in `done`."""
    try:
        while not server.started:
            if not http.is_alive():
                raise RuntimeError("the agents' endpoint did not start")
            time.sleep(0.01)
        flat = [(problem, e) for problem, row in zip(problems, episodes) for e in row]
        outcomes = run_jobs(agent, [Job(problem, e.session) for problem, e in flat], url, limits)
        for (_, episode), outcome in zip(flat, outcomes):
            episode.reward, episode.error, episode.seconds = outcome.reward, outcome.error, outcome.seconds
        done.set_result(None)
    except BaseException as e:
        done.set_exception(e)
