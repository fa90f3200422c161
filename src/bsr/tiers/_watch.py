"""What a tier reports when an object leaves it: the removal seam.

Where it runs: wherever an object leaves a tier's index, which may be a worker thread (a write's
eviction, a read that found the file gone) as well as the event loop. Listeners are therefore
called on that thread, synchronously, and must be cheap and thread-safe (append to a locked
queue, count).

How it works: every tier has a :class:`RemovalFeed` (``Tier.on_removed(listener)`` subscribes).
The indexed tiers (HostTier, FileTier) report from their :class:`~bsr.tiers._lru.LruIndex` the
moment an entry leaves it (an LRU eviction, a delete, a quarantine, a file found gone), in the
order the index changed; the engine adds what it decides itself (an object quarantined in the
engine) and what an audit finds gone (removed by another process: ``bsr store gc``, another
server sharing the root; or by a remote store's own eviction). A removal is reported at least
once per object that leaves; a listener that keeps state deduplicates.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import ConfigError
from .._log import logger


class Removal(str, enum.Enum):
    """Why an object left a tier (or stopped being served from it)."""

    #: evicted to make room for a write (least recently used first)
    EVICTED = "evicted"
    #: deleted through the tier (the engine replacing a retired copy, an application), or
    #: forgotten by the tier after it found the object gone
    DELETED = "deleted"
    #: taken out of service after failing verification (or an I/O error) in this engine
    QUARANTINED = "quarantined"
    #: found gone by an audit: removed by another process (``bsr store gc``, ``bsr store verify
    #: --quarantine``, another server sharing a FileTier root) or by the store itself (a
    #: remote server's own eviction or expiry)
    VANISHED = "vanished"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ObjectRemoved:
    """One object that left a tier: the tier's name, the object's id and why."""

    tier: str
    object_id: str
    cause: Removal


RemovalListener = Callable[[ObjectRemoved], None]


class RemovalFeed:
    """The listeners of one source of removals (a tier, an engine). Thread-safe.

    A listener that raises is logged and ignored: reporting must never fail the write, read or
    delete that caused the removal.
    """

    __slots__ = ("_listeners", "_lock", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: tuple[RemovalListener, ...] = ()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def add(self, listener: RemovalListener) -> Callable[[], None]:
        """Subscribe ``listener``; returns a function that unsubscribes it (idempotent)."""
        if not callable(listener):
            raise ConfigError(f"a removal listener must be callable, got {listener!r}")
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def remove() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return remove

    def emit(self, object_id: str, cause: Removal, tier: str | None = None) -> None:
        """Tell every listener that ``object_id`` left tier ``tier`` (default: this feed's)."""
        listeners = self._listeners
        if not listeners:
            return
        record = ObjectRemoved(self.name if tier is None else tier, object_id, cause)
        for listener in listeners:
            try:
                listener(record)
            except Exception as exc:  # a listener's bug must never fail the tier's operation
                logger.warning(
                    "bsr.tier.removal_listener_failed", tier=record.tier, error=repr(exc)
                )
