"""Held-out evaluation, kept apart from training reward: greedy accuracy and pass@k.

Runs the rollout engine on the task's held-out split (never seen in training) and reports under
`eval/` names only: `eval/greedy_accuracy` (one greedy completion per problem is correct),
`eval/pass@k` (at least one of k samples at the eval temperature is correct; with n = k samples
the unbiased estimator 1 - C(n-c, k)/C(n, k) reduces to this), `eval/sample_accuracy` (mean over
the k samples) and the mean of each reward component of the greedy completions.
"""

from __future__ import annotations

import numpy as np

from tpurl.generate import generate
from tpurl.rl.batch import decode
from tpurl.rl.runtime import RLRuntime


def greedy_accuracy(rt: RLRuntime, rollout_params, problems, *, seed: int = 0) -> float:
    """Fraction of `problems` whose greedy completion is correct."""
    task = rt.task
    prompts = [task.encode_prompt(p) for p in problems]
    completions = generate(rt.engine, rollout_params, prompts, n_samples=1, sampling=rt.greedy, seed=seed,
                           tokenizer=task.tokenizer)
    return float(np.mean([task.score(p, decode(task.tokenizer, c[0].token_ids), c[0].finish_reason)
                          .components.get("correct", 0.0) for p, c in zip(problems, completions)]))


def evaluate(rt: RLRuntime, rollout_params, *, seed: int) -> dict[str, float]:
    """Evaluate the rollout-layout policy on the held-out split."""
    cfg, task = rt.cfg.eval, rt.task
    problems = list(task.eval_problems())
    if cfg.num_problems is not None:
        problems = problems[:cfg.num_problems]
    prompts = [task.encode_prompt(p) for p in problems]

    def score(completions):
        correct = np.zeros((len(problems), len(completions[0])), np.float64)
        comps = {name: [] for name in task.reward_components}
        for i, (problem, group) in enumerate(zip(problems, completions)):
            for j, c in enumerate(group):
                r = task.score(problem, decode(task.tokenizer, c.token_ids), c.finish_reason)
                correct[i, j] = r.components["correct"] if "correct" in r.components else float(r.total > 0)
                for name in comps:
                    comps[name].append(r.components[name])
        return correct, comps

    greedy, comps = score(generate(rt.engine, rollout_params, prompts, n_samples=1, sampling=rt.greedy,
                                   seed=seed, tokenizer=task.tokenizer))
    out = {"eval/greedy_accuracy": float(greedy.mean()), "eval/num_problems": float(len(problems))}
    out.update({f"eval/greedy_{name}": float(np.mean(v)) for name, v in comps.items()})
    k = cfg.pass_k
    if k > 1:
        sampled, _ = score(generate(rt.engine, rollout_params, prompts, n_samples=k, sampling=rt.eval_sampling,
                                    seed=seed + 1, tokenizer=task.tokenizer))
        out[f"eval/pass@{k}"] = float((sampled.max(axis=1) > 0).mean())
        out["eval/sample_accuracy"] = float(sampled.mean())
    return out
