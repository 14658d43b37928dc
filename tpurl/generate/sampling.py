"""Token sampling for the rollout engine: greedy, temperature, top-k, top-p, per-request seeds.

Letters: B rows (decode slots or samples of one prompt), V vocab.

Every row carries its own sampling parameters (arrays, not Python constants), so requests with
different temperatures share one compiled decode step.

**Reported logprob.** For each sampled token we report `log_softmax(logits / T)[token]`: the
log-probability under the *tempered, untruncated* distribution (T = the row's temperature; T = 0,
greedy, reports T = 1). This is what the trainer recomputes from a teacher-forced forward pass at
the same temperature; top-k / top-p only restrict which tokens can be drawn. (The probability the
truncated distribution assigned is higher by its renormalization; policy-gradient corrections use
the untruncated one because that is the distribution the trainer can evaluate.)

**Randomness.** Row b at generation step t draws one uniform from the key `fold_in(key(seed_b), t)`
and takes the token whose interval of the (tempered, truncated) CDF holds it. The key depends only
on the request's seed and the token index, never on the slot, the batch composition or whether the
prompt's pages were shared, so a request reproduces exactly wherever it is scheduled.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.config_types import check_types
from tpurl.models import invariant

# A sampling temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Below 1e-4
# sampling is greedy in all but name (a logit gap of 0.01 already gives odds of e^100) while
# logits / T head for float32 overflow (1e-300 is 0 on the device, where it silently means T = 1)
# and the update's gradients scale with 1 / T. Above 1e4 every token of any real model is equally
# likely to within 1% (logit spreads are far below 100), and past float32's range T is inf:
# uniform sampling, or NaN where a logit is -inf.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4


def temperature_problem(temperature: float, *, greedy: bool) -> str | None:
    """Why `temperature` cannot be used to sample (None when it can); 0 is allowed iff `greedy`."""
    if greedy and temperature == 0:
        return None
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        return (f"must be {'0 (greedy) or ' if greedy else ''}in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]: a "
                "smaller one is greedy in all but name and overflows logits / T, a larger one samples uniformly")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to draw tokens for one request.

    temperature: 0 means greedy (argmax); in [MIN_TEMPERATURE, MAX_TEMPERATURE] samples from
    softmax(logits / temperature).
    top_k: keep the k most likely tokens (0: no limit). top_p: keep the smallest set of most likely
    tokens whose probability reaches top_p (1.0: no limit). max_new_tokens: generation budget.
    stop_token_ids: stop after generating one of these (the stop token is included in the output).
    stop_strings: stop once the decoded completion contains one of these (needs a tokenizer).
    top_logprobs: how many of the most likely tokens to report with each sampled token (OpenAI's
    `top_logprobs`), at most the engine's `EngineConfig.top_logprobs`, which is what its programs
    compute; None (the default): all of those; 0: none. A program computes them only when one of
    its sequences reports them (`Engine.reports_top`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int | None = None

    def __post_init__(self):
        check_types(self)
        if problem := temperature_problem(self.temperature, greedy=True):
            raise ValueError(f"SamplingConfig.temperature={self.temperature} {problem}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingConfig.stop_token_ids must be non-negative ids, got {self.stop_token_ids}")
        if any(not s for s in self.stop_strings):
            raise ValueError("SamplingConfig.stop_strings must not contain the empty string")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"SamplingConfig.top_logprobs must be >= 0 (0 = none, None = the engine's), "
                             f"got {self.top_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p restricts the tokens that can be drawn."""
        return self.top_k > 0 or self.top_p < 1.0


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 32-bit seed of sample `sample_index` of prompt `prompt_index` in a run seeded `seed`.

    Derived with numpy's SeedSequence (a hash), so neighbouring requests get unrelated streams.
    """
    return int(np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(1)[0])


def tempered_logprobs(logits_BV: jax.Array, temperature_B: jax.Array, bitwise: bool = False) -> jax.Array:
    """`log_softmax(logits / T)` per row in float32; rows with T = 0 (greedy) use T = 1 (one formula
    with the trainer's bitwise mode: `tpurl.models.invariant.tempered_logprobs`)."""
    return invariant.tempered_logprobs(logits_BV, temperature_B, bitwise)


def _truncation_threshold(logp_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Per-row lowest log-probability that survives top-k and top-p (`[B]`)."""
    v = logp_BV.shape[-1]
    sorted_BV = -jnp.sort(-logp_BV, axis=-1)  # descending
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    kth_B = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)[:, 0]
    # top-p: keep token i (in sorted order) iff the mass strictly before it is < top_p; the most
    # likely token is always kept, and top_p = 1 keeps every token (a float32 running sum may
    # reach 1 before the vocabulary's last tokens: a row that does not truncate must draw as in a
    # program without truncation).
    before_BV = jnp.cumsum(jnp.exp(sorted_BV), axis=-1) - jnp.exp(sorted_BV)
    keep_BV = (before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    last_B = jnp.maximum(jnp.sum(keep_BV, axis=-1) - 1, 0)
    pth_B = jnp.take_along_axis(sorted_BV, last_B[:, None], axis=-1)[:, 0]
    return jnp.maximum(kth_B, pth_B)


def _uniforms(seeds_B: jax.Array, steps_B: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row from the row's key `fold_in(key(seed), step)`."""
    return jax.vmap(lambda seed, step: jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step)))(
        seeds_B, steps_B)


def _inverse_cdf_draw(logp_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """The first token of positive probability whose CDF reaches past `u x total` (`logp` may
    hold -inf for excluded tokens, which are never drawn).

    One uniform per row instead of one random number per vocabulary entry (Gumbel-max): the
    random bits, not the cumulative sum, dominate sampling at real vocabulary sizes. A float32
    prefix sum may round down from one entry to the next, so the CDF is read as non-decreasing
    (the running maximum of the prefix sums) and tokens of zero probability are skipped
    explicitly; a row whose threshold no allowed token passes (rounding at the very top) takes its
    most likely allowed token.

    The running maximum passes the threshold first where the prefix sum itself does (`first_B`),
    so the draw is the first token of positive probability at or after it, and the total is the
    largest prefix sum: no running-maximum pass is computed (on CPU it cost as much as the sum).
    """
    p_BV = jnp.exp(logp_BV)
    cdf_BV = jnp.cumsum(p_BV, axis=-1)
    thresh_B = u_B * jnp.max(cdf_BV, axis=-1)
    over_BV = cdf_BV > thresh_B[:, None]
    first_B = jnp.argmax(over_BV, axis=-1)
    iota_V = jnp.arange(p_BV.shape[-1], dtype=first_B.dtype)
    hit_BV = (iota_V[None, :] >= first_B[:, None]) & (p_BV > 0)
    hit_B = jnp.any(over_BV, axis=-1) & jnp.any(hit_BV, axis=-1)
    # The fallback's full-vocabulary argmax runs only when some row needs it (almost never).
    fallback_B = _argmax_if(~jnp.all(hit_B), logp_BV)
    return jnp.where(hit_B, jnp.argmax(hit_BV, axis=-1), fallback_B)


def _argmax_if(needed: jax.Array, x_BV: jax.Array) -> jax.Array:
    """`argmax(x, axis=-1)` when `needed` (a scalar bool) is true, else zeros: a full pass over the
    vocabulary that a batch which uses none of its rows skips (on CPU each such pass costs about
    as much as the log-softmax)."""
    return jax.lax.cond(needed, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
                        lambda x: jnp.zeros(x.shape[:1], jnp.int32), x_BV)


class TopLogprobs(NamedTuple):
    """The `K` most likely tokens of each row's tempered, untruncated distribution (the one the
    reported logprob is of), most likely first: ids `[B, K]` int32 and their logprobs `[B, K]`."""

    ids: jax.Array
    logprobs: jax.Array


def sample_tokens(logits_BV: jax.Array, seeds_B: jax.Array, steps_B: jax.Array, temperature_B: jax.Array,
                  top_k_B: jax.Array, top_p_B: jax.Array, *, truncate: bool = True, top_n: int = 0,
                  bitwise: bool = False) -> tuple[jax.Array, jax.Array, TopLogprobs | None]:
    """Draw one token per row; returns `(tokens_B int32, logprobs_B float32, top)`.

    `seeds_B` (uint32) and `steps_B` (int32, the index of the token being generated) form each
    row's key. The returned logprob is `log_softmax(logits / T)[token]` (see the module docstring).
    `truncate` (static): whether any row may use top-k / top-p. Without it the program has no
    vocabulary sort at all (RL never truncates); with it the sort runs only when a row truncates.
    `top_n` (static): the most likely tokens to report per row (`TopLogprobs`; 0: none, `top`
    None, and the program computes nothing for it). `bitwise`: the logprobs computed batch-invariantly
    (`ModelConfig.consistency`).
    """
    logp_BV = tempered_logprobs(logits_BV, temperature_B, bitwise)
    masked_BV = logp_BV
    if truncate:
        needs_filter = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
        # Sorting the vocabulary is the expensive part; skip it when no row truncates.
        thresh_B = jax.lax.cond(needs_filter, _truncation_threshold,
                                lambda lp, k, p: jnp.full(lp.shape[:1], -jnp.inf), logp_BV, top_k_B, top_p_B)
        masked_BV = jnp.where(logp_BV >= thresh_B[:, None], logp_BV, -jnp.inf)

    sampled_B = _inverse_cdf_draw(masked_BV, _uniforms(seeds_B, steps_B))
    greedy_B = _argmax_if(jnp.any(~(temperature_B > 0)), logits_BV)  # only for greedy rows
    tokens_B = jnp.where(temperature_B > 0, sampled_B, greedy_B).astype(jnp.int32)
    logprobs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    top = None
    if top_n > 0:
        top_lp, top_ids = jax.lax.top_k(logp_BV, min(top_n, logp_BV.shape[-1]))
        top = TopLogprobs(ids=top_ids.astype(jnp.int32), logprobs=top_lp)
    return tokens_B, logprobs_B, top
