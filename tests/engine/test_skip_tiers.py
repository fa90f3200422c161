"""restore(skip_tiers=...) and lookup(skip_tiers=...): the named tiers are not asked (neither
their metadata nor their breakers), hold nothing for the probe and are listed in its
``unanswered``; the other tiers serve what they hold, byte for byte.

Why: with several ranks, the vLLM connector's lookup is rank 0's alone and every rank's load
probes again. A tier rank 0 found slow or down would hold every rank's load probe until its
deadline, so such a lookup offered nothing, not even the host tier's hit, for as long as a pool
below it was down. With ``skip_tiers`` the loads skip what rank 0 had no answer from.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

import bsr
from support.engines import HangingContains, make_engine
from support.helpers import filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
CHUNKS = 4
TOKENS = tokens_for(CHUNKS * 16)
BLOCKS = list(range(CHUNKS))

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def host_over_pool(
    tmp_path: Path, **kw: object
) -> AsyncIterator[tuple[bsr.RestoreEngine, bsr.HostTier, HangingContains, bsr.PagedKVCache]]:
    """An engine over a HostTier and, below it, a FileTier whose metadata queries hang on
    demand (``pool.hang``), the prompt saved in both; ``kw``: the engine's options."""
    src = filled_cache(LAYOUT, 8, 16)
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    async with make_engine(LAYOUT, [host, pool], window=2, io_depth=1, model_id="m", **kw) as eng:
        saved = await eng.save(TOKENS, src, BLOCKS)
        assert saved.chunks == CHUNKS
        yield eng, host, pool, src


def restored_equal(dst: bsr.PagedKVCache, src: bsr.PagedKVCache) -> bool:
    return torch.equal(dst.tensor("kv")[:, :CHUNKS], src.tensor("kv")[:, :CHUNKS])


async def test_a_skipped_hung_tier_is_not_asked_and_the_host_serves(tmp_path: Path) -> None:
    async with host_over_pool(tmp_path, breaker_threshold=1) as (eng, host, pool, src):
        pool.hang = True  # asked, it would hold the probe for its share of the deadline
        calls = pool.calls
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        with anyio.fail_after(30):  # a hang guard, not a timing claim
            r = await eng.restore(TOKENS, dst, BLOCKS, skip_tiers=(pool.name,), deadline_s=60)
        assert r.committed and r.committed_tokens == CHUNKS * 16
        assert set(r.bytes_by_tier) == {host.name}
        assert r.unanswered == (pool.name,)
        assert restored_equal(dst, src)
        assert pool.calls == calls  # never asked
        # not counted against it either (threshold 1: one failure would have opened it)
        assert eng.health.state(pool.name).consecutive_failures == 0
        assert not eng.health.state(pool.name).open


async def test_skipping_the_host_reads_the_pool(tmp_path: Path) -> None:
    async with host_over_pool(tmp_path) as (eng, host, pool, src):
        hits = host.statistics().hits
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        r = await eng.restore(TOKENS, dst, BLOCKS, skip_tiers=[host.name])
        assert r.committed_tokens == CHUNKS * 16
        assert set(r.bytes_by_tier) == {pool.name}
        assert r.unanswered == (host.name,)
        assert restored_equal(dst, src)
        assert host.statistics().hits == hits
        # a restore without skip_tiers reads the host again: nothing was left skipped
        r = await eng.restore(TOKENS, bsr.PagedKVCache(LAYOUT, 8, 16), BLOCKS)
        assert set(r.bytes_by_tier) == {host.name} and r.unanswered == ()


async def test_skipping_every_holder_is_a_miss_that_writes_nothing(tmp_path: Path) -> None:
    async with host_over_pool(tmp_path) as (eng, host, pool, _):
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        before = dst.tensor("kv").clone()
        r = await eng.restore(TOKENS, dst, BLOCKS, skip_tiers=(pool.name, host.name))
        assert r.committed_tokens == 0 and r.bytes_by_tier == {}
        assert r.unanswered == (host.name, pool.name)  # tier order
        assert torch.equal(dst.tensor("kv"), before)


async def test_a_lookup_skips_too_and_its_probe_restores(tmp_path: Path) -> None:
    async with host_over_pool(tmp_path) as (eng, host, pool, src):
        pool.hang = True
        calls = pool.calls
        with anyio.fail_after(30):
            probe = await eng.lookup(TOKENS, skip_tiers=(pool.name,), lease_ttl_s=30)
        assert probe.prefix_chunks == CHUNKS and probe.unanswered == (pool.name,)
        assert all(h["kv"] == (host.name,) for h in probe.holders)
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        r = await eng.restore(TOKENS, dst, BLOCKS, probe=probe)
        assert r.committed_tokens == CHUNKS * 16 and restored_equal(dst, src)
        assert pool.calls == calls


async def test_bad_skip_tiers_are_typed_errors_that_change_nothing(tmp_path: Path) -> None:
    async with host_over_pool(tmp_path) as (eng, host, pool, src):
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        before = dst.tensor("kv").clone()
        with pytest.raises(bsr.ConfigError, match="not a bare string"):
            await eng.restore(TOKENS, dst, BLOCKS, skip_tiers=host.name)
        with pytest.raises(bsr.ConfigError, match="collection of tier names"):
            await eng.lookup(TOKENS, skip_tiers=3)  # type: ignore[arg-type]
        with pytest.raises(bsr.ConfigError, match=r"'nope', not among this engine's tiers"):
            await eng.restore(TOKENS, dst, BLOCKS, skip_tiers=("nope",))
        with pytest.raises(bsr.ConfigError, match="'nope'"):
            await eng.lookup(TOKENS, skip_tiers=("nope", pool.name))
        probe = await eng.lookup(TOKENS, lease_ttl_s=30)
        with pytest.raises(bsr.ConfigError, match="pass skip_tiers to the lookup"):
            await eng.restore(TOKENS, dst, BLOCKS, probe=probe, skip_tiers=(pool.name,))
        probe.release()
        assert torch.equal(dst.tensor("kv"), before)
        assert eng.statistics().leases == 0
        r = await eng.restore(TOKENS, dst, BLOCKS)  # the store is as it was
        assert r.committed_tokens == CHUNKS * 16 and restored_equal(dst, src)
        assert set(r.bytes_by_tier) == {host.name}


async def test_two_ranks_that_skip_the_same_hung_tier_agree_on_the_hosts_prefix(
    tmp_path: Path,
) -> None:
    """What the connector does with several ranks: each rank's load skips the tiers rank 0's
    lookup had no answer from; each rank reads its own host tier, and they agree."""
    group = bsr.InProcessGroup(2, timeout_s=30)
    src = [filled_cache(LAYOUT, 8, 16, seed=r) for r in range(2)]
    pools = [HangingContains(bsr.FileTier(tmp_path / f"r{r}", 1 << 26)) for r in range(2)]
    hosts = [bsr.HostTier(1 << 24) for _ in range(2)]

    def rank(r: int) -> bsr.RestoreEngine:
        namespace = bsr.Namespace("m", tp_rank=r, tp_size=2)
        tiers: list[bsr.Tier] = [hosts[r], pools[r]]
        return make_engine(LAYOUT, tiers, namespace=namespace, coordinator=group.coordinator(r))

    engines = [rank(r) for r in range(2)]
    results: list[bsr.RestoreResult | None] = [None, None]
    dsts = [bsr.PagedKVCache(LAYOUT, 8, 16) for _ in range(2)]
    async with engines[0], engines[1]:
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(engines[r].save, TOKENS, src[r], BLOCKS)
        for pool in pools:
            pool.hang = True
        calls = [pool.calls for pool in pools]  # the saves asked what each holds

        async def load(r: int) -> None:
            results[r] = await engines[r].restore(
                TOKENS, dsts[r], BLOCKS, skip_tiers=(pools[r].name,), deadline_s=60
            )

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for r in range(2):
                    tg.start_soon(load, r)
    for r in range(2):
        res = results[r]
        assert res is not None and res.committed_tokens == CHUNKS * 16
        assert set(res.bytes_by_tier) == {hosts[r].name}
        assert restored_equal(dsts[r], src[r])
        assert pools[r].calls == calls[r]
