"""Decode steps over the slots in use only: an RL rollout's long tail without the finished slots.

A rollout admits a whole batch at once and its sequences finish at different lengths: halfway
through, most slots may be idle while the longest completions still decode. A full-width decode
step computes every slot anyway. With a paged cache the per-slot decode state is small (next
token, length, sampling settings, page table) and the KV lives in a pool addressed by page ids, so
a step can gather the slots in use into a narrower batch, decode them against the same pool, and
scatter their new state back: the KV writes land in the same pages, and each slot samples from its
own seed and step, so the tokens are those of the full-width step (up to the rounding of matmuls
at another batch size).

The widths are `max_slots` times 1, 3/4, 1/2, 3/8, 1/4, 3/16 and 1/8 (the whole numbers among
them), `EngineConfig.decode_buckets` sizes at most, so a run compiles at most that many decode
programs; a step runs at the smallest that holds every slot in use (finished slots not yet freed
count: their `active` flag keeps them still), padded with free slots, which are inactive and change
nothing. Steps of 3/4 and 2/3 rather than halves (from 16 slots up; halves below): with an RL
batch's geometric tail of lengths, halving widths run ~1.4x the slots in use on average, these
~1.2x (a 16 x 8 rollout of 128 new tokens of `scripts/bench_vs_trl.py`'s model: 15% fewer
slot-steps and ~10% less time).

Letters: B decode slots, N slots of a narrowed step, M max pages per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.generate.protocol import ResultTokens


# The widths' ladder: max_slots times 1, 3/4, 1/2, 3/8, 1/4, 3/16, 1/8, as (multiplier, halvings).
_LADDER = ((1, 0), (3, 2), (1, 1), (3, 3), (1, 2), (3, 4), (1, 3))
# Below this many slots a decode step costs about the same whatever its width (dispatch and the
# weights' read dominate), so the 3/4 steps between halvings are not worth a compilation there.
MIN_FINE_WIDTH = 16


def decode_widths(max_slots: int, buckets: int) -> tuple[int, ...]:
    """The decode batch sizes compiled: the whole numbers among `max_slots` times 1, 3/4, 1/2,
    3/8, 1/4, 3/16 and 1/8 (the 3/4 steps only from `MIN_FINE_WIDTH` slots up), `buckets` of
    them at most, largest first."""
    widths = []
    for mult, shift in _LADDER:
        num = mult * max_slots
        if num % (1 << shift) == 0 and num >> shift >= (MIN_FINE_WIDTH if mult == 3 else 1):
            widths.append(num >> shift)
    return tuple(widths[:buckets])


def step_rows(in_use: list[int], max_slots: int, widths: tuple[int, ...]) -> np.ndarray | None:
    """The slots a step decodes: the slots in use, padded with free ones to the narrowest width
    that holds them (sorted, distinct); None for a full-width step."""
    n = min((w for w in widths if w >= len(in_use)), default=max_slots)
    if n >= max_slots:
        return None
    used = set(in_use)
    free = [s for s in range(max_slots) if s not in used][:n - len(in_use)]
    return np.asarray(sorted(list(in_use) + free), np.int32)


class Narrowing:
    """The host side of narrowed steps: the widths compiled (1 width: never narrowed) and the slots
    each step runs, on device (sent again only when they change, not at most steps)."""

    def __init__(self, max_slots: int, buckets: int, sharding):
        self.max_slots, self.widths, self.sharding = max_slots, decode_widths(max_slots, buckets), sharding
        self._sent: tuple[bytes | None, jax.Array | None] = (None, None)

    def extend_rows(self, resumed: list[int]) -> np.ndarray | None:
        """The slots an extend program runs: the `resumed` ones, padded to the power of two that
        holds them (an extend runs several tokens per slot, and most resume one or two slots: a
        narrower program is worth its compilation); None for full width, or never narrowed."""
        if len(self.widths) == 1:
            return None
        return step_rows(resumed, self.max_slots, tuple(1 << i for i in range(self.max_slots.bit_length())))

    def rows(self, in_use: list[int]) -> jax.Array | None:
        """The slots the next step runs (see `step_rows`), on device; None for a full-width step.
        `in_use`: the slots that hold a sequence (`PageBook.used_slots`)."""
        if len(self.widths) == 1:
            return None
        rows = step_rows(in_use, self.max_slots, self.widths)
        if rows is None:
            return None
        if self._sent[0] != rows.tobytes():
            self._sent = (rows.tobytes(), jax.device_put(rows, self.sharding))
        return self._sent[1]


def gather_slots(state: dict, rows_N: jax.Array, fields) -> dict:
    """The decode state of slots `rows_N` only (per-slot `fields` gathered; the pool shared)."""
    return {name: (value[rows_N] if name in fields else value) for name, value in state.items()}


def scatter_slots(state: dict, narrow: dict, rows_N: jax.Array, fields) -> dict:
    """`state` with slots `rows_N` replaced by a narrowed step's new state (and its pool)."""
    return {name: (state[name].at[rows_N].set(value) if name in fields else value) for name, value in narrow.items()}


def widen_result(result: ResultTokens, rows_N: jax.Array, max_slots: int) -> ResultTokens:
    """A narrowed step's results at their slots of a full-width `[B]` result (other slots: not
    valid, zeros)."""
    def widen(x):
        return jnp.zeros((max_slots,) + x.shape[1:], x.dtype).at[rows_N].set(x)

    return ResultTokens(*(jax.tree.map(widen, x) for x in result))
