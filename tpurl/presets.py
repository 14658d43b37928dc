"""Config fields that take either a preset name or a full object (`model="tiny"`, `train_layout=
"fsdp_tp"`, `algorithm="grpo"`): one resolver, so every config names the field and the fix alike."""

from __future__ import annotations

from typing import Any, Callable


def resolve_preset(value: Any, kind: type, lookup: Callable[[str], Any], *, where: str) -> Any:
    """`value` itself when it is a `kind`, `lookup(value)` when it is a preset name.

    `where` names the field in errors (e.g. `"RLConfig.model"`). Raises a one-line ValueError for an
    unknown name (`lookup`'s message, prefixed with `where`) or a value of another type.
    """
    if isinstance(value, str):
        try:
            value = lookup(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{where} must be a preset name or a {kind.__name__}, got {type(value).__name__}")
    return value
