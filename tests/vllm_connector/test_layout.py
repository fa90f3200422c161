"""bsr.vllm._layout: vLLM KV tensors of any backend layout -> bsr layout and no-copy cache.

Pure torch (no vLLM needed); the independent model is "the raw bytes of block b of a tensor".
"""

from __future__ import annotations

import pytest
import torch

import bsr
from bsr.transfer._cache import gather_chunk, install_chunk
from bsr.vllm._layout import GroupSpec, block_parts, derive, group_window, layer_order

NB, BS, H, D, L = 10, 4, 2, 8, 3
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(L))


def raw_block(part: torch.Tensor, b: int) -> torch.Tensor:
    return part[b].contiguous().view(torch.uint8).reshape(-1)


def cpu_layout() -> dict[str, torch.Tensor]:  # vLLM CPU backend: [num_blocks, 2, bs, H * D]
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(NB, 2, BS, H * D, generator=g).bfloat16() for n in NAMES}


def flash_layout() -> dict[str, torch.Tensor]:  # K and V apart: [2, num_blocks, bs, H, D]
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(2, NB, BS, H, D, generator=g).half() for n in NAMES}


def hnd_layout() -> dict[str, torch.Tensor]:  # logical [nb, 2, bs, H, D], memory [nb, 2, H, bs, D]
    g = torch.Generator().manual_seed(2)
    return {n: torch.randn(NB, 2, H, BS, D, generator=g).bfloat16().transpose(2, 3) for n in NAMES}


@pytest.mark.parametrize(
    ("make", "parts_per_layer"), [(cpu_layout, 1), (flash_layout, 2), (hnd_layout, 1)]
)
def test_derive_views_every_backend_layout_without_copy(make, parts_per_layer) -> None:  # type: ignore[no-untyped-def]
    kv = make()
    layout, cache = derive(
        kv, [GroupSpec("kv", NAMES)], num_blocks=NB, block_tokens=BS, chunk_tokens=2 * BS
    )
    (g,) = layout.groups
    assert g.num_layers == L * parts_per_layer
    assert (
        g.token_bytes * BS * g.num_layers
        == sum(t.numel() * t.element_size() for t in kv.values()) // NB
    )
    ptrs = {t.untyped_storage().data_ptr() for t in kv.values()}
    assert {v.untyped_storage().data_ptr() for v in cache.layers("kv")} == ptrs
    # a chunk installed through the view lands in vLLM's tensors, block by block
    region = torch.randint(0, 256, (layout.group_chunk_bytes("kv"),), dtype=torch.uint8)
    install_chunk(cache, "kv", torch.tensor([7, 3]), region)
    parts = [p for n in NAMES for p in block_parts(kv[n], NB, n)]
    got = torch.cat([raw_block(p, b) for p in parts for b in (7, 3)])
    assert torch.equal(got, region)
    out = torch.empty_like(region)
    gather_chunk(cache, "kv", torch.tensor([7, 3]), out)
    assert torch.equal(out, region)


def test_layer_order_is_numeric() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    assert sorted(names, key=layer_order) == [names[2], names[1], names[0]]


def test_refusals_say_what_is_wrong() -> None:
    kv = cpu_layout()
    spec = [GroupSpec("kv", NAMES)]
    with pytest.raises(bsr.LayoutError, match="multiple of vLLM's block_size"):
        derive(kv, spec, num_blocks=NB, block_tokens=BS, chunk_tokens=BS + 1)
    with pytest.raises(bsr.LayoutError, match="num_blocks"):
        derive(kv, spec, num_blocks=NB + 1, block_tokens=BS, chunk_tokens=BS)
    with pytest.raises(bsr.LayoutError, match="did not register"):
        derive(
            kv, [GroupSpec("kv", (*NAMES, "x"))], num_blocks=NB, block_tokens=BS, chunk_tokens=BS
        )
    shared = dict(kv)
    shared[NAMES[1]] = kv[NAMES[0]]
    with pytest.raises(bsr.LayoutError, match="share one KV tensor"):
        derive(shared, spec, num_blocks=NB, block_tokens=BS, chunk_tokens=BS)
    mixed = dict(kv)
    mixed[NAMES[2]] = kv[NAMES[2]].float()
    with pytest.raises(bsr.LayoutError, match="must match"):
        derive(mixed, spec, num_blocks=NB, block_tokens=BS, chunk_tokens=BS)
    # outer dimensions before the block one are split off, however many there are
    tokens_outer = torch.randn(2, BS, NB, H * D).permute(2, 0, 1, 3)
    assert len(block_parts(tokens_outer, NB, "x")) == 2 * BS
    with pytest.raises(bsr.LayoutError, match="not supported"):
        block_parts(torch.randn(NB, 2 * BS)[:, ::2], NB, "x")  # a block's bytes strided


def test_group_window_only_for_vllm_sliding_window_groups() -> None:
    """vLLM's own spec classes: a FullAttentionSpec carrying a sliding_window (the hybrid
    manager off merges a sliding-window model into one such group) is full length; a
    SlidingWindowSpec group stores what vLLM keeps after a load: the next token attends to
    ``sliding_window - 1`` tokens, and ``extra_retained_tokens`` more stay below them."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    common = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    assert group_window(kvi.SlidingWindowSpec(sliding_window=64, **common)) == 63
    extra = kvi.SlidingWindowSpec(sliding_window=64, extra_retained_tokens=5, **common)
    assert group_window(extra) == 68
    assert group_window(kvi.FullAttentionSpec(sliding_window=64, **common)) is None
    assert group_window(kvi.FullAttentionSpec(**common)) is None
    assert group_window(kvi.MLAAttentionSpec(**{**common, "num_kv_heads": 1})) is None
    with pytest.raises(bsr.LayoutError, match="ChunkedLocalAttentionSpec"):
        group_window(kvi.ChunkedLocalAttentionSpec(attention_chunk_size=64, **common))
    # subclasses of the full spec that free or pin blocks otherwise are not taken as full
    with pytest.raises(bsr.LayoutError, match="RSWASpec"):
        group_window(kvi.RSWASpec(rswa_window=64, **common))
    with pytest.raises(bsr.LayoutError, match="SinkFullAttentionSpec"):
        group_window(kvi.SinkFullAttentionSpec(sink_len=4, **common))


def test_vllm_window_matches_the_blocks_vllm_keeps_after_a_load() -> None:
    """The blocks vLLM's SlidingWindowManager keeps real for a load of ``n`` tokens (those of
    ``get_num_skipped_tokens(n)`` on are real, the ones below are its null block) are exactly
    the blocks of the chunks bsr's window needs, never fewer (a kept block bsr does not write
    would be cached unwritten) and without a real block below them."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    stkm = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")
    common = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    for block, chunk, window, extra in [(32, 64, 64, 0), (16, 256, 1024, 0), (16, 256, 128, 0),
                                        (32, 64, 100, 7), (16, 64, 16, 0), (32, 64, 65, 0),
                                        (32, 64, 64, 40)]:  # fmt: skip
        spec = kvi.SlidingWindowSpec(
            block_size=block, sliding_window=window, extra_retained_tokens=extra, **common
        )
        w = group_window(spec)
        layout = bsr.StateLayout(chunk, (bsr.StateGroup("swa", 1, 8, window_tokens=w),))
        for n_chunks in range(1, 12):
            n = n_chunks * chunk
            skipped = stkm.SlidingWindowManager.get_num_skipped_tokens(
                type("M", (), {"sliding_window": window, "extra_retained_tokens": extra})(), n
            )
            first_real = skipped // block
            first_read = layout.needed_chunks("swa", n_chunks).start * chunk // block
            # every real block lies in a chunk bsr reads; no chunk bsr needs lies wholly below
            assert first_read <= first_real, (block, chunk, window, n)
            assert first_real - first_read < chunk // block, (block, chunk, window, n)
            # the tokens the next one attends to (and those vLLM retains) are in real blocks
            assert first_real * block <= max(0, n - w)


def test_mla_latent_cache_is_one_part_per_layer() -> None:
    """vLLM CPU_MLA's per-layer KV ``[num_blocks, 1, block_size, 576]`` bf16: no K/V halves."""
    g = torch.Generator().manual_seed(3)
    kv = {n: torch.randn(NB, 1, BS, 576, generator=g).bfloat16() for n in NAMES}
    layout, cache = derive(
        kv, [GroupSpec("kv", NAMES)], num_blocks=NB, block_tokens=BS, chunk_tokens=2 * BS
    )
    (grp,) = layout.groups
    assert (grp.num_layers, grp.token_bytes, grp.dtype) == (L, 576 * 2, "bfloat16")
    region = torch.randint(0, 256, (layout.group_chunk_bytes("kv"),), dtype=torch.uint8)
    install_chunk(cache, "kv", torch.tensor([5, 2]), region)
    got = torch.cat([raw_block(kv[n], b) for n in NAMES for b in (5, 2)])
    assert torch.equal(got, region)


def test_hybrid_groups_over_shared_tensors() -> None:
    """vLLM's hybrid manager: layer 0 (sliding group) and layer 1 (full group) share a tensor,
    as do layers 2 and 3; the cache knows the two groups alias block for block."""
    g = torch.Generator().manual_seed(4)
    shared = [torch.randn(NB, 2, BS, H * D, generator=g).bfloat16() for _ in range(2)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv = {names[0]: shared[0], names[1]: shared[0], names[2]: shared[1], names[3]: shared[1]}
    specs = [
        GroupSpec("kv0", (names[0], names[2]), window_tokens=BS - 1),
        GroupSpec("kv1", (names[1], names[3])),
    ]
    layout, cache = derive(kv, specs, num_blocks=NB, block_tokens=BS, chunk_tokens=2 * BS)
    assert layout.group_names == ("kv0", "kv1") and cache.aliased == (("kv0", "kv1"),)
    assert layout.group("kv0").window_tokens == BS - 1
    with pytest.raises(bsr.BlockTableError, match="share memory"):
        cache.block_tables([1, 2], 2 * BS)
    assert cache.block_tables({"kv0": [-1, 3], "kv1": [1, 2]}, 2 * BS).serves(1)
