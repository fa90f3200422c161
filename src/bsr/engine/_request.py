"""One restore request's record: its lifecycle, its deadline, and what each phase left behind.

Where it runs: the engine's event loop. A plain record, so the engine's phases read as steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..core._keys import KeyExtra
from ..core._lifecycle import RequestLifecycle, RequestState
from ..core._options import Policy, Strategy
from ..core._results import LoadDecision, Probe, RestoreResult, Timings
from ..transfer._cache import PagedKVCache
from ..transfer._pipeline import OnInstalled, RestoreRun, SlotSource
from ..transfer._tables import BlockTables
from ._decisions import RestoreGate


@dataclass
class RestoreRequest:
    """Everything one ``restore`` call carries from phase to phase."""

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
    probe: Probe | None = None
    run: RestoreRun | None = None
    slots: SlotSource | None = None
    gate: RestoreGate | None = None
    timed_out: bool = False
    committed_chunks: int = 0
    on_installed: OnInstalled | None = None
    first_block: int = 0  # restore(start_tokens=...): blocks before it are never written
    valid_chunks: int = 0  # chunks the caller already holds: neither read nor installed
    cost: bool = False  # policy "cost": decide how much to load (then all-or-nothing)
    decision: LoadDecision | None = None  # what it decided
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

    def invalid_blocks(self) -> dict[str, tuple[int, ...]]:
        """Per group, the blocks this restore wrote that hold no valid state (all of them
        unless Committed)."""
        if self.run is None:
            return {}
        out: dict[str, set[int]] = {}
        for c in self.run.touched_chunks:
            if c >= self.committed_chunks:
                for g in self.run.needed.get(c, ()):
                    written = self.tables.written_blocks(g, c, self.first_block)
                    out.setdefault(g, set()).update(written)
        return {g: tuple(sorted(bs)) for g, bs in out.items() if bs}

    def result(self, chunk_tokens: int) -> RestoreResult:
        """The public outcome of this request (it must be terminal)."""
        assert self.life.reason is not None and self.life.terminal
        if self.life.state is not RequestState.COMMITTED:
            self.committed_chunks = 0
        run, probed = self.run, self.probe.prefix_chunks if self.probe else 0
        invalid = self.invalid_blocks()
        return RestoreResult(
            request_id=self.rid,
            state=self.life.state,
            committed_tokens=self.committed_chunks * chunk_tokens,
            probed_tokens=probed * chunk_tokens,
            bytes_by_tier=dict(run.bytes_by_tier) if run else {},
            rws_peak_bytes=0 if self.slots is None else self.slots.peak_bytes,
            timings=Timings(
                self.phase_s.get("probe", 0.0),
                self.phase_s.get("window", 0.0),
                self.phase_s.get("commit", 0.0),
                time.perf_counter() - self.t0,
                self.phase_s.get("settle", 0.0),
            ),
            reason=self.life.reason,
            invalid_block_ids=tuple(sorted({b for bs in invalid.values() for b in bs})),
            invalid_block_ids_by_group=invalid,
            trace=tuple(self.life.trace),
            strategy=self.strategy,
            policy=Policy.COST if self.cost else self.policy,
            fallbacks=run.fallbacks if run else 0,
            quarantined=run.quarantined if run else 0,
            errors=tuple(run.errors) if run else (),
            decision=self.decision,
            read_s_by_tier={} if self.gate is None else self.gate.busy_by_tier(),
        )
