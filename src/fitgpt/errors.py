"""Errors a user can fix by changing what they asked for: the CLI prints them as one line and exits 2."""

from __future__ import annotations

import functools
import math
from dataclasses import fields


class UserError(Exception):
    """A setting, a path or an input the user can change; the message names what to change.

    Not a ValueError: the flag parser (tyro) would catch a ValueError raised while it builds a config and
    draw it in a box; this one reaches the CLI, which prints it on one line."""


def user_errors(post_init):
    """Decorate a config's ``__post_init__``: the ValueErrors of its checks (and of the helpers they call) become
    UserErrors."""

    @functools.wraps(post_init)
    def checked(self) -> None:
        try:
            post_init(self)
        except ValueError as e:
            raise UserError(str(e)) from None

    return checked


def require_finite(obj: object, section: str = "") -> None:
    """Refuse NaN and infinities in every float field of a config dataclass, naming the flag."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}{f.name} must be a finite number, got {value} (set --{section}{f.name.replace('_', '-')})")
