"""From rollouts to a training batch: scoring every completion and packing fixed-shape arrays.

Each sequence is one row `[bos, prompt..., completion..., pad...]` of a fixed length `T` (the
task's longest prompt plus `max_new_tokens`), so every step has the same shapes and the train
step, the logprob passes and the update compile once. Group members are adjacent (row
`p * G + g` is sample g of prompt p), which is what `compute_advantages` expects.

Letters: P prompts, G samples per prompt, B = P * G rows, T positions.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tpurl.generate import Completion
from tpurl.tasks import Problem, Task


def decode(tokenizer, ids) -> str:
    """Decode generated ids; ids past the tokenizer's vocabulary (the model's vocab may be padded
    for sharding) become U+FFFD, so graders see an invalid character instead of crashing."""
    ids = [int(i) for i in ids]
    if all(i < tokenizer.vocab_size for i in ids):
        return tokenizer.decode(ids)
    return "".join(tokenizer.decode([i]) if i < tokenizer.vocab_size else "\ufffd" for i in ids)


@dataclasses.dataclass
class Rollouts:
    """A step's scored rollouts as host arrays (rows grouped by prompt)."""

    tokens: np.ndarray             # [B, T] int32
    valid: np.ndarray              # [B, T] bool
    loss_mask: np.ndarray          # [B, T] float32, 1 on generated tokens
    rollout_logprobs: np.ndarray   # [B, T] float32, the engine's logprobs at generated tokens, else 0
    rewards: np.ndarray            # [P, G] float32 totals
    components: dict[str, np.ndarray]  # name -> [P, G]
    completion_lengths: np.ndarray  # [B] int32
    finish_reasons: list[str]
    texts: list[str]
    problems: list[Problem]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_lengths.sum())


def pack_rollouts(task: Task, problems: Sequence[Problem], completions: Sequence[Sequence[Completion]],
                  seq_len: int) -> Rollouts:
    """Score `completions[p][g]` with the task and pack them into `[P*G, seq_len]` arrays."""
    tok = task.tokenizer
    num_prompts, group = len(completions), len(completions[0])
    rows = num_prompts * group
    tokens = np.full((rows, seq_len), tok.pad_id, np.int32)
    valid = np.zeros((rows, seq_len), bool)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    rollout_lp = np.zeros((rows, seq_len), np.float32)
    rewards = np.zeros((num_prompts, group), np.float32)
    comps = {name: np.zeros((num_prompts, group), np.float32) for name in task.reward_components}
    lengths = np.zeros(rows, np.int32)
    reasons, texts = [], []
    for p, (problem, group_c) in enumerate(zip(problems, completions)):
        for g, c in enumerate(group_c):
            b = p * group + g
            prompt, gen = np.asarray(c.prompt_ids), np.asarray(c.token_ids)
            n_p, n_g = len(prompt), len(gen)
            if n_p + n_g > seq_len:
                raise ValueError(f"pack_rollouts: prompt {n_p} + completion {n_g} tokens exceed the batch length "
                                 f"{seq_len}; the task's max_prompt_len / max_new_tokens are wrong")
            tokens[b, :n_p], tokens[b, n_p:n_p + n_g] = prompt, gen
            valid[b, :n_p + n_g] = True
            loss_mask[b, n_p:n_p + n_g] = 1.0
            rollout_lp[b, n_p:n_p + n_g] = c.logprobs
            text = decode(tok, gen)
            reward = task.score(problem, text, c.finish_reason)
            rewards[p, g] = reward.total
            for name in task.reward_components:
                comps[name][p, g] = reward.components[name]
            lengths[b] = n_g
            reasons.append(c.finish_reason)
            texts.append(text)
    return Rollouts(tokens=tokens, valid=valid, loss_mask=loss_mask, rollout_logprobs=rollout_lp, rewards=rewards,
                    components=comps, completion_lengths=lengths, finish_reasons=reasons, texts=texts,
                    problems=list(problems))


def sft_batch(task: Task, problems: Sequence[Problem], seq_len: int, first_index: int) -> dict[str, np.ndarray]:
    """Teacher-forcing batch `[bos, prompt, demonstration, eos]` with the loss on the
    demonstration and eos; problem i is training problem `first_index + i`."""
    tok = task.tokenizer
    tokens = np.full((len(problems), seq_len), tok.pad_id, np.int32)
    valid = np.zeros(tokens.shape, bool)
    loss_mask = np.zeros(tokens.shape, np.float32)
    for b, problem in enumerate(problems):
        prompt = task.encode_prompt(problem)
        answer = tok.encode(task.demonstration(problem, first_index + b)) + [tok.eos_id]
        n_p, n = len(prompt), len(prompt) + len(answer)
        if n > seq_len:
            raise ValueError(f"sft_batch: problem {problem.uid!r} needs {n} tokens, more than {seq_len}")
        tokens[b, :n] = prompt + answer
        valid[b, :n] = True
        loss_mask[b, n_p:n] = 1.0
    return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask}


def trajectory_records(ro: Rollouts, advantages: np.ndarray, completions: Sequence[Sequence[Completion]],
                       group_offset: int, group_ids: Sequence[int] | None = None) -> list[dict]:
    """One JSON-ready record per sequence (see `tpurl.logging.TRAJECTORY_KEYS`). `group_offset`
    makes group ids unique over the run (the data cursor of the step's first prompt); `group_ids`
    (each group's data index) replaces it when the groups are not consecutive problems (DAPO's
    dynamic sampling)."""
    group = ro.rewards.shape[1]
    out = []
    for p, (problem, group_c) in enumerate(zip(ro.problems, completions)):
        for g, c in enumerate(group_c):
            b = p * group + g
            out.append({
                "group_id": int(group_ids[p]) if group_ids is not None else group_offset + p,
                "sample_index": g, "problem_uid": problem.uid,
                "prompt": problem.prompt, "answer": problem.answer,
                "prompt_ids": np.asarray(c.prompt_ids).tolist(), "completion": ro.texts[b],
                "completion_ids": np.asarray(c.token_ids).tolist(), "finish_reason": c.finish_reason,
                "rewards": {name: float(v[p, g]) for name, v in ro.components.items()},
                "reward": float(ro.rewards[p, g]), "advantage": float(advantages[b]),
            })
    return out
