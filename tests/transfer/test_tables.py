"""Per-group block tables: which groups alias memory, and the checks a request's tables pass."""

from __future__ import annotations

import warnings

import pytest
import torch

import bsr

BT, NB = 4, 10
LAYOUT = bsr.StateLayout(
    chunk_tokens=8,
    groups=(
        bsr.StateGroup("full", 2, 16, dtype="uint8"),
        bsr.StateGroup("win", 2, 16, window_tokens=7, dtype="uint8"),
    ),
)


def buffers(n: int) -> list[torch.Tensor]:
    return [torch.zeros(NB, BT, 16, dtype=torch.uint8) for _ in range(n)]


def hybrid_cache() -> bsr.PagedKVCache:
    """vLLM's hybrid manager: layer i of each group views buffer i."""
    bufs = buffers(2)
    return bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"full": bufs, "win": bufs}, BT)


def test_groups_over_one_buffer_alias_block_for_block() -> None:
    assert hybrid_cache().aliased == (("full", "win"),)
    bufs = buffers(4)
    separate = bsr.PagedKVCache.from_layer_tensors(LAYOUT, {"full": bufs[:2], "win": bufs[2:]}, BT)
    assert separate.aliased == ()
    stacked = torch.zeros(2, NB, BT, 16, dtype=torch.uint8)
    shared = bsr.PagedKVCache(LAYOUT, NB, BT, tensors={"full": stacked, "win": stacked})
    assert shared.aliased == (("full", "win"),)
    assert bsr.PagedKVCache(LAYOUT, NB, BT).aliased == ()


def test_memory_shared_otherwise_is_refused() -> None:
    bufs = buffers(2)
    with pytest.raises(bsr.LayoutError, match="layers 0 and 1 of group 'full' share memory"):
        bsr.PagedKVCache.from_layer_tensors(
            LAYOUT, {"full": [bufs[0], bufs[0]], "win": buffers(2)}, BT
        )
    big = torch.zeros(
        NB + 1, BT, 16, dtype=torch.uint8
    )  # shifted by one block: not block for block
    with pytest.raises(bsr.LayoutError, match="do not view it block for block"):
        bsr.PagedKVCache.from_layer_tensors(
            LAYOUT, {"full": [big[:NB], bufs[1]], "win": [big[1:], buffers(1)[0]]}, BT
        )


def test_one_table_cannot_serve_aliased_groups() -> None:
    cache = hybrid_cache()
    with pytest.raises(bsr.BlockTableError, match="share memory") as info:
        cache.block_tables([1, 2, 3, 4], 16)
    assert info.value.fields["groups"] == ["full", "win"]
    # the groups' own tables, disjoint but for placeholders
    t = cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, -1, 5, 6]}, 16)
    assert t.table("win").tolist() == [-1, -1, 5, 6] and not t.shared
    with pytest.raises(bsr.BlockTableError, match=r"\[3\] are in the tables of several") as info:
        cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, -1, 3, 6]}, 16)
    assert info.value.fields["duplicates"] == [3]


def test_tables_by_group_are_checked_like_one_table() -> None:
    cache = bsr.PagedKVCache(LAYOUT, NB, BT)
    t = cache.block_tables([1, 2, 3, 4], 16)
    assert t.shared and t.table("full") is t.table("win")
    with pytest.raises(bsr.BlockTableError, match="missing") as info:
        cache.block_tables({"full": [1, 2, 3, 4]}, 16)
    assert info.value.fields["missing"] == ["win"]
    with pytest.raises(bsr.BlockTableError, match="unknown"):
        cache.block_tables({"full": [1, 2], "win": [3, 4], "kv": [5, 6]}, 8)
    with pytest.raises(bsr.BlockTableError, match="of group 'win'") as info:
        cache.block_tables({"full": [1, 2, 3, 4], "win": [5, 5, 6, 7]}, 16)
    assert info.value.fields["group"] == "win"
    with pytest.raises(bsr.BlockTableError, match="NULL_BLOCK"):
        cache.block_tables({"full": [1, 2, 3, 4], "win": [-2, 5, 6, 7]}, 16)
    with pytest.raises(bsr.BlockTableError, match="need 4 blocks"):
        cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, -1, 6]}, 16)
    # placeholders may repeat; the 1-D block_table() of other callers still refuses them
    assert cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, -1, -1, 7]}, 16)
    with pytest.raises(bsr.BlockTableError, match=r"\[0, 10\)"):
        cache.block_table([-1, 2], 8)


def test_what_a_prefix_needs_from_the_tables() -> None:
    cache = bsr.PagedKVCache(LAYOUT, NB, BT)
    # 2 chunks of 8 tokens; the window group needs the last 7 tokens: blocks 2 and 3
    t = cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, -1, 5, 6]}, 16)
    assert t.needed_blocks("win", 2) == (2, 4) and t.needed_blocks("full", 2) == (0, 4)
    assert t.serves(2) and not t.serves(1)  # a 1-chunk prefix needs win's blocks 0 and 1
    assert t.unserved(1) == ("win", 0)
    assert t.serves(1, first_block=2)  # blocks before first_block are the caller's
    assert t.written_blocks("win", 1) == [5, 6] and t.written_blocks("win", 0) == []
    # a save reads a chunk only whole: win's chunk 0 is not, its chunk 1 is
    assert [t.whole(c, "win") for c in (0, 1)] == [False, True]
    assert [t.whole(c, "full") for c in (0, 1)] == [True, True]
    t = cache.block_tables({"full": [1, 2, 3, 4], "win": [-1, 7, 5, 6]}, 16)
    assert [t.whole(c, "win") for c in (0, 1)] == [False, True]
    t = cache.block_tables({"full": [1, 2, -1, 4], "win": [8, 7, 5, 6]}, 16)
    assert [t.whole(c, "full") for c in (0, 1)] == [True, False]  # no block 2


def _hostile_tables() -> dict[str, object]:
    ids = torch.tensor([1, 2, 3, 4])
    with warnings.catch_warnings():  # CSR is "beta", quantized tensors "deprecated": still made
        warnings.simplefilter("ignore")
        return {
            "meta": torch.empty(4, dtype=torch.int64, device="meta"),
            "sparse_coo": ids.to_sparse(),
            "sparse_csr": ids.view(2, 2).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(ids.float(), 1.0, 0, torch.quint8),
            "list_of_meta": [torch.tensor(1, device="meta")] * 4,
        }


@pytest.mark.parametrize("name", sorted(_hostile_tables()))
def test_tables_torch_cannot_read_back_are_block_table_errors(name: str) -> None:
    """Meta, sparse and quantized tensors (and lists of them) are typed errors naming what to
    pass, on both entry points and in a mapping by group; before: torch's own
    NotImplementedError / TypeError escaped."""
    table = _hostile_tables()[name]
    cache = bsr.PagedKVCache(LAYOUT, NB, BT)
    with pytest.raises(bsr.BlockTableError, match="block_ids"):
        cache.block_table(table, 16)
    with pytest.raises(bsr.BlockTableError, match="block_ids"):
        cache.block_tables(table, 16)
    with pytest.raises(bsr.BlockTableError, match="of group 'win'") as info:
        cache.block_tables({"full": [1, 2, 3, 4], "win": table}, 16)
    assert info.value.fields["group"] == "win"


@pytest.mark.anyio
async def test_an_engine_refuses_a_meta_table_before_anything_moves() -> None:
    layout = bsr.StateLayout(chunk_tokens=8, groups=(bsr.StateGroup("kv", 2, 16, dtype="uint8"),))
    cache = bsr.PagedKVCache(layout, NB, BT)
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    async with bsr.RestoreEngine(
        layout, [bsr.HostTier(1 << 20)], window=2, io_depth=1, namespace=bsr.Namespace("t")
    ) as eng:
        with pytest.raises(bsr.BlockTableError, match="meta tensor"):
            await eng.save(list(range(16)), cache, meta)
        with pytest.raises(bsr.BlockTableError, match="meta tensor"):
            await eng.restore(list(range(16)), cache, meta)
        assert eng.statistics().staging.in_use == 0
