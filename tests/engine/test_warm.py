"""RestoreEngine.warm and promotions: a stored prefix copied from a FileTier into the HostTier
above it, verified, bounded, idempotent, cancellable, and read once when a restore races it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import bsr
from bsr.testing import corrupt_stored
from support.engines import make_engine
from support.helpers import (
    blocks_equal,
    filled_cache,
    shuffled_blocks,
    tokens_for,
    two_group_layout,
)

CAP = 1 << 26


def kv_layout() -> bsr.StateLayout:
    """One full-attention group: 4 KiB per chunk object (8 KiB stored in a HostTier)."""
    return bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))


def payload(layout: bsr.StateLayout, n_chunks: int) -> int:
    """Payload bytes of every object a prefix of ``n_chunks`` chunks needs."""
    return sum(layout.group_chunk_bytes(g) for _, g in layout.needed_objects(n_chunks))


async def save_to_file(
    layout: bsr.StateLayout, root: Path, src: bsr.PagedKVCache, *prompts: tuple[Any, Any]
) -> None:
    """Save each ``(tokens, block_ids)`` of ``src`` through an engine over a FileTier alone."""
    async with make_engine(layout, [bsr.FileTier(root, CAP)]) as eng:
        for toks, ids in prompts:
            assert (await eng.save(toks, src, ids)).ok


async def stored(
    root: Path, n_chunks: int, seed: int
) -> tuple[bsr.StateLayout, list[int], bsr.PagedKVCache, torch.Tensor]:
    """``kv_layout()`` state of ``n_chunks`` chunks (blocks 0..n-1 of an 8-block cache, 16
    tokens a block), saved to a FileTier at ``root``: ``(layout, tokens, source, block ids)``."""
    layout = kv_layout()
    toks = tokens_for(n_chunks * 16)
    src = filled_cache(layout, 8, 16, seed=seed)
    ids = torch.arange(n_chunks)
    await save_to_file(layout, root, src, (toks, ids))
    return layout, toks, src, ids


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll ``cond`` (every millisecond, for at least 20 s) until it holds."""
    for _ in range(20_000):
        if cond():
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"gave up waiting for {what}")


class GatedTier(bsr.TierWrapper[bsr.Tier]):
    """Reads pass the first ``free`` times, then wait for :attr:`gate`; every read is noted."""

    def __init__(self, inner: bsr.Tier, *, free: int = 0) -> None:
        super().__init__(inner)
        self.free = free
        self.gate = anyio.Event()
        self.waiting = 0
        self.reads: list[tuple[int, str]] = []

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> Any:
        self.reads.append((key.index, group))
        if self.free > 0:
            self.free -= 1
        else:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await self.inner.fetch_into(key, group, dst)


class FailingWrites(bsr.TierWrapper[bsr.Tier]):
    """Writes raise ``error`` (the first ``times`` writes; None: all)."""

    def __init__(self, inner: bsr.Tier, error: Callable[[], Exception], times: int | None) -> None:
        super().__init__(inner)
        self.error, self.times, self.calls = error, times, 0

    async def write(self, key: bsr.ChunkKey, group: str, payload: Any) -> bool:
        self.calls += 1
        if self.times is None or self.calls <= self.times:
            raise self.error()
        return await self.inner.write(key, group, payload)


async def restore(
    eng: bsr.RestoreEngine, toks: list[int], nblocks: int, block_tokens: int, ids: Any
) -> tuple[bsr.RestoreResult, bsr.PagedKVCache]:
    dst = bsr.PagedKVCache(eng.layout, nblocks, block_tokens)
    return await eng.restore(toks, dst, ids), dst


# ---------------------------------------------------------------------- warm, then restore
@pytest.mark.parametrize("n_tokens", [32, 5 * 32, 3 * 32 + 5])
@pytest.mark.anyio
async def test_warm_then_restore_reads_only_the_host(tmp_path: Path, n_tokens: int) -> None:
    layout = two_group_layout()  # kv every chunk, swa the window's chunks only
    n_chunks = n_tokens // 32
    nblocks = 64
    src = filled_cache(layout, nblocks, 8, seed=3)
    ids = shuffled_blocks(nblocks, -(-n_tokens // 8), seed=4)
    dst_ids = shuffled_blocks(nblocks, -(-n_tokens // 8), seed=5)
    toks = tokens_for(n_tokens, seed=n_tokens)
    await save_to_file(layout, tmp_path, src, (toks, ids))
    objs = layout.needed_objects(n_chunks)
    total = payload(layout, n_chunks)

    host = bsr.HostTier(CAP)
    async with make_engine(layout, [host, bsr.FileTier(tmp_path, CAP)]) as eng:
        w = await eng.warm(toks)
        assert (w.kind, w.reason, w.target) == ("warm", "warm", "host")
        assert w.tokens == n_tokens
        assert w.prefix_tokens == w.warm_tokens == n_chunks * 32 and w.complete
        assert w.objects_copied == len(objs) > 0 and w.objects_present == 0
        assert w.bytes_by_tier == {"file": total} and w.quarantined == 0
        assert host.usage().objects == len(objs)
        stats = eng.statistics().warm
        assert (stats.warms, stats.objects_copied, stats.bytes_copied) == (1, len(objs), total)
        r, dst = await restore(eng, toks, nblocks, 8, dst_ids)
        assert r.committed and r.committed_tokens == n_chunks * 32
        assert r.bytes_by_tier == {"host": total}
        assert blocks_equal(layout, src, ids, dst, dst_ids, n_chunks)
        assert eng.staging.statistics().in_use == 0


@pytest.mark.anyio
async def test_warm_a_then_restore_b_sharing_its_prefix(tmp_path: Path) -> None:
    layout = two_group_layout()
    a = tokens_for(6 * 32, seed=1)
    b = a[: 3 * 32] + tokens_for(3 * 32, seed=2)  # diverges in chunk 3
    src = filled_cache(layout, 64, 8, seed=6)
    blocks = shuffled_blocks(64, 36, seed=7)
    ids_a = blocks[:24]
    ids_b = torch.cat([blocks[:12], blocks[24:36]])  # the shared chunks in the same blocks
    await save_to_file(layout, tmp_path, src, (a, ids_a), (b, ids_b))
    kv, swa = layout.group_chunk_bytes("kv"), layout.group_chunk_bytes("swa")

    async with make_engine(layout, [bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)]) as eng:
        w = await eng.warm(a)
        assert w.reason == "warm" and w.objects_copied == 6 + 2
        r, dst = await restore(eng, b, 64, 8, ids_b)
        assert r.committed and r.committed_tokens == 6 * 32
        # chunks 0-2 (kv) are A's too; B's own chunks 3-5 and its window (swa 4, 5) are not
        assert r.bytes_by_tier == {"host": 3 * kv, "file": 3 * kv + 2 * swa}
        assert blocks_equal(layout, src, ids_b, dst, ids_b, 6)
        wb = await eng.warm(b)  # only what B adds to A is copied
        assert (wb.reason, wb.objects_present, wb.objects_copied) == ("warm", 3, 5)
        assert wb.bytes_by_tier == {"file": 3 * kv + 2 * swa}


@pytest.mark.anyio
async def test_second_warm_copies_nothing(tmp_path: Path) -> None:
    layout = two_group_layout()
    toks = tokens_for(4 * 32 + 7)
    src = filled_cache(layout, 64, 8)
    ids = shuffled_blocks(64, 17, seed=1)
    await save_to_file(layout, tmp_path, src, (toks, ids))
    n_objs = len(layout.needed_objects(4))

    file = bsr.FileTier(tmp_path, CAP)
    async with make_engine(layout, [bsr.HostTier(CAP), file]) as eng:
        first = await eng.warm(toks)
        assert first.objects_copied == n_objs and first.reason == "warm"
        reads = file.statistics().reads
        again = await eng.warm(toks)
        assert (again.reason, again.objects_copied, again.objects_present) == ("warm", 0, n_objs)
        assert again.bytes_by_tier == {} and again.warm_tokens == 4 * 32
        assert file.statistics().reads == reads  # nothing read a second time
        assert eng.statistics().warm.objects_copied == n_objs


@pytest.mark.anyio
async def test_warm_of_an_unknown_prefix_is_a_miss(tmp_path: Path) -> None:
    layout = kv_layout()
    async with make_engine(layout, [bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)]) as eng:
        w = await eng.warm(tokens_for(4 * 16))
        assert (w.reason, w.prefix_tokens, w.warm_tokens, w.objects_copied) == ("miss", 0, 0, 0)
        assert w.target == "host" and w.bytes_by_tier == {}


# ---------------------------------------------------------------------- cut short
@pytest.mark.anyio
async def test_cancelled_warm_leaves_only_whole_verified_objects(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 4, seed=2)

    host = bsr.HostTier(CAP)
    file = GatedTier(bsr.FileTier(tmp_path, CAP), free=1)  # the 2nd read waits for the gate
    async with make_engine(layout, [host, file], window=2) as eng:
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.warm, toks)
            await until(lambda: eng.statistics().warm.objects_copied == 1, "the first copy")
            await until(lambda: file.waiting == 1, "the second read to block")
            tg.cancel_scope.cancel()
        assert file.waiting == 0 and eng.staging.statistics().in_use == 0
        keys = eng.keys(toks)
        held = [c for c in range(4) if await host.contains(keys[c], "kv")]
        assert held == [0] and host.usage().objects == 1
        buf, want = bytearray(4096), bytearray(4096)
        assert await host.read_into(keys[0], "kv", buf) == 4096  # verified
        assert await file.inner.read_into(keys[0], "kv", want) == 4096
        assert buf == want
        file.gate.set()
        r, dst = await restore(eng, toks, 8, 16, ids)
        assert r.committed and r.committed_tokens == 4 * 16
        assert r.bytes_by_tier == {"host": 4096, "file": 3 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 4)
        assert eng.statistics().warm.restores_joined == 0  # nothing left registered


@pytest.mark.anyio
async def test_warm_ended_by_its_deadline_reports_what_it_copied(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 3, seed=3)

    file = GatedTier(bsr.FileTier(tmp_path, CAP), free=1)  # the 2nd read never ends by itself
    async with make_engine(layout, [bsr.HostTier(CAP), file], window=2) as eng:
        w = await eng.warm(toks, deadline_s=0.2)
        assert (w.reason, w.target, w.prefix_tokens, w.warm_tokens) == ("deadline", "host", 48, 16)
        assert file.waiting == 0 and eng.staging.statistics().in_use == 0
        assert eng.statistics().warm.objects_copied == 1
        # what this call copied before its deadline: chunk 0
        assert w.objects_copied == 1 and w.bytes_by_tier == {"file": 4096}
        file.gate.set()
        r, dst = await restore(eng, toks, 8, 16, ids)
        assert r.committed_tokens == 48 and r.bytes_by_tier == {"host": 4096, "file": 2 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 3)


# ---------------------------------------------------------------------- corrupt source
@pytest.mark.anyio
async def test_corrupt_object_ends_the_warm_and_is_never_installed(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 4, seed=4)

    host, file = bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)
    async with make_engine(layout, [host, file], window=2) as eng:
        keys = eng.keys(toks)
        assert corrupt_stored(file, keys[2], "kv")  # a flipped payload byte on disk
        w = await eng.warm(toks)
        assert w.reason == "read_failed" and w.quarantined == 1
        assert (w.prefix_tokens, w.warm_tokens) == (4 * 16, 2 * 16)
        assert not await host.contains(keys[2], "kv")
        assert [await host.contains(keys[c], "kv") for c in range(2)] == [True, True]
        assert w.bytes_by_tier.get("file", 0) >= 2 * 4096
        # the corrupt copy is out of use, and out of its tier
        assert (await eng.lookup(toks)).prefix_tokens == 2 * 16
        assert any((tmp_path / "quarantine").iterdir())
        r, dst = await restore(eng, toks, 8, 16, ids)
        assert r.committed and r.committed_tokens == 2 * 16
        assert r.bytes_by_tier == {"host": 2 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 2)
        assert not dst.tensor("kv")[:, 2:].any()  # chunk 2's block was never written


@pytest.mark.anyio
async def test_corrupt_object_stops_copying_at_the_failure(tmp_path: Path) -> None:
    """With one read in flight (window 2), nothing after the corrupt chunk is copied."""
    layout = kv_layout()
    toks = tokens_for(5 * 16)
    src = filled_cache(layout, 8, 16, seed=5)
    await save_to_file(layout, tmp_path, src, (toks, torch.arange(5)))

    host, file = bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)
    async with make_engine(layout, [host, file], window=2) as eng:
        keys = eng.keys(toks)
        assert corrupt_stored(file, keys[1], "kv")
        w = await eng.warm(toks)
        assert (w.reason, w.warm_tokens, w.quarantined) == ("read_failed", 16, 1)
        assert w.objects_copied == 1 and w.bytes_by_tier == {"file": 4096}
        assert host.usage().objects == 1


# ---------------------------------------------------------------------- races and bounds
@pytest.mark.anyio
async def test_restore_during_a_warm_reads_each_object_once(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 4, seed=6)

    file = GatedTier(bsr.FileTier(tmp_path, CAP))  # every read waits for the gate
    async with make_engine(layout, [bsr.HostTier(CAP), file], window=4) as eng:
        out: dict[str, Any] = {}

        async def warm() -> None:
            out["warm"] = await eng.warm(toks)

        async def restore_it() -> None:
            out["restore"] = await restore(eng, toks, 8, 16, ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(warm)
            await until(lambda: file.waiting >= 1, "the warm's first read")
            tg.start_soon(restore_it)
            await until(lambda: eng.statistics().warm.restores_joined == 1, "the join")
            file.gate.set()
        w = out["warm"]
        assert w.reason == "warm" and w.objects_copied == 4
        r, dst = out["restore"]
        assert r.committed and r.committed_tokens == 4 * 16
        assert r.bytes_by_tier == {"host": 4 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 4)
        assert sorted(file.reads) == [(c, "kv") for c in range(4)]  # one read per object
        assert file.statistics().hits == 4 and file.statistics().bytes_read == 4 * 4096
        assert eng.statistics().warm.restores_joined == 1


@pytest.mark.anyio
async def test_warm_budget_is_never_exceeded(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 5, seed=7)
    budget = 2 * 4096 + 2048  # two objects fit, not three

    host = bsr.HostTier(CAP)
    tiers = [host, bsr.FileTier(tmp_path, CAP)]
    async with make_engine(layout, tiers, warm_budget_bytes=budget) as eng:
        assert eng.statistics().warm.budget_bytes == budget
        w = await eng.warm(toks)
        assert (w.reason, w.prefix_tokens, w.warm_tokens) == ("budget", 5 * 16, 2 * 16)
        assert w.objects_copied == 2 and sum(w.bytes_by_tier.values()) == 2 * 4096 <= budget
        assert eng.statistics().warm.bytes_copied <= budget
        assert host.usage().objects == 2
        r, dst = await restore(eng, toks, 8, 16, ids)
        assert r.committed and r.committed_tokens == 5 * 16
        assert r.bytes_by_tier == {"host": 2 * 4096, "file": 3 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 5)

    tiers = [bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)]
    async with make_engine(layout, tiers, warm_budget_bytes=4095) as eng:  # not one object
        w = await eng.warm(toks)
        assert (w.reason, w.warm_tokens, w.objects_copied, w.bytes_by_tier) == ("budget", 0, 0, {})


@pytest.mark.anyio
async def test_warm_beyond_the_concurrency_is_refused_as_busy(tmp_path: Path) -> None:
    layout = kv_layout()
    a, b = tokens_for(3 * 16, seed=1), tokens_for(3 * 16, seed=2)
    src = filled_cache(layout, 8, 16, seed=8)
    await save_to_file(layout, tmp_path, src, (a, torch.arange(3)), (b, torch.arange(3, 6)))

    host = bsr.HostTier(CAP)
    file = GatedTier(bsr.FileTier(tmp_path, CAP))
    async with make_engine(layout, [host, file], warm_concurrency=1) as eng:
        out: dict[str, bsr.WarmResult] = {}

        async def warm_a() -> None:
            out["a"] = await eng.warm(a)

        async with anyio.create_task_group() as tg:
            tg.start_soon(warm_a)
            await until(lambda: file.waiting >= 1, "the first warm's read")
            busy = await eng.warm(b)
            assert (busy.reason, busy.target, busy.objects_copied) == ("busy", "host", 0)
            assert busy.bytes_by_tier == {} and busy.warm_tokens == 0
            assert "a" not in out and file.waiting >= 1  # answered while the other still ran
            file.gate.set()
        assert out["a"].reason == "warm" and out["a"].objects_copied == 3
        assert host.usage().objects == 3  # a's only
        assert all(c < 3 for c, _ in file.reads)  # b's objects were never read
        stats = eng.statistics().warm
        assert (stats.warms, stats.warms_refused, stats.objects_copied) == (2, 1, 3)
        again = await eng.warm(b)  # nothing in flight now
        assert again.reason == "warm" and again.objects_copied == 3


@pytest.mark.parametrize("which", ["file_only", "host_only", "host_below_file"])
@pytest.mark.anyio
async def test_warm_without_a_host_tier_on_top_has_no_target(tmp_path: Path, which: str) -> None:
    layout = kv_layout()
    toks = tokens_for(3 * 16)
    src = filled_cache(layout, 8, 16)
    tiers: dict[str, list[bsr.Tier]] = {
        "file_only": [bsr.FileTier(tmp_path, CAP)],
        "host_only": [bsr.HostTier(CAP)],
        "host_below_file": [bsr.FileTier(tmp_path, CAP), bsr.HostTier(CAP)],
    }
    async with make_engine(layout, tiers[which]) as eng:
        assert (await eng.save(toks, src, torch.arange(3))).ok
        before = [t.reads for t in eng.statistics().tiers]
        w = await eng.warm(toks)
        assert (w.reason, w.target, w.objects_copied, w.warm_tokens) == ("no_target", None, 0, 0)
        assert not w.complete
        assert [t.reads for t in eng.statistics().tiers] == before  # nothing was read
        assert await eng.run_promotions() == []


# ---------------------------------------------------------------------- promotion
@pytest.mark.anyio
async def test_a_lookup_made_before_a_warm_reads_what_the_warm_copied(tmp_path: Path) -> None:
    """A server looks a request up (its probe names the FileTier), a warm of the prefix lands,
    then the restore given that probe runs: it reads the host tier's copies, not the file."""
    layout, toks, src, ids = await stored(tmp_path, 4, seed=21)
    host = bsr.HostTier(CAP)
    async with make_engine(layout, [host, bsr.FileTier(tmp_path, CAP)]) as eng:
        probe = await eng.lookup(toks, lease_ttl_s=30)
        assert probe.bytes_by_tier == {"file": 4 * 4096}
        assert (await eng.warm(toks)).objects_copied == 4
        dst = bsr.PagedKVCache(layout, 8, 16)
        r = await eng.restore(toks, dst, ids, probe=probe)
        assert r.committed_tokens == 4 * 16 and r.bytes_by_tier == {"host": 4 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 4)
        assert eng.statistics().leases == 0  # the probe's lease went with the restore


async def _restore_and_promote(
    eng: bsr.RestoreEngine, toks: list[int], src: bsr.PagedKVCache, ids: torch.Tensor
) -> tuple[bsr.RestoreResult, list[bsr.WarmResult]]:
    r, dst = await restore(eng, toks, 8, 16, ids)
    assert r.committed and r.committed_tokens == len(toks)
    assert blocks_equal(eng.layout, src, ids, dst, ids, len(toks) // 16)
    return r, await eng.run_promotions()


@pytest.mark.parametrize(
    ("promote", "promoted_after"), [("second_hit", 2), ("always", 1), ("never", None)]
)
@pytest.mark.anyio
async def test_promotion_policies(tmp_path: Path, promote: str, promoted_after: int | None) -> None:
    layout, toks, src, ids = await stored(tmp_path, 4, seed=9)

    host = bsr.HostTier(CAP)
    eng = make_engine(layout, [host, bsr.FileTier(tmp_path, CAP)], promote=promote)
    await eng.open()  # no background task: promotions run when asked
    try:
        for hit in (1, 2, 3):
            r, promos = await _restore_and_promote(eng, toks, src, ids)
            promoted_before = promoted_after is not None and hit > promoted_after
            want = {"host": 4 * 4096} if promoted_before else {"file": 4 * 4096}
            assert r.bytes_by_tier == want, hit
            if hit == promoted_after:
                assert len(promos) == 1, hit
                p = promos[0]
                assert (p.kind, p.reason, p.objects_copied) == ("promotion", "warm", 4)
                assert p.warm_tokens == 4 * 16 and p.bytes_by_tier == {"file": 4 * 4096}
                assert host.usage().objects == 4
            else:
                assert promos == [], hit
        stats = eng.statistics().warm
        assert stats.promotions == (0 if promoted_after is None else 1)
        assert stats.warms == 0 and stats.promotions_dropped == 0
        assert host.usage().objects == (0 if promoted_after is None else 4)
    finally:
        await eng.aclose()


@pytest.mark.anyio
async def test_background_task_runs_promotions(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 3, seed=10)

    host = bsr.HostTier(CAP)
    async with make_engine(layout, [host, bsr.FileTier(tmp_path, CAP)], promote="always") as eng:
        r, _ = await restore(eng, toks, 8, 16, ids)
        assert r.bytes_by_tier == {"file": 3 * 4096}
        await until(lambda: eng.statistics().warm.promotions == 1, "the promotion")
        assert host.usage().objects == 3
        r2, dst2 = await restore(eng, toks, 8, 16, ids)
        assert r2.committed_tokens == 3 * 16 and r2.bytes_by_tier == {"host": 3 * 4096}
        assert blocks_equal(layout, src, ids, dst2, ids, 3)


@pytest.mark.anyio
async def test_promotion_stays_within_the_host_capacity(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 6, seed=11)
    capacity = 3 * 8192  # three stored objects of the six the prefix needs

    host = bsr.HostTier(capacity)
    tiers = [host, bsr.FileTier(tmp_path, CAP)]
    eng = make_engine(layout, tiers, promote="always", warm_budget_bytes=1 << 20)
    await eng.open()
    try:
        r, promos = await _restore_and_promote(eng, toks, src, ids)
        assert r.committed_tokens == 6 * 16 and r.bytes_by_tier == {"file": 6 * 4096}
        # the leading part that fits, never more: more would evict the prefix's own first objects
        assert len(promos) == 1 and promos[0].reason == "capacity"
        assert promos[0].objects_copied == 3 and promos[0].warm_tokens == 3 * 16
        assert host.usage().bytes <= capacity
        for _ in range(2):  # later restores read the leading half from the host tier, stably
            r, promos = await _restore_and_promote(eng, toks, src, ids)
            assert r.committed_tokens == 6 * 16
            assert r.bytes_by_tier == {"host": 3 * 4096, "file": 3 * 4096}
            assert [(p.reason, p.objects_copied) for p in promos] == [("capacity", 0)]
        w = await eng.warm(toks)
        assert (w.reason, w.objects_copied, w.warm_tokens) == ("capacity", 0, 3 * 16)
        assert host.statistics().peak_bytes <= capacity
        assert host.statistics().evictions == 0  # no copy evicted what an earlier one copied
    finally:
        await eng.aclose()


@pytest.mark.anyio
async def test_failed_promotion_leaves_the_file_tier_intact(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 4, seed=12)

    def error() -> Exception:
        return bsr.TierIOError("injected write failure", tier="host")

    host = FailingWrites(bsr.HostTier(CAP), error, times=None)
    file = bsr.FileTier(tmp_path, CAP)
    eng = make_engine(layout, [host, file], promote="always")
    await eng.open()
    try:
        r, promos = await _restore_and_promote(eng, toks, src, ids)
        assert r.bytes_by_tier == {"file": 4 * 4096}
        assert len(promos) == 1 and host.calls >= 1
        p = promos[0]
        assert (p.reason, p.objects_copied, p.warm_tokens) == ("write_failed", 0, 0)
        assert host.usage().objects == 0 and file.usage().objects == 4
        assert eng.staging.statistics().in_use == 0
        w = await eng.warm(toks)
        assert (w.reason, w.objects_copied) == ("write_failed", 0)
        for _ in range(2):  # still usable, still byte-exact from the file tier
            r, _ = await _restore_and_promote(eng, toks, src, ids)
            assert r.bytes_by_tier == {"file": 4 * 4096}
        assert (await eng.lookup(toks)).prefix_tokens == 4 * 16
    finally:
        await eng.aclose()


@pytest.mark.anyio
async def test_promotion_that_raises_leaves_the_background_task_running(tmp_path: Path) -> None:
    layout, toks, src, ids = await stored(tmp_path, 2, seed=13)

    host = FailingWrites(bsr.HostTier(CAP), lambda: RuntimeError("not a storage error"), times=1)
    tiers = [host, bsr.FileTier(tmp_path, CAP)]
    async with make_engine(layout, tiers, promote="always", window=2) as eng:
        r, _ = await restore(eng, toks, 8, 16, ids)
        assert r.bytes_by_tier == {"file": 2 * 4096}
        await until(lambda: host.calls >= 1, "the promotion's first write")
        assert host.usage().objects == 0 and eng.statistics().warm.promotions == 0
        r2, _ = await restore(eng, toks, 8, 16, ids)  # nothing was promoted: read from file
        assert r2.committed_tokens == 2 * 16 and r2.bytes_by_tier == {"file": 2 * 4096}
        await until(lambda: eng.statistics().warm.promotions == 1, "the second promotion")
        assert host.calls == 1 + 2 and host.usage().objects == 2
        r3, dst = await restore(eng, toks, 8, 16, ids)
        assert r3.bytes_by_tier == {"host": 2 * 4096}
        assert blocks_equal(layout, src, ids, dst, ids, 2)


# ---------------------------------------------------------------------- bad input, metrics
@pytest.mark.anyio
async def test_bad_warm_arguments_and_options(tmp_path: Path) -> None:
    layout = kv_layout()
    tiers: list[bsr.Tier] = [bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)]
    eng = make_engine(layout, tiers)
    async with eng:
        for bad in (-1, 0, float("nan"), "soon"):
            with pytest.raises(bsr.ConfigError):
                await eng.warm(tokens_for(32), deadline_s=bad)  # type: ignore[arg-type]
    with pytest.raises(bsr.ClosedError):
        await eng.warm(tokens_for(32))
    with pytest.raises(bsr.ClosedError):
        await eng.run_promotions()
    for kw in ({"promote": "sometimes"}, {"warm_concurrency": 0}, {"warm_budget_bytes": -1}):
        with pytest.raises(bsr.ConfigError):
            make_engine(layout, [bsr.HostTier(CAP)], **kw)
    base = {"tiers": [{"kind": "host", "capacity_bytes": "1MiB"}]}
    assert bsr.EngineConfig.from_dict({**base, "promote": "second_hit"}).promote == "second_hit"
    for key, value in (("promote", "sometimes"), ("warm_concurrency", 0)):
        with pytest.raises(bsr.ConfigError, match=key):
            bsr.EngineConfig.from_dict({**base, key: value})


@pytest.mark.anyio
async def test_warm_metrics(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    import bsr.metrics

    layout = kv_layout()
    toks = tokens_for(3 * 16)
    src = filled_cache(layout, 8, 16, seed=14)
    await save_to_file(layout, tmp_path, src, (toks, torch.arange(3)))

    eng = make_engine(layout, [bsr.HostTier(CAP), bsr.FileTier(tmp_path, CAP)])
    registry = prometheus_client.CollectorRegistry()
    metrics = bsr.metrics.PrometheusMetrics(eng, registry=registry)
    try:
        value = registry.get_sample_value
        async with eng:
            w = await eng.warm(toks)
            assert w.reason == "warm" and w.bytes_by_tier == {"file": 3 * 4096}
            assert value("bsr_warms_total", {"kind": "warm", "reason": "warm"}) == 1
            assert value("bsr_warmed_bytes_total", {"kind": "warm", "tier": "file"}) == 3 * 4096
            again = await eng.warm(toks)  # copies nothing
            assert again.reason == "warm" and again.bytes_by_tier == {}
        assert value("bsr_warms_total", {"kind": "warm", "reason": "warm"}) == 2
        assert value("bsr_warmed_bytes_total", {"kind": "warm", "tier": "file"}) == 3 * 4096
        assert value("bsr_warms_total", {"kind": "promotion", "reason": "warm"}) is None
    finally:
        metrics.close()
