"""Admission by sightings: how often each prefix was seen, in bounded memory, with a bounded
rate of admitting a prefix seen once.

Where it runs: wherever a server decides whether to save a request's state (the vLLM
connector's scheduler side, the kit's :class:`~bsr.kit.ConversationCache`); one instance per
server, called from one thread (it is not thread-safe). Pure: no I/O.

How it works: a prefix is named by the chained digest of its last full chunk (``chunk_keys``: a
chunk's key names the whole prefix up to it), so a request "sights" every prefix of its chunk
chain. A sighting first meets the *doorkeeper* (as in TinyLFU): two generations of a Bloom
filter of ``doorkeeper_bits`` bits each, ``DOORKEEPER_HASHES`` bit positions per prefix. A
prefix the doorkeeper has not seen is only recorded there; a prefix it has seen raises its
counters in a count-min sketch: ``depth`` rows of ``width`` counters, one counter per row (bits
of a keyed BLAKE2b of the digest), conservative update (a sighting raises only the counters that
hold the least). A prefix's count is 1 if the doorkeeper holds it, plus the least of its
counters: never below the true count since the last aging, above it only by collisions. So
traffic seen once costs a few bits, not a counter, and does not fill the sketch.

The bound on false admission. A prefix seen for the first time reads a count of 2 or more
(passes any threshold >= 2) only if the doorkeeper wrongly answers that it saw it, or each of
its ``depth`` counters is already non-zero. Its bit positions and counters are hashes of its
digest, independent of what was counted before, so with ``b`` the fraction of set bits of a
generation and ``f_r`` the fraction of non-zero counters of row ``r``::

    P(false admission) <= 1 - (1 - b_new**h) * (1 - b_old**h) + prod_r f_r      (h: hashes)

The counter keeps ``b <= beta`` and ``f_r <= rho`` at every moment, whatever the traffic: a
generation is retired (the older one dropped, a new empty one started) before an insertion could
take it past ``beta``, and every counter is halved before an increment could take a row past
``rho`` (again, if halving once is not enough). ``beta`` and ``rho`` are derived from
``false_admission`` (``eps``), half of it for each part: ``1 - (1 - beta**h)**2 = eps / 2`` and
``rho**depth = eps / 2``. Hence, at any traffic volume and any mix of traffic::

    P(a prefix seen once is admitted at a threshold >= 2) <= eps     (default 1%)

With the defaults (``eps`` 0.01, ``h`` 4, ``depth`` 4): ``beta`` = 0.2237, ``rho`` = 0.2659.
:meth:`SightingCounter.statistics` reports the bound from the current fill
(``false_admission_bound``, never above ``eps``).

What the bound costs is memory of the past, stated too:

- A first sighting is remembered for at least :attr:`SightingCounter.remembers` later sightings
  (``floor(floor(beta * doorkeeper_bits) / h)``: 234,542 with the defaults): a generation takes at
  least that many insertions before it is retired, and a prefix is dropped only with the
  generation after its own. A prefix seen again within that many sightings is admitted at
  threshold 2 at that sighting, always (a Bloom filter has no false negatives).
- A row holds at most ``floor(rho * width)`` non-zero counters (17,426 with the defaults): when
  more distinct prefixes than that repeat between agings, the sketch is halved sooner and a
  count of 1 above the doorkeeper's is forgotten sooner. Size ``width`` from the number of
  distinct prefixes expected to repeat in a halving period, ``doorkeeper_bits`` from the
  sightings a repeat should be recognised across (``h / beta`` = 17.9 bits per sighting).

Besides, every ``halve_after`` sightings every counter is halved (as TinyLFU does), so what was
popular long ago fades. :meth:`SightingCounter.admitted` says how many leading chunks of a
request were seen at least ``threshold`` times: a server saves that prefix only (``threshold`` 1
saves everything, the default everywhere).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._check import finite_float, int_between, positive_int
from .._errors import ConfigError

#: counters per row by default (with 4 rows: 1 MiB)
DEFAULT_WIDTH = 1 << 16
DEFAULT_DEPTH = 4
#: rows at most (each takes 8 bytes of one 64-byte BLAKE2b digest)
MAX_DEPTH = 8
#: bits of each of the doorkeeper's two generations by default (512 KiB each)
DEFAULT_DOORKEEPER_BITS = 1 << 22
#: bit positions per prefix in the doorkeeper
DOORKEEPER_HASHES = 4
#: the probability bound on admitting a prefix seen once, by default
DEFAULT_FALSE_ADMISSION = 0.01
_MAX = int(np.iinfo(np.uint32).max)
_UNPACK_DOOR = struct.Struct(f"<{DOORKEEPER_HASHES}Q").unpack


@dataclass(frozen=True)
class SightingStatistics:
    """A snapshot of a :class:`SightingCounter`."""

    #: sightings counted since the counter was made (each chunk of each request is one)
    sightings: int
    #: times every counter was halved (every ``halve_after`` sightings, and when full)
    halvings: int
    #: bytes the counters and the doorkeeper take (fixed)
    memory_bytes: int
    #: of ``halvings``, those made because a row of counters was full (``rho``)
    full_halvings: int = 0
    #: doorkeeper generations retired (each forgets the prefixes last seen in the one before)
    rotations: int = 0
    #: the bound on admitting a prefix seen once, from the current fill (<= false_admission)
    false_admission_bound: float = 0.0


def doorkeeper_fill(false_admission: float, hashes: int = DOORKEEPER_HASHES) -> float:
    """The largest fraction of set bits per generation (``beta``) for which the doorkeeper's
    part of the bound is ``false_admission / 2``: ``1 - (1 - beta**h)**2 = eps / 2``."""
    return float((1.0 - math.sqrt(1.0 - false_admission / 2.0)) ** (1.0 / hashes))


def counter_fill(false_admission: float, depth: int) -> float:
    """The largest fraction of non-zero counters per row (``rho``) for which the sketch's
    part of the bound is ``false_admission / 2``: ``rho**depth = eps / 2``."""
    return float((false_admission / 2.0) ** (1.0 / depth))


class _Doorkeeper:
    """Two generations of a Bloom filter; the newer one takes insertions, both answer."""

    def __init__(self, bits: int, hashes: int, fill: float) -> None:
        self.bits = bits
        self.hashes = hashes
        self.cap = math.floor(fill * bits)  # set bits a generation may hold at most
        self.new = bytearray((bits + 7) // 8)
        self.old = bytearray((bits + 7) // 8)
        self.new_set = 0
        self.old_set = 0
        self.rotations = 0

    def contains(self, positions: Sequence[int]) -> bool:
        new, old = self.new, self.old
        if all(new[p >> 3] & (1 << (p & 7)) for p in positions):
            return True
        return all(old[p >> 3] & (1 << (p & 7)) for p in positions)

    def insert(self, positions: Sequence[int]) -> None:
        if self.new_set + self.hashes > self.cap:  # it could pass the cap: retire it first
            self.old, self.old_set = self.new, self.new_set
            self.new, self.new_set = bytearray(len(self.old)), 0
            self.rotations += 1
        new = self.new
        for p in positions:
            i, bit = p >> 3, 1 << (p & 7)
            if not new[i] & bit:
                new[i] |= bit
                self.new_set += 1

    def false_positive(self) -> float:
        """The probability that a prefix never inserted is answered as seen."""
        h, m = self.hashes, self.bits
        return 1.0 - (1.0 - (self.new_set / m) ** h) * (1.0 - (self.old_set / m) ** h)

    @property
    def nbytes(self) -> int:
        return len(self.new) + len(self.old)


class SightingCounter:
    """Approximate sighting counts of prefixes (chained chunk digests), in fixed memory, with
    the probability of admitting a prefix seen once bounded by ``false_admission`` at any
    traffic volume (see the module docstring for the bound and what it costs).

    Args:
        width: counters per row (more: more distinct repeated prefixes held between agings).
        depth: rows (more: fewer collisions, more work per sighting).
        halve_after: halve every counter after this many sightings (default ``10 x width``);
            they are also halved whenever a row is full for the bound.
        false_admission: the bound on the probability that a prefix seen once passes a
            threshold of 2 or more (0 < x < 1; default 0.01).
        doorkeeper_bits: bits of each of the doorkeeper's two generations (more: a first
            sighting is remembered across more later ones, :attr:`remembers`).

    Raises:
        ConfigError: a size out of range, or too small to hold anything within the bound.
    """

    def __init__(
        self,
        *,
        width: int = DEFAULT_WIDTH,
        depth: int = DEFAULT_DEPTH,
        halve_after: int | None = None,
        false_admission: float = DEFAULT_FALSE_ADMISSION,
        doorkeeper_bits: int = DEFAULT_DOORKEEPER_BITS,
    ) -> None:
        self.width = positive_int(width, "width")
        self.depth = int_between(depth, "depth", 1, MAX_DEPTH)
        self.halve_after = positive_int(
            10 * self.width if halve_after is None else halve_after, "halve_after"
        )
        eps = finite_float(false_admission, "false_admission", minimum=0.0, strict=True)
        if eps >= 1.0:
            raise ConfigError(f"false_admission must be < 1, got {false_admission!r}")
        self.false_admission = eps
        bits = positive_int(doorkeeper_bits, "doorkeeper_bits")
        #: the fill bounds the counter keeps: set bits per generation, non-zero counters per row
        self.doorkeeper_fill = doorkeeper_fill(eps)
        self.counter_fill = counter_fill(eps, self.depth)
        self._row_cap = math.floor(self.counter_fill * self.width)
        if self._row_cap < 1:
            raise ConfigError(
                f"width {self.width} holds no counter within false_admission {eps:g} at depth "
                f"{self.depth}: use width >= {math.ceil(1 / self.counter_fill)}"
            )
        self._door = _Doorkeeper(bits, DOORKEEPER_HASHES, self.doorkeeper_fill)
        #: sightings a first sighting is remembered across, at least
        self.remembers = self._door.cap // DOORKEEPER_HASHES
        if self.remembers < 1:
            raise ConfigError(
                f"doorkeeper_bits {bits} holds no prefix within false_admission {eps:g}: use "
                f"doorkeeper_bits >= "
                f"{math.ceil(DOORKEEPER_HASHES / self.doorkeeper_fill)}"
            )
        self._unpack_rows = struct.Struct(f"<{self.depth}Q").unpack
        self._rows = np.zeros((self.depth, self.width), dtype=np.uint32)
        # the same memory, flat, for fast scalar access (numpy's is slow one item at a time)
        self._cells = memoryview(self._rows.data).cast("B").cast("I")
        self._nonzero = [0] * self.depth
        self._since_halving = 0
        self._sightings = 0
        self._halvings = 0
        self._full_halvings = 0

    # ------------------------------------------------------------------ hashing
    def _slots(self, digest: bytes) -> list[int]:
        """The flat index of the digest's counter in each row."""
        h = hashlib.blake2b(bytes(digest), digest_size=8 * self.depth, person=b"bsr-sight").digest()
        w = self.width
        return [r * w + x % w for r, x in enumerate(self._unpack_rows(h))]

    def _positions(self, digest: bytes) -> list[int]:
        """The digest's bit positions in the doorkeeper."""
        h = hashlib.blake2b(
            bytes(digest), digest_size=8 * DOORKEEPER_HASHES, person=b"bsr-door"
        ).digest()
        m = self._door.bits
        return [x % m for x in _UNPACK_DOOR(h)]

    # ------------------------------------------------------------------ counting
    def count(self, digest: bytes) -> int:
        """How often ``digest``'s prefix was seen (never less than the truth since its counters
        and doorkeeper generation last aged)."""
        cells = self._cells
        held = 1 if self._door.contains(self._positions(digest)) else 0
        return held + min(cells[i] for i in self._slots(digest))

    def _halve(self, *, full: bool) -> None:
        self._rows >>= 1
        self._nonzero = [int(n) for n in np.count_nonzero(self._rows, axis=1)]
        self._halvings += 1
        self._full_halvings += full

    def _increment(self, digest: bytes) -> int:
        """Raise the digest's counters (conservative update), halving first while a row is
        full; the least of them afterwards."""
        while max(self._nonzero) >= self._row_cap:  # one more could pass rho
            self._halve(full=True)
        slots = self._slots(digest)
        cells = self._cells
        old = [cells[i] for i in slots]
        new = min(min(old) + 1, _MAX)
        for r, i in enumerate(slots):
            if old[r] < new:
                if old[r] == 0:
                    self._nonzero[r] += 1
                cells[i] = new
        return new

    def add(self, digests: Sequence[bytes]) -> list[int]:
        """Sight every prefix in ``digests`` once; each one's count afterwards."""
        out = []
        door = self._door
        for d in digests:
            positions = self._positions(d)
            if door.contains(positions):
                counted = self._increment(d)
            else:
                counted = min(self._cells[i] for i in self._slots(d))
            door.insert(positions)  # (again: a prefix seen now is remembered from now)
            self._sightings += 1
            self._since_halving += 1
            if self._since_halving >= self.halve_after:
                self._halve(full=False)
                self._since_halving = 0
            out.append(1 + counted)
        return out

    def admitted(self, digests: Sequence[bytes], threshold: int) -> int:
        """Sight ``digests`` (a request's chunk chain, first chunk first) and return how many
        leading chunks have now been seen at least ``threshold`` times (the prefix worth
        saving). ``threshold`` 1 admits every chunk; a chunk seen once passes a threshold of 2
        or more with probability at most :attr:`false_admission`."""
        threshold = positive_int(threshold, "threshold")
        counts = self.add(digests)
        n = 0
        for c in counts:
            if c < threshold:
                break
            n += 1
        return n

    def false_admission_bound(self) -> float:
        """The bound on admitting a prefix seen once, from the current fill (at most
        :attr:`false_admission`)."""
        rows = 1.0
        for n in self._nonzero:
            rows *= n / self.width
        return self._door.false_positive() + rows

    def statistics(self) -> SightingStatistics:
        return SightingStatistics(
            sightings=self._sightings,
            halvings=self._halvings,
            memory_bytes=int(self._rows.nbytes) + self._door.nbytes,
            full_halvings=self._full_halvings,
            rotations=self._door.rotations,
            false_admission_bound=self.false_admission_bound(),
        )
