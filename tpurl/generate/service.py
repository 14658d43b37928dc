"""`Service`: a continuous batch on its own thread that requests join from any thread.

`driver.generate` samples a fixed list of prompts and returns; a server (`tpurl.serve`) receives
requests one by one, each with its own sampling parameters, and must not wait for the running ones
to end before starting the next. `Service` runs the same scheduler (`tpurl.generate.scheduler`) on
one engine thread that owns the engine and its KV pool, and takes requests from any thread:

    with Service(engine, params, tokenizer=tok) as service:
        ticket = service.submit(prompt_ids, n=2, sampling=SamplingConfig(...), seed=7,
                                on_token=lambda sample, token, logprob, top: ...)  # optional, streaming
        completions = ticket.result()        # [sample]; or service.cancel(ticket)

A request joins the batch at the next round (between decode steps): its prompt is prefilled in the
next admission wave that has room, and its samples decode next to every other running sequence.
Sample j of a request seeded s draws with `request_seed(s, 0, j)`, so a request's tokens do not
depend on what else runs: the same request gives the same tokens alone or among 64 others (and the
same as `generate` of that one prompt with seed s).

Callbacks (`on_token`, `on_sample`, and the ticket's result) run on the engine thread, between decode steps:
they must be quick (hand the token to another thread). One that raises cancels its request, which
fails with that error; the service goes on.

`cancel` frees the request's slots and pages at the next round. A failure of the engine itself
(a device error) fails every open request with that error and stops the service; `submit` then
raises. `close` (or leaving the `with` block) fails the open requests with `ServiceClosed`, stops
the thread and frees the KV pool.

Weights: `params`, or a `WeightSlot` whose newer weights every later step switches to (in-flight
updates, as in `generate`); the service holds the weights it runs on until it closes.

Across processes (a multi-process run, `background=False`) every process runs the batch and only
process 0 takes requests: they reach the others before each round (`tpurl.generate.lockstep`).
"""

from __future__ import annotations

import concurrent.futures
import queue
import secrets
import threading
from typing import Any, Callable

import jax
import numpy as np

from tpurl.generate import lockstep
from tpurl.generate.engine import Engine
from tpurl.generate.pool import KVPool
from tpurl.generate.records import Completion
from tpurl.generate.sampling import SamplingConfig, request_seed
from tpurl.generate.scheduler import _Scheduler
from tpurl.generate.weights import Weights, WeightSlot

# (sample index, token id, logprob, top: (ids, logprobs) lists or None), on the engine thread
OnToken = Callable[[int, int, float, Any], None]
OnSample = Callable[[Completion], None]  # each sample's completion as it finishes, on the engine thread


class ServiceClosed(RuntimeError):
    """The service closed before the request finished."""


class Ticket:
    """One submitted request: `result()` waits for its completions `[sample]`; `done()` says
    whether it has ended (finished, cancelled or failed)."""

    def __init__(self, n: int, on_token: OnToken | None, on_sample: OnSample | None = None, *, tid: int = 0):
        self.n, self.on_token, self.on_sample, self.tid = n, on_token, on_sample, tid
        self.error: BaseException | None = None  # its stream callback's failure
        self.future: concurrent.futures.Future[list[Completion]] = concurrent.futures.Future()
        self._completions: list[Completion | None] = [None] * n
        self._left = n

    def result(self, timeout: float | None = None) -> list[Completion]:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def _finished(self, completion: Completion) -> None:
        self._completions[completion.sample_index] = completion
        self._left -= 1
        if self._left == 0 and not self.future.done():
            self.future.set_result(list(self._completions))

    def _fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class Service:
    """A continuous batch of `engine` on its own thread (see the module docstring). `tokenizer`:
    needed for stop strings. `pipeline`: pipelined decode (as in `generate`)."""

    def __init__(self, engine: Engine, params, *, tokenizer=None, version: int = 0, pipeline: bool = True,
                 background: bool = True):
        self.engine, self.tokenizer, self.pipeline = engine, tokenizer, pipeline
        self.slot = params if isinstance(params, WeightSlot) else WeightSlot(Weights(params, version))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[Ticket, int | None] = {}  # engine thread only: ticket -> scheduler index
        self._scheduler: _Scheduler | None = None  # engine thread only
        self._before_round: Callable[[], None] | None = None
        self._lock = threading.Lock()  # submit against the engine thread's end
        self._tickets = 0  # tickets made so far (their ids)
        self._lockstep = jax.process_count() > 1  # several processes run the batch (`tpurl.generate.lockstep`)
        if self._lockstep and background:
            raise ValueError("Service: in a multi-process run every process runs the batch on the caller's thread; "
                             "make it with background=False and run_until")
        self._stopped = False
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="tpurl-service", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._stopped

    def submit(self, prompt, *, n: int = 1, sampling: SamplingConfig, seed: int | None = None,
               on_token: OnToken | None = None, on_sample: OnSample | None = None, session: str | None = None) -> Ticket:
        """Queue `n` samples of `prompt` (token ids); raises a one-line ValueError for a request that
        could never run (checked here, on the caller's thread). `seed` None: a random one.
        `on_sample(completion)`: each sample as it finishes (before the ticket's result, which waits
        for all `n`). `session`: the conversation it continues; its sample 0 stays in its KV pages
        for the session's next request, which resumes it if its prompt extends this one's prompt
        and completion (`tpurl.generate.session_cache`)."""
        ids = self._checked(prompt, n, sampling)
        seed = secrets.randbits(32) if seed is None else seed
        with self._lock:
            if self._stopped:
                raise ServiceClosed(f"the service has stopped{f': {self.error}' if self.error else ''}")
            ticket, self._tickets = Ticket(n, on_token, on_sample, tid=self._tickets), self._tickets + 1
            self._commands.put(("submit", ticket, ids, sampling, [request_seed(seed, 0, j) for j in range(n)], session))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End `ticket`'s request at the next round (its slots and pages freed); it fails with
        `concurrent.futures.CancelledError`. Nothing for one already done."""
        self._commands.put(("cancel", ticket))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between rounds (e.g. to read the engine's page counts
        while nothing else touches them); returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                future.set_exception(ServiceClosed("the service has stopped"))
            else:
                self._commands.put(("call", future, fn))
        return future

    def load(self) -> concurrent.futures.Future:
        """What the engine holds now, read on the engine thread between rounds: open requests,
        running sequences, free, parked (sessions' sequences kept for their next request, given to
        any request that needs them) and total KV pages (paged engines; pages of all replicas)."""
        def read():
            engine = self.engine
            total = engine.num_pages * engine.replicas if engine.paged else None
            free = sum(engine.free_pages(r) for r in range(engine.replicas)) if engine.paged else None
            scheduler = self._scheduler
            running = len(scheduler.running) if scheduler is not None else 0
            parked = scheduler.sessions.pages() if scheduler is not None and scheduler.sessions is not None else 0
            return {"requests_open": len(self._open), "sequences_running": running, "pages_free": free,
                    "pages_parked": parked if engine.paged else None, "pages_total": total}
        return self.call(read)

    def run_until(self, done: concurrent.futures.Future, pool: KVPool,
                  before_round: Callable[[], None] | None = None) -> None:
        """A service made with `background=False`: run the batch on the calling thread, on the
        caller's `pool`, until `done` completes (e.g. the agents that send the requests have all
        finished); then fail what is still open with `ServiceClosed` and stop. An engine failure
        is raised here. `before_round()` runs before each round (as `generate`'s `before_step`:
        it may publish newer weights into the slot, which this round switches to)."""
        if self._thread is not None:
            raise RuntimeError("Service.run_until: this service runs on its own thread (background=True)")
        done.add_done_callback(lambda _: self._commands.put(("wake",)))
        self._before_round = before_round
        self._run(pool, done)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Fail the open requests with `ServiceClosed`, stop the engine thread, free the KV pool."""
        self._commands.put(("close",))
        if self._thread is not None:
            self._thread.join()
        else:
            self._end_all(ServiceClosed("the service closed before this request finished"))

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked(self, prompt, n: int, sampling: SamplingConfig) -> np.ndarray:
        ids = np.asarray(prompt, np.int64).reshape(-1)
        if n < 1:
            raise ValueError(f"n={n}: a request needs at least one sample")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; start the service with tokenizer=...")
        self.engine.check_request(len(ids), sampling.max_new_tokens)
        self.engine.model_cfg.check_token_ids(ids, "prompt")
        self.engine.check_sampling(sampling)
        return ids.astype(np.int32)

    # ----------------------------------------------------------------------------------------------
    # The engine thread.

    def _run(self, pool: KVPool | None = None, until: concurrent.futures.Future | None = None) -> None:
        try:
            if pool is None:
                with KVPool(self.engine) as own:
                    self._serve(own, until)
            else:
                self._serve(pool, until)
        except BaseException as e:  # the engine failed: every open request fails with it
            self.error = e
        finally:
            self._end_all(self.error or ServiceClosed("the service closed before this request finished"))

    def _serve(self, pool: KVPool, until: concurrent.futures.Future | None) -> None:
        """Rounds of the batch until the service closes (or `until` is done)."""
        held, scheduler = self.slot.hold(), None
        try:
            scheduler = _Scheduler(self.engine, held, pool, tokenizer=self.tokenizer, pipeline=self.pipeline,
                                   sessions=True)
            self._scheduler = scheduler
            while self._apply_commands(scheduler, until):
                if self._before_round is not None:
                    self._before_round()
                scheduler.refresh(self.slot)
                scheduler.resume()
                scheduler.wave()
                scheduler.decode()
            for index in list(scheduler.requests):  # what is still open gives back its slots and pages
                scheduler.cancel(index)
            while scheduler.ahead is not None:  # a step still in flight: read it before the pool is reused
                scheduler.decode()
        finally:
            if scheduler is not None and scheduler.sessions is not None:
                scheduler.sessions.clear()  # parked pages go back to the pool, whatever ended the batch
            self.slot.release(held if scheduler is None else scheduler.weights)
            # The scheduler holds device arrays (prefills' keys and values, a step's results) and
            # its requests' callbacks hold this service: drop it now rather than at a cyclic GC.
            self._scheduler = None

    def _apply_commands(self, scheduler: _Scheduler, until: concurrent.futures.Future | None) -> bool:
        """Apply the commands queued since the last round (waiting for one when nothing runs);
        False once the service closes (or `until` is done). Across processes process 0 takes them
        and every process applies the same (`tpurl.generate.lockstep`)."""
        if not self._lockstep:
            return self._take_commands(scheduler, until, lambda command: self._apply(scheduler, command))
        go, commands = lockstep.shared_round(lambda taken: self._take_commands(scheduler, until, taken.append),
                                             self.engine.mesh, {t.tid: t for t in self._open},
                                             lambda n, tid: Ticket(n, None, tid=tid))
        for command in commands:
            self._apply(scheduler, command)
        return go

    def _take_commands(self, scheduler: _Scheduler, until: concurrent.futures.Future | None, take) -> bool:
        """Hand each submit and cancel queued since the last round to `take` (waiting for one while
        nothing runs), run the `call`s here; False once the service closes (or `until` is done)."""
        block = not scheduler.busy
        while True:
            if until is not None and until.done():
                return False
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            if command[0] == "close":
                return False
            if command[0] in ("submit", "cancel"):
                take(command)
                block = False  # a round first (what was taken may have been the last to run)
            else:
                self._apply(scheduler, command)

    def _apply(self, scheduler: _Scheduler, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            _, ticket, ids, sampling, seeds, session = command
            self._open[ticket] = scheduler.add(ids, sampling=sampling, seeds=seeds, session=session,
                                               on_finish=lambda c, t=ticket: self._finished(t, c),
                                               on_token=None if ticket.on_token is None else
                                               lambda j, tok, lp, top, t=ticket: self._token(t, j, tok, lp, top))
        elif kind == "cancel":
            error = command[2] if len(command) > 2 else concurrent.futures.CancelledError()
            self._drop(scheduler, command[1], error)
        elif kind == "wake":
            pass  # `until` may be done: the loop looks
        elif kind == "call":
            _, future, fn = command
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _finished(self, ticket: Ticket, completion: Completion) -> None:
        if ticket.error is None and ticket.on_sample is not None:
            self._callback(ticket, ticket.on_sample, completion)
        if ticket.error is not None:  # a callback failed: the request fails with that error, and the
            ticket._fail(ticket.error)  # cancel `_callback` queued frees its other samples
            return
        ticket._finished(completion)
        if ticket.done():
            self._open.pop(ticket, None)

    def _token(self, ticket: Ticket, sample: int, token: int, logprob: float, top) -> None:
        self._callback(ticket, ticket.on_token, sample, token, logprob, top)

    def _callback(self, ticket: Ticket, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # the caller's callback failed: its request ends, the service goes on
            ticket.error = ticket.error or e
            self._commands.put(("cancel", ticket, e))

    def _drop(self, scheduler: _Scheduler, ticket: Ticket, error: BaseException) -> None:
        index = self._open.pop(ticket, None)
        if index is not None:
            scheduler.cancel(index)
        ticket._fail(error)

    def _end_all(self, error: BaseException) -> None:
        with self._lock:
            self._stopped = True
        for ticket in list(self._open):
            ticket._fail(error)
        self._open.clear()
        while True:  # requests queued after the last round
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "submit":
                command[1]._fail(error)
            elif command[0] == "call":
                command[1].set_exception(error)
