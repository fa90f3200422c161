"""RestoreEngine.narrow: the probe of a prefix of the tokens a probe was made for, cut from it
without asking any tier again, equals a fresh lookup of that prefix, and restores like one.

Found while bounding the vLLM worker's lookups: to give a load a probe of exactly the prefix it
offers, the worker looked that prefix up a second time, which asked every tier again, a slow
one it had just cut off included. The model narrow is checked against is the lookup itself:
every field a restore reads (holders, prefix, digest, bytes per tier) must be the same, for
prefixes shorter and longer than what is stored, whole chunks or not, with a sliding-window
group whose chunks move with the prefix's end, over two tiers holding different chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import bsr
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8
TOKENS = tokens_for(6 * CT + 5)
#: what the host and the file tier hold: the first chunk in both, up to 4 chunks in the file
#: tier only; the sliding-window group only at each save's end (chunk 0; chunks 2 and 3), so a
#: prefix of 2 or 3 chunks lacks its window's chunk 1 and is usable up to chunk 1 only
HOST_SAVE, FILE_SAVE = CT, 4 * CT
#: prefixes cut to: none, inside and at chunk ends, at and past what is stored, the whole prompt
CUTS = [0, CT - 1, CT, CT + 5, 2 * CT, 3 * CT - 1, 3 * CT, 4 * CT, 4 * CT + 7, 5 * CT, 6 * CT + 5]


def fields(p: bsr.Probe) -> dict[str, object]:
    return {
        "num_tokens": p.num_tokens, "keys": p.keys, "holders": p.holders,
        "local_chunks": p.local_chunks, "prefix_chunks": p.prefix_chunks,
        "bytes_by_tier": p.bytes_by_tier, "digest": p.digest, "origin": p.origin,
    }  # fmt: skip


async def stored(tmp_path: Path) -> tuple[bsr.RestoreEngine, bsr.PagedKVCache]:
    engine = make_engine(LAYOUT, [bsr.HostTier(1 << 24), bsr.FileTier(tmp_path, 1 << 26)])
    await engine.open()
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = list(range(len(TOKENS) // BLOCK + 1))
    await engine.save(TOKENS[:FILE_SAVE], src, ids, tiers=["file"])
    await engine.save(TOKENS[:HOST_SAVE], src, ids, tiers=["host"])
    return engine, src


@pytest.mark.anyio
async def test_a_narrowed_probe_equals_a_fresh_lookup_of_the_prefix(tmp_path: Path) -> None:
    engine, _ = await stored(tmp_path)
    try:
        whole = await engine.lookup(TOKENS)
        assert whole.prefix_chunks == 4  # the file tier's saved prefix (its window is there)
        seen = set()
        for n in CUTS:
            fresh = await engine.lookup(TOKENS[:n])
            cut = await engine.narrow(whole, TOKENS[:n])
            assert fields(cut) == fields(fresh), n
            seen.add(cut.prefix_chunks)
        # the cuts cover a miss, the host's prefix (also where a window is lacking), the whole
        assert seen == {0, 1, 4}
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_a_narrowed_probe_restores_like_a_fresh_one_and_keeps_its_own_lease(
    tmp_path: Path,
) -> None:
    engine, src = await stored(tmp_path)
    try:
        whole = await engine.lookup([*TOKENS, 7], lease_ttl_s=60)
        cut = await engine.narrow(whole, TOKENS[: HOST_SAVE + 3], lease_ttl_s=60)
        assert engine.statistics().leases == 2
        whole.release()
        assert engine.statistics().leases == 1 and cut.lease is not None
        ids = list(range(len(TOKENS) // BLOCK + 1))
        dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
        r = await engine.restore(TOKENS[: HOST_SAVE + 3], dst, ids, probe=cut)
        assert r.committed_tokens == HOST_SAVE
        assert blocks_equal(LAYOUT, src, ids, dst, ids, HOST_SAVE // CT)
        assert engine.statistics().leases == 0  # the restore gave the cut probe's lease back
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_narrow_refuses_what_is_not_a_prefix_of_its_probe(tmp_path: Path) -> None:
    engine, _ = await stored(tmp_path)
    try:
        whole = await engine.lookup(TOKENS)
        other = [t + 1 for t in TOKENS[: 2 * CT]]
        salted = [bsr.KeyExtra(b"tenant:b", 0, 1)]
        for tokens, extras in ((other, None), (TOKENS[: 2 * CT], salted)):
            with pytest.raises(bsr.ConfigError, match="prefix of the tokens"):
                await engine.narrow(whole, tokens, extras=extras)
        async with make_engine(LAYOUT, [bsr.HostTier(1 << 20)]) as stranger:
            with pytest.raises(bsr.ConfigError):
                await stranger.narrow(whole, TOKENS[:CT])
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_narrow_refuses_a_probe_agreed_by_several_ranks(tmp_path: Path) -> None:
    group = bsr.InProcessGroup(2, timeout_s=0.5)
    engine = bsr.RestoreEngine(
        LAYOUT, [bsr.FileTier(tmp_path, 1 << 26)], window=2, io_depth=1,
        namespace=bsr.Namespace("m", tp_rank=0, tp_size=2), coordinator=group.coordinator(0),
    )  # fmt: skip
    async with engine:
        probe = await engine.lookup(TOKENS, local=True)
        with pytest.raises(bsr.ConfigError, match="several ranks"):
            await engine.narrow(probe, TOKENS[:CT])
