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
    """A step's scored rollouts as host arrays: the one carrier of rollout data, from the engine's
    completions to the update batch and the trajectory log. Rows are grouped by prompt (row
    `p * G + g` is sample g of group p); `take` and `concat` select and join whole groups."""

    tokens: np.ndarray             # [B, T] int32: prompt, completion, padding
    valid: np.ndarray              # [B, T] bool
    loss_mask: np.ndarray          # [B, T] float32, 1 on generated tokens
    rollout_logprobs: np.ndarray   # [B, T] float32, the engine's logprobs at generated tokens, else 0
    rewards: np.ndarray            # [P, G] float32 totals
    components: dict[str, np.ndarray]  # name -> [P, G]
    prompt_lengths: np.ndarray     # [B] int32
    completion_lengths: np.ndarray  # [B] int32
    finish_reasons: list[str]      # [B]
    texts: list[str]               # [B] decoded completions
    problems: list[Problem]        # [P]
    group_ids: np.ndarray          # [P] int64: each group's training-stream index (its trajectory group id)

    @property
    def group_size(self) -> int:
        return self.rewards.shape[1]

    @property
    def num_groups(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_lengths.sum())

    def prompt_ids(self, row: int) -> np.ndarray:
        return self.tokens[row, :self.prompt_lengths[row]]

    def completion_ids(self, row: int) -> np.ndarray:
        start = self.prompt_lengths[row]
        return self.tokens[row, start:start + self.completion_lengths[row]]

    def take(self, groups) -> Rollouts:
        """The groups `groups` (indices or a `[P]` bool mask), in that order."""
        sel = np.asarray(groups)
        idx = np.flatnonzero(sel) if sel.dtype == bool else sel.astype(np.int64).reshape(-1)
        g = self.group_size
        rows = (idx[:, None] * g + np.arange(g)).reshape(-1)
        return Rollouts(
            tokens=self.tokens[rows], valid=self.valid[rows], loss_mask=self.loss_mask[rows],
            rollout_logprobs=self.rollout_logprobs[rows], rewards=self.rewards[idx],
            components={k: v[idx] for k, v in self.components.items()}, prompt_lengths=self.prompt_lengths[rows],
            completion_lengths=self.completion_lengths[rows], finish_reasons=[self.finish_reasons[r] for r in rows],
            texts=[self.texts[r] for r in rows], problems=[self.problems[i] for i in idx],
            group_ids=self.group_ids[idx])

    @staticmethod
    def concat(parts: Sequence[Rollouts]) -> Rollouts:
        """The groups of `parts`, one after the other (same group size, length and components)."""
        if not parts:
            raise ValueError("Rollouts.concat: nothing to concatenate")
        first = parts[0]
        for ro in parts[1:]:
            if ro.tokens.shape[1:] != first.tokens.shape[1:] or ro.group_size != first.group_size \
                    or set(ro.components) != set(first.components):
                raise ValueError("Rollouts.concat: the parts differ in length, group size or reward components")

        def cat(name):
            return np.concatenate([getattr(ro, name) for ro in parts], axis=0)

        return Rollouts(
            tokens=cat("tokens"), valid=cat("valid"), loss_mask=cat("loss_mask"),
            rollout_logprobs=cat("rollout_logprobs"), rewards=cat("rewards"),
            components={k: np.concatenate([ro.components[k] for ro in parts]) for k in first.components},
            prompt_lengths=cat("prompt_lengths"), completion_lengths=cat("completion_lengths"),
            finish_reasons=[r for ro in parts for r in ro.finish_reasons], texts=[t for ro in parts for t in ro.texts],
            problems=[p for ro in parts for p in ro.problems], group_ids=cat("group_ids"))

    def without_loss(self) -> Rollouts:
        """The same groups with the loss mask zeroed: they keep a batch's shape but train nothing."""
        return dataclasses.replace(self, loss_mask=np.zeros_like(self.loss_mask))


def pack_rollouts(task: Task, problems: Sequence[Problem], completions: Sequence[Sequence[Completion]],
                  seq_len: int, group_ids: Sequence[int] | None = None) -> Rollouts:
    """Score `completions[p][g]` with the task and pack them into `[P*G, seq_len]` arrays;
    `group_ids` (default `0..P-1`) are the groups' training-stream indices."""
    tok = task.tokenizer
    num_prompts, group = len(completions), len(completions[0])
    rows = num_prompts * group
    tokens = np.full((rows, seq_len), tok.pad_id, np.int32)
    valid = np.zeros((rows, seq_len), bool)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    rollout_lp = np.zeros((rows, seq_len), np.float32)
    rewards = np.zeros((num_prompts, group), np.float32)
    comps = {name: np.zeros((num_prompts, group), np.float32) for name in task.reward_components}
    prompt_lengths = np.zeros(rows, np.int32)
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
            prompt_lengths[b], lengths[b] = n_p, n_g
            reasons.append(c.finish_reason)
            texts.append(text)
    ids = np.arange(num_prompts) if group_ids is None else np.asarray(group_ids, np.int64)
    return Rollouts(tokens=tokens, valid=valid, loss_mask=loss_mask, rollout_logprobs=rollout_lp, rewards=rewards,
                    components=comps, prompt_lengths=prompt_lengths, completion_lengths=lengths,
                    finish_reasons=reasons, texts=texts, problems=list(problems),
                    group_ids=ids.astype(np.int64))


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


def trajectory_records(ro: Rollouts, advantages: np.ndarray) -> list[dict]:
    """One JSON-ready record per sequence (see `tpurl.logging.TRAJECTORY_KEYS`), from the rollouts
    alone; `advantages` is `[B]` (one per sequence)."""
    out = []
    for b in range(ro.num_groups * ro.group_size):
        p, g = divmod(b, ro.group_size)
        problem = ro.problems[p]
        out.append({
            "group_id": int(ro.group_ids[p]), "sample_index": g, "problem_uid": problem.uid,
            "prompt": problem.prompt, "answer": problem.answer,
            "prompt_ids": ro.prompt_ids(b).tolist(), "completion": ro.texts[b],
            "completion_ids": ro.completion_ids(b).tolist(), "finish_reason": ro.finish_reasons[b],
            "rewards": {name: float(v[p, g]) for name, v in ro.components.items()},
            "reward": float(ro.rewards[p, g]), "advantage": float(advantages[b]),
        })
    return out
