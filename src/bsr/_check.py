"""Argument checks shared by every public constructor and call.

One place decides what a valid option is, so every message reads the same and says what to
change. Each check returns the value it accepted (so ``x = positive_int(x, "what")`` reads well)
or raises a :class:`~bsr.ConfigError` (or the subclass given as ``error``) naming the option.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeGuard

from ._errors import ConfigError

#: the largest byte count bsr accepts (8 EiB - 1): a file offset (``off_t``), a torch size and a
#: Prometheus sample all hold it exactly; a larger "size" is a typo, never a real store
MAX_BYTES = (1 << 63) - 1
#: Linux's limits on a path and on one name in it (bytes); longer ones fail with ENAMETOOLONG
PATH_MAX, NAME_MAX = 4096, 255
#: the longest time a seconds option may name: 2**31 ms rounded down to whole seconds
#: (2,147,483 s, about 24.8 days). poll(2) and epoll_wait(2) take a timeout in milliseconds as a
#: C int, and CPython hands a socket's timeout to poll() that way: a socket timeout of 2**32 ms
#: plus 0.5 s times out after 0.5 s, and past about 9.2e9 s (2**63 ns) ``settimeout``,
#: ``threading`` waits and ``time`` conversions raise OverflowError. Every option is used
#: as a socket, thread, lock or event-loop timeout somewhere, so one bound covers them all; a
#: longer time is a typo or "forever", which an option says with None where it allows it.
MAX_SECONDS = 2_147_483


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
    maximum: float | None = None,
    unit: str = "",
    too_large: str = "",
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
        maximum: highest accepted value (inclusive).
        unit: written after the number in messages (``" s"``).
        too_large: what the message says after a value above ``maximum`` (why, what to do).
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
    if maximum is not None and number > maximum:
        tail = f"; {too_large}" if too_large else ""
        raise error(
            f"{what} must be at most {maximum:,}{unit}{alt}, got {short_repr(value)}{tail}",
            **fields,
        )
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


def _seconds_hint(none_ok: bool) -> str:
    forever = " (None: no limit)" if none_ok else ""
    return (
        "that is about 24.8 days, the longest timeout poll() and sockets represent: use a "
        f"shorter time{forever}"
    )


def positive_seconds(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float:
    """A time in seconds: a finite number > 0 and at most :data:`MAX_SECONDS`."""
    return finite_float(
        value,
        what,
        minimum=0.0,
        strict=True,
        maximum=MAX_SECONDS,
        unit=" s",
        too_large=_seconds_hint(False),
        error=error,
        **fields,
    )


def non_negative_seconds(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float:
    """A time in seconds that may be 0: a finite number >= 0, at most :data:`MAX_SECONDS`."""
    return finite_float(
        value,
        what,
        minimum=0.0,
        maximum=MAX_SECONDS,
        unit=" s",
        too_large=_seconds_hint(False),
        error=error,
        **fields,
    )


def optional_positive_seconds(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> float | None:
    """``None`` (no limit) or :func:`positive_seconds` (e.g. an optional deadline)."""
    if value is None:
        return None
    return finite_float(
        value,
        what,
        minimum=0.0,
        strict=True,
        maximum=MAX_SECONDS,
        unit=" s",
        too_large=_seconds_hint(True),
        none_ok=True,
        error=error,
        **fields,
    )


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (True is an int to Python, never to bsr)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(
    value: Any, what: str, minimum: int, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ``error`` naming ``what``."""
    if not is_int(value) or value < minimum:
        raise error(f"{what} must be an int >= {minimum}, got {short_repr(value)}", **fields)
    return int(value)


def int_between(
    value: Any,
    what: str,
    low: int,
    high: int,
    *,
    bounds: str = "",
    hint: str = "",
    error: type[ConfigError] = ConfigError,
    **fields: Any,
) -> int:
    """``value`` if it is an int (not a bool) with ``low <= value <= high``.

    ``bounds`` says the range in the message (default ``[low, high]``); ``hint`` what to do.
    """
    if not is_int(value) or not low <= value <= high:
        where = bounds or f"[{low}, {high}]"
        tail = f"; {hint}" if hint else ""
        raise error(f"{what} must be an int in {where}, got {short_repr(value)}{tail}", **fields)
    return int(value)


def non_negative_int(
    value: Any, what: str, *, error: type[ConfigError] = ConfigError, **fields: Any
) -> int:
    """``value`` if it is an int >= 0 (not a bool), else ``error`` naming ``what``."""
    return int_at_least(value, what, 0, error=error, **fields)


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


# --------------------------------------------------------------------- the option vocabulary
# Options (of the engine and of every tier kind) are frozen dataclasses whose fields carry a
# parser in their metadata: ``field: int = option(Check.size)``. One parser decides each option
# wherever it arrives from (a constructor argument, a config dict, a TOML file, an environment
# variable), so the constructor and the config can never disagree. A parser takes
# ``(value, key)``, returns the normalised value or raises a ConfigError whose ``key`` field and
# message name ``key``. :class:`Options` (below) is the base of such classes: construction runs
# the parsers, ``from_dict`` parses a mapping into the same checks.

Parser = Callable[[Any, str], Any]


class Check:
    """The parsers of the option vocabulary: ``(value, key) -> value`` or a ConfigError(key=key).

    Use them in :func:`option` fields, or call one directly (``Check.size(v, "capacity_bytes")``).
    """

    @staticmethod
    def size(value: Any, key: str) -> int:
        """A positive byte count: an int or a string such as ``"64GiB"`` (see :func:`byte_size`)."""
        return byte_size(value, key, key=key)

    @staticmethod
    def optional_size(value: Any, key: str) -> int | None:
        return None if value is None else Check.size(value, key)

    @staticmethod
    def size_or_zero(value: Any, key: str) -> int:
        """0 (none) or a positive byte count."""
        zero = isinstance(value, int) and not isinstance(value, bool) and value == 0
        return 0 if zero else Check.size(value, key)

    @staticmethod
    def positive_int(value: Any, key: str) -> int:
        return positive_int(value, key, key=key)

    @staticmethod
    def optional_positive_int(value: Any, key: str) -> int | None:
        return None if value is None else positive_int(value, key, key=key)

    @staticmethod
    def non_negative_int(value: Any, key: str) -> int:
        return non_negative_int(value, key, key=key)

    @staticmethod
    def seconds(value: Any, key: str) -> float:
        """A number of seconds > 0, at most :data:`MAX_SECONDS`."""
        return positive_seconds(value, key, key=key)

    @staticmethod
    def optional_seconds(value: Any, key: str) -> float | None:
        """None or a number of seconds > 0, at most :data:`MAX_SECONDS`."""
        return optional_positive_seconds(value, key, key=key)

    @staticmethod
    def non_negative_seconds(value: Any, key: str) -> float:
        """A number of seconds >= 0, at most :data:`MAX_SECONDS`."""
        return non_negative_seconds(value, key, key=key)

    @staticmethod
    def flag(value: Any, key: str) -> bool:
        """True or False (never 0, 1 or a string)."""
        if not isinstance(value, bool):
            raise ConfigError(
                f"{key} must be True or False (true or false in a config), got {short_repr(value)}",
                key=key,
            )
        return value

    @staticmethod
    def optional_flag(value: Any, key: str) -> bool | None:
        """True, False, or None (unset: the owner decides)."""
        return None if value is None else Check.flag(value, key)

    @staticmethod
    def text(value: Any, key: str) -> str:
        """A non-empty string with a UTF-8 form."""
        return text(value, key, key=key)

    @staticmethod
    def optional_text(value: Any, key: str) -> str | None:
        return None if value is None else text(value, key, key=key)

    @staticmethod
    def text_or_blank(value: Any, key: str) -> str:
        return "" if value == "" else text(value, key, key=key)

    @staticmethod
    def path(value: Any, key: str) -> str:
        """A filesystem path the OS can take (see :func:`fs_path`)."""
        return fs_path(value, key, key=key)

    @staticmethod
    def address(value: Any, key: str) -> str:
        """``host:port`` with a port in 1..65535 (an IPv6 host may be bracketed)."""
        host_port(value, key)
        return str(value)

    @staticmethod
    def optional_address(value: Any, key: str) -> str | None:
        return None if value is None else Check.address(value, key)

    @staticmethod
    def host_port(value: Any, key: str) -> tuple[str, int]:
        """An address option split for a socket: ``(host, port)`` of :meth:`address` (an IPv6
        host without its brackets)."""
        return host_port(value, key)

    @staticmethod
    def one_of(*choices: str) -> Parser:
        """A parser accepting exactly one of ``choices`` (strings; an enum's ``.value`` too)."""

        def parse(value: Any, key: str) -> str:
            value = getattr(value, "value", value)
            if not isinstance(value, str) or value not in choices:
                raise ConfigError(
                    f"{key}: must be one of {list(choices)}, got {short_repr(value)}", key=key
                )
            return value

        parse.takes_string = True  # type: ignore[attr-defined]
        return parse


for _parser in (
    Check.text,
    Check.optional_text,
    Check.text_or_blank,
    Check.path,
    Check.address,
    Check.optional_address,
):
    _parser.takes_string = True  # type: ignore[attr-defined]


def host_port(value: Any, key: str) -> tuple[str, int]:
    """Split ``host:port``; a ConfigError naming ``key`` unless the port is 1..65535."""
    address = text(value, key, key=key)
    host, sep, port = address.rpartition(":")
    digits = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not host or not digits or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{key} must be 'host:port', e.g. '127.0.0.1:50051', got {short_repr(address)}",
            key=key,
        )
    return host.strip("[]"), int(port)


def option(parse: Parser, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field checked by ``parse`` (in :func:`check_options` and :func:`parse_options`).

    Example::

        @dataclass(frozen=True)
        class MyOptions:
            capacity_bytes: int = option(Check.size)
            timeout_s: float = option(Check.seconds, 5.0)
    """
    meta = {"parse": parse, "string": bool(getattr(parse, "takes_string", False))}
    return dataclasses.field(default=default, metadata=meta)


def option_fields(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    """The fields of an options class that carry a parser, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if "parse" in f.metadata}


def check_options(obj: Any, prefix: str = "") -> None:
    """Run every option's parser on a (frozen) options object, storing the normalised values.

    Called from ``__post_init__``: a directly constructed options object is checked exactly
    like a parsed one. Errors name ``<prefix><field>``.
    """
    for name, f in option_fields(obj).items():
        object.__setattr__(obj, name, f.metadata["parse"](getattr(obj, name), prefix + name))


def parse_options(
    cls: Any, data: Mapping[str, Any], prefix: str = "", skip: Sequence[str] = ()
) -> dict[str, Any]:
    """Check a plain mapping against the options class ``cls``; return its constructor kwargs.

    An unknown key is an error with a close-match suggestion; a missing required key says what
    to add. Errors name ``<prefix><key>``.
    """
    import difflib

    fields = {n: f for n, f in option_fields(cls).items() if n not in skip}
    out: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            known = list(fields) + list(skip)
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown key {short_repr(key)}{hint}", key=key)
        out[name] = fields[name].metadata["parse"](value, key)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in out:
            where = f"the {prefix[:-1]} table" if prefix else "the config"
            raise ConfigError(
                f"{prefix}{name} is required; add {name} = ... to {where}", key=f"{prefix}{name}"
            )
    return out


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of an options class: a frozen dataclass of :func:`option` fields.

    Direct construction checks every field with its parser (errors name ``options_prefix`` and the
    field), then :meth:`validate` (rules across fields); :meth:`from_dict` parses a plain
    mapping (a config table: an unknown key is refused with the closest known one) into the
    same checks; :meth:`to_dict` is the plain form it reads back. The engine's options
    (:class:`~bsr.EngineOptions`, :class:`~bsr.EngineConfig`), every tier kind's
    (:class:`~bsr.TierOptions`) and the vLLM connector's are such classes. Example::

        @dataclass(frozen=True)
        class MyOptions(bsr.Options):
            capacity_bytes: int = bsr.option(bsr.Check.size)
            timeout_s: float = bsr.option(bsr.Check.seconds, 5.0)
    """

    #: written before a field's name in the errors of direct construction (``"bsr_connector."``)
    options_prefix: ClassVar[str] = ""
    #: what a mapping of these options is called in the error for a value that is none
    options_name: ClassVar[str] = "the options"
    #: keys a mapping may hold besides the fields (a tier table's ``kind``): listed among the
    #: known keys in the error for an unknown one
    options_other_keys: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_options(self, self.options_prefix)
        self.validate()

    def validate(self) -> None:
        """Checks across fields (default: none); raise a ConfigError naming one key."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str | None = None) -> Self:
        """Parse a plain mapping; errors name ``<prefix><key>`` (default ``options_prefix``).

        Raises:
            ConfigError: not a mapping, an unknown key (with the closest known one), a missing
                required one, or a bad value (naming the key and what to write instead).
        """
        prefix = cls.options_prefix if prefix is None else prefix
        if not isinstance(data, Mapping):
            names = ", ".join(list(option_fields(cls))[:3])
            raise ConfigError(
                f"{cls.options_name} must be a dict/table of options ({names}, ...), got "
                f"{type(data).__name__} {short_repr(data)}",
                **({"key": prefix[:-1]} if prefix else {}),
            )
        kwargs = parse_options(cls, data, prefix, skip=cls.options_other_keys)
        try:
            return cls(**kwargs)
        except ConfigError as exc:  # a rule across fields (validate): name it under prefix
            key = str(exc.fields.get("key") or "")
            key = key[len(cls.options_prefix) :] if key.startswith(cls.options_prefix) else key
            where = f"{prefix}{key}" if key else prefix[:-1]
            if not where:
                raise
            message = exc.message if exc.message.startswith(where) else f"{where}: {exc.message}"
            raise ConfigError(message, key=where) from None

    def to_dict(self) -> dict[str, Any]:
        """Every option by name; ``type(self).from_dict`` reads it back."""
        return {n: getattr(self, n) for n in option_fields(self)}
