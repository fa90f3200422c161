"""HostArena: one host buffer, allocated once, that a HostTier keeps its objects in.

Where it runs: wherever the HostTier runs (its writes on the event loop, its reads and lends in
worker threads); every method takes one lock and does no I/O.

How it works: the buffer is ``capacity`` bytes rounded up to 4 KiB, made on first use: page-locked
(pinned) where CUDA is present, so a host hit can be copied to the device by DMA straight from
where the object lies, with no staging copy; ordinary pageable memory otherwise (anonymous
pages, committed by the OS only as objects are written), for which the kernel is asked for
transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux): a restore's hash and copy of a host
hit then take a TLB miss per 2 MiB instead of per 4 KiB (about 5% less CPU per restored
GiB at 512 KiB chunks, the bench's ``cpu`` section). Objects take extents of whole 4 KiB
pages (an object's header is a page, so its payload starts page-aligned too), handed out first
fit from a free list kept sorted by offset, coalesced with its neighbours as extents come back.
An extent comes back only when its object has left the tier's index *and* no read or lend pins
it any more (:class:`~bsr.tiers._lru.LruIndex` calls :meth:`HostArena.free` then), so the memory
under a device copy in flight is never handed to another object.

Fragmentation: objects of one layout have one size per group, so a freed extent fits the next
object of its group exactly; when no extent fits although the index has room, the tier evicts
more least-recently-used objects until one does (:meth:`~bsr.HostTier.write`).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np

from .._memory import anonymous_buffer
from ..core._layout import ALIGNMENT, align_up


class Block:
    """One object's extent of the arena: ``blob`` (its stored bytes, a view into the arena),
    ``offset`` and ``size`` (the whole pages it takes); :meth:`views` its header and body."""

    __slots__ = ("_views", "blob", "offset", "size", "stored")

    def __init__(self, blob: np.ndarray[Any, np.dtype[np.uint8]], offset: int, size: int) -> None:
        self.blob = blob
        self.offset = offset
        self.size = size
        #: the stored length (``len(blob)``)
        self.stored = len(blob)
        self._views: tuple[Any, Any] | None = None

    def views(self, header_size: int) -> tuple[Any, Any]:
        """``(header, body)``: views of the stored bytes before and after ``header_size`` (made
        once: every read of the object hands them out; one header size per tier)."""
        views = self._views
        if views is None:  # the header as a memoryview: the check slices it, cheaply
            blob = self.blob
            head: Any = blob[:header_size]
            views = self._views = (memoryview(head), blob[header_size:])
        return views

    def reshaped(self, blob: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """The stored bytes are now ``blob`` (same extent, a shorter or longer view)."""
        self.blob, self.stored, self._views = blob, len(blob), None

    def __len__(self) -> int:
        return len(self.blob)


class HostArena:
    """A first-fit allocator of 4 KiB-page extents over one host buffer.

    Args:
        capacity: bytes the arena holds (rounded up to 4 KiB).
        pin: page-lock the buffer (needs CUDA; None: pinned where CUDA is available).
        huge_pages: ask for transparent huge pages for a pageable buffer (where the kernel
            offers ``MADV_HUGEPAGE``; a pinned buffer is CUDA's).
    """

    def __init__(self, capacity: int, *, pin: bool | None = None, huge_pages: bool = True) -> None:
        self.capacity = align_up(max(capacity, ALIGNMENT))
        self._pin = pin
        self._huge = huge_pages
        self.pinned = False
        #: the kernel took the request for huge pages (the buffer is made on first use)
        self.huge_pages = False
        self._buf: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._keep: Any = None  # what owns the memory (a pinned torch tensor)
        self._lock = threading.Lock()
        self._starts: list[int] = []  # free extents' offsets, sorted
        self._sizes: dict[int, int] = {}  # free extent offset -> size
        self._ends: dict[int, int] = {}  # free extent end -> offset
        self.used = 0
        self.peak = 0

    @staticmethod
    def page_size(nbytes: int) -> int:
        """The bytes an object of ``nbytes`` takes in the arena (whole pages)."""
        return align_up(max(nbytes, 1))

    def _buffer(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if self._buf is None:
            pin = self._pin
            if pin is None or pin:
                import torch

                pin = bool(torch.cuda.is_available()) if pin is None else pin
                if pin:
                    t = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
                    self._keep, self._buf, self.pinned = t, t.numpy(), True
            if self._buf is None:  # anonymous pages, committed only as they are written
                self._buf, self.huge_pages = anonymous_buffer(
                    self.capacity, huge_pages=self._huge, noreserve=True
                )  # the array keeps its mapping alive
            self._add_free(0, self.capacity)
        return self._buf

    def alloc(self, nbytes: int) -> Block | None:
        """An extent for an object of ``nbytes`` stored bytes, or None when no free extent is
        large enough (evict, then ask again)."""
        size = self.page_size(nbytes)
        with self._lock:
            buf = self._buffer()
            for start in self._starts:
                have = self._sizes[start]
                if have >= size:
                    self._take_free(start)
                    if have > size:
                        self._add_free(start + size, have - size)
                    self.used += size
                    self.peak = max(self.peak, self.used)
                    return Block(buf[start : start + nbytes], start, size)
            return None

    def free(self, block: Block) -> None:
        """Give ``block``'s extent back (exactly once, when nothing reads it any more)."""
        with self._lock:
            start, size = block.offset, block.size
            self.used -= size
            end = start + size
            after = self._sizes.get(end)
            if after is not None:  # coalesce with the extent after it
                self._take_free(end)
                size += after
            before = self._ends.get(start)
            if before is not None:  # and with the one before it
                self._take_free(before)
                size += start - before
                start = before
            self._add_free(start, size)

    @property
    def free_extents(self) -> int:
        with self._lock:
            return len(self._starts)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size
        self._ends[start + size] = start

    def _take_free(self, start: int) -> None:
        size = self._sizes.pop(start)
        del self._ends[start + size]
        del self._starts[bisect.bisect_left(self._starts, start)]
