"""Per-tier circuit breakers: a dead tier costs a few timeouts, not one per chunk."""

from __future__ import annotations

from pathlib import Path

import anyio
import torch

import bsr
from bsr.engine._health import TierHealth
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier
from helpers import blocks_equal, filled_cache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_and_half_opens_after_cooldown() -> None:
    clock = Clock()
    h = TierHealth(["a", "b"], threshold=2, cooldown_s=5.0, clock=clock)
    h.failure("a")
    assert h.available("a")
    h.failure("a")
    assert not h.available("a") and h.available("b")
    assert h.state("a").open and h.state("a").trips == 1
    clock.now += 5.0
    assert h.available("a")  # half-open: one try
    h.failure("a")
    assert not h.available("a") and h.state("a").trips == 2
    clock.now += 5.0
    h.success("a")
    assert h.available("a") and h.state("a").consecutive_failures == 0


def test_no_threshold_never_opens() -> None:
    h = TierHealth(["a"], threshold=None)
    for _ in range(100):
        h.failure("a")
    assert h.available("a")


def test_dead_l1_is_skipped_after_the_threshold(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = list(range(1, 12 * 16 + 1))
    src = filled_cache(layout, 16, 16)
    ids = torch.arange(12)
    plan = FaultPlan(seed=0)

    async def main() -> None:
        l1 = FaultyTier(bsr.HostTier(1 << 26), plan)
        engine = bsr.RestoreEngine(
            layout,
            [l1, bsr.FileTier(tmp_path, 1 << 26)],
            window=2,
            io_depth=1,
            namespace=bsr.Namespace("m"),
            breaker_threshold=2,
            breaker_cooldown_s=60,
        )
        async with engine:
            await engine.save(toks, src, ids)
            plan.faults = (Fault(FaultKind.READ_ERROR),)  # L1 dies: every read fails
            dst = bsr.PagedKVCache(layout, 16, 16)
            r = await engine.restore(toks, dst, ids)
            assert r.committed and r.committed_tokens == 12 * 16
            assert blocks_equal(layout, src, ids, dst, ids, 12)
            # only the first two chunks paid for the dead tier
            assert plan.fired["read_error"] == 2
            assert r.bytes_by_tier["file"] == 12 * layout.chunk_bytes
            assert any("circuit breaker open" in e for e in r.errors)
            state = {b.tier: b for b in engine.statistics().breakers}
            assert state["host"].open and not state["file"].open
            # the next probe does not even ask the dead tier
            probe = await engine.lookup(toks)
            assert probe.holders[0]["kv"] == ("file",)

    anyio.run(main)
