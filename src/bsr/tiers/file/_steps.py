"""FileTier's locked steps: a blocking step that needs the root's lock, run without ever waiting
for that lock past ``lock_timeout_s``.

Where it runs: the tier's event-loop side hands each step to a worker thread (at most
``io_threads`` at once) and tries it again from the event loop while another process holds the
lock, holding nothing in between.

How it works: a step takes the root's lock without waiting (trying for a moment, then raising
:class:`~bsr.tiers.file._ledger.RootBusy`); room that writes in progress hold comes back as
``RoomPending``. Past ``lock_timeout_s`` the step is given up with a typed
:class:`~bsr.TierBusyError` (counted in ``statistics().busy``). Once a step gave up on the lock,
later steps try it once until one gets it: a peer stopped for long costs one ``lock_timeout_s``,
then a short try per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ..._errors import TierBusyError
from .._lru import RoomPending
from ._ledger import RootBusy

if TYPE_CHECKING:
    from ._tier import FileTier

T = TypeVar("T")

#: how often a step waiting for room that writes in progress hold looks again (seconds)
ROOM_POLL_S = 0.005


class LockedSteps:
    """The root-lock steps of one :class:`~bsr.FileTier` (``tier``)."""

    def __init__(self, tier: FileTier) -> None:
        self.tier = tier
        self.stuck = False  # a step gave up on the root's lock, none got it since

    async def run(self, fn: Callable[..., T], *args: Any, what: str, abandon: bool = False) -> T:
        """``fn(*args)``: a worker-thread step that takes the root's lock without waiting
        (trying for a moment, then raising :class:`RootBusy` while another process holds it),
        tried again from the event loop, holding nothing in between, until it runs or
        ``lock_timeout_s`` passed. Room that writes in progress hold (``RoomPending``) is
        waited for the same way. A caller's cancel ends the wait at once; a step already
        running finishes first (``abandon``: unless it has nothing to give back).

        Once a step gave up on the lock, later steps try it once (one step's patience, 50 ms)
        until one gets it: a peer stopped for long costs one ``lock_timeout_s``, then a short
        try per call (saves hold staging slots while their writes wait).

        Raises:
            TierBusyError: the lock (or the room) stayed taken for ``lock_timeout_s`` (counted
                in ``statistics().busy``).
        """
        tier = self.tier
        start = time.monotonic()
        while True:
            try:
                out = await anyio.to_thread.run_sync(
                    fn, *args, limiter=tier._limiter, abandon_on_cancel=abandon
                )
            except RootBusy:
                reason = "root_locked"
            except RoomPending:  # it had the lock
                reason, self.stuck = "room_pending", False
            else:
                self.stuck = False
                return out
            stuck = self.stuck and reason == "root_locked"
            if time.monotonic() - start >= (0.0 if stuck else tier.lock_timeout_s):
                if reason == "root_locked":
                    self.stuck = True
                raise self.busy(reason, what)
            # each try waited up to PATIENCE_S in its thread (RootBusy); room held by writes in
            # progress comes back when they end: look again shortly
            await anyio.sleep(0 if reason == "root_locked" else ROOM_POLL_S)

    def busy(self, reason: str, what: str) -> TierBusyError:
        """The typed error of a step given up (``reason``: ``root_locked`` or
        ``room_pending``), counted in ``statistics().busy``."""
        tier = self.tier
        tier._count(busy=1)
        held = (
            "the root's lock stayed held by another process"
            if reason == "root_locked"
            else "the room it needs stayed reserved by writes in progress"
        )
        return TierBusyError(
            f"{what} skipped: {held} (up to {tier.lock_timeout_s:g} s; a process sharing "
            f"{tier.root} stopped or frozen?); reads go on, and a later call tries again",
            tier=tier.name,
            reason=reason,
            path=str(tier.root),
        )
