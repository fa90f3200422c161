"""HostTier: L1, objects in host DRAM with LRU eviction.

Where it runs: the serving process; reads run in worker threads (``read_into`` is a thin
``to_thread`` wrapper over :meth:`HostTier.read_into_blocking`, which the transfer pipeline may
also call directly in its own worker thread).

How it works: objects are kept encoded (header + payload) so a read verifies exactly what a
durable tier would. Sizes, LRU order, pins and leases live in a shared
:class:`~bsr.tiers._lru.LruIndex` (thread-safe): a write reserves its bytes before it fills
them, so concurrent writes never overshoot ``capacity_bytes``; an object being read, or held by
an unexpired lease, is never evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import anyio
import numpy as np

from .._check import Check, option
from .._errors import ObjectNotFoundError
from ..core._keys import ChunkKey, ObjectKey, object_id
from ._base import Borrowed, LentPayloads, StorageHooks, Tier, as_payload_view
from ._codec import ObjectCodec
from ._lru import IndexedTier, LruIndex
from ._registry import TierOptions, takes_options

Blob = np.ndarray[Any, np.dtype[np.uint8]]


@dataclass(frozen=True)
class HostTierOptions(TierOptions):
    """A :class:`HostTier`: ``{"kind": "host", "capacity_bytes": "8GiB", "name": "host"}``."""

    kind = "host"
    capacity_bytes: int = option(Check.size)
    _: KW_ONLY
    name: str = option(Check.text, "host")

    def build(self) -> Tier:
        return HostTier(**self.arguments())


class HostTier(IndexedTier):
    """L1 tier in host memory.

    Args:
        capacity_bytes: upper bound on stored bytes (headers included); least recently used
            objects are evicted to make room, never one that is being read or is leased.
        name: tier name used in statistics, logs and ``bytes_by_tier``.
    """

    durable = False
    blocking_reads = True
    inline_reads = True  # a verified memcpy out of DRAM
    borrow_reads = True  # a verified payload lent where it lies (borrow_blocking)

    @takes_options(HostTierOptions)
    def __init__(self, options: HostTierOptions) -> None:
        self.options = options
        super().__init__(options.name)
        self.capacity_bytes = options.capacity_bytes
        self._index: LruIndex[Blob] = LruIndex(self.capacity_bytes, name=options.name)

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        # not abandonable: a memcpy is bounded, and no byte may land in dst after we return
        return await anyio.to_thread.run_sync(self.read_into_blocking, key, group, dst)

    def read_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> int:
        self._check_open()
        okey = ObjectKey(key, group)
        got = self._index.pin(okey.object_id)
        if got is None:
            self._count(misses=1)
            raise ObjectNotFoundError(
                "object not in host tier", tier=self.name, key=key.hex[:16], group=group
            )
        try:
            plen = self._copy_verified(okey, got[1], dst)
        except Exception:
            self._count(errors=1)
            raise
        finally:
            self._index.unpin(okey.object_id)
        self._count_hit(plen)
        return plen

    def borrow_blocking(self, key: ChunkKey, group: str) -> Borrowed:
        """Verify the object where it lies and lend its payload, pinned until released.

        The restore pipeline installs a host-destination chunk from here with one copy (no
        staging slot copy); the pin keeps the object from eviction meanwhile (its bytes are
        immutable once written), and the payload is checked here, before anything is copied.
        """
        self._check_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        got = self._index.pin(oid)
        if got is None:
            self._count(misses=1)
            raise ObjectNotFoundError(
                "object not in host tier", tier=self.name, key=key.hex[:16], group=group
            )
        try:
            payload = ObjectCodec.verified_payload(got[1], okey, where=self.name)
        except BaseException:
            self._index.unpin(oid)
            self._count(errors=1)
            raise
        self._count_hit(len(payload))
        return Borrowed(payload, lambda: self._index.unpin(oid))

    def borrow_many_blocking(self, objects: Sequence[tuple[ChunkKey, str]]) -> LentPayloads:
        """:meth:`borrow_blocking` of a whole batch: every object pinned under one lock,
        verified where it lies (header, stored length, payload checksum: the same checks, before
        anything is lent), the counters updated once, and one release that unpins them all."""
        self._check_open()
        oids = [object_id(key.digest, group) for key, group in objects]
        entries = self._index.pin_many(oids)
        pinned = [oid for oid, e in zip(oids, entries) if e is not None]
        try:
            if len(pinned) == len(oids):  # the usual case: every object is here
                blobs = [e[1] for e in entries if e is not None]
                items = ObjectCodec.verified_bodies(blobs, objects, where=self.name)
            else:
                items = [None] * len(oids)
                here = [i for i, e in enumerate(entries) if e is not None]
                found = ObjectCodec.verified_bodies(
                    [e[1] for e in entries if e is not None],
                    [objects[i] for i in here],
                    where=self.name,
                )
                for i, got in zip(here, found):
                    items[i] = got
                for i, e in enumerate(entries):
                    if e is None:
                        key, group = objects[i]
                        items[i] = ObjectNotFoundError(
                            "object not in host tier", tier=self.name, key=key.hex[:16], group=group
                        )
        except BaseException:
            self._index.unpin_many(pinned)
            raise
        held: list[str] = []  # pinned and lent: unpinned by the release
        dropped: list[str] = []  # pinned, but failed verification: unpinned now
        nbytes = 0
        for oid, entry, got in zip(oids, entries, items):
            if entry is None:
                continue
            if isinstance(got, BaseException):
                dropped.append(oid)
            else:
                held.append(oid)
                nbytes += len(got)
        if dropped:
            self._index.unpin_many(dropped)
        self._count(hits=len(held), reads=len(held), bytes_read=nbytes,
                    misses=len(oids) - len(pinned), errors=len(dropped))  # fmt: skip
        return LentPayloads(items, lambda: self._index.unpin_many(held))

    def _copy_verified(self, okey: ObjectKey, blob: Blob, dst: Any) -> int:
        return ObjectCodec.decode_into(blob, okey, dst, where=self.name)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.touch(oid):
            return False
        mv = as_payload_view(payload)
        size = ObjectCodec.stored_size(len(mv))
        reservation, victims = await self._index.reserve_waiting(size)
        if victims:
            self._count(evictions=len(victims))
        try:
            blob: Blob = np.empty(size, dtype=np.uint8)
            await anyio.to_thread.run_sync(ObjectCodec.encode_into, okey, mv, blob)
            if not reservation.commit(oid, blob):  # a concurrent writer won
                return False
        finally:
            reservation.abort()  # gives the bytes back unless committed
        self._count(writes=1, bytes_written=len(mv))
        return True

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._check_open()
        return self._index.discard(ObjectKey(key, group).object_id)

    async def aclose(self) -> None:
        self._index.clear()
        await super().aclose()

    def storage_hooks(self) -> StorageHooks:
        return _HostStorage(self._index)


class _HostStorage:
    """HostTier's :class:`~bsr.tiers._base.StorageHooks`: the blobs in its index."""

    def __init__(self, index: LruIndex[Blob]) -> None:
        self._index = index

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        blob = self._index.peek(ObjectKey(key, group).object_id)
        return None if blob is None else blob.tobytes()

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        new = np.frombuffer(blob, dtype=np.uint8).copy()
        return self._index.replace_value(ObjectKey(key, group).object_id, new)

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        new = np.frombuffer(blob, dtype=np.uint8).copy()
        self._index.put(ObjectKey(key, group).object_id, len(blob), new)
        return True
