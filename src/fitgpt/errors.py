"""Errors a user can fix by changing what they asked for: the CLI prints them as one line and exits 2."""

from __future__ import annotations

import math
from dataclasses import fields


class UserError(Exception):
    """A setting, a path or an input the user can change; the message names what to change.

    The CLI prints it on one line and exits 2; every other exception is a bug and keeps its traceback. Not a
    ValueError: the flag parser (tyro) would catch a ValueError raised while it builds a config and draw it in
    a box; this one reaches the CLI."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, corrupt, or not ours."""


def require_finite(obj: object, section: str = "", flags: str | None = None) -> None:
    """Refuse NaN and infinities in every float field of a config dataclass, naming the flag (``flags``: the
    command's prefix of them, default ``--{section}``)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            flag = f"{f'--{section}' if flags is None else flags}{f.name.replace('_', '-')}"
            raise UserError(f"{section}{f.name} must be a finite number, got {value} (set {flag})")


def require_not_empty(obj: object, names: tuple[str, ...], prefix: str = "") -> None:
    """Refuse an empty string where a path, a card or a size is named: ``--gpu "$CARD"`` with CARD unset means a
    mistake, never "not given"."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, str) and not value.strip():
            flag = f"--{prefix}{name.replace('_', '-')}"
            raise UserError(f"{flag} is empty (an unset shell variable?): give a value, or drop {flag}")
