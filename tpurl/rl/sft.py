"""Supervised warm start: teacher-forced cross-entropy on the task's reference answers.

A short warm start teaches the output format and some of the skill, leaving a policy that is right
sometimes: the regime where group-relative RL has signal (a group of all-wrong samples carries
none). It uses the train layout and the same jitted machinery as the update (`make_sft_step`), its
own optimizer, and consumes the training problem stream from the data cursor, so RL continues with
problems the warm start has not seen.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from tpurl.rl.batch import sft_batch
from tpurl.rl.runtime import RLRuntime
from tpurl.tasks import train_batch


def warm_start(rt: RLRuntime, params, cursor: int, *, on_step: Callable[[int, dict[str, float]], None] | None = None,
               log_every: int = 10) -> tuple[Any, int, dict[str, float]]:
    """Run `cfg.sft.steps` SFT steps from `params`; returns `(params, cursor, last_metrics)`.
    `on_step(step, metrics)` sees every `log_every`-th step's metrics (fetching them syncs)."""
    cfg = rt.cfg.sft
    if cfg.steps == 0:
        return params, cursor, {}
    step_fn = rt.sft_step()
    state = rt.sft_state(params)
    metrics: dict[str, Any] = {}
    for i in range(cfg.steps):
        problems, next_cursor = train_batch(rt.task, cursor, cfg.batch_size)
        state, metrics = step_fn(state, sft_batch(rt.task, problems, rt.seq_len, cursor))
        cursor = next_cursor
        if on_step is not None and ((i + 1) % log_every == 0 or i + 1 == cfg.steps):
            on_step(i + 1, {f"sft/{k}": float(np.asarray(v)) for k, v in jax.device_get(metrics).items()})
    host = {f"sft/{k}": float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
    return state.params, cursor, host
