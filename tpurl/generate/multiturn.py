"""The engine's multi-turn half: detach a sequence from its slot, resume it later in a free slot.

`Engine` inherits these methods (`tpurl.generate.engine`); the pages move through the engine's
page book (`Engine.page_book`: detach, check, resume, release) and the resume program is
`extend_step` (`tpurl.generate.extend`, which says what a resume appends and where).
"""

from __future__ import annotations

from tpurl.generate.extend import Resume, extend_step, resume_rows
from tpurl.generate.page_book import Detached
from tpurl.generate.prefill import pow2_bucket
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import SamplingConfig


class MultiTurn:
    """Detach / resume for `Engine` (a mixin: every attribute it uses is the engine's)."""

    def detach(self, slot: int) -> Detached:
        """Take the sequence in `slot` out of it, keeping its pages (and so its cached positions):
        a sequence that waits for its environment needs no decode slot. The slot is free for
        another sequence from the next program on; `extend_batch` resumes the sequence in a free
        slot of the same replica, `release_detached` gives its pages back."""
        return self.page_book.detach(slot)

    def release_detached(self, seq: Detached) -> None:
        """Give a detached sequence's pages back to its pool (its episode is over)."""
        self.page_book.release_detached(seq)

    def _extend_fn(self, params, state, clear_B, tokens_BT, rows, truncate):
        self.trace_counts["extend"] += 1
        state = self._clear_slots(state, clear_B)
        return extend_step(self.graphdef, params, state, tokens_BT, rows, constrain=self._constrain,
                           sharding=self._kernel_sharding, truncate=truncate, top_n=self.config.top_logprobs)

    def extend_batch(self, params, decode_state: dict, requests: list[Resume], sampling: SamplingConfig
                     ) -> tuple[dict, ResultTokens]:
        """Resume detached sequences in free slots: append tokens to each one's pages at its
        position (the model's last sampled token, then the environment's) and sample its next
        token, all in one program (see `tpurl.generate.extend`). The slots decode from then on
        unless the sampled token ends them. Donates `decode_state`."""
        if not self.paged:
            raise ValueError("extend_batch: resuming a sequence needs the paged cache (cache='paged')")
        self.check_sampling(sampling)
        width = pow2_bucket(max(len(r.tokens) for r in requests), self.config.max_seq_len)
        tokens_BT, rows = resume_rows(requests, sampling, self.config.max_slots, width, self.shape,
                                      self.config.max_stop_tokens)
        for r in requests:
            self._check_resume(r)
        self._truncating |= sampling.truncates
        out = self._extend_jit(params, decode_state, self._clear_mask(), tokens_BT, rows, truncate=self._truncating)
        self.page_book.mark_cleared()
        for r in requests:
            self.page_book.resume(r.slot, r.seq)
        self.stats["extends"] += len(requests)
        self.stats["extend_batches"] += 1
        return out

    def _check_resume(self, r: Resume) -> None:
        try:
            self.page_book.check_resume(r.slot, r.seq)
        except ValueError as e:
            raise ValueError(f"extend_batch: {e}") from None
        capacity = len(r.seq.pages) * self.shape.page_size
        if not r.tokens or r.start < 1 or r.start + len(r.tokens) > capacity:
            raise ValueError(f"extend_batch: {len(r.tokens)} tokens at position {r.start} do not fit the sequence's "
                             f"{capacity} cached positions; the episode's token budget is exhausted")
        if min(r.tokens) < 0 or max(r.tokens) >= self.model_cfg.vocab_size:
            raise ValueError(f"extend_batch: token ids {min(r.tokens)}..{max(r.tokens)} to append are outside the model's "
                             f"vocabulary (0..{self.model_cfg.vocab_size - 1}); the environment's tokenizer is not the "
                             "model's")
        if r.remaining < 1:
            raise ValueError(f"extend_batch: the sequence has no model tokens left to generate (remaining={r.remaining})")
