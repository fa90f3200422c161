"""HostTier: L1, objects in host DRAM with LRU eviction.

Where it runs: the serving process; reads run in worker threads (``fetch_into`` is a thin
``to_thread`` wrapper over :meth:`HostTier.fetch_into_blocking`; the transfer pipeline calls
:meth:`HostTier.read_many_blocking` in its own worker thread).

How it works: objects are kept encoded (header + payload) so a read is checked exactly as a
durable tier's would be. A bulk read lends payloads where they lie (pinned until the pipeline
has copied them): a host hit is copied once, into the cache. Sizes, LRU order, pins and
leases live in a shared :class:`~bsr.tiers._lru.LruIndex` (thread-safe): a write reserves its
bytes before it fills them, so concurrent writes never overshoot ``capacity_bytes``; an object
being read, or held by an unexpired lease, is never evicted.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import anyio
import numpy as np

from .._check import Check, option
from .._errors import ObjectNotFoundError, TierFullError
from ..core._keys import ChunkKey, ObjectKey, object_id
from ._arena import Block, HostArena
from ._base import Medium, StorageHooks, Tier
from ._codec import ObjectCodec
from ._lru import IndexedTier, LruIndex
from ._reads import Begin, Borrowed, End, Fetched, ReadItem
from ._registry import TierOptions, takes_options
from ._views import as_byte_view, as_payload_view

Blob = np.ndarray[Any, np.dtype[np.uint8]]
HEADER_SIZE = ObjectCodec.HEADER_SIZE


@dataclass(frozen=True)
class HostTierOptions(TierOptions):
    """A :class:`HostTier`: ``{"kind": "host", "capacity_bytes": "8GiB", "name": "host"}``."""

    kind = "host"
    capacity_bytes: int = option(Check.size)
    _: KW_ONLY
    name: str = option(Check.text, "host")
    #: page-lock the tier's memory (host-to-device copies by DMA straight from an object);
    #: None: where CUDA is present
    pinned: bool | None = option(Check.optional_flag, None)
    #: ask the kernel for transparent huge pages for a pageable arena (Linux)
    huge_pages: bool = option(Check.flag, True)

    def build(self) -> Tier:
        return HostTier(**self.arguments())


class HostTier(IndexedTier):
    """L1 tier in host memory.

    Args:
        capacity_bytes: upper bound on stored bytes (headers included, each object rounded up
            to whole 4 KiB pages); least recently used objects are evicted to make room, never
            one that is being read, lent or leased. The tier's memory is one arena of this size
            (:class:`~bsr.tiers._arena.HostArena`), made on the first write.
        name: tier name used in statistics, logs and ``bytes_by_tier``.
        pinned: page-lock the arena, so a restore into a CUDA cache copies a host hit by DMA
            straight from where it lies (no staging copy). None (the default): pinned where
            CUDA is present, ordinary pageable memory otherwise; True without CUDA is an error
            when the arena is made.
        huge_pages: ask the kernel to back a pageable arena with transparent huge pages
            (``madvise(MADV_HUGEPAGE)``, Linux; the default): restoring a host hit hashes and
            copies its bytes with a TLB miss per 2 MiB, not per 4 KiB, about 5% less CPU
            per GiB. Memory is still committed as objects are written, 2 MiB at a time where
            the kernel gives a huge page. A pinned arena is CUDA's memory: not asked.
    """

    durable = False
    blocking_reads = True
    inline_reads = True  # a memcpy out of DRAM
    bulk_reads = True  # a batch pinned under one lock, lent where it lies
    medium = Medium.HOST

    @takes_options(HostTierOptions)
    def __init__(self, options: HostTierOptions) -> None:
        self.options = options
        super().__init__(options.name)
        self.capacity_bytes = options.capacity_bytes
        self._arena = HostArena(
            self.capacity_bytes, pin=options.pinned, huge_pages=options.huge_pages
        )
        # an extent goes back to the arena once its object left the index and nothing pins it
        self._index: LruIndex[Block] = LruIndex(
            self.capacity_bytes, name=options.name, release=self._arena.free
        )

    @property
    def pinned(self) -> bool:
        """Whether the tier's memory is page-locked (known once the arena was made)."""
        return self._arena.pinned

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        # not abandonable: a memcpy is bounded, and no byte may land in dst after we return
        return await anyio.to_thread.run_sync(self.fetch_into_blocking, key, group, dst)

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        self._check_open()
        oid = object_id(key.digest, group)
        got = self._index.pin(oid)
        if got is None:
            self._count(misses=1)
            raise ObjectNotFoundError(
                "object not in host tier", tier=self.name, key=key.hex[:16], group=group
            )
        try:
            blob = got[1].blob
            out = np.frombuffer(as_byte_view(dst), dtype=np.uint8)
            n = max(0, min(len(blob) - HEADER_SIZE, len(out)))
            out[:n] = blob[HEADER_SIZE : HEADER_SIZE + n]
            header = blob[:HEADER_SIZE].tobytes()  # the caller may keep it past the unpin
        finally:
            self._index.unpin(oid)
        self._count_hit(n)
        return Fetched(header, n, len(blob))

    def read_many_blocking(self, begin: Begin, end: End, ahead: int, *, lend: bool = False) -> None:
        """Up to ``ahead`` objects at a time pinned under one lock, then each one lent where it
        lies (``lend``: pinned until the caller releases it) or copied into its destination,
        with its stored header (a view of the tier's bytes, valid while pinned)."""
        self._check_open()
        index = self._index
        unpin_many = index.unpin_many
        limit = max(1, ahead)
        more = True
        while more:
            items: list[ReadItem] = []
            while (item := begin()) is not None:
                items.append(item)
                if len(items) >= limit:
                    break
            if not items:
                return
            oids = [object_id(it.key.digest, it.group) for it in items]
            entries = index.pin_many(oids)
            hits = nbytes = 0
            try:
                for i, item in enumerate(items):
                    entry = entries[i]
                    if entry is None:
                        result: int | Borrowed | BaseException = ObjectNotFoundError(
                            "object not in host tier",
                            tier=self.name, key=item.key.hex[:16], group=item.group,
                        )  # fmt: skip
                        self._count(misses=1)
                    else:
                        block, oid = entry[1], oids[i]
                        entries[i] = None  # its pin is the result's (lent) or undone below
                        header, body = block.views(HEADER_SIZE)
                        item.header, item.stored = header, block.stored
                        hits += 1
                        nbytes += block.stored
                        if lend:  # unpinned by the release (several in one call)
                            result = Borrowed(body, None, header, many=unpin_many, arg=oid)
                        else:
                            try:
                                n = max(0, min(len(body), len(item.dst)))
                                item.dst[:n] = body[:n]
                                result = n
                            finally:
                                index.unpin(oid)
                    more = end(item, result) and more
            finally:  # an end that raised: the pins not handed out yet go back
                index.unpin_many([oids[i] for i, e in enumerate(entries) if e is not None])
                if hits:  # payload bytes: each lent or copied body past its header
                    self._count(hits=hits, reads=hits, bytes_read=nbytes - hits * HEADER_SIZE)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.touch(oid):
            return False
        mv = as_payload_view(payload)
        stored = ObjectCodec.stored_size(len(mv))
        reservation, victims = await self._index.reserve_waiting(HostArena.page_size(stored))
        if victims:
            self._count(evictions=len(victims))
        block: Block | None = None
        try:
            block = self._alloc(stored)
            await anyio.to_thread.run_sync(ObjectCodec.encode_into, okey, mv, block.blob)
            if not reservation.commit(oid, block):  # a concurrent writer won
                return False
            block = None  # the index's now
        finally:
            reservation.abort()  # gives the bytes back unless committed
            if block is not None:
                self._arena.free(block)
        self._count(writes=1, bytes_written=len(mv))
        return True

    def _alloc(self, stored: int) -> Block:
        """An arena extent for ``stored`` bytes, evicting least recently used objects while
        none is large enough (the index's room is reserved already; the arena's may be cut
        up); TierFullError when what is left is pinned."""
        while (block := self._arena.alloc(stored)) is None:
            if self._index.pop_victim() is None:
                raise TierFullError(
                    f"{self.name!r} has no contiguous room for {stored} bytes: the rest is "
                    "pinned by reads, lends or leases; retry later or raise capacity_bytes",
                    tier=self.name,
                )
            self._count(evictions=1)
        return block

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._check_open()
        return self._index.discard(ObjectKey(key, group).object_id)

    async def aclose(self) -> None:
        self._index.clear()
        await super().aclose()

    def storage_hooks(self) -> StorageHooks:
        return _HostStorage(self)


class _HostStorage:
    """HostTier's :class:`~bsr.tiers._base.StorageHooks`: the bytes in its arena."""

    def __init__(self, tier: HostTier) -> None:
        self._tier = tier

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        block = self._tier._index.peek(ObjectKey(key, group).object_id)
        return None if block is None else block.blob.tobytes()

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        oid = ObjectKey(key, group).object_id
        block = self._tier._index.peek(oid)
        if block is None:
            return False
        if len(blob) == len(block.blob):  # in place, as damage in memory would be
            block.blob[:] = np.frombuffer(blob, dtype=np.uint8)
            return True
        new = self._tier._alloc(len(blob))
        new.blob[:] = np.frombuffer(blob, dtype=np.uint8)
        if not self._tier._index.replace_value(oid, new):
            self._tier._arena.free(new)
            return False
        return True

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        try:
            new = self._tier._alloc(max(1, len(blob)))
        except TierFullError:
            return False
        new.reshaped(new.blob[: len(blob)])
        new.blob[:] = np.frombuffer(blob, dtype=np.uint8)
        self._tier._index.put(ObjectKey(key, group).object_id, new.size, new)
        return True
