"""Tokenizers behind one small interface: Hugging Face `tokenizer.json` (see `load_hf_tokenizer`)
and a built-in character-level tokenizer for the embedded demo."""

from __future__ import annotations

from typing import Protocol, Sequence


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
