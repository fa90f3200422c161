"""The abstract tier: a place that retains objects.

Where it runs: on the serving process's event loop (any anyio backend). Blocking work (file I/O,
store RPCs, large memcpy) must run in worker threads; every method is a coroutine, except
:meth:`Tier.read_into_blocking`, which a tier with ``blocking_reads = True`` offers so that the
transfer pipeline can read, verify and install a whole batch of chunks in one worker-thread call.

How it works: a tier implements a small core (``contains_many``, ``read_into``, ``write``,
``delete``) and inherits working defaults for the rest (``usage``, ``statistics``, ``lease``,
``quarantine``, ``contains``). ``read_into`` writes the payload into a caller-provided buffer (a
staging slot region) and verifies the object's header and checksum before returning; it never
returns unverified bytes as valid. Capability flags are class attributes, as in zarr's stores,
and each one is read by the library: ``durable`` by the test kit's campaign (a volatile tier
starts empty after a reopen) and ``blocking_reads`` / ``inline_reads`` by the transfer pipeline. A
:class:`TierWrapper` delegates every method and reads every flag through to the tier it wraps.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from .._check import positive_float, text
from .._errors import ClosedError, ConfigError
from .._log import logger
from .._resource import AsyncResource
from ..core._keys import ChunkKey, ObjectKey
from ._watch import Removal, RemovalFeed, RemovalListener


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


class Borrowed:
    """A verified payload lent by a tier in place (:meth:`Tier.borrow_blocking`).

    ``payload`` is a flat uint8 NumPy view of the tier's own bytes: read it, never write it, and
    :meth:`release` it (idempotent) as soon as it has been copied; until then the tier keeps the
    object pinned.
    """

    __slots__ = ("_release", "payload")

    def __init__(self, payload: Any, release: Any) -> None:
        self.payload = payload
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class LentPayloads:
    """The payloads of a batch of objects lent by a tier in place
    (:meth:`Tier.borrow_many_blocking`).

    ``items[i]`` is the i-th object's verified payload (a flat uint8 NumPy view of the tier's
    own bytes, as :attr:`Borrowed.payload`) or the exception asking for it raised
    (``ObjectNotFoundError``, an ``ObjectError``, ...): one object's failure is its own, the
    others are lent. Read the payloads, never write them, and :meth:`release` them (idempotent)
    once copied; until then the tier keeps every lent object pinned.
    """

    __slots__ = ("_release", "items")

    def __init__(self, items: list[Any], release: Any) -> None:
        self.items = items
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def as_byte_view(dst: Any) -> memoryview:
    """A writable flat byte view of a CPU buffer (uint8 tensor, numpy array, bytearray...)."""
    if isinstance(dst, torch.Tensor):
        if dst.device.type != "cpu":
            raise ConfigError(
                "this tier reads into host buffers; pass a CPU tensor", device=str(dst.device)
            )
        if not dst.is_contiguous():
            raise ConfigError("read_into needs a contiguous destination tensor")
        dst = dst.view(torch.uint8).reshape(-1).numpy()
    mv = memoryview(dst)
    if mv.readonly:
        raise ConfigError("read_into needs a writable destination buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_payload_view(payload: Any) -> memoryview:
    """A flat byte view of a payload to store (bytes-likes as they are, else as_byte_view)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        mv = memoryview(payload)
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return as_byte_view(payload)


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
    #: read_into_blocking() is implemented: the transfer pipeline may then run reads, checksum
    #: verification and host installs of a whole batch of chunks in ONE worker-thread call
    blocking_reads: ClassVar[bool] = False
    #: read_into_blocking() is a bounded memory copy that never waits on a device or a peer, so
    #: the pipeline may run a small batch (a few hundred KiB) on the event loop itself instead of
    #: paying a worker-thread hop (implies ``blocking_reads``)
    inline_reads: ClassVar[bool] = False
    #: borrow_blocking() is implemented: the tier holds objects in host memory and can lend a
    #: verified payload where it lies (pinned until released), so a host install copies it
    #: once, with no staging copy
    borrow_reads: ClassVar[bool] = False

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
    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        """Read and verify the payload of ``(key, group)`` into ``dst``; return its length.

        Raises:
            ObjectNotFoundError: the tier does not hold it.
            ObjectError: it failed verification (nothing valid was returned).
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

    # ------------------------------------------------------------------ defaults
    def read_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> int:
        """Same contract as read_into (verify before returning; raise ObjectNotFoundError /
        ObjectError / TierError), but synchronous and safe to call from any worker thread
        concurrently with the event loop.

        Only tiers with ``blocking_reads = True`` implement it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no blocking reads (blocking_reads is False); "
            "call await read_into()"
        )

    def borrow_blocking(self, key: ChunkKey, group: str) -> Borrowed:
        """Verify ``(key, group)`` where the tier keeps it and lend its payload, pinned (never
        evicted or changed) until :meth:`Borrowed.release`. Same errors as ``read_into``.

        Only tiers with ``borrow_reads = True`` implement it (any thread, like
        :meth:`read_into_blocking`).
        """
        raise NotImplementedError(f"{type(self).__name__} lends no payloads (borrow_reads)")

    def borrow_many_blocking(self, objects: Sequence[tuple[ChunkKey, str]]) -> LentPayloads:
        """:meth:`borrow_blocking` of every ``(key, group)`` of ``objects``, one result per
        object (a payload, or the exception asking for it raised; see :class:`LentPayloads`).

        Default: one :meth:`borrow_blocking` per object. A lending tier may override it to pin
        and verify a whole batch at once (HostTier does); the contract is the same.
        """
        lent: list[Borrowed] = []
        items: list[Any] = []
        try:
            for key, group in objects:
                try:
                    b = self.borrow_blocking(key, group)
                except Exception as exc:
                    items.append(exc)
                    continue
                lent.append(b)
                items.append(b.payload)
        except BaseException:
            for b in lent:
                b.release()
            raise

        def release() -> None:
            for b in lent:
                b.release()

        return LentPayloads(items, release)

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
        ttl = positive_float(ttl_s, "lease ttl_s")
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

    ``blocking_reads`` reads through only while the wrapper does not change reads: a subclass
    that overrides ``read_into`` without also overriding ``read_into_blocking`` reports False,
    so a pipeline that batches blocking reads cannot bypass the wrapper's behaviour.
    """

    def __init__(self, inner: T, *, name: str | None = None) -> None:
        super().__init__(name or inner.name)
        self.inner: T = inner

    # capability flags: class-level on tiers, read through to the inner tier here
    @property  # type: ignore[misc]
    def durable(self) -> bool:  # type: ignore[override]
        return self.inner.durable

    @property  # type: ignore[misc]
    def blocking_reads(self) -> bool:  # type: ignore[override]
        cls = type(self)
        changes_reads = cls.read_into is not TierWrapper.read_into
        blocking_too = cls.read_into_blocking is not TierWrapper.read_into_blocking
        return self.inner.blocking_reads and (blocking_too or not changes_reads)

    @property  # type: ignore[misc]
    def inline_reads(self) -> bool:  # type: ignore[override]
        # a wrapper that changes blocking reads (delay, faults) may block: never on the loop
        unchanged = type(self).read_into_blocking is TierWrapper.read_into_blocking
        return self.inner.inline_reads and bool(self.blocking_reads) and unchanged

    @property  # type: ignore[misc]
    def borrow_reads(self) -> bool:  # type: ignore[override]
        # a wrapper exists to change reads (delay, faults, accounting): never lend around it
        return False

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

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        return await self.inner.read_into(key, group, dst)

    def read_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> int:
        return self.inner.read_into_blocking(key, group, dst)

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
