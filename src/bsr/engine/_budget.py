"""One deadline over a lookup and the restore after it: what the kit's ``admit``, ``HCache.restore``
and a server's own admission spend, as a restore without a probe spends its own.

Where it runs: wherever a prefix is looked up and then restored (the caller's event loop).

How it works: the lookup waits for the tiers at most the engine's ``probe_share`` of the
deadline (a tier still answering then is cut off, holds nothing for this request and counts
against its circuit breaker), and the restore gets what is left of it, so the pair ends within
the one deadline the caller gave, as ``restore`` alone does. Without a deadline (none given,
none on the engine) neither is bounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: what a restore gets when the lookup left nothing of the deadline: a deadline that has
#: passed (it ends ``deadline`` at once, nothing read)
SPENT_S = 1e-6


@dataclass(frozen=True)
class DeadlineSplit:
    """One deadline split between a lookup and the restore after it
    (:meth:`RestoreEngine.split_deadline <bsr.RestoreEngine.split_deadline>`).

    Attributes:
        total_s: the whole deadline in seconds (None: unbounded).
        share: the lookup's share of it (the engine's ``probe_share``).
        started: when it started (``time.perf_counter()``).
    """

    total_s: float | None
    share: float
    started: float

    @property
    def lookup_s(self) -> float | None:
        """The lookup's deadline: ``probe_share`` of the whole."""
        return None if self.total_s is None else self.total_s * self.share

    def restore_s(self) -> float | None:
        """The restore's deadline: what is left of the whole now (at least :data:`SPENT_S`)."""
        if self.total_s is None:
            return None
        return max(SPENT_S, self.total_s - (time.perf_counter() - self.started))
