"""One restore request's record: its arguments, its lifecycle, its deadline and its phase timings.

Where it runs: the engine's event loop. What the phases find is not kept here: each phase of the
restore job (:mod:`bsr.engine._job`) returns it to the next.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..core._keys import KeyExtra
from ..core._lifecycle import RequestLifecycle
from ..core._options import Policy, Strategy
from ..transfer._cache import PagedKVCache
from ..transfer._run import OnInstalled
from ..transfer._tables import BlockTables


@dataclass
class RestoreRequest:
    """One ``restore`` call's arguments, checked, and the state every phase shares: the
    lifecycle (which the phases fire), the deadline and the time each phase took."""

    rid: str
    life: RequestLifecycle
    log: Any
    tokens: Any
    extras: tuple[KeyExtra, ...]
    cache: PagedKVCache
    tables: BlockTables
    policy: Policy
    strategy: Strategy
    deadline_at: float | None
    on_installed: OnInstalled | None = None
    first_block: int = 0  # restore(start_tokens=...): blocks before it are never written
    valid_chunks: int = 0  # chunks the caller already holds: neither read nor installed
    cost: bool = False  # policy "cost": decide how much to load (then all-or-nothing)
    skip_tiers: frozenset[str] = frozenset()  # tiers its probe does not ask
    t0: float = field(default_factory=time.perf_counter)
    phase_s: dict[str, float] = field(default_factory=dict)

    def remaining(self) -> float:
        """Seconds left before the deadline (``inf`` without one, never negative)."""
        if self.deadline_at is None:
            return math.inf
        return max(0.0, self.deadline_at - time.perf_counter())

    def timed(self, phase: str, since: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - since

    def serves(self, prefix_chunks: int) -> bool:
        """Whether the block tables hold every block a prefix needs, past ``first_block``."""
        return self.tables.serves(prefix_chunks, self.first_block)
