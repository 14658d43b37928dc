"""Bring your own agent: a task whose episode is a user's agent function, named by import path.

    tpurl.TaskConfig.name = "agent"
    tpurl.AgentConfig.agent = "my_pkg.agents:solve"     # async def solve(client, problem) -> reward
    tpurl.AgentConfig.source = "calculator"             # whose problems (and tokenizer) the agent gets

The problems, the held-out split, the tokenizer and the warm start's demonstrations are those of
the `source` task (configured in its own field of `TaskConfig`, e.g. `TaskConfig.calculator`); the
reward is what the agent returns (`tpurl.serve.agents`): a number (the component `reward`) or
named components, weighted by `reward_weights`. A component the agent leaves out counts 0, one it
adds that `reward_weights` does not name is an error of that episode.

Each rollout runs every episode's agent against an OpenAI-compatible endpoint on the rollout
engine, bound to the current policy (`tpurl.serve.agents.run_agents`), and trains on what the
endpoint saw, token for token (`tpurl.serve.sessions`; with router replay, with the experts that
routed every token). The endpoint samples every call at the rollout's own sampling (the
algorithm's temperature, untruncated; greedy for evaluation) and seeds (derived from the step's
seed, the episode and the call), whatever the agent asks: the trainer's logprobs are of that
distribution, and a rerun samples the same tokens (up to float rounding where a call resumes its
session's KV pages in one run and is prefilled in the other, `tpurl.generate.session_cache`). An episode's context
(its first prompt and every token after it) is at most `max_prompt_tokens + max_new_tokens`, the
batch's row length: a call that would pass it gets a 400 error, which the agent sees.

**Which sequences train** (`trained_sequences`). Calls that extend each other token for token make
one sequence (the common case: an agent that sends back the conversation so far, with a chat
template that renders earlier turns as they were sampled). When an episode's calls make several
(a template that re-renders an earlier turn differently, an agent that rewrote its history, a
call with `n` > 1), its last `trained_sequences` sequences train, latest first (ordered by the
last call each holds): each is a row of its own in the update batch, and every one of them trains
with the episode's reward (its group-relative advantage; a KL in the reward takes the KL of all of
them from it; to the loss its rows are one sequence: aggregation, GSPO's ratio, sequence-level
corrections). Since each sampled
token belongs to one sequence, an episode whose sequences all train has every token it sampled
trained once, with the weight it would have in one row. With the default 1 only the context the final
answer came from trains; the others' calls are still in the trajectory log, and their count in
`info.agent.sequences` (each row's `info.agent.trained_sequence` says which it holds). The batch
has `trained_sequences` rows per episode (rows an episode has no sequence for hold no token: the
packed update skips them, the unpacked one computes on them). An episode without a call, whose
agent failed, or whose reward names a component `reward_weights` does not, trains nothing (its
first row holds the prompt alone) and its reward is 0.

`processes` = k >= 1 runs the agents in k worker processes of their own, off the trainer's
interpreter lock (`tpurl.serve.agent_loop`); 0, on a thread of the trainer's process.

Across processes the endpoint and the agents run on process 0; every process runs the engine's
batch with process 0's requests (`tpurl.generate.lockstep`) and packs process 0's sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from tpurl.config_types import check_types
from tpurl.generate.records import Completion, completion_fields, completion_from_fields
from tpurl.serve.agent_loop import AgentLimits, check_limits
from tpurl.tasks.base import Problem, Reward
from tpurl.tasks.imports import import_object, is_import_path
from tpurl.tasks.reward_fn import check_reward_weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """The `agent` task (see the module docstring)."""

    agent: str | None = None
    source: str = "addition"
    reward_weights: tuple[tuple[str, float], ...] = (("reward", 1.0),)
    max_prompt_tokens: int = 64
    max_new_tokens: int = 64
    concurrency: int = 32
    timeout_s: float = 300.0
    processes: int = 0
    trained_sequences: int = 1
    model_name: str = "policy"

    def __post_init__(self):
        if isinstance(self.reward_weights, Mapping):  # gin's dict, kept in order as pairs
            object.__setattr__(self, "reward_weights", tuple(self.reward_weights.items()))
        check_types(self)
        object.__setattr__(self, "reward_weights", tuple(tuple(p) for p in self.reward_weights))
        if self.agent is not None and not is_import_path(self.agent):
            raise ValueError(f"AgentConfig.agent={self.agent!r} is not an import path; write 'package.module:function'")
        if self.source == "agent":
            raise ValueError("AgentConfig.source='agent': name the task whose problems the agent solves")
        check_reward_weights(self.reward_weights, "AgentConfig.reward_weights")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError(f"AgentConfig: need max_prompt_tokens >= 1 and max_new_tokens >= 1, got "
                             f"{self.max_prompt_tokens}, {self.max_new_tokens}")
        check_limits(self, "AgentConfig")
        if not 1 <= self.trained_sequences <= 64:
            raise ValueError(f"AgentConfig.trained_sequences={self.trained_sequences}: need 1 (the sequence of the "
                             "final answer) to 64 (an episode's last sequences, each a row of the batch)")


class AgentTask:
    """The source task's problems, solved by the user's agent (see the module docstring)."""

    name = "agent"

    def __init__(self, cfg: AgentConfig, source):
        if cfg.agent is None:
            raise ValueError("TaskConfig.name='agent' needs AgentConfig.agent, e.g. 'my_pkg.agents:solve'")
        self.cfg, self.source = cfg, source
        self.agent = import_object(cfg.agent, "AgentConfig.agent")
        if not callable(self.agent):
            raise ValueError(f"AgentConfig.agent={cfg.agent!r} is a {type(self.agent).__name__}; name an async "
                             "function of (client, problem)")
        self.weights = dict(cfg.reward_weights)
        self.version = f"agent-v1/{source.version}"

    @property
    def tokenizer(self):
        return self.source.tokenizer

    @property
    def reward_components(self) -> tuple[str, ...]:
        return tuple(self.weights)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ()

    @property
    def limits(self) -> AgentLimits:
        """How the agents run (`concurrency`, `timeout_s`, `processes`)."""
        return AgentLimits(concurrency=self.cfg.concurrency, timeout_s=self.cfg.timeout_s, processes=self.cfg.processes)

    @property
    def rows_per_episode(self) -> int:
        """An episode's rows in the update batch (`tpurl.rl.batch`)."""
        return self.cfg.trained_sequences

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens

    @property
    def max_prompt_len(self) -> int:
        return self.cfg.max_prompt_tokens

    def encode_prompt(self, problem: Problem) -> list[int]:
        return self.source.encode_prompt(problem)

    def train_problem(self, index: int) -> Problem:
        return self.source.train_problem(index)

    def eval_problems(self) -> Sequence[Problem]:
        return self.source.eval_problems()

    def demonstration(self, problem: Problem, index: int):
        return self.source.demonstration(problem, index)

    def data_report(self) -> list[str]:
        return self.source.data_report()

    @property
    def data_files(self) -> tuple[str, ...]:
        return self.source.data_files

    def describe(self) -> dict[str, Any]:
        source = dict(self.source.describe()) if hasattr(self.source, "describe") else {"name": self.source.name}
        return {"name": self.name, "agent": self.cfg.agent, "source": source, "reward_weights": self.weights,
                "max_prompt_tokens": self.cfg.max_prompt_tokens, "max_new_tokens": self.cfg.max_new_tokens,
                "trained_sequences": self.cfg.trained_sequences}

    def reward(self, components: Mapping[str, float] | None, error: str | None) -> Reward:
        """The episode's `Reward` from the agent's components (None: it failed)."""
        if components is not None and (extra := sorted(set(components) - set(self.weights))):
            components, error = None, (f"the agent's reward names {extra}, which AgentConfig.reward_weights="
                                       f"{self.weights} does not")
        comps = {n: float((components or {}).get(n, 0.0)) for n in self.weights}
        return Reward(components=comps, total=sum(self.weights[n] * v for n, v in comps.items()), error=error)


def is_agent_task(task) -> bool:
    return isinstance(task, AgentTask)


class AgentOutcome:
    """One agent episode as `pack_rollouts` grades it: its reward is known already (the agent's),
    its info is what the trajectory log keeps of it (calls, sequences, error, seconds)."""

    def __init__(self, reward: Reward, info: dict[str, Any]):
        self._reward, self.info = reward, info

    def observe(self, turn_ids, turn_text):  # never asked: the endpoint ran the turns
        return None

    def finish(self, text: str, finish_reason: str) -> Reward:
        return self._reward


def agent_rollouts(task: AgentTask, problems: Sequence[Problem], episodes, on_writer=None,
                   route_shape: tuple[int, int] | None = None):
    """`(completions, outcomes, row_infos)` of `episodes[problem][sample]`
    (`tpurl.serve.agents.AgentEpisode`): each episode's `rows_per_episode` rows to pack
    (`completions[problem][sample * S + s]`: its last sequences, latest first, see the module
    docstring), its outcome to grade, and the infos of its rows past the first.
    `on_writer(fn)`: a multi-process run's, where process 0 alone ran the agents: every process
    gets its rows (the outcomes are graded there too, `pack_rollouts`). `route_shape`: the
    engine's (router replay, `Engine.route_shape`), for the rows without a sequence."""
    completions, outcomes, row_infos = _rollouts(task, problems, episodes, route_shape)
    if on_writer is None:
        return completions, outcomes, row_infos
    shared = on_writer(lambda: {"rows": [[completion_fields(c) for c in row] for row in completions],
                                "infos": row_infos})
    completions = [[completion_from_fields(fields, i, j // task.rows_per_episode) for j, fields in enumerate(row)]
                   for i, row in enumerate(shared["rows"])]
    return completions, outcomes, shared["infos"]


def _rollouts(task: AgentTask, problems: Sequence[Problem], episodes, route_shape):
    completions, outcomes, row_infos = [], [], []
    for i, (problem, row) in enumerate(zip(problems, episodes)):
        completions.append([])
        outcomes.append([])
        row_infos.append([])
        for j, episode in enumerate(row):
            reward = task.reward(episode.reward, episode.error)  # its error goes to the info when graded
            seqs = episode.sequences if reward.error is None else []
            # Latest first: by the episode's last call each holds (the first of its choices on a tie).
            trained = sorted(range(len(seqs)), key=lambda k: (-seqs[k].calls[-1], k))[:task.rows_per_episode]
            for s in range(task.rows_per_episode):
                if s < len(trained):
                    completions[-1].append(seqs[trained[s]].completion(i, j))
                else:  # the first row of an episode without a sequence holds its prompt, the others nothing
                    prompt = task.encode_prompt(problem) if s == 0 else []
                    completions[-1].append(_no_sequence(prompt, i, j, route_shape))
                row_infos[-1].append({"agent": {"trained_sequence": trained[s]}} if 0 < s < len(trained) else {})
            info = {"agent": {"calls": [c.log() for c in episode.calls], "seconds": round(episode.seconds, 3),
                              "sequences": len(episode.sequences),
                              "trained_sequence": trained[0] if trained else None}}
            outcomes[-1].append(AgentOutcome(reward, info))
    return completions, outcomes, row_infos


def _no_sequence(prompt: list[int], i: int, j: int, route_shape) -> Completion:
    """A row that trains nothing: `prompt` alone (an episode's first row) or no token."""
    prompt = np.asarray(prompt, np.int32)
    routes = None if route_shape is None else np.full((len(prompt), *route_shape), -1, np.int16)
    return Completion(prompt_ids=prompt, token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                      finish_reason="stop", prompt_index=i, sample_index=j, model_mask=np.zeros(0, bool), turns=0,
                      routes=routes)
