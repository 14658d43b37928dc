"""A user's code named by import path: `"my_pkg.my_module:name"` (a module, a colon, an attribute,
dots for nested attributes), the form gin configs use for a task class or a reward function.

`import_object` imports the module and returns the attribute, with one-line errors that say what
to fix (the module is not importable, has no such attribute); `source_file` is the file that
defines it, whose checksum goes into the run manifest so a run records the exact code it trained
with."""

from __future__ import annotations

import importlib
import inspect
import re
import sys

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def is_import_path(name: str) -> bool:
    """Whether `name` has the form `package.module:attribute`."""
    return bool(_IMPORT_PATH.fullmatch(name))


def import_object(path: str, what: str):
    """The object `path` names; `what` (e.g. "TaskConfig.name") starts every error's one line."""
    if not is_import_path(path):
        raise ValueError(f"{what}={path!r} is not an import path; write 'package.module:name'")
    module_name, attr = path.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = f"no module named {e.name!r}" if e.name else str(e)
        raise ValueError(f"{what}={path!r}: cannot import {module_name!r} ({missing}); install its package or "
                         "put its directory on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{what}={path!r}: importing {module_name!r} raised {type(e).__name__}: {first}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def source_file(path: str) -> str | None:
    """The source file of the module `path` imports from (None for a built-in or frozen module)."""
    module = sys.modules.get(path.split(":")[0])
    try:
        return inspect.getsourcefile(module) if module is not None else None
    except TypeError:
        return None
