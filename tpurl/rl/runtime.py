"""The resources of an RL run: meshes, layouts, the rollout side and the jitted functions.

Built once from a run's resolved spec (`tpurl.rl.spec.RunSpec`) and its task; the step (`tpurl.rl.step`), the warm start
(`tpurl.rl.sft`) and evaluation (`tpurl.rl.evaluation`) use it. The rollout side (engine, rollout
weights, KV pool, the colocated handover) is one object, `rt.rollout` (`tpurl.rl.rollout`). Placement
decides the meshes:
colocated (both layouts over the same devices, taking turns, with the optimizer state parked in
host memory during rollout) or disaggregated (a train pool and a rollout pool; weights cross with
`device_put`).
"""

from __future__ import annotations

import jax
from flax import nnx

from tpurl.generate import Engine
from tpurl.models.transformer import abstract_model, init_model
from tpurl.rl.advantage_phase import make_advantage_fn
from tpurl.rl.rollout import RolloutSide
from tpurl.rl.spec import RunSpec
from tpurl.sharding.host import to_mesh
from tpurl.sharding.placement import make_placement
from tpurl.sync import ColocatedHandover
from tpurl.tasks import Task
from tpurl.train.critic import init_value_head, make_value_fn
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.state import TrainState, abstract_train_state, init_train_state
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
        engine = Engine(self.model_cfg, spec.engine, mesh=self.rollout_mesh,
                        layout=self.rollout_layout, graphdef=self.graphdef)
        self.rollout = RolloutSide(engine, self.rollout_layout.param_shardings(abstract_params, self.rollout_mesh),
                               cfg.sync, task, seq_len=self.seq_len,
                               handover=ColocatedHandover(cfg.handover) if self.placement.colocated else None,
                               in_flight=spec.in_flight)

        algo = spec.algorithm
        self.train_step = make_train_step(self.graphdef, algo, cfg.optimizer, mesh=self.train_mesh,
                                          layout=self.train_layout, packing=cfg.packing)
        self.logprob_fn = make_logprob_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout,
                                          temperature=algo.temperature, packing=cfg.packing,
                                          micro_batches=algo.micro_batches)
        # Group estimators, KL in the reward and GAE (tpurl.rl.advantage_phase); PPO's critic adds the
        # old-policy values, computed in the logprobs phase.
        self.advantages_fn = make_advantage_fn(algo)
        self.value_fn = (make_value_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout,
                                       packing=cfg.packing, micro_batches=algo.micro_batches)
                         if algo.uses_critic else None)

    @property
    def uses_reference(self) -> bool:
        return self.cfg.algorithm.uses_reference

    def init_params(self, seed: int):
        """Fresh parameters (from scratch, or from `init_from`'s Hugging Face checkpoint) in the
        train layout."""
        if self.cfg.init_from:
            from tpurl.models.hf import load_hf_checkpoint

            model = load_hf_checkpoint(self.cfg.init_from, config=self.model_cfg, shardings=self.train_shardings)
            return nnx.state(model, nnx.Param)
        params = nnx.state(init_model(self.model_cfg, seed), nnx.Param)
        return jax.device_put(params, self.train_shardings)

    def new_train_state(self, params) -> TrainState:
        return init_train_state(params, self.cfg.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                value_head=self._value_head())

    def abstract_train_state(self) -> TrainState:
        """The train state's shapes, dtypes and shardings, without allocating or reading anything
        (what a checkpoint restores into)."""
        params = nnx.state(abstract_model(self.model_cfg), nnx.Param)
        head = jax.eval_shape(self._value_head)
        return abstract_train_state(params, self.cfg.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                    value_head=head)

    def _value_head(self):
        return init_value_head(self.model_cfg.hidden_size) if self.cfg.algorithm.uses_critic else None

    def place_batch(self, batch: dict):
        """A host batch (`[B, ...]` arrays, the same on every process) on the train mesh, sharded
        over the layout's batch axes, as the train and SFT steps take it."""
        return to_mesh(batch, {k: self.train_layout.batch_sharding(self.train_mesh, v.ndim) for k, v in batch.items()})

    def sft_step(self):
        return make_sft_step(self.graphdef, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout)

    def sft_state(self, params):
        return init_train_state(params, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout)
