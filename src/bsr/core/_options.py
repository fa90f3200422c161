"""Option enums of a restore (commit policy, transfer strategy, promotion) and their parser."""

from __future__ import annotations

import enum
from typing import TypeVar

from .._errors import ConfigError

E = TypeVar("E", bound=enum.Enum)


class Policy(str, enum.Enum):
    """What a restore may commit when part of the prefix cannot be installed."""

    #: full reuse of the agreed prefix or zero external reuse (default)
    ALL_OR_NOTHING = "all_or_nothing"
    #: commit the longest agreed prefix of fully installed chunks (never a partial chunk/group)
    TRUNCATE = "truncate"
    #: load the part of the agreed prefix that is faster to load than to recompute by the
    #: measured rates (the whole of it, a shorter prefix, or nothing), all-or-nothing
    COST = "cost"


class Strategy(str, enum.Enum):
    """How bytes move during a restore."""

    #: stream through the engine's W staging slots (RWS <= W x slot_bytes)
    BOUNDED = "bounded"
    #: LMCache-style baseline: read every hit chunk into host memory, then install (RWS = |S|)
    WHOLE_PLAN = "whole_plan"


class Promote(str, enum.Enum):
    """When a restore's hits read from a tier below the host tier are copied into it."""

    #: never: each restore reads its prefix where it lies (default)
    NEVER = "never"
    #: when the same prefix is restored from a lower tier a second time
    SECOND_HIT = "second_hit"
    #: after every restore that read from a lower tier
    ALWAYS = "always"


def choice(enum_type: type[E], value: object, what: str) -> E:
    """``enum_type(value)`` with a :class:`~bsr.ConfigError` that lists the choices."""
    try:
        return enum_type(value)
    except ValueError:
        options = ", ".join(repr(m.value) for m in enum_type)  # type: ignore[attr-defined]
        raise ConfigError(
            f"unknown {what} {value!r}; use one of {options}", **{what: value}
        ) from None
