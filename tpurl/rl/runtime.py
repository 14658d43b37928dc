"""The resources of an RL run: meshes, layouts, the rollout side and the jitted functions.

Built once from a run's resolved spec (`tpurl.rl.spec.RunSpec`) and its task; the step (`tpurl.rl.step`), the warm start
(`tpurl.rl.sft`) and evaluation (`tpurl.rl.evaluation`) use it. The rollout side (engine, rollout
weights, KV pool, the colocated handover) is one object, `rt.rollout` (`tpurl.rl.rollout`). Placement
decides the meshes:
colocated (both layouts over the same devices, taking turns, with the optimizer state parked in
host memory during rollout) or disaggregated (a train pool and a rollout pool; weights cross with
`device_put`). A LoRA model (`ModelConfig.lora`) trains its adapters alone: the train state's
`frozen` base serves the reference policy (the base graph, `ref_logprob_fn`) and the rollout
weights (`tpurl.sync.lora`: merged into the base, or beside it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.generate import Engine
from tpurl.models.lora import adapter_state, base_state, new_adapters
from tpurl.models.transformer import abstract_model, init_model
from tpurl.rl.advantage_phase import make_advantage_fn
from tpurl.rl.rollout import RolloutSide
from tpurl.rl.spec import RunSpec
from tpurl.sharding.host import to_mesh
from tpurl.sharding.placement import make_placement
from tpurl.sync import ColocatedHandover
from tpurl.sync.lora import LoraRollout
from tpurl.tasks import Task
from tpurl.train.critic import init_value_head, make_value_fn
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.packed_shapes import PackedShapes
from tpurl.train.state import TrainState, abstract_train_state, init_train_state, trained_and_frozen
from tpurl.train.step import make_sft_step, make_train_step


class RLRuntime:
    """Meshes, shardings, the rollout side and compiled step functions of one run (see module docstring)."""

    def __init__(self, spec: RunSpec, task: Task, *, devices=None):
        cfg = self.cfg = spec.cfg
        self.spec, self.task, self.model_cfg, self.seq_len = spec, task, spec.model, spec.seq_len
        self.placement = make_placement(cfg.placement, devices)
        self.train_mesh, self.rollout_mesh = self.placement.train_mesh, self.placement.rollout_mesh
        self.train_layout, self.rollout_layout = cfg.train_layout, cfg.rollout_layout
        self.graphdef, abstract_params = nnx.split(abstract_model(self.model_cfg))
        self.train_shardings = self.train_layout.param_shardings(abstract_params, self.train_mesh)
        self.rollout = self._rollout_side(spec, task)
        algo = spec.algorithm
        self.train_step = make_train_step(self.graphdef, algo, cfg.optimizer, mesh=self.train_mesh,
                                          layout=self.train_layout, packing=cfg.packing, seed=cfg.seed,
                                          rows_per_sequence=spec.lengths.rows_per_episode)
        self.logprob_fn = make_logprob_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout,
                                          temperature=algo.temperature, packing=cfg.packing,
                                          micro_batches=algo.micro_batches)
        # Group estimators, KL in the reward and GAE (tpurl.rl.advantage_phase); PPO's critic adds the
        # old-policy values, computed in the logprobs phase.
        self.advantages_fn = make_advantage_fn(algo)
        self.value_fn = (make_value_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout,
                                       packing=cfg.packing, micro_batches=algo.micro_batches)
                         if algo.uses_critic else None)
        # A LoRA run's reference policy: the base graph on the frozen base (no weights of its own).
        self.ref_logprob_fn = self.logprob_fn
        if spec.reference == "base":
            self.ref_logprob_fn = make_logprob_fn(nnx.graphdef(abstract_model(self.model_cfg.replace(lora=None))),
                                                  mesh=self.train_mesh, layout=self.train_layout,
                                                  temperature=algo.temperature, packing=cfg.packing,
                                                  micro_batches=algo.micro_batches)

    def _rollout_side(self, spec: RunSpec, task: Task) -> RolloutSide:
        """The engine on the rollout model (the trained one, or the base when adapters are merged)
        with its weights' shardings; a LoRA run's rollout weights come from `LoraRollout`."""
        cfg = spec.cfg
        graphdef, abstract = nnx.split(abstract_model(spec.rollout_model))
        shardings = self.rollout_layout.param_shardings(abstract, self.rollout_mesh)
        engine = Engine(spec.rollout_model, spec.engine, mesh=self.rollout_mesh, layout=self.rollout_layout,
                        graphdef=graphdef)
        lora = LoraRollout(self.lora, spec.adapters, shardings, cfg.sync) if self.lora is not None else None
        return RolloutSide(engine, shardings, cfg.sync, task, seq_len=self.seq_len,
                           handover=ColocatedHandover(cfg.handover) if self.placement.colocated else None,
                           in_flight=spec.in_flight, lora=lora)

    def packed_programs(self) -> list[PackedShapes]:
        """The `PackedShapes` of the programs on the step's packed rows: the update, the logprobs
        passes (the reference's where it has its own) and the critic's values."""
        fns = [self.logprob_fn, self.ref_logprob_fn, self.value_fn]
        scoring = {id(f): f.on_batch.shapes for f in fns if f is not None}
        return [self.train_step.shapes, *scoring.values()]

    @property
    def lora(self):
        """The model's `LoraConfig` (None: every parameter trains)."""
        return self.model_cfg.lora

    @property
    def uses_reference(self) -> bool:
        return self.cfg.algorithm.uses_reference

    @property
    def keeps_reference(self) -> bool:
        """Whether the run holds reference weights of its own: a copy of the starting weights (of a
        LoRA run's starting adapters), not the base alone (`RunSpec.reference`)."""
        return self.spec.reference in ("copy", "adapters")

    def init_params(self, seed: int):
        """Fresh parameters of the whole model (from scratch, or from `init_from`'s Hugging Face
        checkpoint; a LoRA model's adapters new, or `init_adapter`'s) in the train layout."""
        cfg = self.cfg
        if cfg.init_from:
            from tpurl.models.hf import load_hf_checkpoint

            base_cfg = self.model_cfg.replace(lora=None)
            if self.lora is not None and not (cfg.sft.steps and cfg.sft.whole_model):  # read the frozen base as kept
                base_cfg = base_cfg.replace(param_dtype=self.lora.base_dtype)
            params = nnx.state(load_hf_checkpoint(cfg.init_from, config=base_cfg, shardings=self.train_shardings),
                               nnx.Param)
            if self.lora is not None:
                adapters = new_adapters(self.model_cfg, seed)
                adapters = jax.device_put(adapters, self.train_layout.param_shardings(adapters, self.train_mesh))
                params = nnx.merge_state(params, adapters)
        else:
            params = jax.device_put(nnx.state(init_model(self.model_cfg, seed), nnx.Param), self.train_shardings)
        if cfg.init_adapter is not None:
            from tpurl.models.peft import load_peft_adapter

            params = nnx.merge_state(params, load_peft_adapter(cfg.init_adapter, self.model_cfg,
                                                               shardings=self.train_shardings))
        return params

    def new_train_state(self, params) -> TrainState:
        """A fresh train state from the whole model's parameters (a LoRA model's base frozen)."""
        trained, frozen = trained_and_frozen(params, self.lora)
        return init_train_state(trained, self.cfg.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                value_head=self._value_head(), frozen=frozen)

    def abstract_train_state(self) -> TrainState:
        """The train state's shapes, dtypes and shardings, without allocating or reading anything
        (what a checkpoint restores into)."""
        trained, frozen = trained_and_frozen(nnx.state(abstract_model(self.model_cfg), nnx.Param), self.lora)
        head = jax.eval_shape(self._value_head)
        return abstract_train_state(trained, self.cfg.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                    value_head=head, frozen=frozen)

    def reference_logprobs(self, train: TrainState, reference, placed: dict):
        """The reference policy's logprobs of a placed batch (`RunSpec.reference`): `reference`'s
        weights, the LoRA base alone, or the starting adapters `reference` on the base."""
        kind = self.spec.reference
        # The reference routes tokens its own way (-1: each token's own), not by the rollout policy's
        # recorded routes; the batch keeps its structure, so the scoring program is the policy's.
        placed = {k: jnp.full_like(v, -1) if k in ("routes", "packed_routes") else v for k, v in placed.items()}
        if kind == "base":
            params = train.frozen
        elif kind == "adapters":
            params = nnx.merge_state(train.frozen, reference)
        else:
            params = reference
        return self.ref_logprob_fn.on_batch(params, placed)[0]

    def _value_head(self):
        return init_value_head(self.model_cfg.hidden_size) if self.cfg.algorithm.uses_critic else None

    def place_batch(self, batch: dict):
        """A host batch (`[B, ...]` arrays, the same on every process) on the train mesh, sharded
        over the layout's batch axes, as the train and SFT steps take it."""
        return to_mesh(batch, {k: self.train_layout.batch_sharding(self.train_mesh, v.ndim) for k, v in batch.items()})

    def sft_step(self):
        return make_sft_step(self.graphdef, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                             seed=self.cfg.seed)

    def sft_state(self, params):
        """The warm start's train state from the whole model's parameters: a LoRA model's adapters
        train, its base frozen, as in RL; with `SFTConfig.whole_model` its base trains (in the
        params' dtype, a full fine-tune) while its new adapters stay as they are."""
        if self.lora is not None and self.cfg.sft.whole_model:  # the base trains; the new adapters wait for RL
            trained, frozen = base_state(params), adapter_state(params)
        else:
            trained, frozen = trained_and_frozen(params, self.lora)
        return init_train_state(trained, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                frozen=frozen)

    def load_rollout(self, model_state, version: int):
        """The rollout weights from a whole model's parameters (a LoRA run's base goes first,
        with its adapters, `RolloutSide.load`); returns the sync's report."""
        trained, frozen = trained_and_frozen(model_state, self.lora)
        return self.rollout.load(trained, version=version, frozen=frozen)
