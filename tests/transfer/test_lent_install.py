"""Installs straight from host memory: a HostTier lends a verified payload in place, the pipeline
copies it once into the cache, and nothing of it passes through a staging slot.

Real tiers and caches; the observations are the staging buffer's own bytes (a slot a chunk never
passed through stays as the pool made it: zeros), the tier's pins, and the restored blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import bsr
from bsr.testing import FaultPlan, FaultyTier, make_keys
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8


def _engine(tiers: list[bsr.Tier], window: int = 4, io_depth: int = 2) -> bsr.RestoreEngine:
    return make_engine(LAYOUT, tiers, window=window, io_depth=io_depth, model_id="lent")


@pytest.mark.anyio
async def test_borrow_lends_the_verified_payload_pinned_until_released() -> None:
    key = make_keys(1)[0]
    data = np.arange(8192, dtype=np.uint8)
    # room for exactly one object: a second write must evict the first, unless pinned
    async with bsr.HostTier(capacity_bytes=4096 + 8192) as t:
        assert await t.write(key, "kv", data)
        lent = t.borrow_blocking(key, "kv")
        assert np.array_equal(lent.payload, data)
        other = make_keys(1, model="other")[0]
        with pytest.raises(bsr.TierFullError):  # the lent object cannot be evicted
            await t.write(other, "kv", data)
        lent.release()
        lent.release()  # idempotent
        assert await t.write(other, "kv", data)  # now it can
        assert not await t.contains(key, "kv")
        s = t.statistics()
        assert s.hits == 1 and s.reads == 1 and s.bytes_read == 8192


@pytest.mark.anyio
async def test_a_corrupt_object_is_never_lent_and_stays_unpinned() -> None:
    key = make_keys(1)[0]
    async with bsr.HostTier(capacity_bytes=1 << 20) as t:
        await t.write(key, "kv", np.ones(8192, np.uint8))
        blob = t._index.peek(bsr.ObjectKey(key, "kv").object_id)
        assert blob is not None
        blob[-1] ^= 0xFF  # one payload byte flipped in the tier's own memory
        with pytest.raises(bsr.CorruptObjectError):
            t.borrow_blocking(key, "kv")
        assert not t._index.is_pinned(bsr.ObjectKey(key, "kv").object_id)
        with pytest.raises(bsr.ObjectNotFoundError):
            t.borrow_blocking(make_keys(1, model="other")[0], "kv")
        assert t.statistics().errors == 1 and t.statistics().misses == 1


@pytest.mark.parametrize("chunks", [3, 24])
@pytest.mark.anyio
async def test_a_host_restore_copies_from_the_tier_not_through_a_slot(chunks: int) -> None:
    """Small chunks (inline batches) and enough chunks for every worker: the cache gets the
    saved bytes and the staging buffer stays untouched (the old path copied every chunk into a
    slot first)."""
    toks = tokens_for(chunks * CT)
    src = filled_cache(LAYOUT, 128, BLOCK)
    ids = torch.arange(chunks * CT // BLOCK)
    async with _engine([bsr.HostTier(capacity_bytes=1 << 26)]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        eng.staging.buffer.zero_()  # the save staged through the slots: start clean
        dst = bsr.PagedKVCache(LAYOUT, 128, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == chunks * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, chunks)
        assert not eng.staging.buffer.any()
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.acquired == s.released
        assert r.rws_peak_bytes <= eng.window * LAYOUT.slot_bytes
        host = eng.tiers[0]
        assert isinstance(host, bsr.HostTier) and host._index.statistics().pinned == 0


@pytest.mark.anyio
async def test_a_corrupt_host_object_falls_to_the_file_tier_through_the_slot(
    tmp_path: Path,
) -> None:
    n = 4
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    ft = bsr.FileTier(tmp_path, 1 << 26)
    async with _engine([host, ft]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = bsr.chunk_keys(eng.namespace_fp, toks, CT)
        blob = host._index.peek(bsr.ObjectKey(keys[2], "kv").object_id)
        assert blob is not None
        blob[-1] ^= 0xFF
        dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert r.fallbacks == 1 and r.quarantined == 1
        assert r.bytes_by_tier["file"] == LAYOUT.group_chunk_bytes("kv")
        assert host._index.statistics().pinned == 0


def test_a_wrapped_host_tier_lends_nothing() -> None:
    """A wrapper may change reads (latency, faults): the pipeline must go through them."""
    wrapped = FaultyTier(bsr.HostTier(capacity_bytes=1 << 20), FaultPlan())
    assert wrapped.borrow_reads is False and bsr.HostTier(capacity_bytes=1).borrow_reads
