"""The response text of sampled ids (stop strings, what a stream may send) and tool-call parsing,
against the whole text decoded at once."""

import json

import pytest

from tpurl.serve import tool_calls
from tpurl.serve.text import TextStream, cut_at_stop
from tpurl.tokenizer import CharTokenizer

TOK = CharTokenizer("abcdefghijklmnopqrstuvwxyz <>/_{}\":,")


def _stream(text, stops=(), hold=None):
    """Push `text` one character (token) at a time; (pieces sent, the rest at the end)."""
    ids = TOK.encode(text)
    s = TextStream(TOK, stops, hold)
    pieces = [s.push(t) for t in ids]
    return pieces, s.finish(ids)


@pytest.mark.parametrize("text, stops", [("abc def ghi", ()), ("abc def ghi", ("def",)), ("abc de", ("def",)),
                                         ("aaab", ("aab",)), ("abcabc", ("ca", "bc"))])
def test_streamed_pieces_add_up_to_the_cut_text(text, stops):
    pieces, rest = _stream(text, stops)
    assert "".join(pieces) + rest == cut_at_stop(text, stops)[0]


def test_a_possible_stop_string_start_is_held_back_until_decided():
    pieces, rest = _stream("abc de", ("def",))
    assert pieces[-2:] == ["", ""]  # "d", "de" might start "def"
    assert rest == "de"  # it did not: sent at the end
    pieces, rest = _stream("abc def ghi", ("def",))
    assert "".join(pieces) == "abc " and rest == ""  # nothing after the stop string


def test_a_tool_call_is_not_streamed():
    text = 'ab <tool_call>{"name":"f"}</tool_call>'
    pieces, rest = _stream(text, hold=tool_calls.OPEN)
    assert "".join(pieces) + rest == "ab "


def test_incomplete_utf8_waits_for_its_last_byte():
    class Bytes:  # a byte-level tokenizer: one token per UTF-8 byte
        vocab_size = 256

        def decode(self, ids, skip_special=True):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("é€!".encode())
    s = TextStream(Bytes())
    pieces = [s.push(t) for t in ids]
    assert pieces == ["", "é", "", "", "€", "!"] and s.finish(ids) == ""


def test_tool_calls_are_parsed_and_the_rest_is_content():
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' \
           '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 3}"}</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("mul", {"x": 3})]
    assert calls[0].to_openai()["type"] == "function" and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {}}', "plain text"])
def test_what_is_not_a_tool_call_stays_content(text):
    assert tool_calls.parse(text) == (text, [])
