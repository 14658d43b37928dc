"""The text of sampled ids as a response shows it: cut at a stop string, streamed in pieces.

The engine stops a sequence once its decoded completion contains a stop string (the tokens that
formed it are kept: they are what the model sampled, and what a trainer gets); the response's text
ends just before the stop string, as OpenAI's does. A stream sends only text that no later token
can take back: not the tail that may be the start of a stop string (or of a tool call, which is
sent whole at the end), nor an incomplete UTF-8 character (decoded as U+FFFD until its last byte
arrives).
"""

from __future__ import annotations

from typing import Sequence

from tpurl.tokenizer import decode_generated


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the first stop string in it, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def _held_back(text: str, markers: Sequence[str]) -> int:
    """Characters at the end of `text` that may begin one of `markers` (a stop string, or the
    opening of a tool call): the longest suffix of `text` that is a proper prefix of one."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:n]):
                longest = n
                break
    return longest


class TextStream:
    """The text of one sample as its tokens arrive: `push(token)` returns the new text that is
    safe to send; `finish()` the rest (cut at a stop string). `hold`: a marker from which on
    nothing more is streamed (the opening of a tool call: the call goes out whole at the end)."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), hold: str | None = None):
        self.tokenizer, self.stops, self.hold = tokenizer, tuple(stops), hold
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent so far
        self.stopped = False

    @property
    def text(self) -> str:
        return decode_generated(self.tokenizer, self.ids)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        if self.stopped:
            return ""
        text, self.stopped = cut_at_stop(self.text, self.stops)
        if self.hold is not None and (at := text.find(self.hold)) >= 0:
            text, self.stopped = text[:at], True  # the rest goes out at the end, parsed
        elif not self.stopped:
            text = text[:len(text) - _held_back(text, (*self.stops, *([self.hold] if self.hold else ())))]
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")  # an incomplete character: wait for its last byte
        return self._send(text)

    def finish(self, ids: Sequence[int]) -> str:
        """The text not sent yet of the whole completion `ids` (cut at a stop string), up to the
        hold marker when there is one (the caller parses the whole text)."""
        self.ids = [int(t) for t in ids]
        text, _ = cut_at_stop(self.text, self.stops)
        if self.hold is not None and (at := text.find(self.hold)) >= 0:
            text = text[:at]
        return self._send(text)

    def _send(self, text: str) -> str:
        new = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return new
