"""The engine's book of probe leases: each released once, and reclaimed once its TTL passed.

Where it runs: the engine's event loop (no locks; every call is synchronous).

How it works: ``lookup(..., lease_ttl_s=...)`` pins the objects it found in their tiers and
records the pins as one :class:`ProbeLease` here, with the moment its TTL runs out. A lease ends
in one of three ways, whichever comes first: the restore given its probe ends, the caller calls
``Probe.release()``, or the TTL passes. The last one needs no caller at all: every engine call
that takes or counts leases (``lookup``, ``restore``, ``save``, ``statistics``) first reclaims
the expired ones, releasing their tier pins, so a server that never releases a lease still holds
only the leases of the last TTL. Expiries sit in a heap (cheapest first); a lease released early
leaves a stale heap entry that is dropped when its time comes, and the heap is compacted when
stale entries outnumber live leases, so memory stays proportional to the leases alive.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from ..tiers._base import TierLease


class ProbeLease:
    """The tier leases of one lookup (a :class:`~bsr.Probe`'s ``lease``); released once."""

    __slots__ = ("_book", "_leases", "expires_at")

    def __init__(self, book: LeaseBook, leases: Sequence[TierLease], expires_at: float) -> None:
        self._book = book
        self._leases = list(leases)
        #: ``time.monotonic()`` after which the engine reclaims this lease on its own
        self.expires_at = expires_at

    @property
    def released(self) -> bool:
        return self not in self._book

    def release(self) -> None:
        """Give the tier pins back now (idempotent)."""
        self._book.forget(self)
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()


class LeaseBook:
    """The probe leases an engine holds.

    Args:
        clock: monotonic seconds (the tiers' leases expire by ``time.monotonic`` too).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: set[ProbeLease] = set()
        self._heap: list[tuple[float, int, ProbeLease]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, lease: object) -> bool:
        return lease in self._live

    def add(self, leases: Sequence[TierLease], ttl_s: float) -> ProbeLease:
        """Record the tier leases of one lookup, taken with ``ttl_s``; reclaim expired ones."""
        self.reclaim()
        # taken after the tier leases, so it expires no earlier than any of them
        lease = ProbeLease(self, leases, self._clock() + ttl_s)
        self._live.add(lease)
        heapq.heappush(self._heap, (lease.expires_at, next(self._seq), lease))
        return lease

    def forget(self, lease: ProbeLease) -> None:
        """``lease`` was released: stop tracking it (its heap entry goes later)."""
        self._live.discard(lease)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if e[2] in self._live]
            heapq.heapify(self._heap)

    def reclaim(self) -> int:
        """Release every lease whose TTL has passed; return how many were still held."""
        now, n = self._clock(), 0
        while self._heap and self._heap[0][0] <= now:
            _, _, lease = heapq.heappop(self._heap)
            if lease in self._live:
                lease.release()
                n += 1
        return n

    def release_all(self) -> None:
        for lease in list(self._live):
            lease.release()
        self._heap.clear()
