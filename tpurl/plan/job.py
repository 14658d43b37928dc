"""What `tpurl plan` plans: an `RLConfig` resolved against a device count, without building the run.

The run's spec (`tpurl.rl.spec.resolve_run`, the one function a run also resolves through: the
model with its vocabulary fitted, the engine's derived sizes, the pools' mesh sizes), with the
meshes as `AbstractMesh`es (so that a 256-chip pod is planned on a laptop). Lengths come from the
task's config where it states them (`max_prompt_tokens` of a JSONL task: an upper bound) and
from the built task otherwise (the built-in synthetic tasks, which are cheap to build).
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import AbstractMesh

from tpurl.generate import EngineConfig
from tpurl.models.config import ModelConfig
from tpurl.rl.config import RLConfig
from tpurl.rl.spec import RunSpec, TaskLengths, resolve_run, task_config_for
from tpurl.sharding.placement import PlacementConfig


@dataclasses.dataclass(frozen=True)
class PlanJob:
    """One RL run on `num_devices` devices. `n_train`/`n_rollout`: the pools (both `num_devices`
    when colocated). `response_len`: the expected mean response length (None: `new_tokens`, an
    upper bound); with packing, the update and scoring passes compute on about that many tokens
    per sequence instead of the padded row."""

    spec: RunSpec
    response_len: int | None = None

    @property
    def cfg(self) -> RLConfig:
        return self.spec.cfg

    @property
    def model(self) -> ModelConfig:
        return self.spec.model

    @property
    def engine(self) -> EngineConfig:
        return self.spec.engine

    @property
    def prompt_len(self) -> int:
        return self.spec.lengths.prompt_len

    @property
    def new_tokens(self) -> int:
        return self.spec.lengths.new_tokens

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def num_devices(self) -> int:
        return self.spec.num_devices

    @property
    def train_mesh(self) -> AbstractMesh:
        return _abstract_mesh(self.spec.train_mesh)

    @property
    def rollout_mesh(self) -> AbstractMesh:
        return _abstract_mesh(self.spec.rollout_mesh)

    @property
    def colocated(self) -> bool:
        return self.cfg.placement.mode == "colocated"

    @property
    def scored_rows(self) -> int:
        """Rows of `seq_len` tokens a scoring pass (old / reference logprobs, values) computes on:
        the step's whole batch, packed in blocks of one batch shard's micro-batch
        (`packed_rows`)."""
        b, algo = self.spec.train_rows, self.cfg.algorithm
        return self.packed_rows(b // (self.spec.batch_shards * algo.micro_batches))

    @property
    def updated_rows(self) -> int:
        """Rows of `seq_len` tokens one epoch of the update computes on: each minibatch packed in
        blocks of one batch shard's micro-batch (`packed_rows`), all minibatches together."""
        b, algo = self.spec.train_rows, self.cfg.algorithm
        return self.packed_rows(b // (algo.minibatches * self.spec.batch_shards * algo.micro_batches))

    def packed_rows(self, block: int) -> int:
        """Rows of `seq_len` tokens the step's batch fills when it is packed in blocks of `block`
        sequences (what `tpurl.train.packing` packs together): the batch itself without packing or
        an expected `response_len`, else about the rows its prompts and mean responses fill (a
        lower count than the packer's buckets may give). When the packer shares prefixes, a group's
        samples in one block hold their prompt once per packed row they fill. (An agent episode of
        several rows is counted as one sequence of a prompt and a response: its rows without a
        sequence hold no token.)"""
        rows, b, packing = self.spec.train_rows, self.cfg.batch_size, self.cfg.packing
        if self.response_len is None or not packing.enabled:
            return rows
        p, r = self.prompt_len, self.response_len
        if not packing.share_prefixes:
            return min(rows, math.ceil(b * (p + r) / self.seq_len))
        s = max(1, min(self.cfg.group_size, block // self.spec.lengths.rows_per_episode))  # samples sharing a prompt
        room = max(packing.row_length(self.seq_len, block) - p, 1)
        tokens = b // s * (s * r + p * math.ceil(s * r / room))
        return min(rows, math.ceil(tokens / self.seq_len))

    @property
    def n_train(self) -> int:
        return self.train_mesh.size

    @property
    def n_rollout(self) -> int:
        return self.rollout_mesh.size

    def with_placement(self, placement: PlacementConfig) -> PlanJob:
        """The same run under another placement (its meshes resolved on the same devices)."""
        return make_job(self.cfg.replace(placement=placement), self.num_devices, lengths=self.spec.lengths,
                        response_len=self.response_len)


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def task_lengths(cfg: RLConfig) -> TaskLengths:
    """The lengths of the run's task: from its config where it states them, else from the built task."""
    params = cfg.task.params
    if hasattr(params, "max_prompt_tokens") and not (cfg.fit_vocab and cfg.init_from is None):
        # The tokenizer's vocabulary matters only for fitting the model's: not read here.
        agent = cfg.task.name == "agent"
        return TaskLengths(prompt_len=params.max_prompt_tokens, new_tokens=params.max_new_tokens, vocab_size=None,
                           agent=agent, rows_per_episode=params.trained_sequences if agent else 1)
    from tpurl.tasks import make_task

    return TaskLengths.of(make_task(task_config_for(cfg)))


def make_job(cfg: RLConfig, num_devices: int, *, lengths: TaskLengths | None = None,
             response_len: int | None = None) -> PlanJob:
    """Resolve `cfg` on `num_devices` devices (`lengths` default: `task_lengths(cfg)`);
    `response_len`: the expected mean response length."""
    lengths = lengths or task_lengths(cfg)
    if response_len is not None and not 1 <= response_len <= lengths.new_tokens:
        raise ValueError(f"--response_len {response_len} must be between 1 and the task's max_new_tokens "
                         f"({lengths.new_tokens})")
    return PlanJob(spec=resolve_run(cfg, lengths, num_devices), response_len=response_len)
