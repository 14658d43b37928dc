"""Typed configuration of an RL run (`tpurl train`), and its validation before any work starts.

`RLConfig` gathers the per-subsystem configs: model, task, algorithm and optimizer, the rollout
engine, placement (colocated / disaggregated meshes) with the train and rollout layouts, weight sync and
the colocated memory handover, the SFT warm start, evaluation, checkpoints and logging. Gin binds
them at the entry point (`configs/demo.gin`). Each config checks its own fields as it is built;
what needs the task or the devices is checked, and everything derived is computed, once, by
`tpurl.rl.spec.resolve_run`.
"""

from __future__ import annotations

import dataclasses

from tpurl.checkpoint import CheckpointConfig
from tpurl.compile_cache import CompileCacheConfig
from tpurl.config_types import check_types
from tpurl.generate import EngineConfig
from tpurl.generate.sampling import temperature_problem
from tpurl.logging import LoggingConfig
from tpurl.models.config import ModelConfig, preset
from tpurl.presets import resolve_preset
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.sharding.layout import Layout
from tpurl.sharding.placement import PlacementConfig
from tpurl.sharding.presets import layout_preset
from tpurl.sync import HandoverConfig, SyncConfig
from tpurl.tasks import TaskConfig
from tpurl.train.config import AlgorithmConfig, OptimizerConfig, algorithm_preset
from tpurl.train.packing import PackingConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Supervised warm start on the task's reference answers before RL (`steps=0`: none).

    `stop_at_accuracy`: end the warm start early, once the greedy accuracy on `probe_problems`
    *training* problems (checked every `check_every` steps) reaches it. How many steps a small
    model needs to pick up a skill varies a lot (its learning curve is a plateau, then a sharp
    rise), so a fixed step count is a fragile way to leave the model "imperfect but capable"; a
    target accuracy is not. The probe never touches the held-out split.
    `whole_model`: a LoRA model's warm start fine-tunes its base (every weight but the adapters,
    which stay new), and RL's adapters then train on that base, frozen; False trains the adapters
    alone, as RL does.
    """

    steps: int = 0
    batch_size: int = 64
    optimizer: OptimizerConfig = OptimizerConfig(lr=3e-3, warmup_steps=20)
    stop_at_accuracy: float | None = None
    check_every: int = 50
    probe_problems: int = 128
    whole_model: bool = False

    def __post_init__(self):
        check_types(self)
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError(f"SFTConfig: need steps >= 0 and batch_size >= 1, got {self.steps}, {self.batch_size}")
        if self.stop_at_accuracy is not None and not 0 < self.stop_at_accuracy <= 1:
            raise ValueError(f"SFTConfig.stop_at_accuracy={self.stop_at_accuracy} must be in (0, 1] or None")
        if self.check_every < 1 or self.probe_problems < 1:
            raise ValueError(f"SFTConfig: need check_every >= 1 and probe_problems >= 1, got {self.check_every}, "
                             f"{self.probe_problems}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: greedy accuracy and pass@k (k samples at `temperature`) every
    `every_steps` RL steps (0: only after the warm start and at the end)."""

    every_steps: int = 0
    num_problems: int | None = None
    pass_k: int = 4
    temperature: float = 1.0

    def __post_init__(self):
        check_types(self)
        if self.every_steps < 0:
            raise ValueError(f"EvalConfig.every_steps={self.every_steps} must be >= 0 (0: start and end only)")
        if self.num_problems is not None and self.num_problems < 1:
            raise ValueError(f"EvalConfig.num_problems={self.num_problems} must be >= 1 or None (all)")
        if self.pass_k < 1:
            raise ValueError(f"EvalConfig.pass_k={self.pass_k} must be >= 1")
        if problem := temperature_problem(self.temperature, greedy=False):  # pass@k samples; greedy is separate
            raise ValueError(f"EvalConfig.temperature={self.temperature} {problem}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """One RL run. `batch_size` sequences per step = prompts per step x the algorithm's group size.

    `model` is a `ModelConfig` or a preset name; with `fit_vocab` (and no `init_from`) its
    `vocab_size` is set to the task tokenizer's rounded up to `vocab_multiple`, so presets work
    with any task and the vocab divides the tensor-parallel axes.
    `init_from`: a Hugging Face checkpoint directory to start from (RL on a pretrained model). The
    architecture then comes from its `config.json` and `model` supplies only the run-time choices
    (`RUNTIME_MODEL_FIELDS`: dtypes, remat, attention implementation and query blocks, layer
    unrolling, LoRA, consistency and its window) and, for a mixture-of-experts checkpoint, `model.moe`'s training options
    (`MOE_TRAINING_FIELDS`: router replay, the router losses' coefficients); the task tokenizes
    with the checkpoint's tokenizer (when it has a `tokenizer.json`) unless `task.tokenizer` names
    another (`tpurl.rl.spec`).
    `algorithm` is an `AlgorithmConfig` or a preset name (`grpo`, `dapo`, ...); with
    `seq-mean-token-sum-norm` (Dr. GRPO) `loss_norm_len=None` means the task's `max_new_tokens`
    (`tpurl.rl.spec.resolve_loss_norm`).
    `train_layout` / `rollout_layout` are `Layout`s or preset names (`fsdp_tp`, `tp`, ...).
    Rollouts sample at `algorithm.temperature` (the trainer recomputes logprobs at it) from the
    untruncated distribution, up to the task's `max_new_tokens`, stopping at EOS or the task's stop
    strings (`tpurl.rl.rollout.RolloutSide.sampling`).
    `engine`: the rollout engine; its sizes left None are derived: `max_slots` the whole step's
    batch (or pass@k's samples, if more), `max_seq_len` the task's longest prompt plus
    `max_new_tokens` (rounded up to a page), `prefill_buckets` the longest prompt.
    `packing`: the update, the old/reference logprobs and the critic run their model forward on
    the step's sequences packed into fewer rows (`tpurl.train.packing`; same results).
    `init_adapter`: a Hugging Face PEFT LoRA adapter directory to continue training (its
    `adapter_config.json` is the run's `ModelConfig.lora` unless that is set, then they must
    agree); the base is `init_from`'s (or the model trained from scratch).
    `async_rollout`: with `max_staleness >= 1` (disaggregated placement only) the rollout pool
    samples the next steps' batches while the train pool updates (`tpurl.rl.async_step`); the
    update corrects the stale batches with `algorithm.correction`, which must be set.
    `compile_cache`: where `tpurl train` keeps compiled programs between runs
    (`tpurl.compile_cache`; on by default, `dir=None` turns it off; a program calling
    `tpurl.rl.loop.run` itself turns it on with `tpurl.compile_cache.enable`).
    `compile_ahead`: compile the update and scoring programs for the packed shapes the run has not
    met yet on a background thread (`tpurl.rl.compile_ahead`; on a CPU-only host it takes the
    step's cores).
    """

    seed: int = 0
    steps: int = 10
    batch_size: int = 64
    model: ModelConfig | str = "tiny"
    fit_vocab: bool = True
    vocab_multiple: int = 8
    init_from: str | None = None
    init_adapter: str | None = None
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig | str = "grpo"
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)
    engine: EngineConfig = EngineConfig()
    placement: PlacementConfig = PlacementConfig()
    async_rollout: AsyncConfig = AsyncConfig()
    train_layout: Layout | str = "fsdp_tp"
    rollout_layout: Layout | str = "tp"
    sync: SyncConfig = SyncConfig()
    handover: HandoverConfig = HandoverConfig()
    packing: PackingConfig = PackingConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    compile_cache: CompileCacheConfig = CompileCacheConfig()
    compile_ahead: bool = False

    def __post_init__(self):
        check_types(self)

        def resolve(field, kind, fn):
            object.__setattr__(self, field, resolve_preset(getattr(self, field), kind, fn, where=f"RLConfig.{field}"))

        resolve("model", ModelConfig, preset)
        resolve("algorithm", AlgorithmConfig, algorithm_preset)
        resolve("train_layout", Layout, layout_preset)
        resolve("rollout_layout", Layout, layout_preset)
        if self.vocab_multiple < 1:
            raise ValueError(f"RLConfig.vocab_multiple={self.vocab_multiple} must be >= 1")
        if self.steps < 0:
            raise ValueError(f"RLConfig.steps={self.steps} must be >= 0")
        if self.engine.top_logprobs:
            raise ValueError(f"RLConfig.engine.top_logprobs={self.engine.top_logprobs}: a rollout trains on its sampled "
                             "tokens' logprobs and reports no alternatives; leave EngineConfig.top_logprobs at 0")
        g = self.algorithm.group_size
        if self.batch_size < 1:
            raise ValueError(f"RLConfig.batch_size={self.batch_size} must be positive: sequences per step, a multiple "
                             f"of the group size {g} (e.g. {8 * g})")
        if self.batch_size % g:
            raise ValueError(f"RLConfig.batch_size={self.batch_size} is not a multiple of the group size {g} "
                             f"(algorithm {self.algorithm.name!r}); use e.g. {max(1, self.batch_size // g) * g}")
        self._check_async()
        chunks = self.algorithm.minibatches * self.algorithm.micro_batches
        if self.batch_size % chunks:
            raise ValueError(f"RLConfig.batch_size={self.batch_size} does not split into minibatches x micro_batches "
                             f"= {self.algorithm.minibatches} x {self.algorithm.micro_batches}; make it a multiple "
                             f"of {chunks}")

    def _check_async(self) -> None:
        s = self.async_rollout.max_staleness
        if not s:
            return
        if self.placement.mode != "disaggregated":
            raise ValueError(f"AsyncConfig.max_staleness={s} overlaps rollout with the update on devices of their own, "
                             f"but PlacementConfig.mode={self.placement.mode!r} runs both on the same devices, taking "
                             "turns (nothing to overlap); use mode='disaggregated' or max_staleness=0")
        if not self.algorithm.correction.active:
            raise ValueError(f"AsyncConfig.max_staleness={s} trains on batches up to {s} policy version(s) old, which "
                             "needs an off-policy correction; set AlgorithmConfig.correction (e.g. "
                             "@tpurl.CorrectionConfig() with is_level='token', is_cap=2.0: truncated importance "
                             "weights of the proximal over the behaviour policy, decoupled PPO; or bypass=True)")

    @property
    def group_size(self) -> int:
        return self.algorithm.group_size

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.algorithm.group_size

    def replace(self, **changes) -> RLConfig:
        return dataclasses.replace(self, **changes)
