"""Every field of a typed config checked against its annotation, before any other validation.

Gin and Python hand a config whatever they were given: without this check `steps=2.5` runs three
steps, `batch_size=16.0` fails much later inside a jitted function, and `pass_k="2"` fails with
`'<' not supported between instances of 'str' and 'int'`, naming no field. Each config dataclass
calls `check_types(self)` first thing in its `__post_init__`, so a value of the wrong type is a
one-line `ValueError` naming `Class.field`, the value and the expected type.

Two value checks hold for every config too, because no field can use what they reject: a float
that is not finite (`lr=1e999` is inf and trains to the end on NaN losses; no config uses inf or
nan as a sentinel, None is the "unset" value), and an int that does not fit in 64 bits (numpy and
JAX take nothing wider). A field named `seed` or ending in `_seed` must be in [0, 2**63): numpy's
SeedSequence takes no negative seed and JAX's PRNG keys no seed of 2**63 or more.

What an annotation accepts:

    int                 integers (Python or numpy), not bools and not floats: 16.0 where a count
                        belongs is a mistake, not a count
    float               ints and floats, not bools
    bool / str          only bools / only strings
    X | Y, Optional     any member
    Literal["a", "b"]   a value of the literals' type (which value is `__post_init__`'s business)
    tuple[T, ...]       a tuple or a list (gin and JSON write lists; configs normalize them) of T
    tuple[A, B]         a tuple or list of that length, element-wise
    a class             an instance (nested configs: `OptimizerConfig`, `MeshConfig`, ...)
    anything else       not checked (Any, callables, mappings)

A process setting read from the environment (`TPURL_HOST_MALLOC`, `TPURL_CPU_COMPILE`) is checked
the same way by `env_choice`: one of its choices, else one line naming the variable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sys
import types
import typing
from typing import Any


def check_types(cfg, *, skip: tuple[str, ...] = ()) -> None:
    """Raise a one-line ValueError if a field of the dataclass instance `cfg` does not match its
    annotation (see the module docstring). Fields in `skip` are left to the config's own checks."""
    hints = _field_types(type(cfg))
    for field in dataclasses.fields(cfg):
        if field.name in skip:
            continue
        want = hints.get(field.name, Any)
        value = getattr(cfg, field.name)
        if not _matches(value, want):
            raise ValueError(f"{_where(cfg, field.name)} must be {_describe(want)}, not {_actual(value)}")
        if want is not Any and (problem := _out_of_range(field.name, value)):
            raise ValueError(f"{_where(cfg, field.name)} {problem}")


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The environment variable `name`, checked: one of `choices` (case and surrounding spaces
    ignored; unset or empty: the first), else a one-line ValueError naming the variable, the value
    and the choices (`what`: what a value of it is, e.g. "a host allocator mode")."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r} is not {what}; set it to one of "
                         f"{', '.join(choices)} (or unset it)")
    return value


def _where(cfg, name: str) -> str:
    return f"{type(cfg).__name__}.{name}={getattr(cfg, name)!r}"


_LIMIT = 2**63  # int64: numpy and JAX take nothing wider; JAX's PRNG keys no seed at or above it


def _out_of_range(name: str, value) -> str | None:
    """What is wrong with a value of the right type that no config can use (see the module
    docstring), looking into tuples; None when nothing is."""
    if isinstance(value, (tuple, list)):
        return next((p for p in (_out_of_range("", v) for v in value) if p), None)
    if type(value) is float:  # the common cases first: an ABC's isinstance costs microseconds
        return None if math.isfinite(value) else "must be a finite number"
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        return None
    if type(value) is not int and not isinstance(value, numbers.Integral):
        return None if math.isfinite(value) else "must be a finite number"
    if name == "seed" or name.endswith("_seed"):
        return None if 0 <= value < _LIMIT else "must be in [0, 2**63): a seed numpy and JAX can both take"
    return None if -_LIMIT <= value < _LIMIT else "does not fit in 64 bits; use a smaller number"


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a name only imported for type checkers: resolve field by field
        namespace = vars(sys.modules[cls.__module__])
        hints = {}
        for field in dataclasses.fields(cls):
            try:
                hints[field.name] = eval(field.type, namespace) if isinstance(field.type, str) else field.type
            except Exception:
                hints[field.name] = Any
        return hints


def _parts(want) -> tuple[Any, tuple]:
    """An annotation's origin and arguments, looked up once per annotation (one that does not
    hash, `[int]`, each time)."""
    try:
        return _cached_parts(want)
    except TypeError:
        return typing.get_origin(want), typing.get_args(want)


@functools.cache
def _cached_parts(want) -> tuple[Any, tuple]:
    return typing.get_origin(want), typing.get_args(want)


def _matches(value, want) -> bool:
    if want is Any:
        return True
    if want is int or want is float:  # the common cases first: an ABC's isinstance costs microseconds
        if type(value) is int or (want is float and type(value) is float):
            return True
    origin, args = _parts(want)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) for a in args)
    if want is type(None):
        return value is None
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return not args or (len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args)))
    if isinstance(want, type) and origin is None:
        return isinstance(value, want)
    return True


def _actual(value) -> str:
    what = _article(type(value).__name__)
    if isinstance(value, (tuple, list)) and value:
        what += " of " + " and ".join(sorted({type(v).__name__ for v in value}))
    return what


def _article(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _describe(want) -> str:
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if want is type(None):
        return "None"
    if want is float:
        return "a number"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _describe(args[0])
            simple = item.startswith(("a ", "an ")) and " " not in item.split(" ", 1)[1]
            return f"a tuple of {item.split(' ', 1)[1]}s" if simple else f"a tuple whose items are each {item}"
        return f"a tuple ({', '.join(_describe(a) for a in args)})"
    return _article(getattr(want, "__name__", str(want)))
