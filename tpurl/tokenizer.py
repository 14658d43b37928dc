"""Tokenizers behind one small interface: Hugging Face `tokenizer.json` (see `load_hf_tokenizer`)
and a built-in character-level tokenizer for the embedded demo.

`HFTokenizer` wraps the `tokenizers` library (the Rust engine behind transformers' fast
tokenizers) and reads special tokens and the chat template from `tokenizer_config.json` /
`chat_template.jinja`. Chat templates are rendered with jinja2 the way transformers does: a
sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, `raise_exception` and `strftime_now` globals, a `tojson` filter that keeps non-ASCII
text, and the special tokens (`bos_token`, `eos_token`, ...) as template variables.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from typing import Any, Protocol, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from tpurl.files import read_json_object


class Tokenizer(Protocol):
    """What the engine, tasks and the loop need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...


def decode_generated(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Decode generated ids; ids past the tokenizer's vocabulary (the model's vocab may be padded
    for sharding) become U+FFFD, so graders and stop strings see an invalid character instead of
    crashing."""
    ids = [int(i) for i in ids]
    if all(i < tokenizer.vocab_size for i in ids):
        return tokenizer.decode(ids)
    return "".join(tokenizer.decode([i]) if i < tokenizer.vocab_size else "\ufffd" for i in ids)


class CharTokenizer:
    """One token per character of a fixed alphabet, plus <pad>=0, <bos>=1, <eos>=2.

    Unknown characters are an error (naming the character), never silently dropped.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer: alphabet {alphabet!r} repeats a character")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def checksum(self) -> str:
        """sha256 of everything that decides the text <-> ids mapping (for the run manifest)."""
        return _sha256({"kind": "char", "specials": self.SPECIALS, "alphabet": self.alphabet})

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in the alphabet {self.alphabet!r}") from None
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < len(self.SPECIALS):
                if not skip_special:
                    out.append(self.SPECIALS[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(self.SPECIALS)])
            else:
                raise ValueError(f"CharTokenizer: id {i} is outside the vocabulary (size {self.vocab_size})")
        return "".join(out)


def _sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

# transformers' `clean_up_tokenization` (applied on decode when the tokenizer config asks for it).
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class ChatTemplateError(jinja2.exceptions.TemplateError):
    """Raised by a chat template's `raise_exception(message)` (transformers defines the same global)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's built-in tojson escapes HTML characters and forces ASCII; chat templates expect
    # plain JSON (this mirrors transformers).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox (templates come with downloaded checkpoints)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class HFTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`) with its special tokens and chat template.

    `encode` never adds the special tokens of the tokenizer's post-processor: callers decide
    (`add_bos=True` prepends the BOS token where the tokenizer has one and is a no-op otherwise,
    e.g. for Qwen, which has no BOS).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, clean_up_tokenization_spaces: bool = False,
                 template_source: str = "the chat template"):
        self._tok = tokenizer
        self.special_tokens = {k: v for k, v in zip(SPECIAL_TOKEN_KEYS, (bos_token, eos_token, pad_token, unk_token))
                               if v is not None}
        self._special_ids = {}
        for key, token in self.special_tokens.items():
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"HFTokenizer: {key} {token!r} is not in the vocabulary; fix tokenizer_config.json")
            self._special_ids[key] = token_id
        self.chat_template = chat_template
        self.template_source = template_source  # where the template came from, named in its errors
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (as `len(tokenizer)` in transformers)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_ids.get("eos_token")

    @property
    def pad_id(self) -> int:
        """The pad token's id; tokenizers without one (Llama 3) pad with EOS, which masks ignore."""
        if "pad_token" in self._special_ids:
            return self._special_ids["pad_token"]
        if self.eos_id is None:
            raise ValueError("HFTokenizer: neither pad_token nor eos_token is set; set pad_token in tokenizer_config.json")
        return self.eos_id

    def checksum(self) -> str:
        """sha256 of everything that decides the text <-> ids mapping and the prompts (the
        serialized tokenizer, special tokens, chat template), for the run manifest."""
        return _sha256({"kind": "hf", "tokenizer": self._tok.to_str(), "special_tokens": self.special_tokens,
                        "chat_template": self.chat_template, "clean_up": self.clean_up_tokenization_spaces})

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[dict] | None = None,
                            documents: Sequence[dict] | None = None, **kwargs) -> str | list[int]:
        """Render a conversation with the tokenizer's chat template (as transformers'
        `apply_chat_template`); with `tokenize=True` return its ids (no extra special tokens).
        Extra keyword arguments become template variables (e.g. `enable_thinking=False`).

        A template that does not compile, calls `raise_exception` (templates reject roles or
        message orders they do not support that way) or fails while rendering is a one-line
        ValueError naming `template_source`."""
        if self.chat_template is None:
            raise ValueError("HFTokenizer: this tokenizer has no chat_template; add one to tokenizer_config.json "
                             "or chat_template.jinja")
        where = self.template_source
        try:
            template = compile_chat_template(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where}: chat template syntax error at line {e.lineno}: {e.message}; fix the "
                             "template") from None
        try:
            text = template.render(messages=list(messages), tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs)
        except ChatTemplateError as e:
            raise ValueError(f"{where}: the chat template rejects these messages: {e}") from None
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as e:
            # what a template's own code can raise (SecurityError and UndefinedError are TemplateErrors)
            raise ValueError(f"{where}: the chat template failed ({type(e).__name__}: {e}); fix the template or "
                             "the messages") from None
        return self.encode(text) if tokenize else text


def _token_text(value: Any, key: str, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # a serialized AddedToken
    raise ValueError(f"{path}: {key} must be a string or an AddedToken dict, got {value!r}")


def load_hf_tokenizer(directory: str) -> HFTokenizer:
    """An `HFTokenizer` from a Hugging Face directory: `tokenizer.json`, plus (optional)
    `tokenizer_config.json` for special tokens and the chat template, and `chat_template.jinja`
    (which newer transformers versions write instead of the config entry, and which wins)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    tok_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tok_path):
        hint = (" (only fast tokenizers are supported: convert tokenizer.model with transformers and save_pretrained)"
                if os.path.exists(os.path.join(directory, "tokenizer.model")) else "")
        raise FileNotFoundError(f"{tok_path} does not exist{hint}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exceptions)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{tok_path} is not a tokenizer the tokenizers library can load ({reason}); save it "
                         "again with save_pretrained") from None
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.exists(cfg_path):
        config = read_json_object(cfg_path, "a tokenizer config")
    template, source = _config_template(config.get("chat_template"), cfg_path), cfg_path
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, "rb") as f:
            try:
                template, source = f.read().decode("utf-8"), jinja_path
            except UnicodeDecodeError as e:
                raise ValueError(f"{jinja_path} is not valid UTF-8: {e}") from None
    specials = {key: _token_text(config.get(key), key, cfg_path) for key in SPECIAL_TOKEN_KEYS}
    return HFTokenizer(tokenizer, chat_template=template, template_source=source,
                       clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                       **specials)


def _config_template(value: Any, path: str) -> str | None:
    """`chat_template` of tokenizer_config.json: a string, or a list of {"name", "template"}
    objects of which transformers uses the one named "default" (None: there is none)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{path}: chat_template must be a string or a list of {{\"name\", \"template\"}} objects, "
                         f"not a {type(value).__name__}")
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ValueError(f"{path}: chat_template[{i}] must be an object with a \"name\" and a \"template\" "
                             f"string, got {str(entry)[:80]}")
    return {t["name"]: t["template"] for t in value}.get("default")
