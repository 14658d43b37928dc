"""In-flight landings at chosen decode steps, for tests of `AsyncConfig(overlap="dispatch",
in_flight="continue")`: whether an update has finished before a given decode step depends on the
machine's timing, so a test pins it. `pin_landings(at)` makes the update that runs beside
the batch of step `s` count as finished at the `at[s]`-th poll of that batch (None: never, so
`load_next` loads it between the batches); at that poll it waits for the update, then asks the
real check (`InlineProducer._update_done`: `is_ready`, agreed by every process), which the polls
before it run too (their answers ignored), so the landing itself and the agreement across
processes at every poll are the real ones.

    python tests/rl/inflight_landing.py '{"1": null, "2": 3}' train --gin_file ...

runs `tpurl` with the landings pinned (the JSON maps steps to polls), in every process of a
multi-process run alike."""

import collections
import json
import sys

import jax

from tpurl.rl.inline_rollout import InlineProducer


def pin_landings(at: dict[int, int | None], set_attr=setattr) -> collections.Counter:
    """Replace `InlineProducer._update_done` (with `set_attr`, e.g. `monkeypatch.setattr`);
    returns the polls per step, counted as they happen."""
    polls, real = collections.Counter(), InlineProducer._update_done

    def update_done(self, params) -> bool:
        step = self._next  # the batch being sampled
        polls[step] += 1
        if at.get(step) is None or polls[step] < at[step]:
            real(self, params)  # the check still runs (across processes: every process agrees here)
            return False
        jax.block_until_ready(params)
        assert real(self, params), "the update was ready on this process: every process must agree"
        return True

    set_attr(InlineProducer, "_update_done", update_done)
    return polls


if __name__ == "__main__":
    from tpurl.commands.main import main

    pin_landings({int(k): v for k, v in json.loads(sys.argv[1]).items()})
    sys.exit(main(sys.argv[2:]))
