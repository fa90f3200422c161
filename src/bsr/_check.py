"""Argument checks shared by every public constructor and call.

One place decides what a valid option is, so every message reads the same and says what to
change. Each check returns the value it accepted (so ``x = positive_int(x, "what")`` reads well)
or raises a :class:`~bsr.ConfigError` (or the subclass given as ``error``) naming the option.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from ._errors import ConfigError

#: the largest byte count bsr accepts (8 EiB - 1): a file offset (``off_t``), a torch size and a
#: Prometheus sample all hold it exactly; a larger "size" is a typo, never a real store
MAX_BYTES = (1 << 63) - 1
#: Linux's limits on a path and on one name in it (bytes); longer ones fail with ENAMETOOLONG
PATH_MAX, NAME_MAX = 4096, 255


def positive_int(
    value: Any,
    what: str,
    *,
    maximum: int | None = None,
    error: type[ConfigError] = ConfigError,
    **fields: Any,
) -> int:
    """``value`` if it is a positive int (not a bool), at most ``maximum``, else ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{what} must be a positive int, got {short_repr(value)}", **fields)
    if maximum is not None and value > maximum:
        raise error(f"{what} must be at most {maximum}, got {short_repr(value)}", **fields)
    return value


def short_repr(value: Any) -> str:
    """``repr(value)``, shortened: a hostile value must not make the message huge."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (Python's int_max_str_digits)
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


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


_SIZE_RE = re.compile(r"\s*([0-9][0-9_]{0,39})(?:\.([0-9]{1,30}))?\s*([A-Za-z]{0,3})\s*")


def byte_size(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """A positive byte count from an int or a string such as ``"64GiB"``, ``"500 MB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000; case does not matter and ``_`` may group digits. The count is computed exactly (no
    float) and must be at most :data:`MAX_BYTES`.
    """
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        unit = m.group(3).lower() if m else ""
        if m is None or unit not in _SIZE_UNITS:
            raise error(
                f"{what} must be a byte count like 4096, '64GiB' or '500MB', "
                f"got {short_repr(value)}",
                **fields,
            )
        whole, frac = m.group(1).replace("_", ""), m.group(2) or ""
        number, rest = divmod(int(whole + frac) * _SIZE_UNITS[unit], 10 ** len(frac))
        if rest:
            raise error(f"{what} must be a whole number of bytes, got {value!r}", **fields)
        value = number
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(
            f"{what} must be a positive byte count (an int or a string like '64GiB'), "
            f"got {short_repr(value)}",
            **fields,
        )
    if value > MAX_BYTES:
        raise error(
            f"{what} must be at most {MAX_BYTES} bytes (8 EiB), got {short_repr(value)}; "
            "check the number and its unit",
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
            f"{what} must be an int or float{alt}, got {type(value).__name__} {short_repr(value)}",
            **fields,
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise error(f"{what} must be a finite number{alt}, got {short_repr(value)}", **fields)
    if minimum is not None and (number <= minimum if strict else number < minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise error(f"{what} must be {bound}{alt}, got {short_repr(value)}", **fields)
    return number


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
        raise error(f"{what} must be an int >= 0, got {short_repr(value)}", **fields)
    return value


def utf8_text(
    value: str, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> bytes:
    """``value`` encoded as UTF-8, or ``error`` saying which character cannot be encoded.

    Names and ids are hashed as UTF-8 and exported as metric labels, so a string that has no
    UTF-8 form (a lone surrogate, e.g. from bytes decoded with ``errors="surrogateescape"``) is
    refused with a message instead of a ``UnicodeEncodeError`` later (inside a save, or in every
    Prometheus scrape).
    """
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end]
        raise error(
            f"{what} {value!r} cannot be encoded as UTF-8: {bad!r} at position {exc.start} is a "
            "lone surrogate; use valid text (e.g. decode the original bytes with "
            "errors='replace') or choose another name",
            **fields,
        ) from None


def text(value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any) -> str:
    """A non-empty string that has a UTF-8 form (no lone surrogates)."""
    if not isinstance(value, str) or not value:
        raise error(f"{what} must be a non-empty string, got {short_repr(value)}", **fields)
    utf8_text(value, what, error=error, **fields)
    return value


def fs_path(value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any) -> str:
    """A non-empty filesystem path (str or ``os.PathLike``) the OS can take.

    Undecodable bytes carried as ``surrogateescape`` (how Python reads such names from the OS)
    are fine; a NUL byte, or a surrogate the filesystem encoding cannot carry, is refused here
    rather than as a ``ValueError`` or ``UnicodeEncodeError`` when the tier opens.
    """
    if not isinstance(value, (str, bytes)) and hasattr(value, "__fspath__"):
        value = value.__fspath__()  # os.fspath (this module stays free of os: core imports it)
    if not isinstance(value, str) or not value:
        raise error(
            f"{what} must be a directory path (a string), got {short_repr(value)}", **fields
        )
    if "\x00" in value:
        raise error(f"{what} must not contain a NUL character, got {short_repr(value)}", **fields)
    try:
        raw = value.encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} {value!r} cannot be encoded for the filesystem: {value[exc.start]!r} at "
            f"position {exc.start}; use a valid path",
            **fields,
        ) from None
    longest = max(len(part) for part in raw.split(b"/"))
    if len(raw) >= PATH_MAX or longest > NAME_MAX:
        raise error(
            f"{what} is too long for the filesystem ({len(raw)} bytes, a name of {longest}; "
            f"paths hold at most {PATH_MAX - 1} bytes and names {NAME_MAX}), got "
            f"{short_repr(value)}",
            **fields,
        )
    return value
