"""Argument checks shared by every public constructor and call.

One place decides what a valid option is, so every message reads the same and says what to
change. Each check returns the value it accepted (so ``x = positive_int(x, "what")`` reads well)
or raises a :class:`~bsr.ConfigError` (or the subclass given as ``error``) naming the option.
"""

from __future__ import annotations

from typing import Any

from ._errors import ConfigError


def positive_int(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """``value`` if it is a positive int (not a bool), else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{what} must be a positive int, got {value!r}", **fields)
    return value
