"""LruIndex: the capacity, pin and lease bookkeeping shared by HostTier and FileTier.

Where it runs: on the event loop and in worker threads at once (a tier's blocking reads pin and
unpin from worker threads), so every method takes one ``threading.Lock``; no method blocks or
does I/O while holding it.

How it works: the index maps object ids to ``(size, value)`` in least-recently-used order
(``value`` is whatever the tier keeps per object: HostTier its bytes, FileTier nothing). Room
for a write is **reserved** before the bytes are written: :meth:`reserve` evicts unpinned
objects in LRU order until ``committed + reserved + size <= capacity`` and hands back the
victims (the tier deletes their storage) with a :class:`Reservation` that the writer either
commits (the object becomes visible) or aborts (the bytes are given back). Concurrent writers
therefore can never overshoot the capacity together. An object is pinned while a read is in
flight (:meth:`pin` / :meth:`unpin`) and while an unexpired lease holds it (:meth:`lease`); a
pinned object is never a victim. Leases expire on their own: an expired lease stops pinning even
if nobody calls ``release()``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio

from .._check import positive_int, positive_seconds
from .._errors import TierError, TierFullError
from ..core._keys import ObjectKey, object_id
from ._base import Tier, TierLease, TierStatistics, TierUsage
from ._watch import Removal, RemovalListener

V = TypeVar("V")


@dataclass(frozen=True)
class LruStatistics:
    """A snapshot of an :class:`LruIndex`."""

    #: objects held (committed)
    objects: int
    #: bytes of committed objects
    bytes: int
    #: bytes reserved by writes in progress
    reserved_bytes: int
    #: the largest ``bytes + reserved_bytes`` ever seen (never above ``capacity_bytes``)
    peak_bytes: int
    #: the bound on ``bytes + reserved_bytes``
    capacity_bytes: int
    #: objects pinned by reads in flight or by unexpired leases
    pinned: int
    #: unexpired leases
    leases: int
    #: objects evicted to make room
    evictions: int


class RoomPending(TierFullError):
    """No room now, but there will be once other writes in progress end (see reserve_waiting)."""


class Reservation:
    """Bytes set aside for one write; :meth:`commit` or :meth:`abort` exactly once.

    Both are idempotent after the first call of either, so a ``finally: r.abort()`` after a
    successful ``commit`` is harmless.
    """

    __slots__ = ("_done", "_index", "size")

    def __init__(self, index: LruIndex[Any], size: int) -> None:
        self._index = index
        self.size = size
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def commit(self, oid: str, value: Any = None) -> bool:
        """Make ``oid`` visible with this reservation's size; False if it was already there.

        When ``oid`` is already held (a concurrent writer won) the reserved bytes are given back
        and the existing object is kept.
        """
        return self._index._commit(self, oid, value)

    def abort(self) -> None:
        """Give the reserved bytes back (the write failed or was cancelled)."""
        self._index._abort(self)


class _Lease(TierLease):
    __slots__ = ("_index", "_lid")

    def __init__(
        self, index: LruIndex[Any], lid: int, objects: tuple[str, ...], expires_at: float
    ) -> None:
        super().__init__(objects=objects, expires_at=expires_at)
        self._index = index
        self._lid = lid

    def release(self) -> None:
        self._index._release(self._lid)


class LruIndex(Generic[V]):
    """Sizes, LRU order, pins, leases and reservations of one tier's objects.

    Args:
        capacity_bytes: bound on committed plus reserved bytes.
        lease_limit_bytes: bound on the bytes unexpired leases may pin together (default: the
            capacity; lower it to keep room for writes whatever the leases hold).
        clock: monotonic clock in seconds (leases expire by it); injectable for tests.
        name: the tier's name, for error messages.
        release: called once for every value that leaves the index (evicted, discarded,
            replaced, cleared) as soon as no read pins its object id: at once when none does,
            else at the last :meth:`unpin`. A tier whose values own memory (HostTier's arena
            blocks) frees it here, never while a read may still use it. Called under the
            index's lock: cheap, and never calling back into the index.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        lease_limit_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "tier",
        release: Callable[[V], None] | None = None,
    ) -> None:
        self.capacity_bytes = positive_int(capacity_bytes, "capacity_bytes")
        self.lease_limit_bytes = (
            capacity_bytes
            if lease_limit_bytes is None
            else positive_int(lease_limit_bytes, "lease_limit_bytes")
        )
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[int, V]] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._peak = 0
        self._evictions = 0
        self._pins: dict[str, int] = {}
        # lease id -> (expiry, object ids); leased[oid] = number of unexpired leases holding it
        self._leases: dict[int, tuple[float, tuple[str, ...]]] = {}
        self._leased: dict[str, int] = {}
        self._next_lease = 0
        #: called (under the lock, in the order the index changes) as an object leaves it
        self._watchers: tuple[Callable[[str, Removal], None], ...] = ()
        self._release_value = release
        #: values that left the index while their object id was pinned: released at its unpin
        self._dropped: dict[str, list[V]] = {}

    def watch(self, fn: Callable[[str, Removal], None]) -> None:
        """Call ``fn(oid, cause)`` whenever an object leaves the index (an eviction, a
        :meth:`discard`), under the index's lock, so in the order the index changed: ``fn``
        must be cheap and must not call back into the index. :meth:`clear` reports nothing (a
        tier closing, not objects leaving)."""
        with self._lock:
            self._watchers = (*self._watchers, fn)

    def _left_locked(self, oid: str, cause: Removal) -> None:
        for fn in self._watchers:
            fn(oid, cause)

    def _drop_value_locked(self, oid: str, value: V) -> None:
        """``value`` left the index: released now, or once no read pins ``oid``."""
        if self._release_value is None:
            return
        if oid in self._pins:
            self._dropped.setdefault(oid, []).append(value)
        else:
            self._release_value(value)

    def _unpinned_locked(self, oid: str) -> None:
        dropped = self._dropped.pop(oid, None) if self._dropped else None
        if dropped is not None and self._release_value is not None:
            for value in dropped:
                self._release_value(value)

    # ------------------------------------------------------------------ queries
    def __contains__(self, oid: object) -> bool:
        with self._lock:
            return oid in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def contains_many(self, oids: Sequence[str]) -> list[bool]:
        """For each of ``oids``, whether it is held (one lock for the batch)."""
        with self._lock:
            entries = self._entries
            return [oid in entries for oid in oids]

    @property
    def bytes(self) -> int:
        """Bytes of committed objects."""
        with self._lock:
            return self._bytes

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved

    def size_of(self, oid: str) -> int | None:
        with self._lock:
            entry = self._entries.get(oid)
            return None if entry is None else entry[0]

    def peek(self, oid: str) -> V | None:
        """The value kept for ``oid`` without touching its recency (None when absent)."""
        with self._lock:
            entry = self._entries.get(oid)
            return None if entry is None else entry[1]

    def oids(self) -> list[str]:
        """Every object id, least recently used first."""
        with self._lock:
            return list(self._entries)

    def is_pinned(self, oid: str) -> bool:
        with self._lock:
            self._expire_locked()
            return oid in self._pins or oid in self._leased

    def statistics(self) -> LruStatistics:
        with self._lock:
            self._expire_locked()
            return LruStatistics(
                objects=len(self._entries),
                bytes=self._bytes,
                reserved_bytes=self._reserved,
                peak_bytes=self._peak,
                capacity_bytes=self.capacity_bytes,
                pinned=len(self._pins.keys() | self._leased.keys()),
                leases=len(self._leases),
                evictions=self._evictions,
            )

    # ------------------------------------------------------------------ updates
    def touch(self, oid: str) -> bool:
        """Mark ``oid`` most recently used; False when it is not held."""
        with self._lock:
            if oid not in self._entries:
                return False
            self._entries.move_to_end(oid)
            return True

    def put(self, oid: str, size: int, value: V) -> None:
        """Insert or replace ``oid`` as most recently used, outside any reservation.

        For rebuilding an index (a tier's scan on open); it may leave the index above capacity,
        which :meth:`trim` then corrects.
        """
        with self._lock:
            old = self._entries.pop(oid, None)
            if old is not None:
                self._bytes -= old[0]
                self._drop_value_locked(oid, old[1])
            self._entries[oid] = (size, value)
            self._bytes += size  # the peak is taken after trim(): put() may overshoot

    def put_lru(self, oid: str, size: int, value: V) -> bool:
        """Insert ``oid`` as the least recently used entry unless it is held; whether it was new.

        For objects found on storage that this process has not used (another process wrote
        them): they are the first candidates for eviction.
        """
        with self._lock:
            if oid in self._entries:
                return False
            self._entries[oid] = (size, value)
            self._entries.move_to_end(oid, last=False)
            self._bytes += size
            return True

    def pop_victim(self, only: Callable[[str], bool] | None = None) -> tuple[str, int, V] | None:
        """Remove and return the least recently used object not pinned by a read or a lease
        (and, given ``only``, one for which ``only(oid)`` is true: a FileTier in network mode
        evicts only what its node wrote).

        Selection and removal are one step under the lock, so a read that pins the object first
        keeps it, and one that comes after misses. The caller deletes its storage.
        """
        with self._lock:
            self._expire_locked()
            for oid, (size, value) in self._entries.items():
                if oid in self._pins or oid in self._leased or (only is not None and not only(oid)):
                    continue
                del self._entries[oid]
                self._bytes -= size
                self._evictions += 1
                if self._watchers:
                    self._left_locked(oid, Removal.EVICTED)
                self._drop_value_locked(oid, value)
                return oid, size, value
            return None

    def replace_value(self, oid: str, value: V) -> bool:
        """Swap the value kept for ``oid`` (same size and recency); False when absent."""
        with self._lock:
            entry = self._entries.get(oid)
            if entry is None:
                return False
            self._entries[oid] = (entry[0], value)
            if entry[1] is not value:
                self._drop_value_locked(oid, entry[1])
            return True

    def discard(self, oid: str, cause: Removal = Removal.DELETED) -> bool:
        """Forget ``oid`` (deleted, quarantined or vanished: ``cause`` says which to the
        watchers); whether it was held."""
        with self._lock:
            entry = self._entries.pop(oid, None)
            if entry is None:
                return False
            self._bytes -= entry[0]
            if self._watchers:
                self._left_locked(oid, cause)
            self._drop_value_locked(oid, entry[1])
            return True

    def clear(self) -> None:
        with self._lock:
            for oid, (_, value) in self._entries.items():
                self._drop_value_locked(oid, value)
            self._entries.clear()
            self._bytes = 0

    def pin(self, oid: str) -> tuple[int, V] | None:
        """Pin ``oid`` for a read and mark it recently used; its ``(size, value)`` or None.

        Pair every successful pin with one :meth:`unpin`.
        """
        with self._lock:
            entry = self._entries.get(oid)
            if entry is None:
                return None
            self._entries.move_to_end(oid)
            self._pins[oid] = self._pins.get(oid, 0) + 1
            return entry

    def pin_many(self, oids: Sequence[str]) -> list[tuple[int, V] | None]:
        """:meth:`pin` of each of ``oids`` under one lock (a batch of reads); an entry is None
        where the object is not held (nothing pinned for it)."""
        out: list[tuple[int, V] | None] = []
        append = out.append
        with self._lock:
            entries, pins = self._entries, self._pins
            for oid in oids:
                entry = entries.get(oid)
                if entry is not None:
                    entries.move_to_end(oid)
                    pins[oid] = pins.get(oid, 0) + 1
                append(entry)
        return out

    def unpin_many(self, oids: Sequence[str]) -> None:
        """:meth:`unpin` of each of ``oids`` (each pinned once more than it is unpinned here)
        under one lock."""
        with self._lock:
            pins = self._pins
            for oid in oids:
                n = pins.get(oid, 0)
                if n <= 0:
                    raise TierError(f"unpin of {oid[:16]} without a pin", tier=self.name)
                if n == 1:
                    del pins[oid]
                    self._unpinned_locked(oid)
                else:
                    pins[oid] = n - 1

    def unpin(self, oid: str) -> None:
        with self._lock:
            n = self._pins.get(oid, 0)
            if n <= 0:
                raise TierError(f"unpin of {oid[:16]} without a pin", tier=self.name)
            if n == 1:
                del self._pins[oid]
                self._unpinned_locked(oid)
            else:
                self._pins[oid] = n - 1

    # ------------------------------------------------------------------ capacity
    def reserve(self, size: int) -> tuple[Reservation, list[tuple[str, V]]]:
        """Set ``size`` bytes aside, evicting unpinned objects in LRU order to make room.

        Returns the reservation and the evicted ``(oid, value)`` pairs, already gone from the
        index; the caller removes their storage.

        Raises:
            TierFullError: ``size`` exceeds the capacity, or pinned objects and other writes in
                progress leave no room (nothing is evicted then).
        """
        if size > self.capacity_bytes:
            raise TierFullError(
                f"object of {size} bytes exceeds capacity {self.capacity_bytes}; "
                "raise capacity_bytes",
                tier=self.name,
            )
        with self._lock:
            self._expire_locked()
            victims = self._victims_locked(self._bytes + self._reserved + size)
            if (
                victims is None
                and self._reserved
                and self._pinned_bytes_locked() + size <= (self.capacity_bytes)
            ):
                raise RoomPending(
                    f"{self.name!r} has room for {size} bytes once writes in progress finish",
                    tier=self.name,
                )
            if victims is None:
                raise TierFullError(
                    f"{self.name!r} has no room for {size} bytes: the rest is pinned by reads or "
                    "leases or reserved by writes in progress; retry later or raise "
                    "capacity_bytes",
                    tier=self.name,
                )
            evicted = self._evict_locked(victims)
            self._reserved += size
            self._peak = max(self._peak, self._bytes + self._reserved)
            return Reservation(self, size), evicted

    def trim(self) -> list[tuple[str, V]]:
        """Evict unpinned LRU objects until the index is within capacity; the evicted pairs."""
        with self._lock:
            self._expire_locked()
            victims = []
            total = self._bytes + self._reserved
            for oid, (osize, _) in self._entries.items():
                if total <= self.capacity_bytes:
                    break
                if oid in self._pins or oid in self._leased:
                    continue
                victims.append(oid)
                total -= osize
            evicted = self._evict_locked(victims)
            self._peak = max(self._peak, self._bytes + self._reserved)
            return evicted

    async def reserve_waiting(
        self, size: int, *, poll_s: float = 0.001
    ) -> tuple[Reservation, list[tuple[str, V]]]:
        """:meth:`reserve`, waiting while only other writes in progress stand in the way.

        Those writes end (committed objects become evictable, aborted ones give their bytes
        back), so the wait is bounded by them; it is cancellable. Pins and leases that leave no
        room raise :class:`~bsr.TierFullError` at once.
        """
        while True:
            try:
                return self.reserve(size)
            except RoomPending:
                await anyio.sleep(poll_s)
                poll_s = min(poll_s * 2, 0.02)

    def _pinned_bytes_locked(self) -> int:
        return sum(
            size
            for oid, (size, _) in self._entries.items()
            if oid in self._pins or oid in self._leased
        )

    def _victims_locked(self, need: int) -> list[str] | None:
        if need <= self.capacity_bytes:
            return []
        victims: list[str] = []
        for oid, (osize, _) in self._entries.items():
            if need <= self.capacity_bytes:
                break
            if oid in self._pins or oid in self._leased:
                continue
            victims.append(oid)
            need -= osize
        return victims if need <= self.capacity_bytes else None

    def _evict_locked(self, victims: Iterable[str]) -> list[tuple[str, V]]:
        out = []
        for oid in victims:
            osize, value = self._entries.pop(oid)
            self._bytes -= osize
            self._evictions += 1
            out.append((oid, value))
            if self._watchers:
                self._left_locked(oid, Removal.EVICTED)
            self._drop_value_locked(oid, value)
        return out

    def _commit(self, r: Reservation, oid: str, value: Any) -> bool:
        with self._lock:
            if r._done:
                raise TierError("reservation already committed or aborted", tier=self.name)
            r._done = True
            self._reserved -= r.size
            if oid in self._entries:
                return False
            self._entries[oid] = (r.size, value)
            self._bytes += r.size
            return True

    def _abort(self, r: Reservation) -> None:
        with self._lock:
            if r._done:
                return
            r._done = True
            self._reserved -= r.size

    # ------------------------------------------------------------------ leases
    def lease(self, oids: Iterable[str], ttl_s: float) -> TierLease:
        """Pin the held objects among ``oids`` until ``release()`` or ``ttl_s`` seconds pass.

        Objects not held are ignored (a lease protects what the tier holds now).

        Raises:
            ConfigError: ``ttl_s`` is not a finite number > 0.
            TierFullError: the objects pinned by leases would exceed ``lease_limit_bytes``.
        """
        ttl = positive_seconds(ttl_s, "lease ttl_s")
        with self._lock:
            self._expire_locked()
            held = tuple(dict.fromkeys(o for o in oids if o in self._entries))
            leased_bytes = sum(self._entries[o][0] for o in self._leased if o in self._entries)
            extra = sum(self._entries[o][0] for o in held if o not in self._leased)
            if leased_bytes + extra > self.lease_limit_bytes:
                raise TierFullError(
                    f"a lease on {extra} more bytes would pin {leased_bytes + extra} bytes, more "
                    f"than {self.name!r} lets leases pin ({self.lease_limit_bytes}); lease fewer "
                    "objects, release leases sooner or raise capacity_bytes",
                    tier=self.name,
                )
            lid = self._next_lease
            self._next_lease += 1
            expires = self._clock() + ttl
            self._leases[lid] = (expires, held)
            for o in held:
                self._leased[o] = self._leased.get(o, 0) + 1
            return _Lease(self, lid, held, expires)

    def _release(self, lid: int) -> None:
        with self._lock:
            self._drop_lease_locked(lid)

    def _drop_lease_locked(self, lid: int) -> None:
        lease = self._leases.pop(lid, None)
        if lease is None:
            return
        for o in lease[1]:
            n = self._leased[o]
            if n == 1:
                del self._leased[o]
            else:
                self._leased[o] = n - 1

    def _expire_locked(self) -> None:
        if not self._leases:
            return
        now = self._clock()
        for lid in [lid for lid, (exp, _) in self._leases.items() if exp <= now]:
            self._drop_lease_locked(lid)


class IndexedTier(Tier):
    """A tier whose objects an :class:`LruIndex` tracks (``self._index``) against
    ``capacity_bytes``: usage, statistics, metadata-only probes and leases come from the index.

    Subclasses set ``_index`` and ``capacity_bytes`` and may tighten :meth:`_ready` (the check
    every call makes before touching the index).
    """

    _index: LruIndex[Any]
    capacity_bytes: int
    _watching: bool = False

    def _ready(self) -> None:
        self._check_open()

    def on_removed(self, listener: RemovalListener) -> Callable[[], None]:
        """See :meth:`Tier.on_removed`: reported by the index as entries leave it."""
        if not self._watching:  # the index reports to this tier's feed from now on
            self._watching = True
            self._index.watch(self._removed)
        return super().on_removed(listener)

    def usage(self) -> TierUsage:
        s = self._index.statistics()
        return TierUsage(s.objects, s.bytes, self.capacity_bytes)

    def statistics(self) -> TierStatistics:
        st = super().statistics()
        return dataclasses.replace(
            st, peak_bytes=max(st.peak_bytes, self._index.statistics().peak_bytes)
        )

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._ready()
        return self._index.contains_many([object_id(o.chunk.digest, o.group) for o in objects])

    async def lease(self, objects: Sequence[ObjectKey], ttl_s: float) -> TierLease:
        """Pin the held ``objects`` against eviction until ``release()`` or ``ttl_s`` passes."""
        self._ready()
        return self._index.lease([o.object_id for o in objects], ttl_s)
