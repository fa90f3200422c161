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


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def byte_size(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """A positive byte count from an int or a string such as ``"64GiB"``, ``"500 MB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000; case does not matter and ``_`` may group digits.
    """
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _SIZE_UNITS:
            raise error(
                f"{what} must be a byte count like 4096, '64GiB' or '500MB', got {value!r}",
                **fields,
            )
        number = float(m.group(1).replace("_", "")) * _SIZE_UNITS[unit]
        if number != int(number):
            raise error(f"{what} must be a whole number of bytes, got {value!r}", **fields)
        value = int(number)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(
            f"{what} must be a positive byte count (an int or a string like '64GiB'), "
            f"got {value!r}",
            **fields,
        )
    return value


def optional_positive_int(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int | None:
    """``None`` or a positive int (not a bool)."""
    return None if value is None else positive_int(value, what, error=error, **fields)


def finite_float(
    value: Any,
    what: str,
    *,
    minimum: float | None = None,
    strict: bool = False,
    none_ok: bool = False,
    error: type[ConfigError] = ConfigError,
    **fields: Any,
) -> float:
    """A finite real number (int or float, never a bool, a string, NaN or infinity).

    Args:
        value: the option's value.
        what: its name, for the message.
        minimum: lowest accepted value (inclusive, or exclusive when ``strict``).
        strict: ``value`` must be strictly greater than ``minimum``.
        none_ok: the option also accepts None (said in the message; the caller handles None).
    """
    import math

    alt = " or None" if none_ok else ""

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(
            f"{what} must be an int or float{alt}, got {type(value).__name__} {value!r}",
            **fields,
        )
    if not math.isfinite(value):
        raise error(f"{what} must be a finite number{alt}, got {value!r}", **fields)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise error(f"{what} must be {bound}{alt}, got {value!r}", **fields)
    return float(value)


def positive_float(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float:
    """A finite number > 0."""
    return finite_float(value, what, minimum=0.0, strict=True, error=error, **fields)


def non_negative_float(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float:
    """A finite number >= 0."""
    return finite_float(value, what, minimum=0.0, error=error, **fields)


def optional_positive_float(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float | None:
    """``None`` or a finite number > 0 (e.g. an optional deadline)."""
    if value is None:
        return None
    return finite_float(value, what, minimum=0.0, strict=True, none_ok=True, error=error, **fields)


def non_negative_int(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """``value`` if it is an int >= 0 (not a bool), else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise error(f"{what} must be an int >= 0, got {value!r}", **fields)
    return value
