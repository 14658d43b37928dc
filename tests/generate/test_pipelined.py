"""The pipelined decode (`tpurl.generate.scheduler`): step k+1 is dispatched before step k is read.

Reference: the same `generate` call with every step read before the next (`pipeline=False`),
itself checked against a dense forward elsewhere. The setup makes the cases that pipelining could
get wrong happen often: four slots and a small page pool (admission waits, slots and pages
are reused at once), and sequences that end by a stop string, which only the host sees, so the
device decodes them one more step, after the host has already handed their slot to the next
sequence."""

import numpy as np
import pytest

from engine_setup import CFG, GREEDY, MAX_NEW, PROMPTS
from tpurl.generate import SamplingConfig, generate
from tpurl.generate import scheduler
from tpurl.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("".join(chr(0x100 + i) for i in range(CFG.vocab_size - 3)))
# Ten single-character stop strings and a stop token: at temperature 1 most sequences stop early.
STOPS = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(7,),
                       stop_strings=tuple(TOKENIZER.decode([t]) for t in range(40, 50)))


_STEP, _READ = scheduler.KVPool.step, scheduler.to_host


def _record(monkeypatch, events: list) -> None:
    """Log each decode step dispatched ("step") and each device result read ("read")."""
    monkeypatch.setattr(scheduler.KVPool, "step",
                        lambda pool, params, **kw: events.append("step") or _STEP(pool, params, **kw))
    monkeypatch.setattr(scheduler, "to_host", lambda x: events.append("read") or _READ(x))


def _run(engine, params, monkeypatch, pipelined: bool, events: list, sampling=STOPS):
    _record(monkeypatch, events)
    out = generate(engine, params, PROMPTS[:12], n_samples=2, sampling=sampling, seed=5, tokenizer=TOKENIZER,
                   pipeline=pipelined)
    return [c for row in out for c in row]


@pytest.mark.slow
def test_pipelined_decode_equals_reading_every_step(paged, model_and_params, monkeypatch):
    events_seq, events_pipe = [], []
    sequential = _run(paged, model_and_params[1], monkeypatch, False, events_seq)
    pipelined = _run(paged, model_and_params[1], monkeypatch, True, events_pipe)
    reasons = [c.finish_reason for c in sequential]
    by_string = sum(c.token_ids[-1] != 7 and r == "stop" for c, r in zip(sequential, reasons))
    assert by_string >= 6 and "length" in reasons  # the host-seen stops happen, and some run to the end
    for a, b in zip(pipelined, sequential):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        # Steps of other widths and slot mixes: the same up to the rounding of matmuls.
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_array_equal(a.versions, b.versions)
    # Sequentially every decode step is read before the next one; pipelined, every step but the
    # first is dispatched while the one before is unread (here the slots never all empty at once).
    assert _ahead(events_seq) == 0
    assert _ahead(events_pipe) == events_pipe.count("step") - 1 > 10


def _ahead(events: list[str]) -> int:
    """How many steps were dispatched while an earlier one was still unread."""
    unread, ahead = 0, 0
    for e in events:
        ahead += e == "step" and unread > 0
        unread = unread + 1 if e == "step" else max(unread - 1, 0)
    return ahead


def test_no_step_past_the_last_token(paged, model_and_params, monkeypatch):
    """Sequences that all run to their token budget: the pipelined run dispatches no step after
    the one that samples the last tokens (as many steps as reading every step)."""
    counts = []
    for pipelined in (False, True):
        before = paged.stats["decode_steps"]
        out = _run(paged, model_and_params[1], monkeypatch, pipelined, [], sampling=GREEDY)
        assert all(len(c.token_ids) == MAX_NEW for c in out)
        counts.append(paged.stats["decode_steps"] - before)
    assert counts[0] == counts[1] > 0


def test_environment_turns_are_read_every_step(paged, model_and_params, monkeypatch):
    """A turn that a stop string ends is detached from its slot at once (its KV must not have run
    ahead), so episodes with an environment never decode ahead."""
    events = []
    _record(monkeypatch, events)
    out = generate(paged, model_and_params[1], PROMPTS[:4], n_samples=2, sampling=STOPS, seed=5,
                   tokenizer=TOKENIZER, on_turn_end=lambda i, j, ids: None)
    assert all(c is not None for row in out for c in row)
    assert "step" in events and _ahead(events) == 0


if __name__ == "__main__":
    pytest.main([__file__])
