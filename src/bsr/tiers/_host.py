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

from typing import Any

import anyio
import numpy as np

from .._check import positive_int
from .._errors import ConfigError, ObjectNotFoundError, TruncatedObjectError
from ..core._keys import ChunkKey, ObjectKey
from ..core._object import (
    HEADER_SIZE,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ._base import Borrowed, as_byte_view, as_payload_view
from ._lru import IndexedTier, LruIndex

Blob = np.ndarray[Any, np.dtype[np.uint8]]


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

    def __init__(self, capacity_bytes: int, *, name: str = "host") -> None:
        super().__init__(name)
        self.capacity_bytes = positive_int(capacity_bytes, "HostTier.capacity_bytes")
        self._index: LruIndex[Blob] = LruIndex(capacity_bytes, name=name)

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
            blob = got[1]
            plen, psum = self._checked_header(okey, blob)
            payload = blob[HEADER_SIZE : HEADER_SIZE + plen]
            verify_payload(payload, plen, psum, okey, where=self.name)
        except BaseException:
            self._index.unpin(oid)
            self._count(errors=1)
            raise
        self._count_hit(plen)
        return Borrowed(payload, lambda: self._index.unpin(oid))

    def _checked_header(self, okey: ObjectKey, blob: Blob) -> tuple[int, int]:
        plen, psum = decode_header(blob[:HEADER_SIZE], okey, where=self.name)
        if len(blob) < HEADER_SIZE + plen:
            raise TruncatedObjectError(
                f"object is {len(blob)} bytes, header says {HEADER_SIZE + plen}",
                tier=self.name,
                key=okey.chunk.hex[:16],
                group=okey.group,
            )
        return plen, psum

    def _copy_verified(self, okey: ObjectKey, blob: Blob, dst: Any) -> int:
        view = as_byte_view(dst)
        plen, psum = self._checked_header(okey, blob)
        if plen > len(view):
            raise ConfigError(
                f"destination holds {len(view)} bytes, object payload is {plen}", tier=self.name
            )
        out = np.frombuffer(view, dtype=np.uint8, count=plen)
        np.copyto(out, blob[HEADER_SIZE : HEADER_SIZE + plen])
        verify_payload(out, plen, psum, okey, where=self.name)
        return plen

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.touch(oid):
            return False
        mv = as_payload_view(payload)
        reservation, victims = await self._index.reserve_waiting(HEADER_SIZE + len(mv))
        if victims:
            self._count(evictions=len(victims))
        try:
            blob: Blob = np.empty(HEADER_SIZE + len(mv), dtype=np.uint8)

            def _fill() -> None:
                blob[HEADER_SIZE:] = np.frombuffer(mv, dtype=np.uint8)
                header = encode_header(okey, len(mv), payload_checksum(blob[HEADER_SIZE:]))
                blob[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)

            await anyio.to_thread.run_sync(_fill)
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
