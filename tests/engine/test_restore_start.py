"""restore(start_tokens=...): the caller already holds the first tokens; bsr reads and writes only
past them (the vLLM connector's "restore past the local hit").

The reference: every block of the table before ``start_tokens // block_tokens`` keeps the poison
the test put there (never written), every needed block from there on holds the saved bytes, the
bytes read are exactly the needed objects of the chunks not entirely below ``start_tokens``, and
the commit covers the whole prefix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bsr
from support.engines import make_engine
from support.helpers import filled_cache, shuffled_blocks, tokens_for, two_group_layout

BLOCK = 8  # 4 blocks per chunk of 32 tokens
POISON = 0xAB
CHUNKS = 5


def per_layer_cache(layout: bsr.StateLayout, num_blocks: int) -> bsr.PagedKVCache:
    """The vLLM shape: one tensor per layer, viewed with no copy (install_chunk's path)."""
    views = {
        g.name: [
            torch.zeros((num_blocks, BLOCK, g.token_bytes), dtype=torch.uint8)
            for _ in range(g.num_layers)
        ]
        for g in layout.groups
    }
    return bsr.PagedKVCache.from_layer_tensors(layout, views, BLOCK)


def poison(cache: bsr.PagedKVCache) -> None:
    for g in cache.layout.groups:
        if cache.per_layer:
            for layer in cache.layers(g.name):
                layer.fill_(POISON)
        else:
            cache.tensor(g.name).fill_(POISON)


def block(cache: bsr.PagedKVCache, group: str, b: int) -> torch.Tensor:
    """Every layer's bytes of block ``b`` of ``group``."""
    if cache.per_layer:
        return torch.stack([layer[b].reshape(-1) for layer in cache.layers(group)])
    return cache.tensor(group)[:, b].reshape(cache.tensor(group).shape[0], -1)


def expected_bytes(layout: bsr.StateLayout, start: int) -> int:
    first_chunk = start // layout.chunk_tokens
    return sum(
        layout.group_chunk_bytes(g) for c, g in layout.needed_objects(CHUNKS) if c >= first_chunk
    )


def check_blocks(
    layout: bsr.StateLayout,
    src: bsr.PagedKVCache,
    src_ids: torch.Tensor,
    dst: bsr.PagedKVCache,
    dst_ids: torch.Tensor,
    start: int,
) -> None:
    bpc = layout.chunk_tokens // BLOCK
    first_block = start // BLOCK
    for g in layout.groups:
        needed = {c for c, name in layout.needed_objects(CHUNKS) if name == g.name}
        for i in range(CHUNKS * bpc):
            got = block(dst, g.name, int(dst_ids[i]))
            if i < first_block or i // bpc not in needed:
                assert bool((got == POISON).all()), f"{g.name} block {i} was written"
            else:
                want = block(src, g.name, int(src_ids[i]))
                assert torch.equal(got, want), f"{g.name} block {i} differs from the saved one"


@pytest.mark.parametrize("cache_kind", ["stacked", "per_layer"])
@pytest.mark.parametrize("layout_kind", ["kv", "kv+swa"])
@pytest.mark.parametrize("start", [0, 64, 72, 88, 120, 160, 200])
@pytest.mark.anyio
async def test_only_blocks_past_start_are_read_and_written(
    tmp_path: Path, start: int, layout_kind: str, cache_kind: str
) -> None:
    if layout_kind == "kv":
        layout = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))
    else:
        layout = two_group_layout()
    n_tokens = CHUNKS * layout.chunk_tokens + 3
    nblocks = 64
    src = filled_cache(layout, nblocks, BLOCK, seed=3)
    src_ids = shuffled_blocks(nblocks, -(-n_tokens // BLOCK), seed=4)
    dst_ids = shuffled_blocks(nblocks, -(-n_tokens // BLOCK), seed=5)
    toks = tokens_for(n_tokens)

    async with make_engine(layout, [bsr.FileTier(tmp_path, 1 << 26)]) as eng:
        await eng.save(toks, src, src_ids)
        if cache_kind == "stacked":
            dst = bsr.PagedKVCache(layout, nblocks, BLOCK)
        else:
            dst = per_layer_cache(layout, nblocks)
        poison(dst)
        r = await eng.restore(toks, dst, dst_ids, start_tokens=start)
        assert r.committed, r
        assert r.committed_tokens == CHUNKS * layout.chunk_tokens
        assert r.bytes_read == expected_bytes(layout, start)
        check_blocks(layout, src, src_ids, dst, dst_ids, start)


@pytest.mark.parametrize("strategy", ["bounded", "whole_plan"])
@pytest.mark.anyio
async def test_a_failed_restore_reports_only_blocks_past_start(
    tmp_path: Path, strategy: str
) -> None:
    """Chunk 3 is damaged: nothing commits, and the blocks of the caller's own prefix (before
    ``start_tokens``) are neither written nor reported invalid."""
    layout = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))
    n_tokens = CHUNKS * 32
    src = filled_cache(layout, 64, BLOCK, seed=3)
    ids = shuffled_blocks(64, n_tokens // BLOCK, seed=4)
    toks = tokens_for(n_tokens)
    start = 40  # chunk 1 straddles it: its first block is the caller's

    tier = bsr.FileTier(tmp_path, 1 << 26)
    async with make_engine(layout, [tier]) as eng:
        await eng.save(toks, src, ids)
        oid = bsr.ObjectKey(eng.keys(toks)[3], "kv").object_id
        path = next(p for p in (tmp_path / "objects").glob("**/*.bsr") if oid in p.name)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
        dst = bsr.PagedKVCache(layout, 64, BLOCK)
        poison(dst)
        r = await eng.restore(toks, dst, ids, start_tokens=start, strategy=strategy)
        assert not r.committed and r.committed_tokens == 0
        first_block = start // BLOCK
        assert r.invalid_block_ids, r
        assert set(r.invalid_block_ids) <= {int(b) for b in ids[first_block:]}
        for i in range(first_block):
            assert bool((block(dst, "kv", int(ids[i])) == POISON).all())


@pytest.mark.anyio
async def test_bad_start_tokens_are_refused_before_anything_starts(tmp_path: Path) -> None:
    layout = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 256),))
    toks = tokens_for(64)

    async with make_engine(layout, [bsr.HostTier(1 << 24)]) as eng:
        dst = bsr.PagedKVCache(layout, 16, BLOCK)
        for bad in (5, -8, 8.0, True):
            with pytest.raises(bsr.ConfigError, match="start_tokens"):
                await eng.restore(toks, dst, list(range(8)), start_tokens=bad)  # type: ignore[arg-type]
        assert eng.statistics().restores == 0
