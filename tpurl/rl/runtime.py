"""The resources of an RL run: meshes, layouts, the rollout engine and the jitted functions.

Built once from an `RLConfig` and a task; the step (`tpurl.rl.step`), the warm start
(`tpurl.rl.sft`) and evaluation (`tpurl.rl.evaluation`) use it. Placement decides the meshes:
colocated (both layouts over the same devices, taking turns, with the optimizer state parked in
host memory during rollout) or disaggregated (a train pool and a rollout pool; weights cross with
`device_put`).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from tpurl.generate import Engine, EngineConfig, SamplingConfig
from tpurl.models.transformer import abstract_model, init_model
from tpurl.rl.config import RLConfig, model_config_for, round_up
from tpurl.rl.shaping import make_advantage_fn
from tpurl.sync import ColocatedHandover, make_placement, sync_weights
from tpurl.tasks import Task
from tpurl.train.critic import init_value_head, make_value_fn
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.state import init_train_state
from tpurl.train.step import make_sft_step, make_train_step


class RLRuntime:
    """Meshes, shardings, engine and compiled step functions of one run (see module docstring)."""

    def __init__(self, cfg: RLConfig, task: Task, *, devices=None):
        self.cfg = cfg
        self.task = task
        self.model_cfg = model_config_for(cfg, task.tokenizer.vocab_size)
        self.placement = make_placement(cfg.placement, devices)
        self.train_mesh, self.rollout_mesh = self.placement.train_mesh, self.placement.rollout_mesh
        self.train_layout, self.rollout_layout = cfg.train_layout, cfg.rollout_layout
        self.graphdef, abstract_params = nnx.split(abstract_model(self.model_cfg))
        self.train_shardings = self.train_layout.param_shardings(abstract_params, self.train_mesh)
        self.rollout_shardings = self.rollout_layout.param_shardings(abstract_params, self.rollout_mesh)

        tok = task.tokenizer
        self.prompt_len = task.max_prompt_len
        self.seq_len = task.max_prompt_len + task.max_new_tokens
        self.sampling = dataclasses.replace(cfg.sampling, max_new_tokens=task.max_new_tokens,
                                            stop_token_ids=(tok.eos_id,), stop_strings=task.stop_strings)
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_k=0, top_p=1.0)
        self.eval_sampling = dataclasses.replace(self.sampling, temperature=cfg.eval.temperature)
        slots = cfg.rollout.max_slots or max(cfg.batch_size, cfg.eval.pass_k)
        engine_cfg = EngineConfig(cache=cfg.rollout.cache, max_slots=slots,
                                  max_seq_len=round_up(self.seq_len, cfg.rollout.page_size),
                                  page_size=cfg.rollout.page_size, prefill_buckets=(self.prompt_len,),
                                  attention_impl=cfg.rollout.attention_impl)
        self.engine = Engine(self.model_cfg, engine_cfg, mesh=self.rollout_mesh, layout=self.rollout_layout,
                             graphdef=self.graphdef)

        algo = cfg.algorithm
        self.train_step = make_train_step(self.graphdef, algo, cfg.optimizer, mesh=self.train_mesh,
                                          layout=self.train_layout, micro_batches=algo.micro_batches)
        self.logprob_fn = make_logprob_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout,
                                          temperature=algo.temperature)
        # Group estimators, KL in the reward and GAE (tpurl.rl.shaping); PPO's critic adds the
        # old-policy values, computed in the logprobs phase.
        self.advantages_fn = make_advantage_fn(algo)
        self.value_fn = (make_value_fn(self.graphdef, mesh=self.train_mesh, layout=self.train_layout)
                         if algo.uses_critic else None)
        self.handover = ColocatedHandover(cfg.handover) if self.placement.colocated else None

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

    def new_train_state(self, params):
        head = init_value_head(self.model_cfg.hidden_size) if self.cfg.algorithm.uses_critic else None
        return init_train_state(params, self.cfg.optimizer, mesh=self.train_mesh, layout=self.train_layout,
                                value_head=head)

    def sft_step(self):
        return make_sft_step(self.graphdef, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout)

    def sft_state(self, params):
        return init_train_state(params, self.cfg.sft.optimizer, mesh=self.train_mesh, layout=self.train_layout)

    def sync(self, train_params):
        """Train layout -> rollout layout (and dtype): `(rollout_params, SyncReport)`."""
        return sync_weights(train_params, self.rollout_shardings, self.cfg.sync)

    def sampling_for(self, kind: str) -> SamplingConfig:
        return {"train": self.sampling, "greedy": self.greedy, "eval": self.eval_sampling}[kind]
