"""A save skips a tier whose circuit breaker is open: not asked what it holds, not written, its
objects counted in ``SaveResult.skipped["breaker_open"]``; once the breaker closes, saves write
it again.

Why: a save asks every tier what it holds before writing, so a tier that hangs held every save
until its caller's bound (the vLLM connector's ``save_timeout_s``: each finished request kept
its blocks that long, for as long as the pool hung), although the lookups had opened its
breaker long before and no probe asked it any more.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import bsr
from support.engines import HangingContains, make_engine
from support.helpers import filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
CHUNKS = 4

pytestmark = pytest.mark.anyio


async def test_a_save_skips_a_hung_tier_whose_breaker_the_lookups_opened(tmp_path: Path) -> None:
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    src = filled_cache(LAYOUT, 8, 16)
    toks = tokens_for(CHUNKS * 16)
    engine = make_engine(
        LAYOUT, [host, pool], window=2, io_depth=1, breaker_threshold=2, breaker_cooldown_s=600
    )
    async with engine as eng:
        pool.hang = True
        with anyio.fail_after(60):  # a hang guard, not a timing claim
            for _ in range(2):  # two lookups cut off: the breaker opens
                probe = await eng.lookup(toks, deadline_s=0.2)
                assert probe.unanswered == (pool.name,)
        assert eng.health.state(pool.name).open
        calls = pool.calls
        with anyio.fail_after(60):  # it hung here: the save asked the pool what it holds
            saved = await eng.save(toks, src, list(range(CHUNKS)))
        assert saved.chunks == CHUNKS
        assert saved.objects_written == {host.name: CHUNKS, pool.name: 0}
        assert saved.skipped == {"breaker_open": CHUNKS}
        assert saved.ok  # skipping a tier that is down is not a failure
        assert pool.calls == calls
        # the host's copy restores
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        r = await eng.restore(toks, dst, list(range(CHUNKS)))
        assert r.committed_tokens == CHUNKS * 16 and set(r.bytes_by_tier) == {host.name}
        assert torch.equal(dst.tensor("kv")[:, :CHUNKS], src.tensor("kv")[:, :CHUNKS])

        # the pool answers again (it holds nothing of the prompt) and its breaker closes:
        # saves write it again
        pool.hang = False
        objects = [bsr.ObjectKey(k, "kv") for k in eng.keys(toks)]
        assert await pool.contains_many(objects) == [False] * CHUNKS
        eng.health.success(pool.name)
        again = await eng.save(toks, src, list(range(CHUNKS)))
        assert again.objects_written == {host.name: 0, pool.name: CHUNKS}
        assert again.skipped == {}
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        r = await eng.restore(toks, dst, list(range(CHUNKS)), skip_tiers=(host.name,))
        assert r.committed_tokens == CHUNKS * 16 and set(r.bytes_by_tier) == {pool.name}
        assert torch.equal(dst.tensor("kv")[:, :CHUNKS], src.tensor("kv")[:, :CHUNKS])


async def test_a_named_tier_whose_breaker_is_open_is_skipped_too(tmp_path: Path) -> None:
    host = bsr.HostTier(1 << 24)
    pool = bsr.FileTier(tmp_path, 1 << 26)
    src = filled_cache(LAYOUT, 8, 16)
    toks = tokens_for(CHUNKS * 16)
    engine = make_engine(LAYOUT, [host, pool], breaker_threshold=1, breaker_cooldown_s=600)
    async with engine as eng:
        eng.health.failure(pool.name)  # one failed call: open (threshold 1)
        saved = await eng.save(toks, src, list(range(CHUNKS)), tiers=[pool.name])
        assert saved.objects_written == {pool.name: 0}
        assert saved.skipped == {"breaker_open": CHUNKS}
        objects = [bsr.ObjectKey(k, "kv") for k in eng.keys(toks)]
        assert await pool.contains_many(objects) == [False] * CHUNKS
