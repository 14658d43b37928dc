"""What a resumed run must match: the config its checkpoint was written with.

Every checkpoint records the run's operative `RLConfig` (`config_record`). `--resume` compares the
config it is given with the one of the checkpoint it restores (`check_resume_config`): a run
continued with another learning rate, seed or task would silently become a different experiment
under the same name, so any difference is refused in one line listing what changed, unless the
user names the intended changes (`--resume-changed FIELD[,FIELD]`, where a field is a dotted path
of `RLConfig`, e.g. `steps` or `optimizer.lr`, and a path names everything under it). Where the
run's records and checkpoints go and how often (`RLConfig.logging`, `RLConfig.checkpoint`) and
where and when its programs are compiled (`RLConfig.compile_cache`, `RLConfig.compile_ahead`)
change nothing it computes: those changes are allowed and said.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

# Sections whose changes do not change what the run computes, only what it records and where.
NEUTRAL = ("logging", "checkpoint", "compile_cache", "compile_ahead")
_SHOWN = 6  # differences listed in the one-line message


def _json_value(value: Any) -> str:
    """A config value JSON does not have: a function or class (a gin reference in
    `TaskConfig.options`) by its import path, anything else by its text."""
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return f"{module}:{name}" if module and name else str(value)


def config_record(cfg) -> dict[str, Any]:
    """The config as JSON values (what a checkpoint stores and what it is compared with)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=_json_value))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`{field path: (saved value, current value)}` for every leaf both records have that differs,
    and every setting the saved record has (not None) that this tpurl version no longer has (its
    current value None: e.g. `algorithm.tis_cap`, now `algorithm.correction`), which the run would
    otherwise lose unsaid. A field only the current record has (added since) cannot be compared."""
    old, new = _flatten(saved), _flatten(current)
    changed = {path: (old[path], new[path]) for path in old.keys() & new.keys() if old[path] != new[path]}
    for path in old.keys() ^ new.keys():
        other = new if path in old else old
        top = next((p for p in _prefixes(path) if p in other), None)
        if top is not None:  # a value on one side, fields under it on the other (None vs a config)
            changed[top] = (_at(saved, top), _at(current, top))
        elif path in old and old[path] is not None:
            changed[path] = (old[path], None)
    return dict(sorted(changed.items()))


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _at(record: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def _nameable(path: str, current: dict[str, Any]) -> str:
    """`path`, or the longest section above it that the current config has."""
    fields = _flatten(current).keys()
    name = path
    while name and not any(_covers(name, f) for f in fields):
        name = name.rpartition(".")[0]
    return name or path


def _covers(allowed: str, path: str) -> bool:
    return path == allowed or path.startswith(allowed + ".")


def _listing(changes: dict[str, tuple[Any, Any]]) -> str:
    shown = [f"{path} {json.dumps(old)} -> {json.dumps(new)}" for path, (old, new) in list(changes.items())[:_SHOWN]]
    more = len(changes) - _SHOWN
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def check_allowed_fields(allowed: tuple[str, ...], current: dict[str, Any]) -> None:
    """Each name of `--resume-changed` must be a field (or section) of the config: a typo must not
    pass for permission."""
    fields = _flatten(current).keys()
    for name in allowed:
        if not any(_covers(name, path) for path in fields):
            raise ValueError(f"--resume-changed names {name!r}, which is not a field of tpurl.RLConfig; use dotted "
                             "field paths such as steps, seed, optimizer.lr or algorithm.kl_coef")


def check_resume_config(saved: dict[str, Any] | None, current: dict[str, Any], *, step: int,
                        allowed: tuple[str, ...] = (), say: Callable[[str], None]) -> None:
    """Refuse (one-line ValueError) to resume checkpoint `step`, written with config `saved`, under
    config `current` when they differ outside `NEUTRAL` and the fields `allowed`; say the changes
    that are let through. `saved` None (a checkpoint that records no config) is said, not refused."""
    check_allowed_fields(allowed, current)
    if saved is None:
        say(f"checkpoint step {step} records no config, so this run's config cannot be compared with it")
        return
    changes = config_changes(saved, current)
    refused = {path: change for path, change in changes.items()
               if path.split(".")[0] not in NEUTRAL and not any(_covers(name, path) for name in allowed)}
    if refused:
        # A setting this version no longer has is named by its section (what --resume-changed takes).
        names = list(dict.fromkeys(_nameable(path, current) for path in refused))
        fields = ",".join(names[:_SHOWN]) + (",..." if len(names) > _SHOWN else "")
        raise ValueError(f"the config differs from the one checkpoint step {step} was written with: "
                         f"{_listing(refused)}; resume with that config, or name the changes you intend with "
                         f"--resume-changed {fields}")
    if changes:
        say(f"resuming from checkpoint step {step} with changed config: {_listing(changes)}")
