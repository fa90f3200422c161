"""Quarantine and the read gate: the decision side's answer to the transfer side's outcomes.

Where it runs: the engine; :class:`RestoreGate` is called from the event loop and from the
pipeline's worker threads (it takes one lock).

How it works: the transfer side reports one :class:`~bsr.transfer._ladder.ReadOutcome` per read
attempt. The gate turns outcomes into decisions: a verified-corrupt object is quarantined in the
engine at once (later probes and reads skip it) and queued for removal from its tier (done by the
engine after the window, bounded by the request's deadline); an I/O error retires the object in
this engine only (never ask a possibly dead tier to delete it) and counts against the tier's
circuit breaker, as does a timeout; a miss and a success are the tier answering. Before an
attempt, the gate refuses a tier whose breaker is open or an object that is quarantined.

Moving an object out of its tier is tidying, not safety: the engine's own quarantine keeps it out
of every later probe and read at once, and every read verifies anyway. So that move is never
allowed to hold a caller's cancel: a move cut short (by the caller, the deadline or the
shield bound) is deferred here and retried when the engine closes, and dropped if a fresh copy
is written meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..core._keys import ChunkKey, ObjectKey, object_id
from ..transfer._ladder import Outcome, ReadOutcome
from ..transfer._pipeline import RestoreRun
from ._health import TierHealth


class Quarantine:
    """The (tier, object id) pairs this engine no longer uses, and the moves out of their
    tiers still owed. Thread-safe."""

    def __init__(self) -> None:
        self._items: set[tuple[str, str]] = set()
        self._deferred: dict[tuple[str, str], TierQuarantine] = {}
        self._lock = threading.Lock()

    def __contains__(self, item: tuple[str, str]) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        with self._lock:
            return iter(sorted(self._items))

    def add(self, tier: str, object_id: str) -> bool:
        """Quarantine an object; return False if it already was."""
        with self._lock:
            if (tier, object_id) in self._items:
                return False
            self._items.add((tier, object_id))
            return True

    def lift(self, tier: str, object_id: str) -> None:
        """A fresh copy was written: the object may be used again (and must stay)."""
        with self._lock:
            self._items.discard((tier, object_id))
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

    def admit(self, tier: str, key: ChunkKey, group: str) -> str | None:
        if len(self.quarantine) and (tier, ObjectKey(key, group).object_id) in self.quarantine:
            return "object quarantined"
        if not self.health.admit(tier):
            return "circuit breaker open"
        return None

    def admit_batch(self, tier: str, objects: Sequence[tuple[ChunkKey, str]]) -> bool:
        """Whether every object of a batch may be asked of ``tier`` without admitting each: the
        tier's breaker is closed (admission would change nothing) and none is quarantined.
        False: the ladder admits and reports object by object."""
        if not self.health.closed(tier):
            return False
        if len(self.quarantine):
            q = self.quarantine
            return not any((tier, object_id(key.digest, g)) in q for key, g in objects)
        return True

    def withdraw(self, tier: str) -> None:
        self.health.release(tier)

    def report_ok(self, tier: str) -> None:
        """``report`` of an ``OK`` outcome, without the record (called once per object read)."""
        self.health.success(tier)

    def report(self, outcome: ReadOutcome) -> None:
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
        if not self.quarantine.add(outcome.tier, outcome.object_id):
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
