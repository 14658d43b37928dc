"""A math answer graded against its reference: the final answer taken from the text, then compared
as a value.

Extraction (`answer_format`, the same for the reference with `reference_format`):

    boxed        the content of `\\boxed{...}` (braces balanced; `\\fbox` too). Boxes that agree
                 are one answer; boxes that differ (`\\boxed{3} or \\boxed{4}`) are no answer, so
                 listing candidates never earns the reward
    hash         the first line after the last `####`, markdown emphasis dropped; a leading number
                 is the answer and what follows it is not (`#### 72 because ...`, `#### 5 apples`)
    last_number  the last number in the text

Comparison (`grader`):

    builtin      no dependency: both sides normalized (math delimiters, `\\left`/`\\right`, LaTeX
                 spacing and thousands separators `1{,}000` / `1\\,000`, `\\dfrac12`, `\\text{}`
                 units and trailing unit words, `%`, degrees, `x = ` before the value, whitespace),
                 then equal as numbers (decimals, `a/b`, `\\frac{a}{b}`, `a^b`; to 1e-6
                 relative), as sets `\\{...\\}` in any order, or as text. It has no algebra:
                 `\\sqrt{8}` is not `2\\sqrt{2}` and `x+1` is not `1+x`
    math_verify  the builtin comparison, and where it finds no match Hugging Face's math-verify
                 (the `math` extra): both sides parsed as LaTeX or plain expressions into sympy
                 and compared by value (roots, powers, intervals, sets, equations, percentages).
                 Each check runs in a worker process (`tpurl.tasks.math_verify_worker`),
                 killed when it runs past `timeout_s`: that answer is wrong, with the reason in
                 the sample's trajectory (`Reward.error`)
    auto         math_verify when it is installed, else builtin
"""

from __future__ import annotations

import importlib.metadata
import re
from fractions import Fraction

from tpurl.tasks.math_verify_worker import THIN_THOUSANDS, WorkerPool

ANSWER_FORMATS = ("boxed", "hash", "last_number")
GRADERS = ("auto", "math_verify", "builtin")
BUILTIN_VERSION = "builtin-v2"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LEADING = re.compile(r"\$?\s*-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*\\?%)?")
_CONTINUED = re.compile(r"\s*(?:[-+*/^=.,\d\\{(]|(?:or|and|to|plus|minus|times)\b)")  # not a lone number
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _braced(text: str, i: int) -> str | None:
    """The text from `i` to the brace that closes the one just before `i`, None when cut off."""
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def boxes(text: str) -> list[str]:
    """The contents of every complete `\\boxed{...}` / `\\fbox{...}` in `text`, in order."""
    found = [_braced(text, m.end()) for m in _BOX.finditer(text)]
    return [b for b in found if b is not None]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept), None without one."""
    found = boxes(text)
    return found[-1] if found else None


def _one_box(text: str) -> str | None:
    """The boxed answer when every box agrees with the last one (builtin comparison), else None."""
    found = [b for b in boxes(text) if b.strip()]
    if not found or any(not builtin_match(b, found[-1]) for b in found[:-1]):
        return None
    return found[-1]


def _after_hash(text: str) -> str | None:
    """The first non-empty line after the last `####`, emphasis dropped; a leading number alone."""
    if "####" not in text:
        return None
    lines = [ln.replace("**", "").replace("__", "").strip() for ln in text.rsplit("####", 1)[1].splitlines()]
    line = next((ln for ln in lines if ln), "")
    lead = _LEADING.match(line)
    if lead and (lead.end() == len(line) or not _CONTINUED.match(line[lead.end():])):
        return lead.group(0).strip()
    return line or None


def extract_answer(text: str, fmt: str) -> str | None:
    """The final answer of `text` in format `fmt` ("raw", or one of `ANSWER_FORMATS`), or None."""
    if fmt == "raw":
        return text
    if fmt == "boxed":
        return _one_box(text)
    if fmt == "hash":
        return _after_hash(text)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_SPACING = re.compile(r"\\[,!;:> ]|~")
_UNIT_TEXT = re.compile(r"(?<=[\d}])\s*\\(?:text|mbox|mathrm|textrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?\s*$")
_UNIT_WORDS = re.compile(r"(.*\d)\s+[A-Za-z]{2,}\.?(?:\s+[A-Za-z]{2,}\.?)*")
_ASSIGNED = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?\s*=\s*([^=]+)")
_DROPPED = ("\\displaystyle", "\\left", "\\right", "\\%", "%", "^{\\circ}", "^\\circ", "\\circ", "°", "\\degree",
            "\\(", "\\)", "\\[", "\\]", "\\$", "$", "**")


def normalize(answer: str) -> str:
    """`answer` in the builtin grader's canonical form (see the module docstring)."""
    s = answer.strip()
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("{,}", ",")
    s = THIN_THOUSANDS.sub("", s)  # 1\,000: a thousands separator
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = _UNIT_TEXT.sub("", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm|textrm|mathbf)\{([^{}]*)\}", r"\1", s).strip()
    s = s[:-1].rstrip() if s.endswith(".") else s
    if (assigned := _ASSIGNED.fullmatch(s)) is not None:
        s = assigned.group(1).strip()
    if (units := _UNIT_WORDS.fullmatch(s)) is not None and _value(_squeeze(units.group(1))) is not None:
        s = units.group(1)
    return _squeeze(s)


def _squeeze(s: str) -> str:
    """`s` without whitespace, except between two digits (`1 000` is not `1000`)."""
    return re.sub(r"(?<!\d)\s+|\s+(?!\d)", "", s.strip())


def _number(s: str) -> Fraction | None:
    """A plain decimal (commas only as thousands separators: `1,234`, not `1,23`)."""
    s = s[1:] if s.startswith("+") else s
    if not _NUMBER.fullmatch(s) or ("," in s and not _GROUPED.fullmatch(s)):
        return None
    return Fraction(s.replace(",", ""))


def _value(s: str) -> Fraction | None:
    """The value of a number, `a/b`, `\\frac{a}{b}` or an integer power `a^b` (small), else None."""
    if (n := _number(s)) is not None:
        return n
    sign = -1 if s.startswith("-") and not s.startswith("--") else 1
    body = s[1:] if sign < 0 else s
    frac = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}|([^/]+)/([^/]+)", body)
    power = re.fullmatch(r"(\d+)\^\{?(-?\d{1,3})\}?", body)
    if frac is not None:
        top, bottom = (frac.group(1), frac.group(2)) if frac.group(1) is not None else (frac.group(3), frac.group(4))
        a, b = _number(top), _number(bottom)
        return sign * a / b if a is not None and b else None
    if power is not None and int(power.group(1)) > 0:
        return sign * Fraction(int(power.group(1))) ** int(power.group(2))
    return None


def _members(s: str) -> list[str] | None:
    """The members of a set written `\\{a, b\\}`, None for anything else."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return [m for m in s[2:-2].split(",") if m]
    return None


def _equal(a: str, b: str) -> bool:
    """Two normalized answers equal as numbers, as sets or as text."""
    va, vb = _value(a), _value(b)
    if va is not None and vb is not None:
        return abs(va - vb) <= max(Fraction(1, 10**9), abs(va) / 10**6, abs(vb) / 10**6)  # exact: no overflow
    ma, mb = _members(a), _members(b)
    if ma is not None and mb is not None:
        return len(ma) == len(mb) and all(any(_equal(x, y) for y in mb) for x in ma) \
            and all(any(_equal(y, x) for x in ma) for y in mb)
    return a == b


def builtin_match(got: str | None, want: str | None) -> bool:
    """The builtin grader: `got` and `want` equal after normalization (see the module docstring)."""
    if not got or not want:
        return False
    a, b = normalize(got), normalize(want)
    return bool(a) and bool(b) and _equal(a, b)


def math_verify_version() -> str | None:
    """The installed math-verify's version, None when it is not installed."""
    try:
        return importlib.metadata.version("math-verify")
    except importlib.metadata.PackageNotFoundError:
        return None


class MathGrader:
    """Compares a final answer with a reference by `grader` (see the module docstring)."""

    def __init__(self, grader: str, timeout_s: float, workers: int = 2, owner: str = "MathConfig"):
        version = math_verify_version()
        if grader == "math_verify" and version is None:
            raise ValueError(f"{owner}.grader='math_verify' needs math-verify: pip install 'tpurl[math]' "
                             "(or grader='builtin')")
        self.uses_math_verify = grader != "builtin" and version is not None
        self.name = f"math-verify-{version}+{BUILTIN_VERSION}" if self.uses_math_verify else BUILTIN_VERSION
        self.timeout_s = timeout_s
        self.workers = WorkerPool(workers) if self.uses_math_verify else None

    def match(self, got: str | None, want: str | None) -> tuple[bool, str | None]:
        """Whether `got` is `want`'s value, and why it could not be decided (None when it was)."""
        if not got or not want:
            return False, None
        if builtin_match(got, want):
            return True, None
        if not self.uses_math_verify:
            return False, None
        return self.workers.check(got, want, self.timeout_s)
