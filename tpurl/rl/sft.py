"""Supervised warm start: teacher-forced cross-entropy on the task's reference answers.

A short warm start teaches the output format and some of the skill, leaving a policy that is right
sometimes: the regime where group-relative RL has signal (a group of all-wrong samples carries
none). It uses the train layout and the same jitted machinery as the update (`make_sft_step`), its
own optimizer, and consumes the training problem stream from the data cursor, so RL continues with
problems the warm start has not seen.
"""

from __future__ import annotations

from typing import Any, Callable

from tpurl.memory import freeze_heap
from tpurl.rl.batch import sft_batch
from tpurl.rl.evaluation import greedy_accuracy
from tpurl.rl.runtime import RLRuntime
from tpurl.sharding.host import to_host
from tpurl.tasks import train_batch

# Probe problems are training-stream indices far beyond any cursor, so the warm start never trains on
# those indices; they are drawn from the training distribution (never the held-out split), and in a
# small problem space (1-digit addition) the same problems also occur in the stream, so the probe
# measures training accuracy, not generalization.
PROBE_OFFSET = 1 << 40


def warm_start(rt: RLRuntime, params, cursor: int, *, on_step: Callable[[int, dict[str, float]], None] | None = None,
               log_every: int = 10) -> tuple[Any, int, dict[str, float]]:
    """Run up to `cfg.sft.steps` SFT steps from `params`, the whole model's (fewer when
    `stop_at_accuracy` is reached; a LoRA model trains its adapters, or everything with
    `SFTConfig.whole_model`); returns `(params, cursor, last_metrics)`, the whole model's. `on_step(step, metrics)` sees every `log_every`-th
    step's metrics (fetching them syncs) and every probe result."""
    cfg = rt.cfg.sft
    if cfg.steps == 0:
        return params, cursor, {}
    step_fn = rt.sft_step()
    state = rt.sft_state(params)
    probe = [rt.task.train_problem(PROBE_OFFSET + i) for i in range(cfg.probe_problems)]
    metrics: dict[str, Any] = {}
    extra: dict[str, float] = {}
    # Each probe's rollout window accounts live memory at its transitions, collecting garbage
    # first: with the start-up heap (and, after the first probe, the compiled programs) frozen,
    # that collection scans only the young objects instead of the whole heap.
    freeze_heap()
    for i in range(cfg.steps):
        problems, next_cursor = train_batch(rt.task, cursor, cfg.batch_size)
        state, metrics = step_fn(state, rt.place_batch(sft_batch(rt.task, problems, rt.seq_len, cursor)))
        cursor = next_cursor
        stop = False
        if cfg.stop_at_accuracy is not None and (i + 1) % cfg.check_every == 0:
            # The probe rolls out like RL does: synced weights, in a rollout window (colocated: the
            # warm start's optimizer state waits in host memory while the KV pool is alive).
            rt.load_rollout(state.model_state(), version=0)  # the warm start is before RL's first update
            acc, state, _ = rt.rollout.lend(lambda: greedy_accuracy(rt.rollout, probe), state)
            if i + 1 == cfg.check_every:  # the first probe compiled the last programs of the warm start
                freeze_heap()
            extra = {"sft/probe_accuracy": acc, "sft/steps_run": float(i + 1)}
            stop = acc >= cfg.stop_at_accuracy
        if on_step is not None and ((i + 1) % log_every == 0 or i + 1 == cfg.steps or stop):
            on_step(i + 1, {**{f"sft/{k}": float(v) for k, v in to_host(metrics).items()},
                            **extra})
        if stop:
            break
    host = {f"sft/{k}": float(v) for k, v in to_host(metrics).items()}
    return state.model_state(), cursor, {**host, **extra}
