"""The engine under every anyio backend: asyncio and trio (the ``anyio_backend`` fixture).

Save, lookup, restore, a cancelled restore and deadlines, on a real HostTier and a real FileTier,
through both read paths of the pipeline: batched blocking reads in worker threads (the plain
tiers) and awaited reads (a LatencyTier around them). Each test first checks that it really runs
under the backend it was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import sniffio
import torch

import bsr
from bsr.testing import LatencyTier
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

pytestmark = pytest.mark.anyio

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8  # block_tokens: 4 blocks per chunk


@pytest.fixture(params=["host", "file"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> bsr.Tier:
    if request.param == "host":
        return bsr.HostTier(capacity_bytes=1 << 26)
    return bsr.FileTier(tmp_path / "l2", capacity_bytes=1 << 26)


def check_backend(anyio_backend: str) -> None:
    assert sniffio.current_async_library() == anyio_backend


def block_ids(n_chunks: int) -> torch.Tensor:
    return torch.arange(n_chunks * CT // BLOCK)


async def poll_until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``cond`` (state another thread changes, so no event to wait on) or fail."""
    for _ in range(int(timeout_s / 0.002)):
        if cond():
            return
        await anyio.sleep(0.002)
    raise AssertionError(f"timed out waiting until {what}")


async def test_save_lookup_restore(anyio_backend: str, tier: bsr.Tier) -> None:
    check_backend(anyio_backend)
    n = 6
    toks = tokens_for(n * CT + 5)  # a partial last chunk is never stored
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = block_ids(n + 1)
    async with make_engine(LAYOUT, [tier], window=2, io_depth=2) as eng:
        saved = await eng.save(toks, src, ids)
        assert saved.ok and saved.chunks == n
        probe = await eng.lookup(toks)
        assert probe.prefix_chunks == n and probe.prefix_tokens == n * CT
        for strategy in bsr.Strategy:
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            r = await eng.restore(toks, dst, ids, strategy=strategy)
            assert r.committed and r.committed_tokens == n * CT, (strategy, r.reason, r.errors)
            assert r.reason is bsr.Reason.COMPLETE
            assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.acquired == s.released > 0
        assert s.peak_in_use <= 2


async def test_concurrent_restores_share_the_window(anyio_backend: str, tier: bsr.Tier) -> None:
    check_backend(anyio_backend)
    n = 5
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = block_ids(n)
    results: list[bsr.RestoreResult] = []
    dsts = [bsr.PagedKVCache(LAYOUT, 64, BLOCK) for _ in range(4)]
    async with make_engine(LAYOUT, [tier], window=2, io_depth=2) as eng:
        await eng.save(toks, src, ids)

        async def one(dst: bsr.PagedKVCache) -> None:
            results.append(await eng.restore(toks, dst, ids))

        async with anyio.create_task_group() as tg:
            for dst in dsts:
                tg.start_soon(one, dst)
        assert [r.committed_tokens for r in results] == [n * CT] * 4
        assert all(blocks_equal(LAYOUT, src, ids, d, ids, n) for d in dsts)
        s = eng.staging.statistics()
        assert s.peak_in_use <= 2 and s.in_use == 0


async def test_cancelled_restore_returns_every_slot(anyio_backend: str, tier: bsr.Tier) -> None:
    check_backend(anyio_backend)
    n = 20
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 128, BLOCK)
    ids = block_ids(n)
    slow = LatencyTier(tier, read_latency_s=0.02)
    async with make_engine(LAYOUT, [slow], window=4, io_depth=2) as eng:
        await eng.save(toks, src, ids)
        scope = anyio.CancelScope()

        async def cancel_mid_window() -> None:
            await poll_until(lambda: eng.staging.statistics().in_use > 0, "a slot is in use")
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_mid_window)
            with scope:
                await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 128, BLOCK), ids)
        assert scope.cancelled_caught
        s = eng.staging.statistics()
        assert s.acquired > 0 and s.in_use == 0 and s.acquired == s.released
        assert eng.statistics().invalidated == 1
        # the engine is still usable after the cancellation
        dst = bsr.PagedKVCache(LAYOUT, 128, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)


async def test_cancelling_the_callers_task_group(anyio_backend: str, tier: bsr.Tier) -> None:
    """A restore cancelled from outside (its task group) ends Invalidated and holds no slot."""
    check_backend(anyio_backend)
    n = 20
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 128, BLOCK)
    ids = block_ids(n)
    slow = LatencyTier(tier, read_latency_s=0.02)
    async with make_engine(LAYOUT, [slow], window=4, io_depth=2) as eng:
        await eng.save(toks, src, ids)
        finished: list[bsr.RestoreResult] = []

        async def restore() -> None:
            finished.append(await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 128, BLOCK), ids))

        async with anyio.create_task_group() as tg:
            tg.start_soon(restore)
            await poll_until(lambda: eng.staging.statistics().in_use > 0, "the window runs")
            tg.cancel_scope.cancel()
        assert finished == []  # cancellation propagated, it was not swallowed
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.acquired == s.released
        assert eng.statistics().invalidated == 1


async def test_deadline_invalidates_a_slow_restore(anyio_backend: str, tier: bsr.Tier) -> None:
    check_backend(anyio_backend)
    n = 20
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 128, BLOCK)
    ids = block_ids(n)
    slow = LatencyTier(tier, read_latency_s=0.05)
    async with make_engine(LAYOUT, [slow], window=2, io_depth=1) as eng:
        await eng.save(toks, src, ids)
        with anyio.fail_after(10):  # a hang guard, not a timing assertion
            r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 128, BLOCK), ids, deadline_s=0.2)
        assert r.state is bsr.RequestState.INVALIDATED and r.reason is bsr.Reason.DEADLINE
        assert r.committed_tokens == 0 and r.invalid_block_ids
        assert eng.staging.statistics().in_use == 0


class StuckBlockingTier(bsr.TierWrapper[bsr.Tier]):
    """Blocking reads of chunk 1 stop in the worker thread until ``unstick`` is set, as a read
    stuck in the kernel would (the thread cannot be cancelled, only abandoned)."""

    inline_reads = False  # its blocking reads can block: never run them on the event loop

    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.unstick = threading.Event()
        self.stuck = threading.Event()

    def fetch_into_blocking(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        if key.index == 1:
            self.stuck.set()
            self.unstick.wait(30)
        return self.inner.fetch_into_blocking(key, group, dst)


async def test_deadline_abandons_a_stuck_worker_thread(anyio_backend: str, tier: bsr.Tier) -> None:
    check_backend(anyio_backend)
    n = 4
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = block_ids(n)
    stuck = StuckBlockingTier(tier)
    assert stuck.blocking_reads  # the batched worker-thread path is the one under test
    async with make_engine(LAYOUT, [stuck], window=2, io_depth=2) as eng:
        await eng.save(toks, src, ids)
        try:
            with anyio.fail_after(10):
                r = await eng.restore(
                    toks, bsr.PagedKVCache(LAYOUT, 64, BLOCK), ids, deadline_s=1.0
                )
            assert stuck.stuck.is_set()
            assert r.state is bsr.RequestState.INVALIDATED and r.reason is bsr.Reason.DEADLINE
            assert r.committed_tokens == 0
        finally:
            stuck.unstick.set()
        # the abandoned thread returns; its parked slot then goes back to the pool
        await poll_until(lambda: eng.staging.statistics().in_use == 0, "the slot is back")
        s = eng.staging.statistics()
        assert s.acquired == s.released and s.parked == 0
        dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)


class ShieldedSlowReads(bsr.TierWrapper[bsr.Tier]):
    """Async reads that outlast the deadline shielded and return without another checkpoint,
    so the cancellation lands at the next one: just before the install's worker thread."""

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        n = await self.inner.fetch_into(key, group, dst)
        if group == LAYOUT.groups[-1].name:  # the chunk's last read: the install comes next
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.4)
        return n


async def test_cancel_before_the_install_thread_starts_releases_the_slot(
    anyio_backend: str, tier: bsr.Tier
) -> None:
    check_backend(anyio_backend)
    toks = tokens_for(2 * CT)
    src = filled_cache(LAYOUT, 16, BLOCK)
    ids = block_ids(2)
    async with make_engine(LAYOUT, [ShieldedSlowReads(tier)], window=2, io_depth=1) as eng:
        await eng.save(toks, src, ids)
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 16, BLOCK), ids, deadline_s=0.2)
        assert r.reason is bsr.Reason.DEADLINE
        await anyio.sleep(0.5)  # longer than any worker thread of this restore can run
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.parked == 0 and s.acquired == s.released, s
