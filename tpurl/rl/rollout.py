"""The rollout side of a run as one object: the engine, the rollout weights and the KV pool.

    report = rollout.load(train.params, version=v)  # weight sync: train layout -> rollout layout and dtype
                                             # (a LoRA run's first load: frozen=train.frozen, its base)
    rollout.open(train, reference)           # a rollout window: park the update-only tensors
                                             # (colocated), then allocate the KV pool
    ro = rollout.sample(problems, n=G, seed=s, temperature=T)   # generate, score, pack: `Rollouts`
    train, reference = rollout.close()       # free the KV pool, bring the parked tensors back

Ownership. The rollout weights are made by `load` and freed by the next `load` (except leaves a
free sync passes through: those are the trainer's arrays, never deleted here). They live in a
`tpurl.generate.WeightSlot`, so `load` may run on another thread while `sample` decodes (in-flight
weight updates, `in_flight`): with "continue" the running `sample` call switches to the new weights
between two decode steps (its sequences keep their KV; every token records the version that
sampled it) and the old weights are freed at that switch; with "drain" `load` waits until the
running `sample` call has finished, so one call never mixes versions. With no `sample` running,
`load` frees the previous weights before the sync, so it never holds two copies. The KV pool
(`tpurl.generate.KVPool`) lives exactly from `open` to `close` and serves every `sample` call in
between (DAPO's extra rounds, evaluation's greedy and sampled passes), so one pool is allocated
per window. Between `open` and `close` the train state and reference policy are lent to the
rollout: with a colocated handover their update-only parts (optimizer state, optionally the fp32
master weights and the reference) sit in host memory, and `close` returns them on device.
`lend(fn, train, reference)` runs `fn` in such a window (evaluation, the warm start's probe).

Threads. A window belongs to the thread that opened it (the engine's owner, `tpurl.threads`):
`open`, `close`, `sample` and the engine's `init_decode_state` raise `WrongThread` on any other
thread until it closes, instead of corrupting the engine's page bookkeeping or waiting forever.
`load` may come from any thread (that is what in-flight updates are).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence, TypeVar

import jax

from tpurl.generate import Engine, InFlight, KVPool, SamplingConfig, Weights, WeightSlot, generate
from tpurl.generate.weights import check_in_flight
from tpurl.rl.batch import Rollouts, decode, pack_rollouts
from tpurl.rl.timeline import Timeline
from tpurl.sharding.host import all_processes, on_writer
from tpurl.sync import ColocatedHandover, SyncConfig, SyncReport, account_metrics, made_by_sync, sync_weights
from tpurl.sync.lora import LoraRollout
from tpurl.tasks import Problem, Task
from tpurl.tasks.agent import agent_rollouts, is_agent_task
from tpurl.tasks.base import stop_token_ids
from tpurl.tasks.env import episode_for, is_multi_turn, run_observe, tool_workers
from tpurl.threads import Owner, owner_of
from tpurl.train.state import TrainState

T = TypeVar("T")


class RolloutSide:
    """Owns the engine, the rollout weights and the KV pool (see the module docstring).

    `shardings`: the rollout layout's parameter shardings; `seq_len`: the packed row length (the
    task's longest prompt plus its `max_new_tokens`); `handover`: the colocated memory handover,
    None when the rollout has devices of its own (disaggregated). A multi-turn environment's turns
    (tool calls) run beside decoding on `tpurl.tasks.env.tool_workers(task)` threads. `in_flight`:
    what a `load` from another thread does to a running `sample` call ("continue" | "drain").
    `lora`: a LoRA run's rollout weights (`tpurl.sync.lora.LoraRollout`): `load` then takes the
    adapters, and the frozen base with the first of them (`frozen`)."""

    def __init__(self, engine: Engine, shardings, sync_cfg: SyncConfig, task: Task, *, seq_len: int,
                 handover: ColocatedHandover | None = None, in_flight: InFlight = "drain",
                 lora: LoraRollout | None = None):
        check_in_flight(in_flight, "RolloutSide")
        self.engine = engine
        self.shardings = shardings
        self.sync_cfg = sync_cfg
        self.task = task
        self.seq_len = seq_len
        self.handover = handover
        self.tool_workers = tool_workers(task)
        self.in_flight = in_flight
        self.lora = lora
        self._weights = WeightSlot()
        self._pool: KVPool | None = None
        self._lent: tuple[TrainState, Any] | None = None
        self._before_step: Callable[[], None] | None = None
        # Shared with every rollout of the same engine: the window's thread owns the engine's state.
        self._owner = owner_of(engine, "rollout window") if engine is not None else Owner("rollout window")

    @property
    def params(self):
        """The current rollout weights (rollout layout and dtype)."""
        return self._weights.current.params

    @property
    def version(self) -> int:
        """The policy version of the current rollout weights (the updates they include); waits for a
        sync in progress on another thread."""
        return self._weights.settled().version

    @property
    def weights(self) -> WeightSlot:
        """The slot `sample` reads the weights from (see `tpurl.generate.weights`)."""
        return self._weights

    def load(self, train_params, *, version: int, frozen=None) -> SyncReport:
        """Replace the rollout weights by `train_params` resharded into the rollout layout and dtype;
        `version` is their policy version (the updates they include), stamped on every token they
        sample. Safe to call while `sample` runs on another thread (see `in_flight`). The previous
        weights are freed before the sync when no `sample` call uses them, else at the running
        call's switch ("continue") or, waiting for it to finish first, before the sync ("drain").
        A LoRA run passes its frozen base as `frozen` where it may be new (a fresh or restored
        state, a warm start's probe): its rollout part is synced first, unless it is the one synced
        already (`LoraRollout.set_base`), and always before anything samples with it."""
        if self.lora is not None and frozen is None and not self.lora.ready:
            raise ValueError("RolloutSide.load: a LoRA rollout's first load needs the train state's frozen base "
                             "(frozen=train.frozen)")
        with self._weights.loading(drain=frozen is not None or self.in_flight == "drain") as publish:
            if self.lora is not None:
                if frozen is not None:
                    self.lora.set_base(frozen)
                params, report, owned = self.lora.sync(train_params)
            else:
                params, report = sync_weights(train_params, self.shardings, self.sync_cfg)
                owned = made_by_sync(params, train_params)
            publish(Weights(params, version, tuple(owned)))
        return report

    @contextlib.contextmanager
    def between_steps(self, fn: Callable[[], None]) -> Iterator[None]:
        """Inside the block, `fn()` runs on the sampling thread before each decode step of every
        `sample` call; it may `load` newer weights, which the running call switches to at once
        (with in_flight="continue": an in-flight sync issued from the sampling thread itself)."""
        if self._before_step is not None:
            raise RuntimeError("RolloutSide.between_steps: a hook is set already")
        self._before_step = fn
        try:
            yield
        finally:
            self._before_step = None

    def agree(self, flag: bool) -> bool:
        """Whether `flag` holds on every process, agreed on the rollout devices alone (so it does
        not wait for a program the train devices run); `flag` itself in one process."""
        return all_processes(flag, self.engine.mesh)

    def open(self, train: TrainState | None = None, reference=None) -> None:
        """Start a rollout window: the train state and reference are lent until `close`. Without a
        handover (disaggregated) nothing is parked, so the window needs no train state (the
        asynchronous rollout thread's, `tpurl.rl.async_rollout`). The calling thread owns the
        window until `close`."""
        self._owner.check("RolloutSide.open")
        if self._lent is not None:
            raise RuntimeError("RolloutSide.open: a rollout window is already open; close() it first")
        if train is None and self.handover is not None:
            raise ValueError("RolloutSide.open: a colocated rollout window parks the train state's update-only tensors; "
                             "pass the train state")
        self._owner.claim("RolloutSide.open")
        try:
            if self.handover is None:
                self._pool = KVPool(self.engine)
            else:
                # A free sync passes train params through as rollout weights: those must stay on device.
                self.handover.start_rollout(opt_state=train.opt_state, master_params=train.params,
                                            reference_params=reference, kv_factory=self._new_pool,
                                            protect={"rollout_params": self.params})
        except BaseException:
            self._owner.release()
            raise
        self._lent = (train, reference)

    def close(self) -> tuple[TrainState, Any]:
        """End the window: free the KV pool; returns the train state and reference, on device."""
        self._owner.check("RolloutSide.close")
        if self._lent is None:
            raise RuntimeError("RolloutSide.close: no rollout window is open")
        (train, reference), self._lent = self._lent, None
        try:
            if self.handover is None:
                self._release_pool()
                return train, reference
            restored = self.handover.start_update(release=self._release_pool)
        finally:
            self._owner.release()
        if "opt_state" in restored:
            train = train.replace(opt_state=restored["opt_state"])
        if "master_params" in restored:
            train = train.replace(params=restored["master_params"])
        return train, restored.get("reference_params", reference)

    def lend(self, fn: Callable[[], T], train: TrainState, reference=None) -> tuple[T, TrainState, Any]:
        """`fn()` inside a rollout window; returns its result and the train state and reference."""
        self.open(train, reference)
        try:
            result = fn()
        finally:
            train, reference = self.close()
        return result, train, reference

    def sampling(self, temperature: float) -> SamplingConfig:
        """The task's rollout sampling at `temperature` (0: greedy): untruncated, stopping at its stop
        tokens (EOS, `tpurl.tasks.base.stop_token_ids`) or stop strings, at most the task's
        `max_new_tokens`."""
        return SamplingConfig(temperature=temperature, max_new_tokens=self.task.max_new_tokens,
                              stop_token_ids=stop_token_ids(self.task), stop_strings=self.task.stop_strings)

    def sample(self, problems: Sequence[Problem], *, n: int, seed: int, temperature: float,
               group_ids: Sequence[int] | None = None, tl: Timeline | None = None) -> Rollouts:
        """`n` episodes of every problem with the current weights (with in_flight="continue", also
        any loaded meanwhile: `Rollouts.token_versions` says which sampled each token), graded and
        packed (phases `rollout` and `reward` of `tl`). A multi-turn environment's turns run on
        `tool_workers` threads while the engine decodes. Across processes process 0 alone runs the
        environments and graders, and every process gets their results. Uses the window's KV pool;
        outside a window the engine allocates (and frees) a pool of its own."""
        self._owner.check("RolloutSide.sample")
        tl = tl if tl is not None else Timeline()
        if is_agent_task(self.task):
            return self._sample_agents(problems, n=n, seed=seed, temperature=temperature, group_ids=group_ids, tl=tl)
        episodes = [[episode_for(self.task, p) for _ in range(n)] for p in problems]
        turns = _Turns(self.task.tokenizer, episodes) if is_multi_turn(self.task) else None
        with tl.phase("rollout"):
            prompts = [self.task.encode_prompt(p) for p in problems]
            completions = generate(self.engine, self._weights, prompts, n_samples=n,
                                   sampling=self.sampling(temperature), seed=seed, tokenizer=self.task.tokenizer,
                                   pool=self._pool, on_turn_end=turns, tool_workers=self.tool_workers,
                                   before_step=self._before_step)
        with tl.phase("reward"):
            # Graded by process 0 alone in a multi-process run, its rewards sent over the rollout devices.
            return pack_rollouts(self.task, problems, completions, self.seq_len, group_ids, episodes,
                                 on_writer=functools.partial(on_writer, mesh=self.engine.mesh))

    def _sample_agents(self, problems: Sequence[Problem], *, n: int, seed: int, temperature: float,
                       group_ids: Sequence[int] | None, tl: Timeline) -> Rollouts:
        """`sample` of an agent task (`tpurl.tasks.agent`): the agents run against an endpoint on
        the engine, sampling at `temperature` with seeds from `seed`; what it saw is packed."""
        from tpurl.serve.agents import run_agents  # the optional extra `tpurl[serve]`

        cfg = self.task.cfg
        with tl.phase("rollout"), contextlib.ExitStack() as stack:
            pool = self._pool if self._pool is not None else stack.enter_context(KVPool(self.engine))
            episodes = run_agents(self.task.agent, problems, n, engine=self.engine, weights=self._weights, pool=pool,
                                  tokenizer=self.task.tokenizer, context_length=self.seq_len,
                                  limits=self.task.limits,
                                  model_name=cfg.model_name, temperature=temperature, seed=seed,
                                  before_round=self._before_step)
        with tl.phase("reward"):
            # Across processes process 0 ran the agents: its sequences and grades reach every process.
            share = functools.partial(on_writer, mesh=self.engine.mesh)
            completions, outcomes, row_infos = agent_rollouts(self.task, problems, episodes,
                                                              on_writer=share if jax.process_count() > 1 else None,
                                                              route_shape=self.engine.route_shape)
            return pack_rollouts(self.task, problems, completions, self.seq_len, group_ids, outcomes, on_writer=share,
                                 rows_per_episode=self.task.rows_per_episode, row_infos=row_infos)

    def memory_metrics(self) -> dict[str, float]:
        """The last window's handover accounts (`memory/<moment>/<group>_device_bytes`); {} when
        not colocated."""
        return account_metrics(self.handover.accounts) if self.handover is not None else {}

    def _new_pool(self) -> KVPool:
        self._pool = KVPool(self.engine)
        return self._pool

    def _release_pool(self) -> None:
        if self._pool is not None:
            self._pool.release()
        self._pool = None


class _Turns:
    """The engine's `on_turn_end` for a multi-turn environment: hands each sample's latest model turn
    (the tokens after what its episode has seen) to its episode and returns the observation."""

    def __init__(self, tokenizer, episodes):
        self.tokenizer, self.episodes = tokenizer, episodes
        self.seen: dict[tuple[int, int], int] = {}

    def __call__(self, i: int, j: int, token_ids) -> list[int] | None:
        turn = [int(t) for t in token_ids[self.seen.get((i, j), 0):]]
        obs = run_observe(self.episodes[i][j], turn, decode(self.tokenizer, turn))
        self.seen[(i, j)] = len(token_ids) + (0 if obs is None else len(obs))
        return obs

