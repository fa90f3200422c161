"""PagedKVCache: per-layer no-copy views (vLLM-shaped tensors) and block-table validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.transfer._cache import gather_chunk, install_chunk
from support.engines import make_engine
from support.helpers import filled_cache, tokens_for

# a vLLM-shaped model: per layer [num_blocks, 2, block_size, heads * head_dim] bf16
NUM_BLOCKS, BLOCK, HD, LAYERS = 12, 4, 8, 3
TOKEN_BYTES = 2 * HD * 2  # K and V rows of one token, bf16
LAYOUT = bsr.StateLayout(
    chunk_tokens=2 * BLOCK, groups=(bsr.StateGroup("kv", LAYERS, TOKEN_BYTES, dtype="bfloat16"),)
)


def vllm_layers(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NUM_BLOCKS, 2, BLOCK, HD, generator=gen).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def block_bytes(t: torch.Tensor, b: int) -> torch.Tensor:
    """The independent model: block ``b`` of a layer tensor as its raw bytes."""
    return t[b].contiguous().view(torch.uint8).reshape(-1)


def test_layer_view_shares_storage() -> None:
    layers = vllm_layers()
    cache = bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": layers}, BLOCK)
    assert cache.per_layer and cache.num_blocks == NUM_BLOCKS
    views = cache.layers("kv")
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in layers]
    assert views[0].shape == (NUM_BLOCKS, BLOCK, TOKEN_BYTES) and views[0].dtype == torch.uint8
    views[1][3].fill_(0)  # writes through to vLLM's tensor
    assert not layers[1][3].any() and layers[1][4].any()
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in layers)
    with pytest.raises(bsr.LayoutError, match="layers"):
        cache.tensor("kv")


@pytest.mark.parametrize("seed", range(5))
def test_install_and_gather_match_raw_blocks(seed: int) -> None:
    layers = vllm_layers(seed)
    cache = bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": layers}, BLOCK)
    gen = torch.Generator().manual_seed(100 + seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:2]
    row = BLOCK * TOKEN_BYTES
    out = torch.empty(LAYERS * 2 * row, dtype=torch.uint8)
    gather_chunk(cache, "kv", blocks, out)
    want = torch.cat([block_bytes(t, int(b)) for t in layers for b in blocks])
    assert torch.equal(out, want)
    # install fresh bytes into two other blocks; nothing else changes
    region = torch.randint(0, 256, (LAYERS * 2 * row,), generator=gen, dtype=torch.uint8)
    before = [t.clone() for t in layers]
    dst = torch.tensor([b for b in range(NUM_BLOCKS) if b not in blocks.tolist()][:2])
    install_chunk(cache, "kv", dst, region)
    parts = region.view(LAYERS, 2, row)
    for i, t in enumerate(layers):
        for j, b in enumerate(dst.tolist()):
            assert torch.equal(block_bytes(t, b), parts[i, j])
        others = [b for b in range(NUM_BLOCKS) if b not in dst.tolist()]
        assert torch.equal(t[others], before[i][others])


def test_padded_block_stride_and_odd_row() -> None:
    """Blocks padded apart (a slice of a larger buffer) and a row that no wide word divides."""
    layout = bsr.StateLayout(chunk_tokens=2, groups=(bsr.StateGroup("g", 2, 3, dtype="uint8"),))
    bases = [torch.arange(NUM_BLOCKS * 5, dtype=torch.uint8).view(NUM_BLOCKS, 5) for _ in "ab"]
    layers = [b[:, :3] for b in bases]  # 3 bytes per block, block stride 5
    cache = bsr.PagedKVCache.from_layer_tensors(layout, {"g": layers}, 1)
    region = torch.arange(100, 112, dtype=torch.uint8)
    install_chunk(cache, "g", torch.tensor([7, 2]), region)
    assert bases[0][7, :3].tolist() == [100, 101, 102]
    assert bases[0][2, :3].tolist() == [103, 104, 105]
    assert bases[1][7, :3].tolist() == [106, 107, 108] and bases[0][7, 3:].tolist() == [38, 39]
    out = torch.empty(12, dtype=torch.uint8)
    gather_chunk(cache, "g", torch.tensor([7, 2]), out)
    assert torch.equal(out, region)


def test_flash_attention_layout_as_k_and_v_parts() -> None:
    """``[2, num_blocks, block, heads, dim]`` (K and V apart): each half is a layer of the view."""
    fa = torch.randn(2, NUM_BLOCKS, BLOCK, 2, HD // 2).to(torch.bfloat16)
    half = bsr.StateLayout(
        chunk_tokens=2 * BLOCK, groups=(bsr.StateGroup("kv", 2, TOKEN_BYTES // 2),)
    )
    with pytest.raises(bsr.LayoutError, match="bytes per block"):
        bsr.PagedKVCache.from_layer_tensors(half, {"kv": [fa, fa]}, BLOCK)
    cache = bsr.PagedKVCache.from_layer_tensors(half, {"kv": list(fa.unbind(0))}, BLOCK)
    out = torch.empty(half.group_chunk_bytes("kv"), dtype=torch.uint8)
    gather_chunk(cache, "kv", torch.tensor([1, 0]), out)
    want = torch.cat([block_bytes(fa[k], b) for k in (0, 1) for b in (1, 0)])
    assert torch.equal(out, want)


def test_bad_layer_tensors_are_refused() -> None:
    layers = vllm_layers()
    with pytest.raises(bsr.LayoutError, match="one tensor per layer"):
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": layers[:2]}, BLOCK)
    with pytest.raises(bsr.LayoutError, match="lacks group"):
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"v": layers}, BLOCK)
    with pytest.raises(bsr.LayoutError, match="contiguous"):
        t = [x.transpose(2, 3).contiguous().transpose(2, 3) for x in layers]
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": t}, BLOCK)
    with pytest.raises(bsr.LayoutError, match="blocks"):
        short = [*layers[:2], layers[2][:5]]
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": short}, BLOCK)
    with pytest.raises(bsr.LayoutError, match="bytes per block"):
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": layers}, BLOCK * 2)
    with pytest.raises(bsr.ConfigError):
        bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": layers}, 0)


@pytest.mark.anyio
async def test_engine_round_trip_between_per_layer_and_stacked(tmp_path: Path) -> None:
    """Saved from vLLM-shaped tensors, restored into a stacked cache and into per-layer ones."""
    tokens = tokens_for(3 * LAYOUT.chunk_tokens + 3)
    src_layers = vllm_layers(1)
    src = bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": src_layers}, BLOCK)
    src_ids = [9, 2, 5, 0, 11, 7, 3]
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    dst = bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"kv": dst_layers}, BLOCK)
    dst_ids = [1, 4, 6, 8, 10, 3, 2]
    stacked = bsr.PagedKVCache(LAYOUT, NUM_BLOCKS, BLOCK)

    async def main() -> None:
        engine = make_engine(LAYOUT, [bsr.FileTier(tmp_path / "l2", capacity_bytes=1 << 22)])
        async with engine:
            saved = await engine.save(tokens, src, src_ids)
            assert saved.chunks == 3
            r = await engine.restore(tokens, dst, dst_ids)
            assert r.state is bsr.RequestState.COMMITTED and r.committed_tokens == 24
            r2 = await engine.restore(tokens, stacked, dst_ids)
            assert r2.committed_tokens == 24

    await main()
    for i in range(LAYERS):
        for s, d in zip(src_ids[:6], dst_ids[:6]):
            assert torch.equal(dst_layers[i][d], src_layers[i][s])
            want = block_bytes(src_layers[i], s).view(BLOCK, -1)
            assert torch.equal(stacked.tensor("kv")[i, d], want)
        assert not dst_layers[i][[0, 5, 7, 9, 11]].any()  # blocks outside the table untouched


@pytest.mark.anyio
async def test_groups_may_have_blocks_of_their_own_count(tmp_path: Path) -> None:
    """A group viewing a caller's buffer sized to one request (HCache's landing) beside a
    group of the whole cache: each table is checked against its own group's blocks, one table
    for every group against the smallest, and a restore moves each group's bytes to its own
    blocks (the independent model: raw block bytes)."""
    two = bsr.StateLayout(
        chunk_tokens=2 * BLOCK,
        groups=(
            bsr.StateGroup("kv", LAYERS, TOKEN_BYTES, dtype="bfloat16"),
            bsr.StateGroup("side", 1, 8),
        ),
    )
    kv = vllm_layers(3)
    side = torch.randint(0, 255, (6, BLOCK, 8), dtype=torch.uint8)  # 6 blocks, not 12
    src = bsr.PagedKVCache.from_layer_tensors(two, {"kv": kv, "side": [side]}, BLOCK)
    assert src.group_blocks == {"kv": NUM_BLOCKS, "side": 6} and src.num_blocks == 6
    with pytest.raises(bsr.LayoutError, match="every layer of a group"):
        uneven = [*kv[:2], kv[2][:6]]
        bsr.PagedKVCache.from_layer_tensors(two, {"kv": uneven, "side": [side]}, BLOCK)
    with pytest.raises(bsr.BlockTableError, match=r"\[0, 6\)"):
        src.block_tables([7, 1, 2, 3], 4 * BLOCK)  # one table: the smallest group's range
    with pytest.raises(bsr.BlockTableError, match=r"\[0, 6\)"):
        src.block_tables({"kv": [7, 1, 2, 3], "side": [1, 2, 3, 6]}, 4 * BLOCK)
    tokens = tokens_for(2 * two.chunk_tokens)
    kv_ids, side_ids = [11, 2, 9, 4], [5, 0, 3, 1]
    src.block_tables({"kv": kv_ids, "side": side_ids}, 4 * BLOCK)  # each in its own range
    dst_kv = [torch.zeros_like(t) for t in kv]
    dst_side = torch.zeros(4, BLOCK, 8, dtype=torch.uint8)
    dst = bsr.PagedKVCache.from_layer_tensors(two, {"kv": dst_kv, "side": [dst_side]}, BLOCK)
    engine = make_engine(two, [bsr.FileTier(tmp_path / "l2", capacity_bytes=1 << 22)])
    async with engine:
        assert (await engine.save(tokens, src, {"kv": kv_ids, "side": side_ids})).chunks == 2
        r = await engine.restore(tokens, dst, {"kv": [1, 3, 5, 7], "side": [0, 1, 2, 3]})
    assert r.committed_tokens == 2 * two.chunk_tokens
    for i in range(LAYERS):
        for s, d in zip(kv_ids, [1, 3, 5, 7]):
            assert torch.equal(block_bytes(dst_kv[i], d), block_bytes(kv[i], s))
    assert torch.equal(dst_side, side[side_ids])


# ------------------------------------------------------------------ block tables (issue 10 item 3)
SMALL = bsr.StateLayout(chunk_tokens=8, groups=(bsr.StateGroup("kv", 2, 64),))


def test_block_table_refuses_duplicates_and_2d() -> None:
    cache = bsr.PagedKVCache(SMALL, 8, 4)
    with pytest.raises(bsr.BlockTableError, match=r"\[5\]") as err:
        cache.block_table([5, 5, 5, 5], 16)
    assert err.value.duplicates == [5]
    with pytest.raises(bsr.BlockTableError, match=r"\[1, 3\]"):
        cache.block_table(torch.tensor([1, 3, 1, 3]), 16)
    # repeats beyond the blocks the tokens occupy are not read or written: allowed
    assert cache.block_table([0, 1, 7, 7], 8).tolist() == [0, 1, 7, 7]
    for two_d in ([[0, 1], [2, 3]], np.array([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 3]])):
        with pytest.raises(bsr.BlockTableError, match="1-D"):
            cache.block_table(two_d, 8)
    with pytest.raises(bsr.BlockTableError, match="1-D"):
        cache.block_table(3, 4)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 63), max_size=40),
    tokens=st.integers(0, 40 * 4),
    as_tensor=st.booleans(),
)
def test_block_table_check_matches_a_set_model(
    ids: list[int], tokens: int, as_tensor: bool
) -> None:
    """Issue 19 item 9: the NumPy check refuses exactly what a plain Python model refuses."""
    cache = bsr.PagedKVCache(SMALL, 64, 4)
    needed = -(-tokens // 4)
    used = ids[:needed]
    want_dupes = sorted({b for b in used if used.count(b) > 1})
    arg = torch.tensor(ids, dtype=torch.int32) if as_tensor else ids
    if len(ids) < needed:
        with pytest.raises(bsr.BlockTableError, match="need"):
            cache.block_table(arg, tokens)
    elif want_dupes:
        with pytest.raises(bsr.BlockTableError) as err:
            cache.block_table(arg, tokens)
        assert err.value.duplicates == want_dupes
    else:
        got = cache.block_table(arg, tokens)
        assert got.dtype == torch.int64 and got.tolist() == ids


def test_block_table_finds_one_alias_among_65536_ids() -> None:
    """A 1M-token request's table (65,536 blocks of 16): one planted alias is found, by value."""
    n = 1 << 16
    cache = bsr.PagedKVCache(SMALL, n, 4)
    ids = np.random.default_rng(5).permutation(n).astype(np.int64)
    assert cache.block_table(ids, n * 4).tolist() == ids.tolist()
    for table in (ids.copy(), torch.from_numpy(ids.copy())):
        table[-1] = table[12345]  # the last block aliases one far before it
        with pytest.raises(bsr.BlockTableError) as err:
            cache.block_table(table, n * 4)
        assert err.value.duplicates == [int(ids[12345])]
    with pytest.raises(bsr.BlockTableError, match="integers"):
        cache.block_table(torch.zeros(4, dtype=torch.complex64), 4)


@pytest.mark.anyio
async def test_aliased_block_tables_touch_nothing(tmp_path: Path) -> None:
    tokens = tokens_for(32)
    src = filled_cache(SMALL, 8, 4, seed=3)

    tier = bsr.FileTier(tmp_path / "l2", capacity_bytes=1 << 20)
    async with make_engine(SMALL, [tier]) as engine:
        with pytest.raises(bsr.BlockTableError, match="more than once"):
            await engine.save(tokens, src, [1, 2, 1, 3, 4, 5, 6, 7])
        assert tier.statistics().objects == 0
        assert engine.statistics().saves == 0
        await engine.save(tokens, src, list(range(8)))
        dst = bsr.PagedKVCache(SMALL, 8, 4)
        with pytest.raises(bsr.BlockTableError, match=r"\[5\]"):
            await engine.restore(tokens[:16], dst, [5, 5, 5, 5])
        assert not dst.tensor("kv").any()
        assert engine.statistics().restores == 0
