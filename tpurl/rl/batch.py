"""From rollouts to a training batch: scoring every completion and packing fixed-shape arrays.

Each sequence is one row `[bos, prompt..., completion..., pad...]` of a fixed length `T` (the
task's longest prompt plus `max_new_tokens`), so every step has the same shapes. (With packing,
`tpurl.train.packing`, the model forwards run on fewer rows, a few row counts over a run.) Group members are adjacent (row
`p * G + g` is sample g of prompt p, with one row per episode), which is what `compute_advantages` expects.

An episode may train several sequences (an agent episode whose calls did not extend each other,
`AgentConfig.trained_sequences`): it then has S rows, row `(p * G + g) * S + s` its sequence s
(0: the one holding its last call); the rows of sequences it did not make hold no token, and
the packed update skips them. Rewards and advantages stay one per episode, every row of an
episode trains with its episode's.

Letters: P prompts, G samples per prompt, S rows per episode, B = P * G * S rows, T positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tpurl.files import to_jsonable
from tpurl.generate import Completion
from tpurl.tasks import Problem, Reward, Task
from tpurl.tasks.env import Episode, OneStep, run_finish
from tpurl.tokenizer import decode_generated as decode


@dataclasses.dataclass
class Rollouts:
    """A step's scored rollouts as host arrays: the one carrier of rollout data, from the engine's
    completions to the update batch and the trajectory log. Rows are grouped by prompt and
    episode (row `(p * G + g) * S + s` is sequence s of sample g of group p, see the module
    docstring); `take` and `concat` select and join whole groups."""

    tokens: np.ndarray             # [B, T] int32: prompt, completion, padding
    valid: np.ndarray              # [B, T] bool
    loss_mask: np.ndarray          # [B, T] float32, 1 on tokens the model sampled (not the environment's)
    rollout_logprobs: np.ndarray   # [B, T] float32, the engine's logprobs at generated tokens, else 0
    token_versions: np.ndarray     # [B, T] int32, the policy version that sampled each token, else -1
    rewards: np.ndarray            # [P, G] float32 totals
    components: dict[str, np.ndarray]  # name -> [P, G]
    prompt_lengths: np.ndarray     # [B] int32
    completion_lengths: np.ndarray  # [B] int32: every token after the prompt (model and environment)
    sampled: np.ndarray            # [B, T] bool: the tokens the model sampled (the loss mask before `without_loss`)
    finish_reasons: list[str]      # [B]
    texts: list[str]               # [B] decoded completions (environment tokens included)
    problems: list[Problem]        # [P]
    group_ids: np.ndarray          # [P] int64: each group's training-stream index (its trajectory group id)
    turns: np.ndarray              # [B] int32: model turns of each row's sequence
    infos: list[dict]              # [B] what each episode reports (tool calls, errors, ...) on its first row
    routes: np.ndarray | None = None  # [B, T, Ls, K] int16: each token's experts per sparse layer (-1: none)
    rows_per_episode: int = 1      # S

    @property
    def group_size(self) -> int:
        return self.rewards.shape[1]

    @property
    def group_rows(self) -> int:
        """Rows of one group: G * S."""
        return self.group_size * self.rows_per_episode

    @property
    def episode_rows(self) -> np.ndarray:
        """`[P * G]` each episode's first row (its last sequence's: the one that holds its final answer)."""
        return np.arange(self.num_groups * self.group_size) * self.rows_per_episode

    @property
    def used_rows(self) -> np.ndarray:
        """`[B]` bool: the rows that hold a sequence (every episode's first row, even empty)."""
        return self.valid.any(axis=1) | (np.arange(len(self.valid)) % self.rows_per_episode == 0)

    @property
    def num_groups(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens the model sampled."""
        return int(self.sampled.sum())

    def prompt_ids(self, row: int) -> np.ndarray:
        return self.tokens[row, :self.prompt_lengths[row]]

    def model_mask(self, row: int) -> np.ndarray:
        """Which completion tokens of `row` the model sampled (0/1, aligned with `completion_ids`)."""
        start = self.prompt_lengths[row]
        return self.sampled[row, start:start + self.completion_lengths[row]].astype(np.int8)

    def completion_ids(self, row: int) -> np.ndarray:
        start = self.prompt_lengths[row]
        return self.tokens[row, start:start + self.completion_lengths[row]]

    def take(self, groups) -> Rollouts:
        """The groups `groups` (indices or a `[P]` bool mask), in that order."""
        sel = np.asarray(groups)
        idx = np.flatnonzero(sel) if sel.dtype == bool else sel.astype(np.int64).reshape(-1)
        g = self.group_rows
        rows = (idx[:, None] * g + np.arange(g)).reshape(-1)
        return Rollouts(
            tokens=self.tokens[rows], valid=self.valid[rows], loss_mask=self.loss_mask[rows],
            rollout_logprobs=self.rollout_logprobs[rows], token_versions=self.token_versions[rows],
            rewards=self.rewards[idx],
            components={k: v[idx] for k, v in self.components.items()}, prompt_lengths=self.prompt_lengths[rows],
            completion_lengths=self.completion_lengths[rows], sampled=self.sampled[rows],
            finish_reasons=[self.finish_reasons[r] for r in rows], texts=[self.texts[r] for r in rows],
            problems=[self.problems[i] for i in idx], group_ids=self.group_ids[idx], turns=self.turns[rows],
            infos=[self.infos[r] for r in rows], routes=None if self.routes is None else self.routes[rows],
            rows_per_episode=self.rows_per_episode)

    @staticmethod
    def concat(parts: Sequence[Rollouts]) -> Rollouts:
        """The groups of `parts`, one after the other (same group size, length and components)."""
        if not parts:
            raise ValueError("Rollouts.concat: nothing to concatenate")
        first = parts[0]
        for ro in parts[1:]:
            if ro.tokens.shape[1:] != first.tokens.shape[1:] or ro.group_rows != first.group_rows \
                    or ro.group_size != first.group_size or set(ro.components) != set(first.components):
                raise ValueError("Rollouts.concat: the parts differ in length, group size, rows per episode or "
                                 "reward components")

        def cat(name):
            return np.concatenate([getattr(ro, name) for ro in parts], axis=0)

        return Rollouts(
            tokens=cat("tokens"), valid=cat("valid"), loss_mask=cat("loss_mask"),
            rollout_logprobs=cat("rollout_logprobs"), token_versions=cat("token_versions"), rewards=cat("rewards"),
            components={k: np.concatenate([ro.components[k] for ro in parts]) for k in first.components},
            prompt_lengths=cat("prompt_lengths"), completion_lengths=cat("completion_lengths"),
            sampled=cat("sampled"), finish_reasons=[r for ro in parts for r in ro.finish_reasons],
            texts=[t for ro in parts for t in ro.texts], problems=[p for ro in parts for p in ro.problems],
            group_ids=cat("group_ids"), turns=cat("turns"), infos=[i for ro in parts for i in ro.infos],
            routes=None if first.routes is None else cat("routes"),  # parts of one run: all or none
            rows_per_episode=first.rows_per_episode)

    def without_loss(self) -> Rollouts:
        """The same groups with the loss mask zeroed: they keep a batch's shape but train nothing."""
        return dataclasses.replace(self, loss_mask=np.zeros_like(self.loss_mask))


def pack_rollouts(task: Task, problems: Sequence[Problem], completions: Sequence[Sequence[Completion]],
                  seq_len: int, group_ids: Sequence[int] | None = None,
                  episodes: Sequence[Sequence[Episode]] | None = None,
                  on_writer: Callable[[Callable[[], Mapping[str, Any]]], dict] | None = None, *,
                  rows_per_episode: int = 1, row_infos: Sequence[Sequence[dict | None]] | None = None) -> Rollouts:
    """Grade `completions[p][g]` and pack them into `[P*G*S, seq_len]` arrays. `episodes[p][g]`
    grades each (a multi-turn environment's episodes; default: the task's one-step episodes, i.e.
    `task.score`); `group_ids` (default `0..P-1`) are the groups' training-stream indices.
    `on_writer(fn)`: runs the grading on one process and returns its result on every process (a
    multi-process run, `tpurl.sharding.host.on_writer`: a sandbox's time limits or a tool's
    output could differ between processes, their batches must not); default: here. The episodes'
    infos come back as plain JSON values (`tpurl.files.to_jsonable`).

    `rows_per_episode` = S > 1: `completions[p]` holds S rows per episode (`[g * S + s]`, see the
    module docstring) and `episodes[p][g]` grades episode g on its first row; `row_infos[p][r]`
    is the info of row r of group p that is not an episode's first (its episode's info is)."""
    num_prompts, group = len(completions), len(completions[0]) // rows_per_episode
    rows = num_prompts * group * rows_per_episode
    out = {"tokens": np.full((rows, seq_len), task.tokenizer.pad_id, np.int32), "valid": np.zeros((rows, seq_len), bool),
           "loss_mask": np.zeros((rows, seq_len), np.float32), "rollout_logprobs": np.zeros((rows, seq_len), np.float32),
           "token_versions": np.full((rows, seq_len), -1, np.int32),
           "prompt_lengths": np.zeros(rows, np.int32), "completion_lengths": np.zeros(rows, np.int32),
           "sampled": np.zeros((rows, seq_len), bool), "turns": np.ones(rows, np.int32)}
    flat = [(problem, c) for problem, group_c in zip(problems, completions) for c in group_c]
    with_routes = {c.routes is not None for _, c in flat}
    if len(with_routes) > 1:
        raise ValueError("pack_rollouts: some completions carry router-replay routes and others do not; the "
                         "engine records them for every sequence of a router-replay model")
    if with_routes == {True}:  # router replay: each token's experts, -1 on padding
        out["routes"] = np.full((rows, seq_len, *flat[0][1].routes.shape[1:]), -1, np.int16)
    for b, (_, c) in enumerate(flat):
        _pack_row(out, b, c, seq_len)
    texts = [decode(task.tokenizer, c.token_ids) for _, c in flat]
    if episodes is None:
        episodes = [[OneStep(task, problem) for _ in range(group)] for problem in problems]
    flat_episodes = [e for group_e in episodes for e in group_e]
    firsts = slice(None, None, rows_per_episode)  # each episode's first row

    def grade() -> dict[str, list]:
        graded = _grade(task, flat[firsts], texts[firsts], flat_episodes)
        return {"totals": [float(r.total) for r in graded],
                "components": [{n: float(r.components[n]) for n in task.reward_components} for r in graded],
                "infos": [to_jsonable(dict(e.info)) for e in flat_episodes]}
    graded = grade() if on_writer is None else on_writer(grade)
    rewards = np.asarray(graded["totals"], np.float32).reshape(num_prompts, group)
    comps = {name: np.asarray([c[name] for c in graded["components"]], np.float32).reshape(num_prompts, group)
             for name in task.reward_components}
    reasons = [c.finish_reason for _, c in flat]
    infos = [{} for _ in range(rows)] if row_infos is None else [to_jsonable(i) for row in row_infos for i in row]
    infos[firsts] = graded["infos"]
    ids = np.arange(num_prompts) if group_ids is None else np.asarray(group_ids, np.int64)
    return Rollouts(**out, rewards=rewards, components=comps, finish_reasons=reasons, texts=texts,
                    problems=list(problems), group_ids=ids.astype(np.int64), infos=infos,
                    rows_per_episode=rows_per_episode)


def _grade(task: Task, flat: list[tuple[Problem, Completion]], texts: list[str], episodes: list[Episode]
           ) -> list[Reward]:
    """Every completion's reward: a single-turn task that grades in batches (`score_batch`, e.g. the
    code task's concurrent sandbox runs) grades them all at once; otherwise each episode grades its
    own transcript. A grader that raises gives its samples zero reward, recorded in their info."""
    if hasattr(task, "score_batch") and all(isinstance(e, OneStep) for e in episodes):
        try:
            rewards = task.score_batch([p for p, _ in flat], texts, [c.finish_reason for _, c in flat])
        except Exception as e:  # a grader's failure is those samples', not the run's
            for episode in episodes:
                episode.info["error"] = f"score_batch: {type(e).__name__}: {e}"
            return [Reward(components={n: 0.0 for n in task.reward_components}, total=0.0) for _ in flat]
        for episode, reward in zip(episodes, rewards):
            if reward.error is not None:
                episode.info["error"] = reward.error
        return rewards
    return [run_finish(e, task.reward_components, text, c.finish_reason)
            for e, text, (_, c) in zip(episodes, texts, flat)]


def _pack_row(out: dict[str, np.ndarray], b: int, c: Completion, seq_len: int) -> None:
    """Row `b` of the packed arrays: `[prompt, completion, padding]`, the loss on the model's tokens."""
    prompt, gen = np.asarray(c.prompt_ids), np.asarray(c.token_ids)
    n_p, n_g = len(prompt), len(gen)
    if n_p + n_g > seq_len:
        raise ValueError(f"pack_rollouts: prompt {n_p} + completion {n_g} tokens exceed the batch length "
                         f"{seq_len}; the task's max_prompt_len / max_new_tokens are wrong")
    out["tokens"][b, :n_p], out["tokens"][b, n_p:n_p + n_g] = prompt, gen
    out["valid"][b, :n_p + n_g] = True
    out["sampled"][b, n_p:n_p + n_g] = c.model_mask
    out["loss_mask"][b, n_p:n_p + n_g] = c.model_mask
    out["rollout_logprobs"][b, n_p:n_p + n_g] = np.where(c.model_mask, c.logprobs, 0.0)
    out["token_versions"][b, n_p:n_p + n_g] = np.where(c.model_mask, c.versions, -1)
    out["prompt_lengths"][b], out["completion_lengths"][b] = n_p, n_g
    out["turns"][b] = c.turns
    if "routes" in out and n_p + n_g:
        out["routes"][b, :n_p + n_g] = c.routes


def sft_batch(task: Task, problems: Sequence[Problem], seq_len: int, first_index: int) -> dict[str, np.ndarray]:
    """Teacher-forcing batch `[bos, prompt, demonstration, eos]` with the loss on the
    demonstration and eos; problem i is training problem `first_index + i`."""
    tok = task.tokenizer
    tokens = np.full((len(problems), seq_len), tok.pad_id, np.int32)
    valid = np.zeros(tokens.shape, bool)
    loss_mask = np.zeros(tokens.shape, np.float32)
    for b, problem in enumerate(problems):
        demo = task.demonstration(problem, first_index + b)
        # A multi-turn demonstration is `(text, the model's?)` segments: the environment's are not trained on.
        ids, mask = list(task.encode_prompt(problem)), [0.0] * len(task.encode_prompt(problem))
        for text, own in ([(demo, True)] if isinstance(demo, str) else demo):
            piece = tok.encode(text)
            ids, mask = ids + piece, mask + [float(own)] * len(piece)
        ids, mask = ids + [tok.eos_id], mask + [1.0]
        if len(ids) > seq_len:
            raise ValueError(f"sft_batch: problem {problem.uid!r} needs {len(ids)} tokens, more than {seq_len}")
        tokens[b, :len(ids)], valid[b, :len(ids)], loss_mask[b, :len(ids)] = ids, True, mask
    return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask}


def sampling_versions(ro: Rollouts) -> np.ndarray:
    """`[B]` the oldest policy version that sampled a token of each sequence (-1: none sampled)."""
    versions = np.where(ro.sampled, ro.token_versions, np.iinfo(np.int32).max).min(axis=1)
    return np.where(ro.sampled.any(axis=1), versions, -1)


def trajectory_records(ro: Rollouts, advantages: np.ndarray) -> list[dict]:
    """One JSON-ready record per sequence (see `tpurl.logging.TRAJECTORY_KEYS`), from the rollouts
    alone (an episode's rows without a sequence have none); `advantages` is `[B]` (one per row). A
    sequence the model sampled tokens of records the oldest policy version that sampled one
    (`policy_version`); with a router replay, `routes` holds every token's experts per sparse layer."""
    versions = sampling_versions(ro)
    out = []
    for b in np.flatnonzero(ro.used_rows):
        p, g = divmod(int(b) // ro.rows_per_episode, ro.group_size)
        problem = ro.problems[p]
        out.append({
            **({"policy_version": int(versions[b])} if versions[b] >= 0 else {}),
            "group_id": int(ro.group_ids[p]), "sample_index": g, "problem_uid": problem.uid,
            "prompt": problem.prompt, "answer": problem.answer,
            "prompt_ids": ro.prompt_ids(b).tolist(), "completion": ro.texts[b],
            "completion_ids": ro.completion_ids(b).tolist(), "finish_reason": ro.finish_reasons[b],
            "rewards": {name: float(v[p, g]) for name, v in ro.components.items()},
            "reward": float(ro.rewards[p, g]), "advantage": float(advantages[b]),
            "turns": int(ro.turns[b]), "model_mask": ro.model_mask(b).tolist(), "info": ro.infos[b],
            # Router replay: every token's experts per sparse layer ([prompt + completion, Ls, K], -1:
            # none), as an array: only the records the trajectory log samples become JSON lists.
            **({} if ro.routes is None else
               {"routes": ro.routes[b, :ro.prompt_lengths[b] + ro.completion_lengths[b]]}),
        })
    return out
