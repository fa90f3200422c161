"""Admission by sightings: how often each prefix was seen, in bounded memory.

Where it runs: wherever a server decides whether to save a request's state (the vLLM
connector's scheduler side, the kit's :class:`~bsr.kit.ConversationCache`); one instance per
server, called from one thread (it is not thread-safe). Pure: no I/O.

How it works: a prefix is named by the chained digest of its last full chunk (``chunk_keys``: a
chunk's key names the whole prefix up to it), so a request "sights" every prefix of its chunk
chain. The counts live in a count-min sketch: ``depth`` rows of ``width`` counters; a digest
maps to one counter per row (bits of a keyed BLAKE2b of the digest) and its count is the least
of them, so a count is never below the true one and above it only by collisions
(conservative update: a sighting raises only the counters that hold the least). Memory is
``depth x width x 4`` bytes whatever the traffic. Every ``halve_after`` sightings every counter
is halved (as TinyLFU does), so what was popular long ago fades. :meth:`SightingCounter.admitted`
says how many leading chunks of a request were seen at least ``threshold`` times: a server
saves that prefix only (``threshold`` 1 saves everything, the default everywhere).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._check import int_between, positive_int

#: counters per row by default (with 4 rows: 1 MiB)
DEFAULT_WIDTH = 1 << 16
DEFAULT_DEPTH = 4
#: rows at most (each takes 8 bytes of one 64-byte BLAKE2b digest)
MAX_DEPTH = 8
_MAX = np.iinfo(np.uint32).max


@dataclass(frozen=True)
class SightingStatistics:
    """A snapshot of a :class:`SightingCounter`."""

    #: sightings counted since the counter was made (each chunk of each request is one)
    sightings: int
    #: times every counter was halved
    halvings: int
    #: bytes the counters take (fixed)
    memory_bytes: int


class SightingCounter:
    """Approximate sighting counts of prefixes (chained chunk digests), in fixed memory.

    Args:
        width: counters per row (more: fewer collisions).
        depth: rows (more: fewer collisions, more work per sighting).
        halve_after: halve every counter after this many sightings (default ``10 x width``).
    """

    def __init__(
        self,
        *,
        width: int = DEFAULT_WIDTH,
        depth: int = DEFAULT_DEPTH,
        halve_after: int | None = None,
    ) -> None:
        self.width = positive_int(width, "width")
        self.depth = int_between(depth, "depth", 1, MAX_DEPTH)
        self.halve_after = positive_int(
            10 * self.width if halve_after is None else halve_after, "halve_after"
        )
        self._rows = np.zeros((self.depth, self.width), dtype=np.uint32)
        self._since_halving = 0
        self._sightings = 0
        self._halvings = 0

    def _slots(self, digest: bytes) -> list[int]:
        h = hashlib.blake2b(bytes(digest), digest_size=8 * self.depth, person=b"bsr-sight").digest()
        return [
            int.from_bytes(h[8 * r : 8 * r + 8], "little") % self.width for r in range(self.depth)
        ]

    def count(self, digest: bytes) -> int:
        """How often ``digest``'s prefix was seen (never less than the truth)."""
        slots = self._slots(digest)
        return int(min(self._rows[r, s] for r, s in enumerate(slots)))

    def add(self, digests: Sequence[bytes]) -> list[int]:
        """Sight every prefix in ``digests`` once; each one's count afterwards."""
        out = []
        for d in digests:
            slots = self._slots(d)
            cells = [int(self._rows[r, s]) for r, s in enumerate(slots)]
            new = min(min(cells) + 1, int(_MAX))
            for r, s in enumerate(slots):
                if cells[r] < new:
                    self._rows[r, s] = new
            self._sightings += 1
            self._since_halving += 1
            if self._since_halving >= self.halve_after:
                self._rows >>= 1
                self._since_halving = 0
                self._halvings += 1
            out.append(new)
        return out

    def admitted(self, digests: Sequence[bytes], threshold: int) -> int:
        """Sight ``digests`` (a request's chunk chain, first chunk first) and return how many
        leading chunks have now been seen at least ``threshold`` times (the prefix worth
        saving). ``threshold`` 1 admits every chunk."""
        threshold = positive_int(threshold, "threshold")
        counts = self.add(digests)
        n = 0
        for c in counts:
            if c < threshold:
                break
            n += 1
        return n

    def statistics(self) -> SightingStatistics:
        return SightingStatistics(self._sightings, self._halvings, int(self._rows.nbytes))
