"""Per-tier circuit breakers: a dead tier costs a few timeouts, not one per chunk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import bsr
from bsr.engine._health import TierHealth
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier
from support.helpers import blocks_equal, filled_cache


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


@pytest.mark.anyio
async def test_dead_l1_is_skipped_after_the_threshold(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = list(range(1, 12 * 16 + 1))
    src = filled_cache(layout, 16, 16)
    ids = torch.arange(12)
    plan = FaultPlan(seed=0)

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


def open_breaker(clock: Clock, *, cooldown_s: float = 5.0) -> TierHealth:
    """A breaker on tier "a" that tripped once and whose cooldown has just passed (half-open)."""
    h = TierHealth(["a"], threshold=1, cooldown_s=cooldown_s, clock=clock)
    h.failure("a")
    assert not h.admit("a") and h.state("a").trips == 1
    clock.now += cooldown_s
    assert h.state("a").half_open and h.available("a")
    return h


def admit_from_threads(h: TierHealth, n: int) -> list[bool]:
    """``n`` threads call ``admit("a")`` at once (released together by a barrier)."""
    barrier = threading.Barrier(n)
    results: list[bool] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait()
        ok = h.admit("a")
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_closed_breaker_admits_every_concurrent_call() -> None:
    h = TierHealth(["a"], threshold=3, clock=Clock())
    assert admit_from_threads(h, 32) == [True] * 32


def test_open_breaker_admits_nothing_before_the_cooldown() -> None:
    clock = Clock()
    h = TierHealth(["a"], threshold=1, cooldown_s=5.0, clock=clock)
    h.failure("a")
    clock.now += 4.9
    assert admit_from_threads(h, 16) == [False] * 16
    assert h.state("a").open and not h.state("a").half_open


def test_half_open_admits_exactly_one_of_many_concurrent_calls() -> None:
    for _ in range(20):  # the race is real: repeat it
        h = open_breaker(Clock())
        results = admit_from_threads(h, 32)
        assert results.count(True) == 1
        # the trial is in flight: the breaker reads open to everyone else until it reports
        assert h.state("a").open and not h.available("a")


def test_release_lets_another_caller_be_the_trial() -> None:
    h = open_breaker(Clock())
    assert h.admit("a")
    assert not h.admit("a")
    h.release("a")  # the trial call was not made after all
    assert h.available("a")
    assert h.admit("a")
    assert not h.admit("a")
    assert h.state("a").trips == 1  # releasing is not a failure


def test_trial_success_closes_the_breaker() -> None:
    h = open_breaker(Clock())
    assert h.admit("a")
    h.success("a")
    s = h.state("a")
    assert not s.open and not s.half_open and s.consecutive_failures == 0 and s.trips == 1
    assert admit_from_threads(h, 16) == [True] * 16


def test_trial_failure_reopens_for_another_cooldown_and_counts_a_trip() -> None:
    clock = Clock()
    h = open_breaker(clock, cooldown_s=5.0)
    assert h.admit("a")
    h.failure("a")
    s = h.state("a")
    assert s.open and not s.half_open and s.trips == 2
    assert not h.admit("a")
    clock.now += 4.9
    assert not h.admit("a")
    clock.now += 0.1
    assert h.admit("a") and not h.admit("a")  # half-open again: one trial


def test_a_trial_failure_reopens_even_with_threshold_not_reached() -> None:
    # threshold 3, but after a trip the single trial's failure is enough to reopen
    clock = Clock()
    h = TierHealth(["a"], threshold=3, cooldown_s=1.0, clock=clock)
    for _ in range(3):
        h.failure("a")
    clock.now += 1.0
    assert h.admit("a")
    h.failure("a")
    assert not h.available("a") and h.state("a").trips == 2


def test_breakers_of_different_tiers_are_independent() -> None:
    clock = Clock()
    h = TierHealth(["a", "b"], threshold=1, cooldown_s=1.0, clock=clock)
    h.failure("a")
    clock.now += 1.0
    assert h.admit("a")
    assert not h.admit("a")
    assert all(h.admit("b") for _ in range(5))
