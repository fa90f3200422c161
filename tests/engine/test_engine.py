"""RestoreEngine: byte-exact restore, bounded staging, concurrency, fallback, deadline, cancel."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import torch

import bsr
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier, LatencyTier
from support.engines import make_engine, restore_all_at_once
from support.helpers import (
    blocks_equal,
    filled_cache,
    shuffled_blocks,
    tokens_for,
    two_group_layout,
)


@pytest.mark.parametrize("block_tokens", [4, 8, 32])
@pytest.mark.anyio
async def test_save_then_restore_is_byte_exact(tmp_path: Path, block_tokens: int) -> None:
    layout = two_group_layout()
    n_tokens = 7 * layout.chunk_tokens + 5  # a partial chunk at the end is not stored
    nblocks = 4 * (n_tokens // block_tokens + 1)
    src = filled_cache(layout, nblocks, block_tokens, seed=3)
    src_ids = shuffled_blocks(nblocks, -(-n_tokens // block_tokens), seed=4)
    dst_ids = shuffled_blocks(nblocks, -(-n_tokens // block_tokens), seed=5)
    toks = tokens_for(n_tokens)

    eng = make_engine(layout, [bsr.HostTier(1 << 26), bsr.FileTier(tmp_path, 1 << 26)])
    async with eng:
        saved = await eng.save(toks, src, src_ids)
        assert saved.saved_tokens == 7 * layout.chunk_tokens
        # swa keeps only the window's chunks: 7 kv + 2 swa objects per tier
        assert saved.objects_written == {"host": 9, "file": 9}
        dst = bsr.PagedKVCache(layout, nblocks, block_tokens)
        r = await eng.restore(toks, dst, dst_ids)
        assert r.state is bsr.RequestState.COMMITTED, r
        assert r.committed_tokens == 7 * layout.chunk_tokens
        assert r.reason is bsr.Reason.COMPLETE
        assert [t.trigger for t in r.trace] == ["probe_hit", "chunks_installed", "commit"]
        assert blocks_equal(layout, src, src_ids, dst, dst_ids, 7)
        assert r.invalid_block_ids == ()
        # a second save skips everything already stored
        again = await eng.save(toks, src, src_ids)
        assert again.objects_written == {"host": 0, "file": 0}
        assert again.objects_skipped == {"host": 9, "file": 9}


@pytest.mark.anyio
async def test_restore_from_file_tier_alone_after_reopen(tmp_path: Path) -> None:
    layout = two_group_layout()
    n_tokens = 5 * layout.chunk_tokens
    src = filled_cache(layout, 64, 8, seed=1)
    ids = shuffled_blocks(64, n_tokens // 8, seed=2)
    toks = tokens_for(n_tokens)

    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        await eng.save(toks, src, ids)
    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng2:
        dst = bsr.PagedKVCache(layout, 64, 8)
        r = await eng2.restore(toks, dst, ids)
        assert r.committed and r.committed_tokens == n_tokens
        assert r.bytes_by_tier == {
            "file": 5 * layout.group_chunk_bytes("kv") + 2 * layout.group_chunk_bytes("swa")
        }
        assert blocks_equal(layout, src, ids, dst, ids, 5)


@pytest.mark.anyio
async def test_prefix_sharing_restores_only_the_common_prefix(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    a = tokens_for(6 * 16, seed=1)
    b = a[: 3 * 16] + tokens_for(3 * 16, seed=9)  # diverges in chunk 3
    src = filled_cache(layout, 64, 16)
    ids = torch.arange(6)

    async with make_engine(layout, [bsr.HostTier(1 << 26)]) as eng:
        await eng.save(a, src, ids)
        probe = await eng.lookup(b)
        assert probe.prefix_tokens == 3 * 16
        dst = bsr.PagedKVCache(layout, 64, 16)
        r = await eng.restore(b, dst, ids)
        assert r.committed_tokens == 3 * 16
        assert blocks_equal(layout, src, ids, dst, ids, 3)


@pytest.mark.anyio
async def test_empty_probe_commits_zero_tokens(tmp_path: Path, layout: bsr.StateLayout) -> None:
    async with make_engine(layout, [bsr.HostTier(1 << 20)]) as eng:
        dst = bsr.PagedKVCache(layout, 16, 8)
        r = await eng.restore(tokens_for(100), dst, list(range(16)))
        assert r.state is bsr.RequestState.COMMITTED
        assert r.committed_tokens == 0 and r.reason is bsr.Reason.EMPTY_PREFIX
        assert [t.trigger for t in r.trace] == ["probe_miss"]
        assert r.rws_peak_bytes == 0
        # fewer tokens than one chunk: also an empty prefix
        r2 = await eng.restore(tokens_for(3), dst, [0])
        assert r2.committed_tokens == 0


@pytest.mark.anyio
async def test_probe_reads_no_payload_and_takes_no_staging(
    tmp_path: Path, layout: bsr.StateLayout
) -> None:
    toks = tokens_for(4 * layout.chunk_tokens)
    src = filled_cache(layout, 32, 8)

    tiers: list[bsr.Tier] = [bsr.HostTier(1 << 26), bsr.FileTier(tmp_path, 1 << 26)]
    async with make_engine(layout, tiers) as eng:
        await eng.save(toks, src, list(range(16)))
        before = eng.statistics()
        probe = await eng.lookup(toks)
        after = eng.statistics()
        assert probe.prefix_chunks == 4 and probe.local_chunks == 4
        assert probe.holders[0]["kv"] == ("host", "file")
        assert probe.holders[0]["swa"] == ()  # outside the window
        assert probe.bytes_by_tier == {
            "host": 4 * layout.group_chunk_bytes("kv") + 2 * layout.group_chunk_bytes("swa")
        }
        for b, a in zip(before.tiers, after.tiers):
            assert (a.reads, a.bytes_read) == (b.reads, b.bytes_read)
        assert after.staging.acquired == before.staging.acquired
        assert after.staging.in_use == 0


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.anyio
async def test_rws_is_flat_while_whole_plan_grows(tmp_path: Path, window: int) -> None:
    layout = bsr.StateLayout(
        chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128), bsr.StateGroup("idx", 1, 256))
    )
    slot = layout.slot_bytes
    assert slot == layout.chunk_bytes  # 4 KiB-aligned groups: no padding

    bounded: list[int] = []
    whole: list[int] = []
    async with make_engine(
        layout, [bsr.FileTier(tmp_path, 1 << 30)], window=window, io_depth=1
    ) as eng:
        for mult in (1, 10, 100):
            n_chunks = mult * window
            n_tok = n_chunks * 16
            src = filled_cache(layout, n_chunks, 16, seed=mult)
            ids = torch.arange(n_chunks)
            toks = tokens_for(n_tok, seed=mult)
            await eng.save(toks, src, ids)
            dst = bsr.PagedKVCache(layout, n_chunks, 16)
            r = await eng.restore(toks, dst, ids)
            assert r.committed_tokens == n_tok
            assert blocks_equal(layout, src, ids, dst, ids, n_chunks)
            bounded.append(r.rws_peak_bytes)
            w = await eng.restore(
                toks, bsr.PagedKVCache(layout, n_chunks, 16), ids, strategy="whole_plan"
            )
            assert w.committed_tokens == n_tok
            whole.append(w.rws_peak_bytes)
            assert eng.statistics().staging.peak_in_use <= window
    assert bounded == [window * slot] * 3
    assert whole == [m * window * slot for m in (1, 10, 100)]


@pytest.mark.anyio
async def test_concurrent_restores_share_the_window(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    W = 3
    n_req = 8
    prompts = [tokens_for(6 * 16, seed=100 + i) for i in range(n_req)]
    src = filled_cache(layout, 6 * n_req, 16)
    ids = [torch.arange(6 * i, 6 * i + 6) for i in range(n_req)]

    async def main() -> None:
        slow = LatencyTier(bsr.HostTier(1 << 26), read_latency_s=0.005)
        async with make_engine(layout, [slow], window=W, io_depth=2) as eng:
            for p, i in zip(prompts, ids):
                await eng.save(p, src, i)
            dst = bsr.PagedKVCache(layout, 6 * n_req, 16)
            results, peak_seen = await restore_all_at_once(eng, prompts, dst, ids)
            stats = eng.staging.statistics()
            assert all(r.committed_tokens == 6 * 16 for r in results)
            assert stats.peak_in_use == W and peak_seen <= W
            assert stats.waits > 0  # the window was really contended
            assert stats.in_use == 0 and stats.acquired == stats.released
            for i in range(n_req):
                assert blocks_equal(layout, src, ids[i], dst, ids[i], 6)

    await main()


@pytest.mark.anyio
async def test_failing_l1_read_falls_back_to_l2(tmp_path: Path, layout: bsr.StateLayout) -> None:
    toks = tokens_for(6 * layout.chunk_tokens)
    src = filled_cache(layout, 64, 8)
    ids = shuffled_blocks(64, 24, seed=1)
    plan = FaultPlan(seed=1, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({1, 4})),))

    host = FaultyTier(bsr.HostTier(1 << 26), plan)
    # three read errors (chunk 1's kv, chunk 4's kv and swa): with the default breaker threshold
    # of 3 they may be reported back to back (reads run io_depth at a time) and open the host's
    # breaker before chunk 5 is read; that is the breaker's test, not this one's
    tiers = [host, bsr.FileTier(tmp_path, 1 << 26)]
    async with make_engine(layout, tiers, breaker_threshold=10) as eng:
        await eng.save(toks, src, ids)
        dst = bsr.PagedKVCache(layout, 64, 8)
        r = await eng.restore(toks, dst, ids)
        assert r.committed and r.committed_tokens == 6 * layout.chunk_tokens
        kv = layout.group_chunk_bytes("kv")
        swa = layout.group_chunk_bytes("swa")
        # chunk 1 (kv) and chunk 4 (kv + swa) came from the file tier
        assert r.bytes_by_tier == {"host": 4 * kv + swa, "file": 2 * kv + swa}
        assert r.fallbacks == 3
        assert blocks_equal(layout, src, ids, dst, ids, 6)
        assert eng.staging.statistics().in_use == 0


@pytest.mark.anyio
async def test_failing_everywhere_invalidates_and_releases(
    tmp_path: Path, layout: bsr.StateLayout
) -> None:
    toks = tokens_for(6 * layout.chunk_tokens)
    src = filled_cache(layout, 64, 8)
    ids = shuffled_blocks(64, 24, seed=1)
    plan = FaultPlan(
        seed=2, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({3}), group="kv"),)
    )

    tiers: list[bsr.Tier] = [
        FaultyTier(bsr.HostTier(1 << 26), plan),
        FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan),
    ]
    async with make_engine(layout, tiers, window=2, io_depth=1) as eng:
        await eng.save(toks, src, ids)
        dst = bsr.PagedKVCache(layout, 64, 8)
        r = await eng.restore(toks, dst, ids)
        assert r.state is bsr.RequestState.INVALIDATED
        assert r.committed_tokens == 0 and r.reason is bsr.Reason.READ_FAILED
        assert r.probed_tokens == 6 * layout.chunk_tokens
        assert [t.trigger for t in r.trace] == ["probe_hit", "invalidate"]
        # every block the restore wrote is reported invalid
        bpc = layout.chunk_tokens // 8
        touched = {
            int(b)
            for c in range(6)
            for b in ids[c * bpc : (c + 1) * bpc]
            if dst.tensor("kv")[:, b].any()
        }
        assert touched and touched <= set(r.invalid_block_ids)
        assert eng.staging.statistics().in_use == 0


@pytest.mark.anyio
async def test_truncate_policy_commits_the_installed_prefix(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(8 * 16)
    src = filled_cache(layout, 16, 16)
    ids = torch.arange(8)
    plan = FaultPlan(seed=3, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({5})),))

    async def main() -> None:
        async with make_engine(layout, [FaultyTier(bsr.HostTier(1 << 26), plan)]) as eng:
            await eng.save(toks, src, ids)
            dst = bsr.PagedKVCache(layout, 16, 16)
            r = await eng.restore(toks, dst, ids, policy="truncate")
            assert r.state is bsr.RequestState.COMMITTED
            assert r.committed_tokens == 5 * 16 and r.reason is bsr.Reason.TRUNCATED
            assert [t.trigger for t in r.trace] == ["probe_hit", "truncate", "commit"]
            assert blocks_equal(layout, src, ids, dst, ids, 5)
            assert all(b >= 5 for b in r.invalid_block_ids)
            # the failed object was quarantined: the next probe stops before it
            r2 = await eng.restore(toks, bsr.PagedKVCache(layout, 16, 16), ids)
            assert r2.probed_tokens == 5 * 16 and r2.reason is bsr.Reason.COMPLETE

    async def all_or_nothing() -> None:
        plan2 = FaultPlan(seed=3, faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({5})),))
        async with make_engine(layout, [FaultyTier(bsr.HostTier(1 << 26), plan2)]) as eng:
            await eng.save(toks, src, ids)
            dst = bsr.PagedKVCache(layout, 16, 16)
            r = await eng.restore(toks, dst, ids)
            assert r.state is bsr.RequestState.INVALIDATED and r.committed_tokens == 0

    await main()


@pytest.mark.anyio
async def test_corrupt_object_is_quarantined_so_later_probes_miss(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(4 * 16)
    src = filled_cache(layout, 8, 16)
    ids = torch.arange(4)
    plan = FaultPlan(seed=4, faults=(Fault(FaultKind.CORRUPT, chunks=frozenset({2}), max_times=1),))

    async with make_engine(layout, [FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan)]) as eng:
        await eng.save(toks, src, ids)
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 8, 16), ids)
        assert r.state is bsr.RequestState.INVALIDATED and r.reason is bsr.Reason.CORRUPT
        assert r.quarantined == 1
        probe = await eng.lookup(toks)
        assert probe.prefix_chunks == 2  # the bad object is a miss now, not a retry loop
        r2 = await eng.restore(toks, bsr.PagedKVCache(layout, 8, 16), ids)
        assert r2.committed_tokens == 2 * 16
        assert any((tmp_path / "quarantine").iterdir())


@pytest.mark.anyio
async def test_hung_tier_hits_the_deadline(tmp_path: Path, layout: bsr.StateLayout) -> None:
    toks = tokens_for(4 * layout.chunk_tokens)
    src = filled_cache(layout, 32, 8)
    plan = FaultPlan(seed=5, faults=(Fault(FaultKind.HANG, chunks=frozenset({2})),))

    async with make_engine(layout, [FaultyTier(bsr.HostTier(1 << 26), plan)]) as eng:
        await eng.save(toks, src, list(range(16)))
        t0 = time.monotonic()
        r = await eng.restore(
            toks, bsr.PagedKVCache(layout, 32, 8), list(range(16)), deadline_s=0.3
        )
        elapsed = time.monotonic() - t0
        assert r.state is bsr.RequestState.INVALIDATED and r.reason is bsr.Reason.DEADLINE
        assert r.committed_tokens == 0
        assert 0.3 <= elapsed < 0.3 + 5  # the hang is forever: 5 s of slack for a busy machine
        assert eng.staging.statistics().in_use == 0


@pytest.mark.anyio
async def test_cancellation_mid_restore_returns_every_slot(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(20 * 16)
    src = filled_cache(layout, 32, 16)
    ids = torch.arange(20)

    slow = LatencyTier(bsr.HostTier(1 << 26), read_latency_s=0.01)
    async with make_engine(layout, [slow], window=4, io_depth=2) as eng:
        await eng.save(toks, src, ids)
        with anyio.move_on_after(0.05) as scope:
            await eng.restore(toks, bsr.PagedKVCache(layout, 32, 16), ids)
        assert scope.cancelled_caught
        s = eng.staging.statistics()
        assert s.acquired > 0 and s.in_use == 0 and s.acquired == s.released
        assert eng.statistics().invalidated == 1
        # the engine is still usable
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 32, 16), ids)
        assert r.committed_tokens == 20 * 16


@pytest.mark.anyio
async def test_whole_plan_and_bounded_install_the_same_bytes(
    tmp_path: Path, layout: bsr.StateLayout
) -> None:
    toks = tokens_for(5 * layout.chunk_tokens + 3)
    src = filled_cache(layout, 64, 4)
    ids = shuffled_blocks(64, 41, seed=8)

    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        await eng.save(toks, src, ids)
        a = bsr.PagedKVCache(layout, 64, 4)
        b = bsr.PagedKVCache(layout, 64, 4)
        ra = await eng.restore(toks, a, ids)
        rb = await eng.restore(toks, b, ids, strategy=bsr.Strategy.WHOLE_PLAN)
        assert ra.committed_tokens == rb.committed_tokens == 5 * layout.chunk_tokens
        for g in layout.group_names:
            assert torch.equal(a.tensor(g), b.tensor(g))


@pytest.mark.anyio
async def test_multi_rank_in_process_agrees(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(6 * 16)

    async def run(fail_rank: int | None) -> list[bsr.RestoreResult]:
        group = bsr.InProcessGroup(2, timeout_s=5)
        engines = []
        srcs = []
        for r in range(2):
            plan = FaultPlan(
                seed=6,
                faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({4})),),
                ranks=frozenset({fail_rank}) if fail_rank is not None else frozenset(),
            )
            tier = FaultyTier(bsr.FileTier(tmp_path / f"rank{r}", 1 << 26), plan, rank=r)
            engines.append(
                bsr.RestoreEngine(
                    layout,
                    [tier],
                    window=2,
                    io_depth=1,
                    namespace=bsr.Namespace("m", tp_rank=r, tp_size=2),
                    coordinator=group.coordinator(r),
                )
            )
            srcs.append(filled_cache(layout, 8, 16, seed=r))
        out: list[bsr.RestoreResult | None] = [None, None]
        async with engines[0], engines[1]:
            async with anyio.create_task_group() as tg:
                for r in range(2):
                    tg.start_soon(engines[r].save, toks, srcs[r], torch.arange(6))
            dsts = [bsr.PagedKVCache(layout, 8, 16) for _ in range(2)]

            async def one(r: int) -> None:
                out[r] = await engines[r].restore(toks, dsts[r], torch.arange(6))

            async with anyio.create_task_group() as tg:
                for r in range(2):
                    tg.start_soon(one, r)
        return [o for o in out if o is not None]

    ok = await run(None)
    assert [r.state for r in ok] == [bsr.RequestState.COMMITTED] * 2
    assert [r.committed_tokens for r in ok] == [6 * 16] * 2
    bad = await run(1)
    assert [r.state for r in bad] == [bsr.RequestState.INVALIDATED] * 2
    assert [r.committed_tokens for r in bad] == [0, 0]
    assert bad[0].reason is bsr.Reason.RANK_FAILED and bad[1].reason is bsr.Reason.READ_FAILED


@pytest.mark.anyio
async def test_in_process_round_that_times_out_fails_for_every_rank() -> None:
    """A rank that gives up on a round makes the round fail for a rank arriving later too."""

    group = bsr.InProcessGroup(2, timeout_s=0.05)
    c0, c1 = group.coordinator(0), group.coordinator(1)
    with pytest.raises(bsr.CoordinatorError, match="timed out"):
        await c0.agree_all(True)  # rank 1 is late
    with pytest.raises(bsr.CoordinatorError, match="timed out"):
        await c1.agree_all(True)  # arrives after rank 0 gave up: must not see "yes"
    # the ranks stay in step for the next round
    async with anyio.create_task_group() as tg:
        out: list[int] = []

        async def vote(c: bsr.InProcessCoordinator, v: int) -> None:
            out.append(await c.agree_min(v))

        tg.start_soon(vote, c0, 5)
        tg.start_soon(vote, c1, 3)
    assert out == [3, 3]


@pytest.mark.anyio
async def test_saving_again_after_quarantine_makes_the_object_visible(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(4 * 16)
    src = filled_cache(layout, 8, 16)
    ids = torch.arange(4)
    plan = FaultPlan(seed=4, faults=(Fault(FaultKind.CORRUPT, chunks=frozenset({2}), max_times=1),))

    async with make_engine(layout, [FaultyTier(bsr.FileTier(tmp_path, 1 << 26), plan)]) as eng:
        await eng.save(toks, src, ids)
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 8, 16), ids)
        assert r.reason is bsr.Reason.CORRUPT and r.quarantined == 1
        assert (await eng.lookup(toks)).prefix_chunks == 2
        saved = await eng.save(toks, src, ids)  # writes a fresh copy of chunk 2
        assert saved.objects_written == {"file": 1}
        assert (await eng.lookup(toks)).prefix_chunks == 4
        dst = bsr.PagedKVCache(layout, 8, 16)
        r2 = await eng.restore(toks, dst, ids)
        assert r2.committed_tokens == 4 * 16
        assert blocks_equal(layout, src, ids, dst, ids, 4)


@pytest.mark.anyio
async def test_a_hanging_tier_quarantine_cannot_hold_the_deadline(tmp_path: Path) -> None:
    """Taking a corrupt object out of a tier is bounded by the request's deadline."""
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
    toks = tokens_for(4 * 16)
    src = filled_cache(layout, 8, 16)
    plan = FaultPlan(seed=9, faults=(Fault(FaultKind.CORRUPT, chunks=frozenset({1})),))

    class StuckQuarantine(FaultyTier):
        async def quarantine(self, key: bsr.ChunkKey, group: str, reason: str) -> None:
            await anyio.sleep(30)  # a store that never answers the delete

    tier = StuckQuarantine(bsr.HostTier(1 << 26), plan)
    async with make_engine(layout, [tier], deadline_s=0.3) as eng:
        await eng.save(toks, src, torch.arange(4))
        t0 = time.monotonic()
        r = await eng.restore(toks, bsr.PagedKVCache(layout, 8, 16), torch.arange(4))
        assert time.monotonic() - t0 < 0.3 + 5  # the stuck delete takes 30 s
        assert r.state is bsr.RequestState.INVALIDATED and r.committed_tokens == 0
        assert r.reason in (bsr.Reason.DEADLINE, bsr.Reason.CORRUPT)
        assert eng.staging.statistics().in_use == 0
        assert (await eng.lookup(toks)).prefix_chunks == 1  # retired in the engine anyway
