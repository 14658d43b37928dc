"""The policy update: advantage and KL estimators, policy losses, chunked logprobs, the train
state and the jitted (micro-batched, sharded) RL and SFT steps.

    config.py      OptimizerConfig, AlgorithmConfig, algorithm presets (grpo, dr_grpo, dapo, ...)
    advantages.py  group estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++), GAE, dynamic sampling
    losses.py      PPO clip / dual clip, GSPO, CISPO, aggregations, k1/k2/k3 KL, TIS, value loss
    logprobs.py    token logprobs and entropies without materializing [B, T, V] logits
    critic.py      PPO value head on the policy's hidden states
    packing.py     packed sequences: the forward on fewer rows, outputs gathered back to [B, T]
    state.py       TrainState, optax optimizer and schedules, state shardings
    step.py        make_train_step / make_sft_step / make_grad_fn
    parity.py      gradient parity of a layout against a single-device run (`tpurl check-layouts`)
"""

from tpurl.train.advantages import (compute_advantages, gae, keep_groups, kl_penalized_rewards, token_rewards,
                                    whiten)
from tpurl.train.config import ALGORITHMS, AlgorithmConfig, OptimizerConfig, algorithm_preset
from tpurl.train.critic import init_value_head, make_value_fn
from tpurl.train.logprobs import logprobs_from_hidden, make_logprob_fn, token_logprobs
from tpurl.train.packing import PackingConfig, pack_batch
from tpurl.train.state import TrainState, init_train_state, make_optimizer, state_shardings
from tpurl.train.step import make_grad_fn, make_sft_step, make_train_step

__all__ = ["compute_advantages", "gae", "keep_groups", "kl_penalized_rewards", "token_rewards", "whiten",
           "ALGORITHMS", "AlgorithmConfig", "OptimizerConfig", "algorithm_preset", "init_value_head",
           "make_value_fn", "logprobs_from_hidden", "make_logprob_fn", "token_logprobs", "PackingConfig", "pack_batch",
           "TrainState", "init_train_state", "make_optimizer", "state_shardings", "make_grad_fn",
           "make_sft_step", "make_train_step"]
