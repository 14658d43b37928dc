"""Held-out evaluation, kept apart from training reward: greedy accuracy and pass@k.

Runs the rollout side on the task's held-out split (never seen in training) and reports under
`eval/` names only: `eval/greedy_accuracy` (one greedy completion per problem is correct),
`eval/pass@k` (at least one of k samples at the eval temperature is correct; with n = k samples
the unbiased estimator 1 - C(n-c, k)/C(n, k) reduces to this), `eval/sample_accuracy` (mean over
the k samples) and the mean of each reward component of the greedy completions. Completions are
scored by the same path as training rollouts (`RolloutSide.sample`); a completion's correctness is its
`correct` reward component (a task without one: 1 when its total reward is positive).

Both run inside a rollout window when called through `RolloutSide.lend` (the loop does), so under the
colocated handover the optimizer state is in host memory while the KV pool is alive.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tpurl.rl.batch import Rollouts
from tpurl.rl.config import EvalConfig
from tpurl.rl.rollout import RolloutSide
from tpurl.tasks import Problem


def correct(ro: Rollouts) -> np.ndarray:
    """`[P, G]` correctness of every completion (see the module docstring)."""
    if "correct" in ro.components:
        return ro.components["correct"].astype(np.float64)
    return (ro.rewards > 0).astype(np.float64)


def greedy_accuracy(rollout: RolloutSide, problems: Sequence[Problem], *, seed: int = 0) -> float:
    """Fraction of `problems` whose greedy completion is correct."""
    return float(correct(rollout.sample(problems, n=1, seed=seed, temperature=0.0)).mean())


def evaluate(rollout: RolloutSide, cfg: EvalConfig, *, seed: int) -> dict[str, float]:
    """Evaluate the rollout weights on the task's held-out split."""
    problems = list(rollout.task.eval_problems())
    if cfg.num_problems is not None:
        problems = problems[:cfg.num_problems]
    greedy = rollout.sample(problems, n=1, seed=seed, temperature=0.0)
    out = {"eval/greedy_accuracy": float(correct(greedy).mean()), "eval/num_problems": float(len(problems))}
    out.update({f"eval/greedy_{name}": float(np.mean(v)) for name, v in greedy.components.items()})
    if cfg.pass_k > 1:
        sampled = correct(rollout.sample(problems, n=cfg.pass_k, seed=seed + 1, temperature=cfg.temperature))
        out[f"eval/pass@{cfg.pass_k}"] = float((sampled.max(axis=1) > 0).mean())
        out["eval/sample_accuracy"] = float(sampled.mean())
    return out
