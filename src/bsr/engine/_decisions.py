"""Quarantine and the read gate: the decision side's answer to the transfer side's outcomes.

Where it runs: the engine; :class:`RestoreGate` is called from the event loop and from the
pipeline's worker threads (it takes one lock).

How it works: the transfer side reports one :class:`~bsr.transfer._ladder.ReadOutcome` per read
attempt. The gate turns outcomes into decisions: a verified-corrupt object is quarantined in the
engine at once (later probes and reads skip it) and queued for removal from its tier (done by the
engine after the window, bounded by the request's deadline); an I/O error retires the object in
this engine only (never ask a possibly dead tier to delete it), for one breaker cooldown
(``breaker_cooldown_s``: the error may pass, as a network filesystem's server coming back), and
counts against the tier's circuit breaker, as does a timeout; a miss and a success are the
tier answering. Before an attempt, the gate refuses a tier whose breaker is open or an object
that is quarantined.

Moving an object out of its tier is tidying, not safety: the engine's own quarantine keeps it out
of every later probe and read at once, and every read verifies anyway. So that move is never
allowed to hold a caller's cancel: a move cut short (by the caller, the deadline or the
shield bound) is deferred here and retried when the engine closes, and dropped if a fresh copy
is written meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..core._keys import ChunkKey, ObjectKey, object_id
from ..transfer._ladder import BatchAdmission, Outcome, ReadOutcome
from ..transfer._run import RestoreRun
from ._health import TierHealth


class Quarantine:
    """The (tier, object id) pairs this engine no longer uses, and the moves out of their
    tiers still owed. Thread-safe.

    Args:
        on_add: called with ``(tier, object id)`` after an object is newly quarantined (the
            engine reports it as removed from that tier), outside the lock.
    """

    def __init__(self, on_add: Callable[[str, str], None] | None = None) -> None:
        self._items: set[tuple[str, str]] = set()
        #: retirements that end on their own (``time.monotonic()`` when): an I/O error's
        self._until: dict[tuple[str, str], float] = {}
        #: retirements that ended on their own: served again, still replaced by a save (a
        #: save rewrites every copy this engine retired, whether or not it reads it again)
        self._ended: set[tuple[str, str]] = set()
        self._deferred: dict[tuple[str, str], TierQuarantine] = {}
        self._lock = threading.Lock()
        self._on_add = on_add

    def __contains__(self, item: tuple[str, str]) -> bool:
        if item not in self._items:
            return False
        until = self._until.get(item)
        if until is None or time.monotonic() < until:
            return True
        with self._lock:  # its time is up: the object may be read again
            if self._until.get(item) == until:
                self._items.discard(item)
                del self._until[item]
                self._ended.add(item)
        return False

    def retired(self, tier: str, object_id: str) -> bool:
        """Whether this engine retired the object since it was last written (quarantined now,
        or retired for an I/O error whose time ran out): a save writes it again."""
        item = (tier, object_id)
        return item in self._items or item in self._ended

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        with self._lock:
            items = sorted(self._items)
        return iter([i for i in items if i in self])

    def add(self, tier: str, object_id: str, *, for_s: float | None = None) -> bool:
        """Quarantine an object (for ``for_s`` seconds, or until lifted); return False if it
        already was."""
        item = (tier, object_id)
        with self._lock:
            if item in self._items and (
                item not in self._until or self._until[item] > time.monotonic()
            ):
                return False
            self._items.add(item)
            self._ended.discard(item)
            if for_s is None:
                self._until.pop(item, None)
            else:
                self._until[item] = time.monotonic() + for_s
        if self._on_add is not None:
            self._on_add(tier, object_id)
        return True

    def lift(self, tier: str, object_id: str) -> None:
        """A fresh copy was written: the object may be used again (and must stay)."""
        with self._lock:
            self._items.discard((tier, object_id))
            self._until.pop((tier, object_id), None)
            self._ended.discard((tier, object_id))
            self._deferred.pop((tier, object_id), None)

    def defer(self, moves: list[TierQuarantine]) -> None:
        """Moves out of a tier that were cut short: owed until :meth:`take_deferred`."""
        with self._lock:
            for q in moves:
                item = (q.tier, ObjectKey(q.key, q.group).object_id)
                if item in self._items:  # not lifted meanwhile
                    self._deferred[item] = q

    def take_deferred(self) -> list[TierQuarantine]:
        with self._lock:
            out = list(self._deferred.values())
            self._deferred.clear()
        return out


@dataclass(frozen=True)
class TierQuarantine:
    """A corrupt object to be moved out of its tier after the window."""

    tier: str
    key: ChunkKey
    group: str
    why: str


class RestoreGate:
    """The :class:`~bsr.transfer._ladder.ReadGate` of one restore.

    Args:
        run: the restore's transfer record (its ``quarantined`` counter is updated here).
        health: the engine's circuit breakers.
        quarantine: the engine's quarantine set.
        log: the request's logger.
    """

    def __init__(self, run: RestoreRun, health: TierHealth, quarantine: Quarantine, log: object):
        self.run = run
        self.health = health
        self.quarantine = quarantine
        self.log = log
        self.pending: list[TierQuarantine] = []
        self._lock = threading.Lock()
        # per tier: reads in flight, since when one was, and the time one was (its busy time:
        # what the cost model divides the tier's bytes by)
        self._inflight: dict[str, int] = {}
        self._since: dict[str, float] = {}
        self._busy: dict[str, float] = {}

    def admit(self, tier: str, key: ChunkKey, group: str) -> str | None:
        if len(self.quarantine) and (tier, ObjectKey(key, group).object_id) in self.quarantine:
            return "object quarantined"
        if not self.health.admit(tier):
            return "circuit breaker open"
        self._started(tier)  # an admitted attempt ends in exactly one report or withdraw
        return None

    def _started(self, tier: str) -> None:
        with self._lock:
            n = self._inflight.get(tier, 0)
            if n == 0:
                self._since[tier] = time.perf_counter()
            self._inflight[tier] = n + 1

    def _ended(self, tier: str) -> None:
        with self._lock:
            n = self._inflight.get(tier, 0) - 1
            if n < 0:
                return
            self._inflight[tier] = n
            if n == 0:
                spent = time.perf_counter() - self._since[tier]
                self._busy[tier] = self._busy.get(tier, 0.0) + spent

    def busy_by_tier(self) -> dict[str, float]:
        """Seconds each tier had at least one read of this restore in flight (the reads that
        are still in flight count up to now)."""
        now = time.perf_counter()
        with self._lock:
            out = dict(self._busy)
            for t, n in self._inflight.items():
                if n > 0:
                    out[t] = out.get(t, 0.0) + now - self._since[t]
        return out

    def admit_batch(
        self, tier: str, objects: Sequence[tuple[ChunkKey, str]]
    ) -> BatchAdmission | None:
        """Every object of a batch asked of ``tier`` without admitting each, when the tier's
        breaker is closed (admission would change nothing) and none is quarantined; else None
        (the ladder admits and reports object by object). The batch's reads are one span of
        the tier's busy time: its objects' failures are reported without ending it, its end
        does (with one success report when the tier served any of them)."""
        if not self.health.closed(tier):
            return None
        if len(self.quarantine):
            q = self.quarantine
            if any((tier, object_id(key.digest, g)) in q for key, g in objects):
                return None
        self._started(tier)
        return _Batch(self, tier)

    def withdraw(self, tier: str) -> None:
        self._ended(tier)
        self.health.release(tier)

    def report(self, outcome: ReadOutcome) -> None:
        self._ended(outcome.tier)
        self._outcome(outcome)

    def _outcome(self, outcome: ReadOutcome) -> None:
        kind = outcome.outcome
        if kind in (Outcome.OK, Outcome.MISS, Outcome.CORRUPT):
            self.health.success(outcome.tier)  # the tier answered
        else:
            self.health.failure(outcome.tier)
        if kind is Outcome.CORRUPT:
            self._retire(outcome, physical=True)
        elif kind is Outcome.IO_ERROR:
            self._retire(outcome, physical=False)

    def _retire(self, outcome: ReadOutcome, *, physical: bool) -> None:
        # a corrupt object stays out until a fresh copy is written; one that could not be read
        # (EIO, a server gone: often passing) for one breaker cooldown, then it is tried again
        for_s = None if physical else self.health.cooldown_s
        if not self.quarantine.add(outcome.tier, outcome.object_id, for_s=for_s):
            return
        with self._lock:
            self.run.quarantined += 1
            if physical:
                why = outcome.error_type or str(outcome.outcome)
                self.pending.append(TierQuarantine(outcome.tier, outcome.key, outcome.group, why))
        self.log.warning(  # type: ignore[attr-defined]
            "bsr.engine.quarantine",
            tier=outcome.tier,
            key=outcome.key.hex[:16],
            group=outcome.group,
            reason=str(outcome.outcome),
            physical=physical,
        )

    def take_pending(self) -> list[TierQuarantine]:
        with self._lock:
            out, self.pending = self.pending, []
        return out


class _Batch:
    """A batch :meth:`RestoreGate.admit_batch` admitted on one tier (a
    :class:`~bsr.transfer._ladder.BatchAdmission`)."""

    __slots__ = ("_ended", "gate", "tier")

    def __init__(self, gate: RestoreGate, tier: str) -> None:
        self.gate = gate
        self.tier = tier
        self._ended = False

    def report(self, outcome: ReadOutcome) -> None:
        self.gate._outcome(outcome)

    def end(self, served: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self.gate._ended(self.tier)
        if served:
            self.gate.health.success(self.tier)
