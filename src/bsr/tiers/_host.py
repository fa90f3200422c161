"""HostTier: L1, objects in host DRAM with LRU eviction.

Where it runs: the serving process. Objects are kept encoded (header + payload) so a read
verifies exactly what a durable tier would. An object being read is pinned and never evicted
until the read ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from .._check import positive_int
from .._errors import (
    ConfigError,
    ObjectNotFoundError,
    TierFullError,
    TruncatedObjectError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..core._object import (
    HEADER_SIZE,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ._base import Tier, as_byte_view, as_payload_view


@dataclass
class _Entry:
    blob: np.ndarray[Any, np.dtype[np.uint8]]
    pins: int = 0


class HostTier(Tier):
    """L1 tier in host memory.

    Args:
        capacity_bytes: upper bound on stored bytes (headers included); least recently used
            objects are evicted to make room, never one that is being read.
        name: tier name used in statistics, logs and ``bytes_by_tier``.
    """

    durable = False
    default_io_depth = 8

    def __init__(self, capacity_bytes: int, *, name: str = "host") -> None:
        super().__init__(name)
        positive_int(capacity_bytes, "HostTier.capacity_bytes")
        self.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def _usage(self) -> tuple[int, int, int]:
        return len(self._objects), self._bytes, self.capacity_bytes

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._check_open()
        return [o.object_id in self._objects for o in objects]

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        self._check_open()
        okey = ObjectKey(key, group)
        entry = self._objects.get(okey.object_id)
        if entry is None:
            self._counters.misses += 1
            raise ObjectNotFoundError(
                "object not in host tier", tier=self.name, key=key.hex[:16], group=group
            )
        self._objects.move_to_end(okey.object_id)
        entry.pins += 1
        try:
            view = as_byte_view(dst)
            try:
                plen, psum = decode_header(entry.blob[:HEADER_SIZE], okey, where=self.name)
                if len(entry.blob) < HEADER_SIZE + plen:
                    raise TruncatedObjectError(
                        f"object is {len(entry.blob)} bytes, header says {HEADER_SIZE + plen}",
                        tier=self.name,
                        key=key.hex[:16],
                        group=group,
                    )
                if plen > len(view):
                    raise ConfigError(
                        f"destination holds {len(view)} bytes, object payload is {plen}",
                        tier=self.name,
                    )
                out = np.frombuffer(view, dtype=np.uint8, count=plen)
                src = entry.blob[HEADER_SIZE : HEADER_SIZE + plen]

                def _copy_and_verify() -> None:
                    np.copyto(out, src)
                    verify_payload(out, plen, psum, okey, where=self.name)

                await anyio.to_thread.run_sync(_copy_and_verify)
            except Exception:
                self._counters.errors += 1
                raise
            self._counters.hits += 1
            self._counters.reads += 1
            self._counters.bytes_read += plen
            return plen
        finally:
            entry.pins -= 1

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._check_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if oid in self._objects:
            self._objects.move_to_end(oid)
            return False
        mv = as_payload_view(payload)
        size = HEADER_SIZE + len(mv)
        if size > self.capacity_bytes:
            raise TierFullError(
                f"object of {size} bytes exceeds capacity {self.capacity_bytes}; "
                "raise capacity_bytes",
                tier=self.name,
            )
        self._make_room(size)
        blob = np.empty(size, dtype=np.uint8)

        def _fill() -> None:
            blob[HEADER_SIZE:] = np.frombuffer(mv, dtype=np.uint8)
            blob[:HEADER_SIZE] = np.frombuffer(
                encode_header(okey, len(mv), payload_checksum(blob[HEADER_SIZE:])), dtype=np.uint8
            )

        await anyio.to_thread.run_sync(_fill)
        if oid in self._objects:  # a concurrent writer won
            return False
        self._make_room(size)
        self._objects[oid] = _Entry(blob)
        self._bytes += size
        self._counters.writes += 1
        self._counters.bytes_written += len(mv)
        self._counters.peak_bytes = max(self._counters.peak_bytes, self._bytes)
        return True

    def _make_room(self, size: int) -> None:
        if self._bytes + size <= self.capacity_bytes:
            return
        for oid in list(self._objects):
            if self._bytes + size <= self.capacity_bytes:
                break
            entry = self._objects[oid]
            if entry.pins:
                continue
            del self._objects[oid]
            self._bytes -= entry.blob.nbytes
            self._counters.evictions += 1
        if self._bytes + size > self.capacity_bytes:
            raise TierFullError(
                "host tier is full of objects being read; retry later or raise capacity_bytes",
                tier=self.name,
            )

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._check_open()
        entry = self._objects.pop(ObjectKey(key, group).object_id, None)
        if entry is None:
            return False
        self._bytes -= entry.blob.nbytes
        return True

    async def aclose(self) -> None:
        self._objects.clear()
        self._bytes = 0
        await super().aclose()

    # test and fault-injection hook: the raw stored blob (header + payload)
    def _raw(self, key: ChunkKey, group: str) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        entry = self._objects.get(ObjectKey(key, group).object_id)
        return None if entry is None else entry.blob
