"""The abstract tier: a place that retains objects.

Where it runs: on the serving process's event loop (any anyio backend). Blocking work (file I/O,
store RPCs, large memcpy) must run in worker threads; every method is a coroutine, except the
blocking reads (:meth:`Tier.fetch_into_blocking`, :meth:`Tier.read_many_blocking`), which a tier
with ``blocking_reads = True`` offers so that the transfer pipeline can move a whole batch of
objects in one worker-thread call.

How it works: a tier implements a small core (``contains_many``, ``fetch_into``, ``write``,
``delete``) and inherits working defaults for the rest (``read_into``, ``read_many_blocking``,
``usage``, ``statistics``, ``lease``, ``quarantine``, ``contains``). ``fetch_into`` moves an
object's stored bytes (its header, and its payload into a caller-provided buffer); it does not
vouch for them: whoever reads checks them against the header (``read_into`` does, and so does
the transfer pipeline for every object it installs, whatever tier moved it). Capability flags
are class attributes, as in zarr's stores, each read by the library: ``durable`` by the test
kit's campaign, ``blocking_reads`` / ``inline_reads`` / ``bulk_reads`` by the transfer pipeline,
``medium`` by the adapters that tell an engine where a hit came from. A :class:`TierWrapper`
delegates every method and reads every flag through to the tier it wraps, unless it changes
reads.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import anyio

from .._check import positive_seconds, text
from .._errors import ClosedError, ObjectError
from .._log import logger
from .._resource import AsyncResource
from ..core._keys import ChunkKey, ObjectKey
from ._codec import ObjectCodec
from ._reads import Begin, Borrowed, End, Fetched, read_one_by_one
from ._views import as_byte_view, as_payload_view
from ._watch import Removal, RemovalFeed, RemovalListener

__all__ = ["Borrowed", "Medium", "Tier", "TierWrapper", "as_byte_view", "as_payload_view"]


class Medium(str, enum.Enum):
    """Where a tier keeps its objects (:attr:`Tier.medium`), as an engine reports its hits."""

    #: the serving process's own memory (HostTier)
    HOST = "host"
    #: storage local to the serving host (FileTier)
    DISK = "disk"
    #: a store across the network or in other processes (Redis, Mooncake; the default)
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now: returned by :meth:`Tier.usage`."""

    #: objects stored
    objects: int = 0
    #: bytes stored (headers and padding included)
    bytes: int = 0
    #: the bound on ``bytes`` (0: unknown or enforced elsewhere)
    capacity_bytes: int = 0


@dataclass(frozen=True)
class TierStatistics:
    """A snapshot of a tier's counters."""

    #: the tier's name (a wrapper reports its own)
    name: str
    #: objects stored now
    objects: int
    #: bytes stored now
    bytes: int
    #: the bound on ``bytes`` (0: unknown)
    capacity_bytes: int
    #: reads that found their object / reads that did not
    hits: int
    misses: int
    #: objects evicted to make room
    evictions: int
    #: failed reads and writes (I/O errors and objects that failed verification)
    errors: int
    #: completed reads and writes, and their payload bytes
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    #: objects taken out of service after failing verification
    quarantined: int
    #: the largest ``bytes`` seen (reserved bytes of writes in progress included where tracked)
    peak_bytes: int
    #: entries in the tier's storage that are not its objects, skipped (and left alone) on open
    junk: int = 0
    #: reads given up by their caller (cancelled) while the worker was still in the kernel
    abandoned_reads: int = 0
    #: objects that could not be read on open (EACCES, EIO...): skipped, neither indexed nor moved
    unreadable: int = 0
    #: calls skipped because the tier stayed busy past its bound (:class:`~bsr.TierBusyError`:
    #: e.g. a FileTier root whose lock another process held)
    busy: int = 0


class _Counters:
    __slots__ = (
        "abandoned_reads",
        "busy",
        "bytes_read",
        "bytes_written",
        "errors",
        "evictions",
        "hits",
        "junk",
        "misses",
        "peak_bytes",
        "quarantined",
        "reads",
        "unreadable",
        "writes",
    )

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.errors = 0
        self.reads = self.writes = self.bytes_read = self.bytes_written = 0
        self.quarantined = self.peak_bytes = 0
        self.junk = self.abandoned_reads = self.unreadable = self.busy = 0


class TierLease:
    """Objects a tier promises not to evict until :meth:`release` or the lease's expiry.

    Returned by :meth:`Tier.lease`. The base class is the no-op lease of tiers that do not
    evict on their own schedule (or cannot pin); HostTier and FileTier return one that pins.
    Usable as a context manager (``with await tier.lease(objs, 5.0): ...``).
    """

    __slots__ = ("expires_at", "objects")

    def __init__(self, objects: tuple[str, ...] = (), expires_at: float = math.inf) -> None:
        #: object ids the lease pins (those the tier held when it was taken)
        self.objects = objects
        #: ``time.monotonic()`` at which the lease stops pinning
        self.expires_at = expires_at

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at

    def release(self) -> None:
        """Stop pinning now (idempotent)."""

    def __enter__(self) -> TierLease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(objects={len(self.objects)})"


class StorageHooks(Protocol):
    """Raw access to the objects a tier stores, behind its API: what :mod:`bsr.testing` uses to
    damage and seed stored objects (:meth:`Tier.storage_hooks`). The library never calls it.

    Every method is blocking and bypasses the tier's verification, capacity reservation and
    statistics; an object is named by its ``(key, group)`` and stored as bytes (header, payload,
    padding).
    """

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        """The stored bytes of ``(key, group)``; None when the storage holds no such object."""
        ...

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        """Replace the stored bytes of an object the storage holds with ``blob`` (where the
        tier indexes it, its entry keeps its size and recency); False when it holds none."""
        ...

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        """Store ``blob`` verbatim as ``(key, group)`` so that the tier holds it (an indexing
        tier indexes it outside its capacity reservation); False when the storage refuses."""
        ...


class Tier(AsyncResource, abc.ABC):
    """Abstract async tier. Use as ``async with tier:`` or call :meth:`aclose`.

    Subclasses implement the abstract methods; the other methods have working defaults that a
    subclass may override (a faster native batch call, a real lease, a usage report).
    """

    #: objects survive a process restart (read by bsr.testing's campaign: a volatile tier
    #: starts empty after a reopen)
    durable: ClassVar[bool] = False
    #: fetch_into_blocking() is implemented: the transfer pipeline may then move a whole batch
    #: of objects (:meth:`read_many_blocking`), check and install them in ONE worker-thread call
    blocking_reads: ClassVar[bool] = False
    #: fetch_into_blocking() is a bounded memory copy that never waits on a device or a peer,
    #: so the pipeline may run a small batch (a few hundred KiB) on the event loop itself
    #: instead of paying a worker-thread hop (implies ``blocking_reads``); its
    #: ``contains_many`` answers at memory speed too (a probe awaits such tiers first, one
    #: after another, and asks the others at once)
    inline_reads: ClassVar[bool] = False
    #: read_many_blocking() moves a batch its own way (several reads in flight on one thread,
    #: or objects lent in place), so the pipeline hands it whole batches through several
    #: staging slots at once (implies ``blocking_reads``)
    bulk_reads: ClassVar[bool] = False
    #: where the objects live (what an engine reports its hits as): the serving process's
    #: memory, local storage, or a remote store (the default)
    medium: ClassVar[Medium] = Medium.REMOTE

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # bsr 0.3 tiers implemented read_into (read and verify); since 0.4 the engine checks
        # every read itself and needs the object's header: refuse a tier it could not check
        if "read_into" in cls.__dict__ and "fetch_into" not in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides read_into() but not fetch_into(): since bsr 0.4 a "
                "tier moves an object's stored bytes with fetch_into(key, group, dst) -> "
                "Fetched(header, nbytes) and the engine checks them (docs/tiers.md, 'Write "
                "your own tier'); move your read into fetch_into and return the stored header "
                "with it (a wrapper that changes reads overrides fetch_into and, for blocking "
                "reads, fetch_into_blocking)"
            )

    def __init__(self, name: str) -> None:
        # a name is a log field, a result key and a metric label: text with a UTF-8 form
        self.name = text(name, "tier name")
        self._closed = False
        self._counters = _Counters()
        self._counters_lock = threading.Lock()
        self._log = logger.bind(tier=name)
        self._removals = RemovalFeed(self.name)

    def _count(self, **deltas: int) -> None:
        """Add to counters; safe from worker threads (``x += 1`` on an attribute is not)."""
        with self._counters_lock:
            c = self._counters
            for field, n in deltas.items():
                setattr(c, field, getattr(c, field) + n)

    def _count_hit(self, nbytes: int) -> None:
        """``_count(hits=1, reads=1, bytes_read=nbytes)`` without the generic loop (per read)."""
        with self._counters_lock:
            c = self._counters
            c.hits += 1
            c.reads += 1
            c.bytes_read += nbytes

    # ------------------------------------------------------------------ lifecycle
    # open() (called by ``async with`` and by the engine; default: nothing), aclose() (later
    # calls raise ClosedError), closed and _check_open() come from AsyncResource
    def _closed_error(self) -> ClosedError:
        return ClosedError(f"tier {self.name!r} is closed; open a new one", tier=self.name)

    # ------------------------------------------------------------------ abstract core
    @abc.abstractmethod
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        """For each object, whether this tier holds it completely. Metadata only."""

    @abc.abstractmethod
    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        """Move the stored object ``(key, group)``: its payload into ``dst`` (at most
        ``len(dst)`` bytes), its stored header into the :class:`Fetched` returned.

        Nothing here vouches for the bytes (a tier may check them too): :meth:`read_into` and
        the transfer pipeline check them against the header (:meth:`ObjectCodec.check_read`).
        A call its caller abandons (cancelled) never writes into ``dst`` after it returned.

        Raises:
            ObjectNotFoundError: the tier does not hold it.
            ObjectError: the stored bytes are not an object (a tier that looked).
            TierError: I/O failure or timeout.
        """

    @abc.abstractmethod
    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        """Store ``payload`` for ``(key, group)``. Returns False if already stored (kept as is).

        The object becomes visible to ``contains_many`` only once completely written.
        """

    @abc.abstractmethod
    async def delete(self, key: ChunkKey, group: str) -> bool:
        """Remove the object; return whether it existed."""

    # ------------------------------------------------------------------ reads
    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        """Read ``(key, group)`` into ``dst`` and check it; return the payload's length.

        Raises:
            ObjectNotFoundError: the tier does not hold it.
            ObjectError: it failed the check (nothing valid was returned).
            ConfigError: ``dst`` is smaller than the object's payload (the object is fine).
            TierError: I/O failure or timeout.
        """
        return self._checked(key, group, dst, await self.fetch_into(key, group, dst))

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        """:meth:`fetch_into`, synchronous and safe to call from a worker thread concurrently
        with the event loop. Tiers with ``blocking_reads = True`` implement it natively.

        Default (a tier whose reads are async only): its :meth:`fetch_into`, run on the event
        loop of the anyio worker thread calling this (``anyio.from_thread``); the transfer
        pipeline never calls it so (it reads such tiers with their async reads), but a caller
        of :meth:`read_many_blocking` in an ``anyio.to_thread`` worker may.
        """
        try:
            return anyio.from_thread.run(self.fetch_into, key, group, dst)
        except RuntimeError as exc:
            if "worker thread" not in str(exc):
                raise
            raise NotImplementedError(
                f"{type(self).__name__} reads with await fetch_into() (blocking_reads is "
                "False); its blocking reads run only in an anyio worker thread "
                "(anyio.to_thread.run_sync)"
            ) from exc

    def read_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> int:
        """:meth:`read_into`, synchronous (tiers with ``blocking_reads = True``)."""
        return self._checked(key, group, dst, self.fetch_into_blocking(key, group, dst))

    def _checked(self, key: ChunkKey, group: str, dst: Any, fetched: Fetched) -> int:
        """The payload length of a fetch into ``dst`` that passes the check, else its error."""
        view = as_byte_view(dst)
        header, n, stored = fetched
        plen = ObjectCodec.check_read(header, n, key, group, view, -1, stored)
        if plen >= 0:
            return plen
        exc = ObjectCodec.read_error(header, n, key, group, view, -1, stored, where=self.name)
        if isinstance(exc, ObjectError):
            self.refused()
        raise exc

    def refused(self) -> None:
        """Count one read whose bytes the reader's check refused (``statistics().errors``):
        the tier moved them, the engine would not have them. Thread-safe."""
        self._count(errors=1)

    def read_many_blocking(self, begin: Begin, end: End, ahead: int, *, lend: bool = False) -> None:
        """Move a batch of objects (:mod:`bsr.tiers._reads` has the contract): ``begin()``
        gives the next :class:`ReadItem` (None: none now), ``end(item, result)`` takes each one
        once as its read completes (the payload bytes moved into ``item.dst``, a
        :class:`Borrowed` payload when ``lend`` allows it, or the exception), with the stored
        header in ``item.header``; at most ``ahead`` reads in flight. Returns only once no
        destination it was given may still be written.

        Default: item by item with :meth:`fetch_into_blocking` (``blocking_reads`` tiers). A tier
        that moves a batch its own way overrides it and sets ``bulk_reads``.
        """
        read_one_by_one(self, begin, end)

    def usage(self) -> TierUsage:
        """What the tier holds now. Default: unknown (zeros); override to report it."""
        legacy = getattr(self, "_usage", None)  # bsr 0.1 tiers implemented a private _usage()
        if callable(legacy):
            objects, nbytes, capacity = legacy()
            return TierUsage(objects, nbytes, capacity)
        return TierUsage()

    async def lease(self, objects: Sequence[ObjectKey], ttl_s: float) -> TierLease:
        """Ask the tier to keep ``objects`` (those it holds) until release or ``ttl_s`` passes.

        Default: a no-op lease (a tier that does not evict on its own schedule, or cannot pin).

        Raises:
            ConfigError: ``ttl_s`` is not a finite number > 0.
            TierFullError: the lease would pin more than the tier's capacity.
        """
        self._check_open()
        ttl = positive_seconds(ttl_s, "lease ttl_s")
        return TierLease(tuple(o.object_id for o in objects), time.monotonic() + ttl)

    async def contains(self, key: ChunkKey, group: str) -> bool:
        return (await self.contains_many([ObjectKey(key, group)]))[0]

    async def recheck_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        """For each object, whether the tier's storage itself still holds it (an audit).

        Unlike :meth:`contains_many`, which may answer from what the tier remembers, this asks
        the storage, so it sees objects removed behind the tier's back (another process, a
        remote store's own eviction); a tier that forgets such an object reports it to its
        removal listeners (:meth:`on_removed`). Default: ``contains_many`` (right for tiers
        that ask their store on every probe). Metadata only.
        """
        return await self.contains_many(objects)

    def on_removed(self, listener: RemovalListener) -> Callable[[], None]:
        """Call ``listener(ObjectRemoved)`` whenever an object leaves this tier.

        HostTier and FileTier report every eviction, delete and quarantine as their index
        changes, and what :meth:`recheck_many` finds gone; other tiers report nothing by
        themselves (the engine reports what it removes, and an audit what vanished). The
        listener may be called from worker threads: keep it cheap and thread-safe. Returns a
        function that unsubscribes it.
        """
        return self._removals.add(listener)

    def _removed(self, object_id: str, cause: Removal) -> None:
        """Report one removal to the listeners (a subclass calls this where objects leave)."""
        self._removals.emit(object_id, cause)

    def storage_hooks(self) -> StorageHooks | None:
        """Raw access to this tier's stored objects for fault injection and test seeding
        (:func:`bsr.testing.corrupt_stored` and its siblings); None (the default): none."""
        return None

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        """Take a failing object out of service so later probes treat it as a miss.

        Default: delete it. Durable tiers may move it aside for inspection instead.
        """
        self._counters.quarantined += 1
        self._log.warning("bsr.tier.quarantine", key=key.hex[:16], group=group, reason=reason)
        try:
            await self.delete(key, group)
        except Exception as exc:  # a tier that cannot delete must still not fail the caller
            self._log.warning(
                "bsr.tier.quarantine_failed", key=key.hex[:16], group=group, error=repr(exc)
            )

    def statistics(self) -> TierStatistics:
        u = self.usage()
        c = self._counters
        c.peak_bytes = max(c.peak_bytes, u.bytes)
        return TierStatistics(
            name=self.name,
            objects=u.objects,
            bytes=u.bytes,
            capacity_bytes=u.capacity_bytes,
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            errors=c.errors,
            reads=c.reads,
            writes=c.writes,
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            quarantined=c.quarantined,
            peak_bytes=c.peak_bytes,
            junk=c.junk,
            abandoned_reads=c.abandoned_reads,
            unreadable=c.unreadable,
            busy=c.busy,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


T = TypeVar("T", bound=Tier)


class TierWrapper(Tier, Generic[T]):
    """A tier that adds behaviour around another tier (latency, faults, logging...).

    Every method delegates to ``inner`` and every capability flag reads through to it; a
    wrapper overrides only what it changes. The wrapper takes the inner tier's name by default,
    so results and ``bytes_by_tier`` read the same as without it; ``statistics()`` and ``repr``
    report the wrapper's own name.

    A wrapper that changes reads overrides :meth:`fetch_into` (and, to keep blocking reads,
    :meth:`fetch_into_blocking`). The flags then say what is left: ``blocking_reads`` only while
    the blocking read goes through the wrapper too, ``inline_reads`` and ``bulk_reads`` only
    while reads pass through unchanged; and :meth:`read_many_blocking` hands the batch to the
    inner tier only then (else it reads item by item through the wrapper's own
    ``fetch_into_blocking``), so a pipeline that moves batches never bypasses the wrapper.
    """

    def __init__(self, inner: T, *, name: str | None = None) -> None:
        super().__init__(name or inner.name)
        self.inner: T = inner

    @classmethod
    def _changes(cls, method: str) -> bool:
        return getattr(cls, method) is not getattr(TierWrapper, method)

    @classmethod
    def _reads_unchanged(cls) -> bool:
        return not (cls._changes("fetch_into") or cls._changes("fetch_into_blocking"))

    # capability flags: class-level on tiers, read through to the inner tier here
    @property  # type: ignore[misc]
    def durable(self) -> bool:  # type: ignore[override]
        return self.inner.durable

    @property  # type: ignore[misc]
    def medium(self) -> Medium:  # type: ignore[override]
        return self.inner.medium

    @property  # type: ignore[misc]
    def blocking_reads(self) -> bool:  # type: ignore[override]
        cls = type(self)
        through = cls._changes("fetch_into_blocking") or not cls._changes("fetch_into")
        return self.inner.blocking_reads and through

    @property  # type: ignore[misc]
    def inline_reads(self) -> bool:  # type: ignore[override]
        # a wrapper that changes reads (delay, faults) may block: never on the event loop
        return self.inner.inline_reads and self._reads_unchanged()

    @property  # type: ignore[misc]
    def bulk_reads(self) -> bool:  # type: ignore[override]
        return self.inner.bulk_reads and self._reads_unchanged()

    @property
    def closed(self) -> bool:
        return self._closed or self.inner.closed

    async def open(self) -> None:
        await self.inner.open()

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            await super().aclose()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def statistics(self) -> TierStatistics:
        return dataclasses.replace(self.inner.statistics(), name=self.name)

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        return await self.inner.contains_many(objects)

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        return await self.inner.fetch_into(key, group, dst)

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        if self._changes("fetch_into"):  # this wrapper's own async read, never around it
            return Tier.fetch_into_blocking(self, key, group, dst)
        return self.inner.fetch_into_blocking(key, group, dst)

    def refused(self) -> None:
        self.inner.refused()

    def read_many_blocking(self, begin: Begin, end: End, ahead: int, *, lend: bool = False) -> None:
        if self._reads_unchanged():
            self.inner.read_many_blocking(begin, end, ahead, lend=lend)
        else:  # through this wrapper's own reads, item by item
            read_one_by_one(self, begin, end)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        return await self.inner.write(key, group, payload)

    async def delete(self, key: ChunkKey, group: str) -> bool:
        return await self.inner.delete(key, group)

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        await self.inner.quarantine(key, group, reason)

    async def lease(self, objects: Sequence[ObjectKey], ttl_s: float) -> TierLease:
        return await self.inner.lease(objects, ttl_s)

    async def recheck_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        return await self.inner.recheck_many(objects)

    def storage_hooks(self) -> StorageHooks | None:
        return self.inner.storage_hooks()

    def on_removed(self, listener: RemovalListener) -> Callable[[], None]:
        # the inner tier's removals under this wrapper's name (the name the engine knows)
        if self.name == self.inner.name:
            return self.inner.on_removed(listener)
        name = self.name
        return self.inner.on_removed(lambda r: listener(dataclasses.replace(r, tier=name)))

    def __repr__(self) -> str:
        named = f"{self.name!r}, " if self.name != self.inner.name else ""
        return f"{type(self).__name__}({named}inner={self.inner!r})"
