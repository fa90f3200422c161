"""TierHealth: a per-tier circuit breaker, so a dead tier costs a few timeouts, not one per chunk.

Where it runs: the engine's decision side; called from the event loop and from the transfer
pipeline's worker threads (every method takes one lock, so it is thread-safe).

How it works: every tier call the engine makes during a restore reports success or failure
(I/O errors, timeouts, a failed probe; a verified-corrupt object or a miss is the object's
problem, not the tier's, and does not count). After ``threshold`` consecutive failures the
breaker opens: :meth:`TierHealth.admit` refuses the tier for ``cooldown_s`` seconds, so requests
fall straight through to the next tier. After the cooldown the breaker is half-open: ``admit``
lets exactly one call through (the trial) and refuses every other call until that trial reports;
a success closes the breaker, a failure opens it for another cooldown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._check import non_negative_seconds, optional_positive_int


@dataclass(frozen=True)
class BreakerState:
    """Snapshot of one tier's breaker.

    Attributes:
        tier: the tier's name.
        open: requests skip the tier (open, or half-open with its one trial call in flight).
        consecutive_failures: failures since the last success.
        trips: how many times the breaker opened.
        half_open: the cooldown passed; the next admitted call is the trial.
    """

    tier: str
    open: bool
    consecutive_failures: int
    trips: int
    half_open: bool = False


class TierHealth:
    """Circuit breakers for a set of tiers.

    Args:
        names: tier names.
        threshold: consecutive failures that open a tier's breaker (None: never open).
        cooldown_s: how long an open breaker keeps the tier out of requests (finite, >= 0).
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(
        self,
        names: Iterable[str],
        *,
        threshold: int | None = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = optional_positive_int(threshold, "breaker_threshold")
        self.cooldown_s = non_negative_seconds(cooldown_s, "breaker_cooldown_s")
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = {n: 0 for n in names}
        self._open_until = {n: 0.0 for n in self._failures}
        self._opened = {n: False for n in self._failures}
        self._trial = {n: False for n in self._failures}
        self._trips = {n: 0 for n in self._failures}

    def _usable(self, tier: str) -> bool:
        if not self._opened[tier]:
            return True
        return self._clock() >= self._open_until[tier] and not self._trial[tier]

    def available(self, tier: str) -> bool:
        """Whether a call to ``tier`` would be admitted now (no state change)."""
        with self._lock:
            return self._usable(tier)

    def closed(self, tier: str) -> bool:
        """Whether ``tier``'s breaker is closed: :meth:`admit` then admits every call and
        changes nothing, so a batch of calls needs no admission of its own."""
        return not self._opened[tier]

    def admit(self, tier: str) -> bool:
        """Whether a call may go to ``tier`` now; in half-open state only the first caller wins.

        An admitted caller must report :meth:`success` or :meth:`failure` (or :meth:`release`
        when the call was not made), or a half-open breaker stays closed to everyone.
        """
        with self._lock:
            if not self._usable(tier):
                return False
            if self._opened[tier]:
                self._trial[tier] = True
            return True

    def release(self, tier: str) -> None:
        """An admitted call was not made after all: let another caller be the trial."""
        with self._lock:
            self._trial[tier] = False

    def success(self, tier: str) -> None:
        if not (self._failures[tier] or self._opened[tier] or self._trial[tier]):
            return  # closed and clean already (the common case): nothing to change
        with self._lock:
            self._failures[tier] = 0
            self._open_until[tier] = 0.0
            self._opened[tier] = False
            self._trial[tier] = False

    def failure(self, tier: str) -> None:
        with self._lock:
            self._failures[tier] += 1
            trial = self._trial[tier]
            self._trial[tier] = False
            if trial or (self.threshold is not None and self._failures[tier] >= self.threshold):
                if not self._opened[tier] or trial or self._clock() >= self._open_until[tier]:
                    self._trips[tier] += 1
                self._opened[tier] = True
                self._open_until[tier] = self._clock() + self.cooldown_s

    def state(self, tier: str) -> BreakerState:
        with self._lock:
            cooled = self._opened[tier] and self._clock() >= self._open_until[tier]
            return BreakerState(
                tier=tier,
                open=not self._usable(tier),
                consecutive_failures=self._failures[tier],
                trips=self._trips[tier],
                half_open=cooled,
            )
