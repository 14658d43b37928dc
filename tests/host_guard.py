"""`no_host_round_trip`: fail when guarded code moves device data through the host.

`jax.transfer_guard` alone cannot show this on CPU: there the host *is* the device, so a
device->host copy is not a transfer and `np.asarray(x)` of a device array passes even under
`transfer_guard_device_to_host("disallow_explicit")`. A sync rewritten to go through numpy would
pass a guard-only test on every CPU machine. This check closes the gap in three ways:

  * Host reads are refused at the Python API: the `jax.Array` methods that produce host values
    (`__array__`, `_value`, `tolist`, `item`, `copy_to_host_async`, `__float__`, `__dlpack__`, ...),
    `jax.device_get`, and the numpy constructors (`np.asarray`, `np.array`, ...) when handed a
    device array. The numpy ones matter on CPU, where a single-device array exposes the buffer
    protocol and numpy reads it without calling any jax method.
  * `jax.device_put` into a host memory kind (`pinned_host`, `unpinned_host`) is refused.
  * Every program that the guarded module's jitted functions (or cached program factories)
    dispatch is lowered once per
    signature and its StableHLO searched for host operations: a Python callback custom call
    (`pure_callback`, `io_callback`, `jax.debug.print`), a value placed in host memory,
    infeed/outfeed, send/recv. Any host interaction of a JAX program is one of these in its
    lowered form, so the compiled program need not be inspected as well.

On top, the transfer guards stay on (`disallow` implicit host->device transfers, and explicit
device->host ones), which is what catches a round trip on GPU/TPU.

What it cannot see: a numpy *ufunc* applied directly to a single-device CPU array (read through
the buffer protocol, no jax or `np.asarray` call involved), and programs dispatched by jitted
functions that are not module-level attributes of the guarded modules.
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses
import re
from types import ModuleType

import jax
import numpy as np
from jax._src.array import ArrayImpl


class HostRoundTrip(AssertionError):
    """Guarded code moved device data through the host."""


# Methods of a concrete jax array that hand its values to the host.
_ARRAY_METHODS = ("__array__", "tolist", "item", "copy_to_host_async", "_copy_single_device_array_to_host_async",
                  "_single_device_array_to_np_array_did_copy", "__float__", "__int__", "__complex__", "__index__",
                  "__bool__", "__dlpack__", "__reduce__")
_ARRAY_PROPERTIES = ("_value",)
_NUMPY_FUNCTIONS = ("asarray", "asanyarray", "array", "ascontiguousarray", "from_dlpack")
_HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
_JITTED = type(jax.jit(lambda x: x))
# Program factories: module-level `functools.cache` functions that build a jitted function per
# static signature (e.g. when the target shardings must be a program's `out_shardings`).
_FACTORY = type(functools.cache(lambda: None))

# StableHLO that touches the host, with the reason reported.
HOST_OPS = (
    (re.compile(r"custom_call @[\w.]*callback"), "a Python host callback"),
    (re.compile(r'"(pinned|unpinned)_host"'), "a value placed in host memory"),
    (re.compile(r"stablehlo\.(infeed|outfeed)\b"), "an infeed/outfeed"),
    (re.compile(r"stablehlo\.(send|recv)\b"), "a send/recv"),
)


def host_ops(program_text: str) -> list[str]:
    """The host operations in a lowered program's text, one line per finding (empty: none)."""
    found = []
    for line in program_text.splitlines():
        for pattern, why in HOST_OPS:
            if pattern.search(line):
                found.append(f"{why}: {line.strip()[:160]}")
    return found


@dataclasses.dataclass
class Seen:
    """What a guarded block dispatched: the names of the programs whose lowered text was checked."""

    programs: list[str] = dataclasses.field(default_factory=list)


# (jitted function, abstract signature) -> host ops found; lowering once per signature keeps the
# check cheap when a sync dispatches the same program for every layer.
_VERDICTS: dict[tuple, list[str]] = {}


def _abstract(x):
    if isinstance(x, jax.Array):
        return ("array", x.shape, x.dtype, x.sharding)
    return x


def _signature(args, kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    return treedef, tuple(_abstract(x) for x in leaves)


def _checked(name: str, fn, seen: Seen):
    def call(*args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            return fn(*args, **kwargs)  # called inside another trace: that program is checked
        key = (fn, _signature(args, kwargs))
        if key not in _VERDICTS:
            _VERDICTS[key] = host_ops(fn.lower(*args, **kwargs).as_text())
        seen.programs.append(name)
        if _VERDICTS[key]:
            raise HostRoundTrip(f"program {name} touches the host: " + "; ".join(_VERDICTS[key]))
        return fn(*args, **kwargs)

    return call


def _checked_factory(name: str, factory, seen: Seen):
    """A program factory (a cached function returning a jitted function) whose programs are checked."""
    def make(*args, **kwargs):
        return _checked(name, factory(*args, **kwargs), seen)

    return make


def _holds_device_array(x) -> bool:
    if isinstance(x, ArrayImpl):
        return True
    return isinstance(x, (list, tuple)) and any(isinstance(e, ArrayImpl) for e in x)


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise HostRoundTrip(f"{what} copied a device array to the host")

    return refuse


def _numpy_guard(name: str, original):
    def guarded(a, *args, **kwargs):
        if _holds_device_array(a):
            raise HostRoundTrip(f"np.{name} copied a device array to the host")
        return original(a, *args, **kwargs)

    return guarded


def _device_put_guard(original):
    def guarded(x, device=None, *args, **kwargs):
        for target in jax.tree.leaves(device):
            if getattr(target, "memory_kind", None) in _HOST_MEMORY_KINDS:
                raise HostRoundTrip(f"jax.device_put into host memory ({target.memory_kind})")
        return original(x, device, *args, **kwargs)

    return guarded


@contextlib.contextmanager
def no_host_round_trip(*modules: ModuleType):
    """Raise `HostRoundTrip` if the block copies device data to the host or runs a program of
    `modules` that touches the host; yields a `Seen` listing the programs it checked.

    `modules`: the modules whose module-level jitted functions the block dispatches (e.g.
    `tpurl.sync.reshard`); their programs are checked for host operations. Explicit host->device
    transfers (`jax.device_put` of a numpy value) stay allowed: they are how constants reach the
    device.
    """
    seen = Seen()
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.transfer_guard("disallow"))
        stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
        patches = [(ArrayImpl, n, _refuse(f"jax.Array.{n}")) for n in _ARRAY_METHODS]
        patches += [(ArrayImpl, n, property(_refuse(f"jax.Array.{n}"))) for n in _ARRAY_PROPERTIES]
        patches += [(np, n, _numpy_guard(n, getattr(np, n))) for n in _NUMPY_FUNCTIONS]
        patches += [(jax, "device_get", _refuse("jax.device_get")), (jax, "device_put", _device_put_guard(jax.device_put))]
        for module in modules:
            patches += [(module, n, _checked(f"{module.__name__}.{n}", f, seen))
                        for n, f in vars(module).items() if isinstance(f, _JITTED)]
            patches += [(module, n, _checked_factory(f"{module.__name__}.{n}", f, seen))
                        for n, f in vars(module).items() if isinstance(f, _FACTORY)]
        for owner, name, replacement in patches:
            original = vars(owner)[name]
            stack.callback(setattr, owner, name, original)
            setattr(owner, name, replacement)
        yield seen
