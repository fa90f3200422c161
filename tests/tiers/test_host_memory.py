"""HostTier's memory: a pageable arena asks the kernel for transparent huge pages (a host hit's
hash and copy then take a TLB miss per 2 MiB, not per 4 KiB), unless ``huge_pages=False``.

Observed where the kernel keeps it: the arena's mapping in ``/proc/self/smaps`` carries the
``hg`` flag (``VM_HUGEPAGE``, set by ``madvise(MADV_HUGEPAGE)``) exactly when asked; restores
from either arena give back the saved bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import bsr
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/smaps").exists(),
    reason="transparent huge pages and /proc/self/smaps are Linux's",
)

LAYOUT = two_group_layout()


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge", [True, False])
@pytest.mark.anyio
async def test_a_pageable_arena_asks_for_huge_pages_unless_told_not_to(huge: bool) -> None:
    host = bsr.HostTier(64 << 20, pinned=False, huge_pages=huge)
    toks = tokens_for(4 * LAYOUT.chunk_tokens)
    src = filled_cache(LAYOUT, 16, 8)
    ids = torch.arange(4 * LAYOUT.chunk_tokens // 8)
    async with make_engine(LAYOUT, [host], model_id="huge") as eng:
        assert (await eng.save(toks, src, ids)).ok
        arena = host._arena
        assert arena._buf is not None and not arena.pinned
        assert arena.huge_pages is huge
        assert ("hg" in _vm_flags(arena._buf.ctypes.data)) is huge
        dst = bsr.PagedKVCache(LAYOUT, 16, 8)
        r = await eng.restore(toks, dst, ids)
        assert r.committed and r.bytes_by_tier.keys() == {host.name}
        assert blocks_equal(LAYOUT, src, ids, dst, ids, 4)


def test_huge_pages_is_a_checked_option() -> None:
    """The option reads from an engine config's tier table like every other, and a value that
    is no flag is a ConfigError naming it (alike from a config and from the constructor)."""
    config = bsr.EngineConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity_bytes": "1MiB", "huge_pages": False}]}
    )
    assert config.tiers[0].huge_pages is False  # type: ignore[attr-defined]
    assert bsr.HostTierOptions(capacity_bytes=1 << 20).huge_pages is True
    bad = {"tiers": [{"kind": "host", "capacity_bytes": "1MiB", "huge_pages": "yes"}]}
    for build in (
        lambda: bsr.EngineConfig.from_dict(bad),
        lambda: bsr.HostTier(1 << 20, huge_pages="yes"),
    ):
        with pytest.raises(bsr.ConfigError, match="huge_pages"):
            build()


@pytest.mark.anyio
async def test_a_large_cpu_cache_lies_on_huge_pages_and_restores_the_saved_bytes() -> None:
    """A ``PagedKVCache`` the cache makes on the CPU, 4 MiB and up per group, is anonymous memory
    with the huge-page advice (installs into it walk the page tables per 2 MiB), zeroed like
    torch's. A restore into the large one gives back the saved
    bytes, and its tensors behave as torch's (a clone, shared memory)."""
    big = bsr.PagedKVCache(LAYOUT, 1024, 8)  # the kv group: 2 x 1024 x 8 x 256 B = 4 MiB
    kv = big.tensor("kv")
    assert kv.numel() >= 4 << 20 and not kv.any()
    # a mapping of its own, which only bsr advised (a smaller group is torch's, in the heap,
    # whose flags say nothing here: NumPy advises huge pages for its own large arrays there)
    assert "hg" in _vm_flags(kv.data_ptr())

    n = 8 * LAYOUT.chunk_tokens
    toks = tokens_for(n)
    src = filled_cache(LAYOUT, 1024, 8, seed=3)
    ids = torch.arange(n // 8) * 7 % 1024  # scattered blocks
    async with make_engine(LAYOUT, [bsr.HostTier(64 << 20)], model_id="huge-cache") as eng:
        assert (await eng.save(toks, src, ids)).ok
        r = await eng.restore(toks, big, ids)
        assert r.committed and r.committed_tokens == n
        assert blocks_equal(LAYOUT, src, ids, big, ids, 8)
    copy = kv.clone()
    kv.share_memory_()
    assert kv.is_shared() and torch.equal(kv, copy)


def test_the_staging_window_and_a_whole_plan_buffer_lie_on_huge_pages() -> None:
    """Without CUDA the staging slots (and the whole-plan baseline's buffer, the same memory so
    the comparison stays fair) are anonymous memory with the huge-page advice: an O_DIRECT
    read pins them, and a chunk's check and install read them, 2 MiB at a time."""
    from bsr.transfer._staging import WholePlanBuffer

    pool = bsr.StagingPool(4, 1 << 20, pin=False)
    assert not pool.pinned
    assert "hg" in _vm_flags(pool._buffer.data_ptr())
    assert not pool._buffer.any()  # prefaulted with zeros
    whole = WholePlanBuffer(4, 1 << 20, pin=False)
    assert "hg" in _vm_flags(whole.buffer.data_ptr())
