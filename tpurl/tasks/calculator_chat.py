"""The calculator in a chat format with OpenAI function calling, for agents (`CalculatorConfig.chat`).

An agent asks through `/v1/chat/completions` with a `multiply` tool; the model answers with a tool
call in the Qwen/Hermes format that the endpoint parses into OpenAI's `tool_calls`, the agent runs
the tool and sends its result back as a `tool` message, and the model's next message is the
answer. The tokenizer (the `tokenizers` library: one token per character of the calculator's
alphabet, plus added tokens) has a chat template that renders a conversation as

    <|user|>47*86=<|end|><|assistant|><tool_call>{"name": "multiply", "arguments": {"a": 47, "b": 86}}</tool_call><|end|><|tool|>4042<|end|><|assistant|>4042<|end|>

`<|end|>` is the end-of-sequence token: it ends each model turn. The call's JSON skeleton is made of
added tokens (`{"name": "multiply", "arguments": {"a": `, `, "b": `, `}}`), so a call costs the
model about as many tokens as the plain calculator's `[47*86]`, and a tool call rendered back by
the template is the same ids the model sampled (the endpoint's parse writes the arguments as
`json.dumps` does, which is the skeleton's spacing): the agent's next call extends the sequence.
The template does not render the `tools` list: the model knows its one tool. A character outside
the alphabet is the token `?`.
"""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models

from tpurl.tasks.base import Problem
from tpurl.tokenizer import HFTokenizer

ALPHABET = "0123456789*=?"
SPECIAL = ("<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>")
CALL = ("<tool_call>", '{"name": "multiply", "arguments": {"a": ', ', "b": ', "}}", "</tool_call>")
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>"
    "{% else %}{{ raise_exception('the calculator chat has user, assistant and tool messages') }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer() -> HFTokenizer:
    """The calculator's chat tokenizer (see the module docstring)."""
    # No merges: one token per character; a character outside the alphabet becomes `?` (never dropped).
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[], unk_token="?"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False) for t in CALL])
    return HFTokenizer(tok, eos_token="<|end|>", pad_token="<pad>", chat_template=TEMPLATE,
                       template_source="the calculator's chat template")


def tool_call(expression: str) -> str:
    """The model's message calling `multiply` on `"a*b"`."""
    a, b = expression.split("*")
    return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {int(a)}, "b": {int(b)}}}}}</tool_call>'


def prompt_ids(tokenizer: HFTokenizer, problem: Problem) -> list[int]:
    """The conversation's first prompt: the problem as the user's message, then the model's turn."""
    return tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True,
                                         tokenize=True)


def demonstration(problem: Problem, calls: bool, guess: int) -> list[tuple[str, bool]]:
    """A transcript after the prompt as `(text, the model's?)` segments (the final end-of-sequence
    token is the caller's): a call, the tool's message and the answer; or the answer `guess`."""
    if not calls:
        return [(str(guess), True)]
    return [(tool_call(problem.prompt[:-1]) + "<|end|>", True),
            (f"<|tool|>{problem.answer}<|end|><|assistant|>", False), (problem.answer, True)]
