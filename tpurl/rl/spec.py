"""The resolved run: everything an RL run derives from its config, computed once.

`resolve_run(cfg, lengths, num_devices)` is the one function that turns the user's `RLConfig`,
the task's lengths and the device count into a frozen `RunSpec`: the model config (vocabulary
fitted, or `init_from`'s architecture), the task config as built (with `init_from`'s tokenizer),
the algorithm with its loss normaliser resolved, the engine's derived sizes, the pools' mesh sizes
and `seq_len`. The runtime (`tpurl.rl.runtime`), the loop and the planner (`tpurl.plan.job`) read
the spec; nothing derives these again. Resolving checks everything that can be checked without
compiling or allocating, so a bad config fails in well under a second with a one-line message
naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp

from tpurl.generate import EngineConfig
from tpurl.models.config import ModelConfig
from tpurl.rl.config import RLConfig
from tpurl.sharding.layout import Layout, entry_axes
from tpurl.sync.lora import resolve_adapters
from tpurl.tasks import TaskConfig
from tpurl.train.config import AlgorithmConfig

# What `RLConfig.model` still decides when the architecture comes from `init_from`'s config.json.
RUNTIME_MODEL_FIELDS = ("dtype", "param_dtype", "remat", "attention_impl", "unroll_layers",
                        "attention_query_blocks", "lora", "consistency", "bitwise_window")
# What `ModelConfig.moe` still decides when the experts come from `init_from`'s config.json.
MOE_TRAINING_FIELDS = ("router_replay", "balance_loss_coef", "z_loss_coef")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskLengths:
    """What the spec needs of a task: its longest prompt and `max_new_tokens` (tokens), its
    tokenizer's vocabulary size (None: not known without reading a checkpoint, as for a planned
    `init_from` run; then not checked), whether it is an environment of several turns, whether
    it is an agent task (whose later calls prefill prompts up to the whole row), and an episode's
    rows in the update batch (an agent task's `trained_sequences`, `tpurl.rl.batch`)."""

    prompt_len: int
    new_tokens: int
    vocab_size: int | None
    multi_turn: bool = False
    agent: bool = False  # an agent task: a call's prompt may hold the episode's whole sequence so far
    rows_per_episode: int = 1

    @property
    def seq_len(self) -> int:
        """Prompt plus completion tokens of the longest sequence: the rows of every batch."""
        return self.prompt_len + self.new_tokens

    @classmethod
    def of(cls, task) -> TaskLengths:
        """The lengths of a built task (`tpurl.tasks.Task`)."""
        from tpurl.tasks.agent import is_agent_task
        from tpurl.tasks.env import is_multi_turn

        return cls(prompt_len=task.max_prompt_len, new_tokens=task.max_new_tokens,
                   vocab_size=task.tokenizer.vocab_size, multi_turn=is_multi_turn(task), agent=is_agent_task(task),
                   rows_per_episode=getattr(task, "rows_per_episode", 1))

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prompt lengths the engine prefills: the longest prompt (an agent task's calls: up to
        the whole row as well)."""
        return (self.prompt_len, self.seq_len) if self.agent else (self.prompt_len,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run as resolved (see the module docstring). `cfg` is the user's config with what it
    leaves to the run resolved in it (the algorithm's loss normaliser), so every reader of the run's
    config sees one value; the other fields are derived."""

    cfg: RLConfig
    task: TaskConfig
    model: ModelConfig
    engine: EngineConfig
    lengths: TaskLengths
    num_devices: int
    train_mesh: dict[str, int]
    rollout_mesh: dict[str, int]

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.cfg.algorithm

    @property
    def adapters(self) -> str | None:
        """How a LoRA model's adapters reach the rollout ("merged" | "unmerged", `SyncConfig.adapters`
        resolved for the placement); None without LoRA."""
        if self.model.lora is None:
            return None
        return resolve_adapters(self.cfg.sync.adapters, colocated=self.cfg.placement.mode == "colocated")

    @property
    def reference(self) -> str | None:
        """What the KL reference policy (the policy at the start of RL) is held as: None (no
        reference), "copy" (a copy of the starting weights), "base" (a LoRA run whose adapters start
        new: the frozen base without them), "adapters" (a LoRA run whose adapters start trained, by
        an adapters-only warm start or `init_adapter`: a copy of the starting adapters on the base)."""
        cfg = self.cfg
        if not cfg.algorithm.uses_reference:
            return None
        if self.model.lora is None:
            return "copy"
        trained_adapters = cfg.init_adapter is not None or (cfg.sft.steps > 0 and not cfg.sft.whole_model)
        return "adapters" if trained_adapters else "base"

    @property
    def rollout_model(self) -> ModelConfig:
        """The model the rollout engine runs: the trained one, or with merged adapters the base; its
        weights quantized as `SyncConfig.quantize` says."""
        model = self.model.replace(lora=None) if self.adapters == "merged" else self.model
        return model.replace(quantization=self.cfg.sync.quantize)

    @property
    def seq_len(self) -> int:
        return self.lengths.seq_len

    @property
    def train_rows(self) -> int:
        """Rows of a step's update batch: `batch_size` episodes x their rows."""
        return self.cfg.batch_size * self.lengths.rows_per_episode

    @property
    def batch_shards(self) -> int:
        """Devices the train layout splits a batch's rows over on the train mesh."""
        return batch_shards(self.cfg.train_layout, self.train_mesh)

    @property
    def in_flight(self) -> str:
        """How a sync meets a running rollout (`AsyncConfig.in_flight`)."""
        return self.cfg.async_rollout.in_flight


def task_config_for(cfg: RLConfig) -> TaskConfig:
    """The task as the run builds it: with `init_from` and no tokenizer of its own, the task
    tokenizes with the checkpoint's tokenizer when it has one (a checkpoint without one, e.g. the
    export of a run on the built-in tokenizer, keeps the task's built-in tokenizer)."""
    if (cfg.init_from is not None and cfg.task.tokenizer is None
            and os.path.exists(os.path.join(cfg.init_from, "tokenizer.json"))):
        return cfg.task.replace(tokenizer=cfg.init_from)
    return cfg.task


def resolve_run(cfg: RLConfig, lengths: TaskLengths, num_devices: int) -> RunSpec:
    """The run's spec on `num_devices` devices; a one-line ValueError for a config that cannot run."""
    if lengths.new_tokens < 1:
        raise ValueError(f"the task's max_new_tokens must be >= 1, got {lengths.new_tokens}")
    _check_engine(cfg, lengths)
    train_mesh, rollout_mesh = _mesh_sizes(cfg, num_devices)
    _check_batch_shards(cfg, train_mesh)
    _check_handover(cfg)
    model = _model_config(cfg, lengths.vocab_size)
    _check_model(cfg, model, lengths)
    if model.bitwise:
        _check_bitwise(cfg, model, lengths, train_mesh, rollout_mesh)
        if model.bitwise_window is None:  # windows as long as the run's sequences (64-slot multiples)
            model = model.replace(bitwise_window=min(round_up(lengths.seq_len, 64), model.max_position_embeddings))
    algorithm = resolve_loss_norm(cfg.algorithm, lengths.new_tokens)
    resolved = cfg if algorithm is cfg.algorithm else cfg.replace(algorithm=algorithm)
    return RunSpec(cfg=resolved, task=task_config_for(cfg), model=model,
                   engine=_engine_config(cfg, lengths), lengths=lengths, num_devices=num_devices,
                   train_mesh=train_mesh, rollout_mesh=rollout_mesh)


def resolve_loss_norm(algo: AlgorithmConfig, max_new_tokens: int) -> AlgorithmConfig:
    """Dr. GRPO's `seq-mean-token-sum-norm` divides by `B * loss_norm_len`, a constant that should
    be the rollout's `max_new_tokens`: `loss_norm_len=None` (the default) becomes it; a value the
    user set is kept, whatever it is. Other aggregations are returned unchanged."""
    if algo.loss_agg != "seq-mean-token-sum-norm" or algo.loss_norm_len is not None:
        return algo
    return algo.replace(loss_norm_len=max_new_tokens)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _model_config(cfg: RLConfig, vocab_size: int | None) -> ModelConfig:
    """`init_from`'s architecture (with `cfg.model`'s run-time fields), or `cfg.model` with its
    vocabulary fitted to the tokenizer's (`fit_vocab`, for models trained from scratch) rounded up
    to `vocab_multiple`, so that the vocab dimension divides the tensor-parallel axes (the padding
    ids are never trained towards and decode as invalid)."""
    model = cfg.model.replace(lora=_lora_config(cfg))
    if cfg.init_from is not None:
        from tpurl.models.hf import load_hf_config

        try:
            loaded = load_hf_config(cfg.init_from, **{f: getattr(model, f) for f in RUNTIME_MODEL_FIELDS})
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"RLConfig.init_from: {e}") from None
        return _with_moe_options(loaded, cfg.model.moe)
    if cfg.fit_vocab and vocab_size is not None:
        return model.replace(vocab_size=round_up(vocab_size, cfg.vocab_multiple))
    return model


def _with_moe_options(loaded: ModelConfig, own) -> ModelConfig:
    """`init_from`'s model with the training options of `ModelConfig.moe` (router replay, the router
    losses' coefficients): the checkpoint decides the experts, the run how to train them."""
    if own is None:
        return loaded
    if loaded.moe is None:
        raise ValueError("RLConfig.init_from is a dense checkpoint, but ModelConfig.moe is set; drop the MoeConfig "
                         "(the architecture comes from the checkpoint) or start from a qwen3_moe checkpoint")
    options = {f: getattr(own, f) for f in MOE_TRAINING_FIELDS}
    return loaded.replace(moe=dataclasses.replace(loaded.moe, **options))


def _lora_config(cfg: RLConfig):
    """`ModelConfig.lora`, or `init_adapter`'s (a PEFT adapter's config; it must agree with a
    `ModelConfig.lora` that is set too)."""
    if cfg.init_adapter is None:
        return cfg.model.lora
    from tpurl.models.peft import peft_lora_config

    try:
        lora = peft_lora_config(cfg.init_adapter)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"RLConfig.init_adapter: {e}") from None
    if cfg.model.lora is None:
        return lora
    own = cfg.model.lora
    differs = own.mismatch(lora)
    if differs:
        raise ValueError(f"RLConfig.init_adapter: ModelConfig.lora and the adapter differ in {differs}; leave "
                         "ModelConfig.lora None (the adapter's config is used) or match it")
    return own


def _engine_config(cfg: RLConfig, lengths: TaskLengths) -> EngineConfig:
    """`cfg.engine` with the sizes it leaves None derived from the step and the task: `max_slots`
    the whole step's batch (or pass@k's samples, if more), `max_seq_len` the longest sequence
    rounded up to a page, `prefill_buckets` the longest prompt (`TaskLengths.prefill_buckets`)."""
    e = cfg.engine
    return dataclasses.replace(e, max_slots=e.max_slots or max(cfg.batch_size, cfg.eval.pass_k),
                               max_seq_len=e.max_seq_len or round_up(lengths.seq_len, e.page_size),
                               prefill_buckets=e.prefill_buckets or lengths.prefill_buckets)


def _check_engine(cfg: RLConfig, lengths: TaskLengths) -> None:
    if lengths.multi_turn and cfg.engine.cache != "paged":
        raise ValueError(f"EngineConfig.cache={cfg.engine.cache!r}: the task {cfg.task.name!r} has turns, and resuming a "
                         "sequence after its environment answers needs the paged cache; set EngineConfig.cache='paged'")
    if cfg.engine.max_seq_len is not None and cfg.engine.max_seq_len < lengths.seq_len:
        raise ValueError(f"EngineConfig.max_seq_len={cfg.engine.max_seq_len} is shorter than the task's longest "
                         f"prompt plus max_new_tokens ({lengths.seq_len}); raise it or leave it None (derived)")


def _mesh_sizes(cfg: RLConfig, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """`{axis: size}` of the train and rollout meshes on their pools."""
    n_train, n_rollout = cfg.placement.split(num_devices)
    sizes = []
    for role, mesh_cfg, n in (("train_mesh", cfg.placement.train_mesh, n_train),
                              ("rollout_mesh", cfg.placement.rollout_mesh, n_rollout)):
        try:
            sizes.append(mesh_cfg.sizes(n))
        except ValueError as e:
            raise ValueError(f"PlacementConfig.{role} does not fit {n} {cfg.placement.mode} devices: {e}") from None
    return sizes[0], sizes[1]


def batch_shards(layout: Layout, mesh_shape: dict[str, int]) -> int:
    """Devices `layout` splits a batch's rows over on a mesh of `{axis: size}`."""
    return math.prod(mesh_shape.get(a, 1) for a in entry_axes(dict(layout.rules).get("batch")))


def _check_batch_shards(cfg: RLConfig, train_mesh: dict[str, int]) -> None:
    shards = batch_shards(cfg.train_layout, train_mesh)
    chunks = cfg.algorithm.minibatches * cfg.algorithm.micro_batches
    if (cfg.batch_size // chunks) % shards:
        raise ValueError(f"RLConfig.batch_size={cfg.batch_size}: each micro-batch has {cfg.batch_size // chunks} "
                         f"sequences, not divisible by the {shards} batch shards of layout {cfg.train_layout.name!r} "
                         f"on {train_mesh}; use a batch size that is a multiple of {shards * chunks}")
    if cfg.sft.steps and cfg.sft.batch_size % shards:
        raise ValueError(f"SFTConfig.batch_size={cfg.sft.batch_size} is not divisible by the {shards} batch "
                         f"shards of layout {cfg.train_layout.name!r}")


def _check_handover(cfg: RLConfig) -> None:
    if (cfg.placement.mode == "colocated" and cfg.handover.offload_master_params
            and not cfg.sync.copies_every_leaf(cfg.model.param_dtype)):
        raise ValueError("HandoverConfig.offload_master_params: with SyncConfig.rollout_dtype="
                         f"{cfg.sync.rollout_dtype!r} the sync passes train params through as rollout params "
                         "(aliased), and parking them would delete rollout weights; set SyncConfig.rollout_dtype to "
                         "a dtype other than the model's param_dtype (e.g. 'bfloat16') or turn it off")


def _check_bitwise(cfg: RLConfig, model: ModelConfig, lengths: TaskLengths, train_mesh: dict[str, int],
                   rollout_mesh: dict[str, int]) -> None:
    """One-line ValueError where bitwise mode (`ModelConfig.consistency`) cannot make the rollout's
    logprobs the trainer's: other weights (a cast to another dtype, fp8), a pool of more than one
    device (a sharded product sums its parts in the layout's order), multi-turn extends."""
    devices = {"train": math.prod(train_mesh.values()), "rollout": math.prod(rollout_mesh.values())}
    if cfg.sync.quantize is not None:
        raise ValueError("ModelConfig.consistency='bitwise' with SyncConfig.quantize: the rollout would run other "
                         "weights than the trainer's; drop one of them")
    dtype = cfg.sync.rollout_dtype
    if dtype is not None and jnp.dtype(dtype) != model.compute_dtype:
        raise ValueError(f"ModelConfig.consistency='bitwise' with SyncConfig.rollout_dtype={dtype!r}: the rollout "
                         f"weights must round as the trainer's do at use; set rollout_dtype None or {model.dtype!r}")
    for pool, n in devices.items():
        if n > 1:
            raise ValueError(f"ModelConfig.consistency='bitwise' runs on one device per pool for now; the {pool} mesh "
                             f"has {n}")
    if lengths.multi_turn or lengths.agent:
        raise ValueError("ModelConfig.consistency='bitwise' does not cover multi-turn or agent tasks yet; use "
                         "consistency='fast'")
    if cfg.engine.cache_dtype is not None and jnp.dtype(cfg.engine.cache_dtype) != model.compute_dtype:
        raise ValueError(f"ModelConfig.consistency='bitwise' with EngineConfig.cache_dtype={cfg.engine.cache_dtype!r}: "
                         "the cache must hold keys in the compute dtype; leave cache_dtype None")
    if cfg.engine.attention_impl not in ("auto", "reference"):
        raise ValueError(f"ModelConfig.consistency='bitwise' with EngineConfig.attention_impl="
                         f"{cfg.engine.attention_impl!r}: only the reference paged attention attends in windows")


def _check_model(cfg: RLConfig, model: ModelConfig, lengths: TaskLengths) -> None:
    model.check_lora()
    if model.quantization is not None:
        raise ValueError(f"ModelConfig.quantization={model.quantization!r} on the model being trained: training keeps "
                         f"full-precision weights; set SyncConfig.quantize={model.quantization!r} to roll out with "
                         "quantized ones")
    if cfg.sft.whole_model and model.lora is None:
        raise ValueError("SFTConfig.whole_model=True fine-tunes a LoRA model's base before its adapters train, but "
                         "the model has no lora; set ModelConfig.lora (or RLConfig.init_adapter) or leave it False")
    if cfg.sft.whole_model and cfg.init_adapter is not None:
        raise ValueError("SFTConfig.whole_model=True would fine-tune the base under RLConfig.init_adapter's trained "
                         "adapter; warm-start without it (whole_model=False trains the adapter) or drop init_adapter")
    if lengths.vocab_size is not None and model.vocab_size < lengths.vocab_size:
        if cfg.init_from is not None:
            raise ValueError(f"RLConfig.init_from: the checkpoint's vocab_size={model.vocab_size} is smaller than "
                             f"the task tokenizer's {lengths.vocab_size} ({task_config_for(cfg).tokenizer}); use the "
                             "checkpoint's own tokenizer (TaskConfig.tokenizer=None)")
        raise ValueError(f"RLConfig.model.vocab_size={cfg.model.vocab_size} is smaller than the task tokenizer's "
                         f"{lengths.vocab_size}; raise it or set RLConfig.fit_vocab=True")
    if lengths.seq_len > model.max_position_embeddings:
        raise ValueError(f"the task's longest prompt ({lengths.prompt_len} tokens) + max_new_tokens "
                         f"({lengths.new_tokens}) exceeds the model's max_position_embeddings="
                         f"{model.max_position_embeddings}; shorten the task's prompts or answers (e.g. "
                         "MathConfig.max_prompt_tokens / max_new_tokens) or raise ModelConfig.max_position_embeddings")
