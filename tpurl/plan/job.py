"""What `tpurl plan` plans: an `RLConfig` resolved against a device count, without building the run.

The model (with its vocabulary fitted as the run would), the prompt and response lengths, the
rollout engine's derived sizes, and the train and rollout meshes as `AbstractMesh`es (so that a
256-chip pod is planned on a laptop). Lengths come from the task's config where it states them
(`max_prompt_tokens` of a JSONL task: an upper bound) and from the built task otherwise (the
built-in synthetic tasks, which are cheap to build).
"""

from __future__ import annotations

import dataclasses
import math
import types

from jax.sharding import AbstractMesh

from tpurl.generate import EngineConfig
from tpurl.models.config import ModelConfig
from tpurl.rl.config import RLConfig, model_config_for
from tpurl.rl.runtime import engine_config_for
from tpurl.sync import PlacementConfig


@dataclasses.dataclass(frozen=True)
class PlanJob:
    """One RL run on `num_devices` devices. `n_train`/`n_rollout`: the pools (both `num_devices`
    when colocated). `response_len`: the expected mean response length (None: `new_tokens`, an
    upper bound); with packing, the update and scoring passes compute on about that many tokens
    per sequence instead of the padded row."""

    cfg: RLConfig
    model: ModelConfig
    prompt_len: int
    new_tokens: int
    engine: EngineConfig
    num_devices: int
    train_mesh: AbstractMesh
    rollout_mesh: AbstractMesh
    response_len: int | None = None

    @property
    def colocated(self) -> bool:
        return self.cfg.placement.mode == "colocated"

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def trained_rows(self) -> int:
        """Rows of `seq_len` tokens the update and scoring passes compute on for the step's batch:
        the batch, or with packing (`RLConfig.packing`) and an expected `response_len`, about the
        rows its prompts and mean responses fill (a lower count than the packer's buckets may give).
        When the packer shares prefixes, a group's samples in one micro-batch hold their prompt
        once per packed row they fill."""
        b, packing = self.cfg.batch_size, self.cfg.packing
        if self.response_len is None or not packing.enabled:
            return b
        p, r = self.prompt_len, self.response_len
        if not packing.share_prefixes:
            return min(b, math.ceil(b * (p + r) / self.seq_len))
        block = b // self.cfg.algorithm.micro_batches  # a micro-batch's rows: what the packer packs together
        s = max(1, min(self.cfg.group_size, block))  # samples sharing a prompt
        room = max(packing.row_length(self.seq_len, block) - p, 1)
        tokens = b // s * (s * r + p * math.ceil(s * r / room))
        return min(b, math.ceil(tokens / self.seq_len))

    @property
    def n_train(self) -> int:
        return self.train_mesh.size

    @property
    def n_rollout(self) -> int:
        return self.rollout_mesh.size

    def with_placement(self, placement: PlacementConfig) -> PlanJob:
        """The same run under another placement (its meshes resolved on the same devices)."""
        return make_job(self.cfg.replace(placement=placement), self.num_devices,
                        lengths=(self.prompt_len, self.new_tokens, self.model.vocab_size), response_len=self.response_len)


def abstract_mesh(mesh_cfg, n: int, role: str) -> AbstractMesh:
    try:
        sizes = mesh_cfg.sizes(n)
    except ValueError as e:
        raise ValueError(f"PlacementConfig.{role}_mesh does not fit {n} devices: {e}") from None
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def task_lengths(cfg: RLConfig) -> tuple[int, int, int]:
    """`(longest prompt, max_new_tokens, tokenizer vocab size)` of the run's task."""
    params = cfg.task.params
    if hasattr(params, "max_prompt_tokens") and not (cfg.fit_vocab and cfg.init_from is None):
        return params.max_prompt_tokens, params.max_new_tokens, cfg.model.vocab_size
    from tpurl.tasks import make_task

    task = make_task(cfg.task_config)
    return task.max_prompt_len, task.max_new_tokens, task.tokenizer.vocab_size


def make_job(cfg: RLConfig, num_devices: int, *, lengths: tuple[int, int, int] | None = None,
             response_len: int | None = None) -> PlanJob:
    """Resolve `cfg` on `num_devices` devices; `lengths` = `(prompt, new tokens, tokenizer vocab)`
    (default: `task_lengths(cfg)`); `response_len`: the expected mean response length."""
    prompt_len, new_tokens, vocab = lengths or task_lengths(cfg)
    if response_len is not None and not 1 <= response_len <= new_tokens:
        raise ValueError(f"--response_len {response_len} must be between 1 and the task's max_new_tokens "
                         f"({new_tokens})")
    model = model_config_for(cfg, vocab)
    n_train, n_rollout = cfg.placement.split(num_devices)
    task = types.SimpleNamespace(max_prompt_len=prompt_len, max_new_tokens=new_tokens)
    return PlanJob(cfg=cfg, model=model, prompt_len=prompt_len, new_tokens=new_tokens,
                   engine=engine_config_for(cfg, task), num_devices=num_devices,
                   train_mesh=abstract_mesh(cfg.placement.train_mesh, n_train, "train"),
                   rollout_mesh=abstract_mesh(cfg.placement.rollout_mesh, n_rollout, "rollout"),
                   response_len=response_len)
