"""A restore's transfer record: what was read, installed and failed, shared by its workers.

Where it runs: the engine's event loop and the transfer pipeline's worker threads (the record's
mutations take one lock; the install gate takes its own).

How it works: the plan comes in made (:func:`~bsr.core._plan.plan_restore`); a
:class:`RestoreRun` records what happened to it. The engine reads it after the window:
``installed`` feeds the commit rule, ``failure`` the invalidation reason, ``held``/``busy`` its
``finally``. Its :class:`InstallGate` lets copies into the cache run in parallel and none land
after the request ended; :class:`Batches` hands the planned chunks to the workers in order.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..core._lifecycle import Reason
from ..core._options import Policy
from ..core._plan import RestorePlan
from ._ladder import LadderResult
from ._staging import Slot


class ChunkFailure(Exception):
    """A (chunk, group) could not be read or installed from any tier."""

    def __init__(self, chunk: int, group: str, reason: Reason, errors: Sequence[str]) -> None:
        super().__init__(f"chunk {chunk} group {group}: {reason}")
        self.chunk = chunk
        self.group = group
        self.reason = reason
        self.errors = list(errors)


#: ``on_installed(chunk, groups)``: told on the event loop once a chunk's groups are in the cache
OnInstalled = Callable[[int, tuple[str, ...]], Awaitable[None] | None]


class InstallGate:
    """Copies into the cache enter the gate; closing it waits for those under way and refuses
    every later one (so copies of one run may run in parallel, and none lands after the end)."""

    #: the longest the close waits for copies under way (a chunk's memcpy takes milliseconds)
    CLOSE_WAIT_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # waited on only while closing
        self._active = 0
        self._closed = False

    def enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._active += 1
            return True

    @property
    def closing(self) -> bool:
        """Whether the gate is closing or closed (an entered batch of copies stops at its next
        chunk, so the close waits for one chunk's copy)."""
        return self._closed

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:
                self._idle.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: self._active == 0, self.CLOSE_WAIT_S)


class RestoreRun:
    """One restore's transfer record, shared by the pipeline's tasks and worker threads.

    The plan comes in made (:func:`~bsr.core._plan.plan_restore`); the run records what
    happened to it. The engine reads it after the window: ``installed`` feeds the commit rule,
    ``failure`` the invalidation reason, ``held``/``busy`` its ``finally``. Mutations from
    worker threads go through the methods below, which take one lock.
    """

    def __init__(self, plan: RestorePlan, policy: Policy) -> None:
        self.plan = plan
        self.policy = policy
        self.target = plan.target
        self.limit = plan.target  # chunks >= limit are abandoned (a chunk below failed)
        self.needed = plan.needed
        #: the chunks the caller already holds (:attr:`RestorePlan.skipped`) count as installed
        self.skipped = plan.skipped
        self.installed: set[tuple[int, str]] = {
            (c, g) for c in plan.skipped for g in plan.needed[c]
        }
        self.first_block = plan.first_block
        self.touched_chunks: set[int] = set()
        self.held: set[Slot] = set()
        self.busy: dict[Slot, threading.Event] = {}
        self.failure: ChunkFailure | None = None
        self.bytes_by_tier: dict[str, int] = {}
        self.fallbacks = 0
        self.quarantined = 0
        self.errors: list[str] = []
        self.abandoned = False
        #: nothing more can be committed: the window should stop now (kept by fail/abandon)
        self.stopped = False
        self.installs = InstallGate()
        #: where the run's slots come from, who hears of installed chunks, and which chunks it
        #: was told of (set by the pipeline when the run starts)
        self.slots: Any = None
        self.on_installed: OnInstalled | None = None
        self.announced: set[int] = set()
        self._lock = threading.Lock()

    def fail(self, failure: ChunkFailure) -> None:
        """Record a failure; chunks from it on will not be used."""
        with self._lock:
            self.errors.extend(failure.errors)
            if self.failure is None or failure.chunk < self.failure.chunk:
                self.failure = failure
            self.limit = min(self.limit, failure.chunk)
            if self.limit == 0 or self.policy is Policy.ALL_OR_NOTHING:
                self.stopped = True

    def record_read(self, result: LadderResult) -> None:
        with self._lock:
            assert result.tier is not None
            self.bytes_by_tier[result.tier] = self.bytes_by_tier.get(result.tier, 0) + result.nbytes
            if result.fell_back:
                self.fallbacks += 1
                self.errors.extend(result.errors)

    def add_bytes(self, by_tier: dict[str, int]) -> None:
        """Bytes served by first holders (a batch call's, recorded at its end)."""
        with self._lock:
            for tier, n in by_tier.items():
                self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + n

    def record_installed_many(self, chunks: Sequence[int]) -> None:
        """Every needed group of each of ``chunks`` is in the cache (one lock for a call)."""
        needed = self.needed
        with self._lock:
            self.installed.update((c, g) for c in chunks for g in needed[c])

    def record_installed(self, chunk: int, groups: Sequence[str]) -> None:
        with self._lock:
            self.installed.update((chunk, g) for g in groups)

    def withdraw(self, chunk: int, groups: Sequence[str]) -> None:
        """The chunk's blocks no longer hold valid state (the caller's work on them failed)."""
        with self._lock:
            self.installed.difference_update((chunk, g) for g in groups)

    def abandon(self) -> None:
        """The request is over: no worker may copy into the cache from now on.

        Waits (bounded) for copies already under way, which are memory copies of one chunk.
        """
        self.installs.close()
        self.abandoned = self.stopped = True

    @property
    def must_stop(self) -> bool:
        """Whether nothing more can be committed, so the window should stop now."""
        return self.stopped

    def wanted(self, chunk: int) -> bool:
        return not self.stopped and chunk < self.limit


class Batches:
    """Hands out consecutive runs of chunks to the workers, in chunk order."""

    def __init__(self, chunks: Sequence[int], size: int) -> None:
        self._chunks = list(chunks)
        self._size = max(1, size)
        self._next = 0

    def take(self, run: RestoreRun) -> list[int]:
        chunks, start = self._chunks, self._next
        if run.must_stop:
            self._next = len(chunks)
            return []
        out = chunks[start : start + self._size]
        self._next = start + len(out)
        if out and out[-1] >= run.limit:  # chunks are ascending: those past the limit go
            out = [c for c in out if c < run.limit]
            self._next = len(chunks)
        return out
