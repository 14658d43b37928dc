"""Typed configs of the policy update: the optimizer and the RL algorithm, plus named presets.

An algorithm is a combination of independent choices (advantage estimator, policy loss, loss
aggregation, KL placement, importance-sampling corrections), so the well-known algorithms are
*presets* of one `AlgorithmConfig` rather than separate code paths:

    grpo          group mean/std advantages, PPO clip, per-sequence token mean, k3 KL in the loss
    dr_grpo       group-mean advantages (no std), constant normalizer (seq-mean-token-sum-norm)
    dapo          clip-higher (eps_high 0.28), token-mean, dynamic sampling, no KL
    gspo          sequence-level importance ratio, tiny clip range, per-sequence token mean
    cispo         clipped stop-gradient IS weights times logprob (MiniMax-M1)
    rloo          leave-one-out baseline, KL subtracted from the reward
    reinforce_pp  REINFORCE++ with group baseline and batch-normalized advantages
    ppo           GAE over token rewards with a value head (critic), KL in the reward

The same presets exist as gin files in `configs/algorithms/` (a test keeps them equal).
"""

from __future__ import annotations

import dataclasses

from tpurl.config_types import check_types
from tpurl.generate.sampling import temperature_problem
from tpurl.train.correction import CorrectionConfig

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
LOSS_TYPES = ("ppo", "gspo", "cispo")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "sgd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optax optimizer: AdamW (or plain SGD, mostly for exact tests) with linear warmup, then a
    constant or cosine schedule, and global-norm gradient clipping.

    `total_steps` is the length of the cosine decay (after warmup); `min_lr_ratio` its floor as a
    fraction of `lr`. Weight decay skips norm scales and biases. `max_grad_norm=None` disables
    clipping.
    """

    optimizer: str = "adamw"
    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        check_types(self)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.optimizer={self.optimizer!r}; use one of {OPTIMIZERS}")
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}; use one of {SCHEDULES}")
        if self.schedule == "cosine" and not (self.total_steps and self.total_steps > 0):
            raise ValueError("OptimizerConfig.total_steps must be set (> 0) for schedule='cosine'")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"OptimizerConfig: b1, b2 must be in [0, 1), got {self.b1}, {self.b2}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """One RL algorithm of the GRPO/PPO family.

    Advantages: `advantage_estimator` (see `advantages.py`); `adv_eps` guards divisions by a std;
    `reinforce_pp_baseline` subtracts the group mean before REINFORCE++'s batch normalization
    (needs group_size >= 2: a group of one is its own mean; set it False for one sample per prompt);
    `gamma`/`gae_lambda` for GAE.
    Loss: `loss_type` ppo | gspo | cispo with ratio clip range [1 - eps_low, 1 + eps_high];
    `dual_clip` (> 1, PPO only) bounds the loss of negative-advantage tokens by dual_clip * |A|;
    `loss_agg` how token losses become one number; `loss_norm_len` the constant of
    seq-mean-token-sum-norm (None: an RL run uses its rollout's max_new_tokens; the batch's padded
    length would make the normalizer vary from batch to batch, which is exactly the length bias
    Dr. GRPO removes).
    KL to the reference policy: `kl_coef` (0 disables the reference policy entirely),
    `kl_estimator` k1 | k2 | k3, `kl_in_reward` subtracts it from the reward instead of adding
    it to the loss (the caller applies `advantages.kl_penalized_rewards`, or `token_rewards` for
    GAE, before computing advantages; the step then only reports the KL). `entropy_coef` adds an
    entropy bonus. `correction` weighs the token losses for the gap between the trainer's old
    policy and the rollout engine's (`tpurl.train.correction`: truncated importance sampling,
    masks, icepop, bypass; the default corrects nothing).
    Batching: `group_size` completions per prompt; `dynamic_sampling` drops degenerate groups and
    refills the batch (DAPO) with at most `max_resample_rounds` rounds of more prompts after the
    first (0: drop but never resample; the batch is padded); `epochs` passes over each batch, split into `minibatches`
    optimizer steps of `micro_batches` gradient-accumulation chunks each.
    PPO critic: `value_coef` weight of the value loss, `value_clip` its clip range.
    `temperature` is the rollout temperature the logprobs are computed at.
    """

    name: str = "grpo"
    advantage_estimator: str = "grpo"
    adv_eps: float = 1e-6
    reinforce_pp_baseline: bool = True
    gamma: float = 1.0
    gae_lambda: float = 1.0
    loss_type: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    loss_norm_len: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    correction: CorrectionConfig = CorrectionConfig()
    group_size: int = 8
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    epochs: int = 1
    minibatches: int = 1
    micro_batches: int = 1
    value_coef: float = 0.0
    value_clip: float | None = None
    temperature: float = 1.0

    def __post_init__(self):
        check_types(self)
        def check(ok, msg):
            if not ok:
                raise ValueError(f"AlgorithmConfig({self.name!r}).{msg}")

        check(self.advantage_estimator in ESTIMATORS,
              f"advantage_estimator={self.advantage_estimator!r}; use one of {ESTIMATORS}")
        check(self.loss_type in LOSS_TYPES, f"loss_type={self.loss_type!r}; use one of {LOSS_TYPES}")
        check(self.loss_agg in LOSS_AGGS, f"loss_agg={self.loss_agg!r}; use one of {LOSS_AGGS}")
        check(self.kl_estimator in KL_ESTIMATORS, f"kl_estimator={self.kl_estimator!r}; use one of {KL_ESTIMATORS}")
        check(0 <= self.eps_low <= 1 and self.eps_high >= 0,
              f"eps_low/eps_high=({self.eps_low}, {self.eps_high}): need 0 <= eps_low <= 1 and eps_high >= 0")
        check(self.dual_clip is None or self.dual_clip > 1, f"dual_clip={self.dual_clip} must be > 1 or None")
        check(self.dual_clip is None or self.loss_type == "ppo", "dual_clip only applies to loss_type='ppo'")
        check(self.loss_norm_len is None or self.loss_norm_len > 0, f"loss_norm_len={self.loss_norm_len} must be > 0")
        check(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0")
        check(self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef} must be >= 0")
        check(self.group_size >= 1, f"group_size={self.group_size} must be >= 1")
        check(self.advantage_estimator in ("gae", "reinforce_pp") or self.group_size >= 2,
              f"group_size={self.group_size}: estimator {self.advantage_estimator!r} needs groups of >= 2")
        check(self.advantage_estimator != "reinforce_pp" or not self.reinforce_pp_baseline or self.group_size >= 2,
              f"group_size={self.group_size} with reinforce_pp_baseline=True makes every advantage 0 (a group of "
              "one is its own baseline); use group_size >= 2 or reinforce_pp_baseline=False")
        check(self.max_resample_rounds >= 0, f"max_resample_rounds={self.max_resample_rounds} must be >= 0")
        for name in ("epochs", "minibatches", "micro_batches"):
            check(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        check(0 <= self.gamma <= 1 and 0 <= self.gae_lambda <= 1, "gamma and gae_lambda must be in [0, 1]")
        check(self.value_coef >= 0, f"value_coef={self.value_coef} must be >= 0")
        check(self.advantage_estimator != "gae" or self.value_coef > 0,
              "value_coef must be > 0 with advantage_estimator='gae' (the critic needs a loss)")
        check(self.value_clip is None or self.value_clip > 0, f"value_clip={self.value_clip} must be > 0 or None")
        check(not (problem := temperature_problem(self.temperature, greedy=False)),
              f"temperature={self.temperature} {problem}")
        check(self.adv_eps > 0, f"adv_eps={self.adv_eps} must be > 0")

    @property
    def uses_reference(self) -> bool:
        """Whether a reference policy is needed at all (it is skipped when kl_coef == 0)."""
        return self.kl_coef > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the step needs a separate old-policy forward pass before the update.

        With one epoch of one minibatch the update starts from the very parameters that define
        the old policy, so its own forward pass gives the old logprobs (`rl_objective` uses
        `stop_gradient` of them: ratio 1) and a separate pass would compute the same numbers
        again. Several minibatches or epochs move the parameters before later minibatches, and
        the KL in the reward needs the old logprobs before the advantages exist. In bypass mode
        (`CorrectionConfig.bypass`) the rollout's logprobs are the old policy's: no pass."""
        if self.correction.bypass:
            return False
        return self.epochs * self.minibatches > 1 or self.kl_penalty_in_reward

    @property
    def kl_penalty_in_reward(self) -> bool:
        """Whether the KL to the reference is subtracted from the reward (before the advantages)."""
        return self.kl_in_reward and self.kl_coef > 0

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    def replace(self, **changes) -> AlgorithmConfig:
        return dataclasses.replace(self, **changes)


ALGORITHMS: dict[str, AlgorithmConfig] = {
    # DeepSeekMath GRPO: std-normalized group advantages, per-sequence mean, k3 KL in the loss.
    "grpo": AlgorithmConfig(name="grpo", advantage_estimator="grpo", loss_agg="seq-mean-token-mean",
                            kl_coef=0.04, kl_estimator="k3"),
    # Dr. GRPO: no std division and no per-sequence length normalization (both bias the update);
    # its constant normalizer (loss_norm_len None) is the rollout's max_new_tokens.
    "dr_grpo": AlgorithmConfig(name="dr_grpo", advantage_estimator="dr_grpo", loss_agg="seq-mean-token-sum-norm"),
    # DAPO: decoupled clip (clip-higher), token-level mean, dynamic sampling, no KL.
    "dapo": AlgorithmConfig(name="dapo", advantage_estimator="grpo", eps_low=0.2, eps_high=0.28,
                            loss_agg="token-mean", dynamic_sampling=True),
    # GSPO: sequence-level ratio (geometric mean of token ratios) with a very small clip range.
    "gspo": AlgorithmConfig(name="gspo", advantage_estimator="grpo", loss_type="gspo", eps_low=3e-4,
                            eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    # CISPO: IS weights clipped from above only and stop-gradient, so every token keeps a gradient.
    "cispo": AlgorithmConfig(name="cispo", advantage_estimator="grpo", loss_type="cispo", eps_low=1.0,
                             eps_high=0.28, loss_agg="token-mean"),
    # RLOO: leave-one-out baseline; the KL penalty is part of the reward.
    "rloo": AlgorithmConfig(name="rloo", advantage_estimator="rloo", loss_agg="token-mean", kl_coef=0.001,
                            kl_estimator="k1", kl_in_reward=True),
    # REINFORCE++ (baseline variant): group-mean baseline, batch-std normalization, KL in reward.
    "reinforce_pp": AlgorithmConfig(name="reinforce_pp", advantage_estimator="reinforce_pp", group_size=8,
                                    loss_agg="token-mean", kl_coef=0.001, kl_estimator="k1", kl_in_reward=True),
    # PPO with a value head: GAE over token rewards (KL per token in the reward), clipped value loss.
    "ppo": AlgorithmConfig(name="ppo", advantage_estimator="gae", group_size=1, gamma=1.0, gae_lambda=0.95,
                           loss_agg="token-mean", kl_coef=0.001, kl_estimator="k1", kl_in_reward=True,
                           value_coef=0.5, value_clip=0.2),
}


def algorithm_preset(name: str, **overrides) -> AlgorithmConfig:
    """A named algorithm preset, optionally with fields replaced (`algorithm_preset("dapo", kl_coef=0.01)`)."""
    key = name.lower().replace("-", "_")
    if key not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known algorithms: {', '.join(sorted(ALGORITHMS))}")
    return dataclasses.replace(ALGORITHMS[key], **overrides)
