"""Tool calls in the model's output, as OpenAI's `tool_calls`.

Qwen2.5/Qwen3 and Hermes-style chat templates have the model write each call as a JSON object
between `<tool_call>` and `</tool_call>`: `{"name": "add", "arguments": {"a": 1}}`. `parse` finds
them and returns the text around them (the message's content) and the calls, each with its
arguments as a JSON string (as OpenAI sends them). A block that is not such an object is left in
the content as the model wrote it; a call the model did not close (the token budget ran out) is
not a call either.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's message; content None when only calls remain."""
    outside, calls = split(text)
    if not calls:
        return text, []
    return outside.strip() or None, calls


def split(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside the tool calls (as written, unstripped) and the calls."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    if not calls:
        return text, []
    return "".join(kept) + text[last:], calls
