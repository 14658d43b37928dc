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
weight updates reach the requests as in `generate`), runs the agents on an event loop thread, at
most `AgentLimits.concurrency` at once, each within `timeout_s`, and stops when the last one has
returned (in a multi-process run, on process 0; the other processes run the same batch,
`tpurl.generate.lockstep`, and get episodes without calls). Each episode's client has a base URL
of its own (`/sessions/<id>/v1`), so every call is recorded with its episode
(`tpurl.serve.sessions`). An agent that raises, times out or returns
something that is not a finite reward gets zero reward and its error is recorded; the others go
on. The model name the agents use is not checked against anything but `model_name`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np

from tpurl.config_types import check_types
from tpurl.generate.engine import Engine
from tpurl.generate.pool import KVPool
from tpurl.generate.service import Service
from tpurl.generate.weights import WeightSlot
from tpurl.serve.app import Endpoint
from tpurl.serve.server import bind, make_server, url_of
from tpurl.serve.sessions import Call, sequences
from tpurl.sharding.host import is_writer, on_writer

Agent = Callable[[Any, Any], Awaitable[Any]]
EPISODES_PER_POOL = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentLimits:
    """How agents run: at most `concurrency` episodes at once, each within `timeout_s` seconds."""

    concurrency: int = 32
    timeout_s: float = 300.0

    def __post_init__(self):
        check_types(self)
        if self.concurrency < 1 or not 0 < self.timeout_s <= 86400:
            raise ValueError(f"AgentLimits: need concurrency >= 1 and 0 < timeout_s <= 86400, got {self.concurrency}, "
                             f"{self.timeout_s}")


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
    import openai  # the optional extra: the agents' client

    episodes = [[AgentEpisode(session=f"p{i}s{j}") for j in range(n)] for i in range(len(problems))]
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
        _serve(openai, agent, problems, episodes, service, endpoint, pool, limits, before_round)
    except BaseException as e:
        with contextlib.suppress(Exception):
            _raise_together(e, engine)  # the other processes raise it too
        raise
    _raise_together(None, engine)
    return episodes


def _serve(openai, agent, problems, episodes, service: Service, endpoint, pool: KVPool, limits: AgentLimits,
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
                              args=(openai, agent, problems, episodes, url, limits, http, server, done))
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
        server.should_exit = True
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


def _run_all(openai, agent, problems, episodes, url, limits, http, server, done) -> None:
    """The agents' event loop thread: wait for the server, run every episode, say so in `done`."""
    try:
        while not server.started:
            if not http.is_alive():
                raise RuntimeError("the agents' endpoint did not start")
            time.sleep(0.01)
        asyncio.run(_episodes(openai, agent, problems, episodes, url, limits))
        done.set_result(None)
    except BaseException as e:
        done.set_exception(e)


async def _episodes(openai, agent, problems, episodes, url, limits) -> None:
    gate = asyncio.Semaphore(limits.concurrency)
    # A connection pool per EPISODES_PER_POOL episodes: a client of its own per episode would build
    # an HTTP client (SSL context and all) each time, and one pool for hundreds of concurrent
    # requests spends its time matching requests to connections (a scan of every connection per
    # request). Each episode's copy of its pool's client has its session's base URL.
    flat = [(p, e) for p, row in zip(problems, episodes) for e in row]
    shared = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="tpurl", max_retries=0, timeout=limits.timeout_s)
              for _ in range(-(-min(len(flat), limits.concurrency) // EPISODES_PER_POOL))]

    async def one(k: int, problem, episode: AgentEpisode):
        async with gate:
            pool = shared[k % len(shared)]
            client = pool.with_options(base_url=f"{url}/sessions/{episode.session}/v1")
            start = time.monotonic()
            try:
                value = await asyncio.wait_for(agent(client, problem), limits.timeout_s)
                episode.reward = reward_components(value)
            except asyncio.TimeoutError:
                episode.error = f"the agent ran past AgentLimits.timeout_s={limits.timeout_s:g} s"
            except Exception as e:  # the agent's failure is its episode's, not the run's
                episode.error = f"agent: {type(e).__name__}: {e}"
            finally:
                episode.seconds = time.monotonic() - start

    try:
        await asyncio.gather(*(one(k, p, e) for k, (p, e) in enumerate(flat)))
    finally:
        for client in shared:
            await client.close()
