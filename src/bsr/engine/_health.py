"""TierHealth: a per-tier circuit breaker, so a dead tier costs one timeout, not one per chunk.

Where it runs: the engine's event loop (plain bookkeeping, no I/O).

How it works: every tier call the engine makes during a restore reports success or failure
(I/O errors, timeouts, a failed probe; a verified-corrupt object or a miss is the object's
problem, not the tier's, and does not count). After ``threshold`` consecutive failures the
breaker opens: probes and reads skip the tier for ``cooldown_s`` seconds, so requests fall
straight through to the next tier. After the cooldown one call is let through (half-open); a
success closes the breaker, a failure opens it for another cooldown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._errors import ConfigError


@dataclass(frozen=True)
class BreakerState:
    """Snapshot of one tier's breaker."""

    tier: str
    open: bool
    consecutive_failures: int
    trips: int


class TierHealth:
    """Circuit breakers for a set of tiers.

    Args:
        names: tier names.
        threshold: consecutive failures that open a tier's breaker (None: never open).
        cooldown_s: how long an open breaker keeps the tier out of requests.
    """

    def __init__(
        self,
        names: Iterable[str],
        *,
        threshold: int | None = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold is not None and threshold < 1:
            raise ConfigError(f"breaker threshold must be >= 1 or None, got {threshold}")
        if cooldown_s < 0:
            raise ConfigError(f"breaker cooldown_s must be >= 0, got {cooldown_s}")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = {n: 0 for n in names}
        self._open_until = {n: 0.0 for n in self._failures}
        self._trips = {n: 0 for n in self._failures}

    def available(self, tier: str) -> bool:
        """Whether requests may use ``tier`` now (closed, or half-open after the cooldown)."""
        return self._clock() >= self._open_until[tier]

    def success(self, tier: str) -> None:
        self._failures[tier] = 0
        self._open_until[tier] = 0.0

    def failure(self, tier: str) -> None:
        self._failures[tier] += 1
        if self.threshold is not None and self._failures[tier] >= self.threshold:
            if self.available(tier):  # closed or half-open: (re)open
                self._trips[tier] += 1
            self._open_until[tier] = self._clock() + self.cooldown_s

    def state(self, tier: str) -> BreakerState:
        return BreakerState(
            tier=tier,
            open=not self.available(tier),
            consecutive_failures=self._failures[tier],
            trips=self._trips[tier],
        )
