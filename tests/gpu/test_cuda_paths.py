"""bsr's CUDA paths against independent references: the bytes of the source cache.

What runs on the GPU here: pinned staging slots, host-to-device installs enqueued on bsr's side
stream with each slot given back only when its copy's event completed, whole-plan installs,
per-layer device tensors (vLLM's layout), kvikio reads, and the failure paths (a corrupt or
truncated object, a copy that cannot be enqueued) on a CUDA destination. Every test compares
what landed with the source it was saved from, block by block, and checks that blocks no table
names stayed zero and that every staging slot came back.

Marked ``cuda``: skipped without a CUDA device (tests/conftest.py); ``bench/gpu/run.py`` runs
them on one, and its dry run runs the device-agnostic ones on the CPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bsr
from bsr.testing import corrupt_stored, make_keys, truncate_stored
from bsr.transfer._installers import _CudaCall, release_lent
from gpu.cuda_kit import (
    BLOCK,
    Case,
    FailingInstallCache,
    SlowSideStreamCache,
    staging_settled,
)

pytestmark = pytest.mark.cuda

CAP = 1 << 28
COMMITTED = bsr.RequestState.COMMITTED
INVALIDATED = bsr.RequestState.INVALIDATED
#: spin-kernel cycles ahead of each side-stream copy: about 5 ms at the H200's 1.98 GHz boost
DELAY_CYCLES = 10_000_000


def _tier(kind: str, root: Path, reader: str = "posix") -> bsr.Tier:
    return bsr.HostTier(CAP) if kind == "host" else bsr.FileTier(root, CAP, reader=reader)


def _keys(case: Case) -> list[bsr.ChunkKey]:
    ns = bsr.Namespace("cuda-tests").fingerprint(case.layout)
    return bsr.chunk_keys(ns, case.tokens, case.layout.chunk_tokens)


# each combination once, on the backend named (the device's time is short): the backend is the
# anyio plugin's own fixture, parametrized here instead of over both backends
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tier", "strategy", "anyio_backend"),
    [
        ("file", "bounded", "asyncio"),
        ("file", "bounded", "trio"),
        ("file", "whole_plan", "asyncio"),
        ("host", "bounded", "asyncio"),
        ("host", "whole_plan", "trio"),
    ],
)
async def test_restore_into_a_device_cache_holds_the_saved_bytes(
    tmp_path: Path, device: str, tier: str, strategy: str
) -> None:
    case = Case(chunks=12, seed=7)
    window = 4
    slot = case.layout.slot_bytes

    async with case.engine([_tier(tier, tmp_path)], window=window, io_depth=2) as eng:
        saved = await eng.save(case.tokens, case.src, case.src_ids)
        assert saved.ok and saved.chunks == case.chunks, saved
        dst = case.destination(device)
        r = await eng.restore(case.tokens, dst, case.dst_ids, strategy=strategy)
        assert r.state is COMMITTED and r.committed_tokens == case.n_tokens, r
        assert case.mismatches(dst, case.chunks) == []
        assert case.stray_writes(dst) == 0
        # bounded: W slots for a state 3x the window (host hits are lent: no slot bytes, the
        # window bounds them, they need not fill it); whole-plan: one region per chunk
        if strategy == "bounded" and tier == "host":
            assert 0 < r.rws_peak_bytes <= window * slot
        else:
            assert r.rws_peak_bytes == (window if strategy == "bounded" else case.chunks) * slot
        settled, stats = staging_settled(eng)
        assert settled, stats
        assert stats.pinned is (device == "cuda")


@pytest.mark.anyio
async def test_restore_into_per_layer_device_tensors_writes_the_engines_own_memory(
    tmp_path: Path, device: str
) -> None:
    # vLLM's layout: one [num_blocks, 2 (K, V), block_size, kv_heads * head_dim] bf16 tensor per
    # layer; 2 x 16 x 128 x 2 B = 8 KiB per block = 16 tokens x 512 B
    layout = bsr.StateLayout(chunk_tokens=64, groups=(bsr.StateGroup("kv", 4, 512),))
    case = Case(chunks=10, seed=11, layout=layout)
    mine = [
        torch.zeros(case.num_blocks, 2, BLOCK, 128, dtype=torch.bfloat16, device=device)
        for _ in range(4)
    ]
    dst = bsr.PagedKVCache.from_layer_tensors(layout, {"kv": mine}, BLOCK)

    async def main() -> None:
        async with case.engine([bsr.FileTier(tmp_path, CAP, reader="posix")], window=3) as eng:
            await eng.save(case.tokens, case.src, case.src_ids)
            r = await eng.restore(case.tokens, dst, case.dst_ids)
            assert r.state is COMMITTED and r.committed_tokens == case.n_tokens, r
            assert r.rws_peak_bytes == 3 * layout.slot_bytes
            settled, stats = staging_settled(eng)
            assert settled, stats

    await main()
    assert case.mismatches(dst, case.chunks) == []
    assert case.stray_writes(dst) == 0
    # read straight from the engine's own bf16 tensors, not through bsr's views
    first = case.dst_ids[0 : layout.chunk_tokens // BLOCK].to(device)
    own = torch.stack([t[first].view(torch.uint8).reshape(-1, BLOCK, 512) for t in mine]).cpu()
    assert torch.equal(own, case.source_chunk("kv", 0))


def _early_release(real: Any) -> Any:
    """A broken ``_CudaCall.after_read``: gives a chunk's slot and lent host objects back at
    once, before its copy's event completed (the mutant that proves the test can fail)."""

    def after_read(self: _CudaCall, run: Any, c: int, slot: Any, lent: Any, ok: bool) -> Any:
        free = list(real(self, run, c, slot, lent, ok))
        if self.pending and self.pending[-1][1] == c:
            event, _, held, held_lent = self.pending.pop()
            release_lent(held_lent)
            if held_lent:
                self.lent_pending -= 1
            self.pending.append((event, c, None, None))
            free += [] if held is None else [held]
        return free

    return after_read


def _churn(host: bsr.HostTier, layout: bsr.StateLayout, count: int) -> None:
    """Delete every object of ``host`` and fill the room with others (from the installing
    thread): memory the tier gave back is reused at once."""
    for oid in host._index.oids():
        host._index.discard(oid)
    for g in layout.groups:
        filler = np.full(layout.group_chunk_bytes(g.name), 0x5A, dtype=np.uint8)
        for k in make_keys(count, model="churn"):
            blob = bsr.ObjectCodec.encode(bsr.ObjectKey(k, g.name), filler)
            host.storage_hooks().put_raw(k, g.name, blob)


@pytest.mark.parametrize("source", ["file", "host"])
@pytest.mark.parametrize("release_early", [False, True], ids=["on-event", "early-mutant"])
@pytest.mark.anyio
async def test_what_a_copy_reads_is_reused_only_after_its_copy_event(
    real_cuda: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
    release_early: bool,
) -> None:  # fmt: skip
    """Each copy held back on the GPU by a spin kernel. From a FileTier, W=2 slots carry 12
    chunks: a slot is refilled by the next read only after its copy landed. From a HostTier
    the copy reads the pinned object where it lies (no slot): right after the first chunk's
    copy is enqueued, every object is deleted and the tier filled with others, and the lent
    object's memory is reused only after its copy landed. The mutant that lets go first shows
    corruption: proof that this test can fail."""
    case = Case(chunks=12, seed=3)
    if source == "host":
        per = sum(-(-(4096 + case.layout.group_chunk_bytes(g.name)) // 4096) * 4096
                  for g in case.layout.groups)  # fmt: skip
        tier: bsr.Tier = bsr.HostTier(case.chunks * per)  # no room but what churn frees
    else:
        tier = bsr.FileTier(tmp_path, CAP, reader="posix")
    real = _CudaCall.after_read
    after = _early_release(real) if release_early else real
    churned: list[int] = []

    def after_read(self: _CudaCall, run: Any, c: int, slot: Any, lent: Any, ok: bool) -> Any:
        free = after(self, run, c, slot, lent, ok)
        if source == "host" and not churned and lent:
            churned.append(c)
            assert isinstance(tier, bsr.HostTier)
            _churn(tier, case.layout, case.chunks)
        return free

    monkeypatch.setattr(_CudaCall, "after_read", after_read)
    async with case.engine([tier], window=2, io_depth=2) as eng:
        await eng.save(case.tokens, case.src, case.src_ids)
        if source == "host":
            assert isinstance(tier, bsr.HostTier) and tier.pinned  # DMA straight from there
        dst = case.destination("cuda", SlowSideStreamCache)
        dst.cycles = DELAY_CYCLES
        r = await eng.restore(case.tokens, dst, case.dst_ids)
        settled, stats = staging_settled(eng)
        assert settled, stats
    landed = case.chunks if source == "file" else churned[0] + 1
    bad = case.mismatches(dst, landed)
    if release_early:
        assert bad, "let go before the copy landed: some chunk must be wrong"
    else:
        assert bad == []
        if source == "file":
            assert r.state is COMMITTED and r.rws_peak_bytes == 2 * case.layout.slot_bytes


@pytest.mark.parametrize("layer_tensors", [False, True], ids=["contiguous", "per-layer"])
@pytest.mark.anyio
async def test_host_hits_go_by_dma_from_pinned_objects_and_every_byte_lands(
    real_cuda: None, layer_tensors: bool
) -> None:
    """A HostTier on a CUDA machine keeps its objects pinned; a restore into a device cache
    (bsr's own, or vLLM's per-layer tensors) copies each host hit from there, checked on the
    CPU first: no staging slot is written, and every byte matches the source."""
    layout = bsr.StateLayout(64, (bsr.StateGroup("kv", 4, 512),))
    case = Case(chunks=16, seed=5, layout=layout)
    host = bsr.HostTier(CAP)
    if layer_tensors:
        mine = [
            torch.zeros(case.num_blocks, 2, BLOCK, 128, dtype=torch.bfloat16, device="cuda")
            for _ in range(4)
        ]
        dst = bsr.PagedKVCache.from_layer_tensors(layout, {"kv": mine}, BLOCK)
    else:
        dst = case.destination("cuda")
    async with case.engine([host], window=4, io_depth=2) as eng:
        await eng.save(case.tokens, case.src, case.src_ids)
        assert host.pinned
        eng.staging.buffer.zero_()
        r = await eng.restore(case.tokens, dst, case.dst_ids)
        assert r.state is COMMITTED and r.committed_tokens == case.n_tokens, r
        assert not eng.staging.buffer.any()  # nothing passed through a slot
        settled, stats = staging_settled(eng)
        assert settled, stats
        assert host._index.statistics().pinned == 0
    assert case.mismatches(dst, case.chunks) == []
    assert case.stray_writes(dst) == 0


@pytest.mark.parametrize("below", [False, True], ids=["alone", "file-below"])
@pytest.mark.anyio
async def test_a_flipped_byte_in_a_pinned_host_object_is_caught_before_its_copy(
    tmp_path: Path, device: str, below: bool
) -> None:
    """One bit flipped where a host object lies (its pinned memory on a GPU machine): the
    check refuses it before any byte of it is copied; a FileTier below serves the chunk."""
    case = Case(chunks=8, seed=9)
    host = bsr.HostTier(CAP)
    tiers: list[bsr.Tier] = [host]
    if below:
        tiers.append(bsr.FileTier(tmp_path, CAP, reader="posix"))
    async with case.engine(tiers, window=3, io_depth=2) as eng:
        await eng.save(case.tokens, case.src, case.src_ids)
        key = _keys(case)[5]
        g = case.layout.groups[0].name
        assert corrupt_stored(host, key, g, 4096 + 777)
        dst = case.destination(device)
        r = await eng.restore(case.tokens, dst, case.dst_ids)
        assert r.quarantined == 1
        if below:
            assert r.state is COMMITTED and r.fallbacks == 1, r
            assert case.mismatches(dst, case.chunks) == []
        else:
            assert r.state is INVALIDATED and r.committed_tokens == 0, r
        settled, stats = staging_settled(eng)
        assert settled, stats


@pytest.mark.parametrize("strategy", ["bounded", "whole_plan"])
@pytest.mark.anyio
async def test_a_copy_that_cannot_be_enqueued_invalidates_and_releases(
    tmp_path: Path, real_cuda: None, strategy: str
) -> None:
    case = Case(chunks=8, seed=13)

    async with case.engine([bsr.FileTier(tmp_path, CAP, reader="posix")], window=2) as eng:
        await eng.save(case.tokens, case.src, case.src_ids)
        dst = case.destination("cuda", FailingInstallCache)
        r = await eng.restore(case.tokens, dst, case.dst_ids, strategy=strategy)
        assert r.state is INVALIDATED and r.reason is bsr.Reason.INSTALL_FAILED, r
        assert r.committed_tokens == 0
        assert any("out of memory (injected" in e for e in r.errors), r.errors
        assert set(r.invalid_block_ids) <= set(case.dst_ids.tolist())
        settled, stats = staging_settled(eng)
        assert settled, stats
        # the next restore of the same state into a healthy cache commits it all
        ok = case.destination("cuda")
        again = await eng.restore(case.tokens, ok, case.dst_ids, strategy=strategy)
        assert again.committed and case.mismatches(ok, case.chunks) == []


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("reader", ["posix", "kvikio"])
@pytest.mark.anyio
async def test_a_damaged_object_invalidates_releases_and_leaves_the_tier(
    tmp_path: Path, device: str, reader: str, damage: str, request: pytest.FixtureRequest
) -> None:
    if reader == "kvikio":
        request.getfixturevalue("kvikio_ok")
    case = Case(chunks=8, seed=9)

    tier = bsr.FileTier(tmp_path, CAP, reader=reader)
    async with case.engine([tier], window=2, io_depth=2) as eng:
        await eng.save(case.tokens, case.src, case.src_ids)
        key = _keys(case)[5]
        hurt = corrupt_stored if damage == "flip" else truncate_stored
        assert hurt(tier, key, "kv")
        dst = case.destination(device)
        r = await eng.restore(case.tokens, dst, case.dst_ids)
        assert r.state is INVALIDATED and r.reason is bsr.Reason.CORRUPT, r
        assert r.committed_tokens == 0 and r.quarantined == 1, r
        assert r.invalid_block_ids and set(r.invalid_block_ids) <= set(case.dst_ids.tolist())
        settled, stats = staging_settled(eng)
        assert settled, stats
        # the object left the tier: saving again writes it alone, then all of it restores
        assert tier.statistics().quarantined == 1
        resaved = await eng.save(case.tokens, case.src, case.src_ids)
        assert resaved.objects_written == {"file": 1}, resaved
        again = await eng.restore(case.tokens, dst, case.dst_ids)
        assert again.committed and again.committed_tokens == case.n_tokens, again
        assert case.mismatches(dst, case.chunks) == []


@pytest.mark.anyio
async def test_kvikio_reads_equal_posix_reads_and_the_source(
    tmp_path: Path, kvikio_ok: None
) -> None:
    case = Case(chunks=8, seed=5)
    keys = _keys(case)
    wanted = [(c, g.name) for g in case.layout.groups for c in case.layout.needed_chunks(g.name, 8)]

    async def read_all(reader: str) -> dict[tuple[int, str], torch.Tensor]:
        out = {}
        async with bsr.FileTier(tmp_path, CAP, reader=reader) as tier:
            assert tier.reader.name == reader
            for c, g in wanted:
                n = case.layout.group_chunk_bytes(g)
                buf = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
                assert await tier.read_into(keys[c], g, buf) == n
                out[(c, g)] = buf
        return out

    async def main() -> None:
        async with case.engine([bsr.FileTier(tmp_path, CAP, reader="posix")]) as eng:
            await eng.save(case.tokens, case.src, case.src_ids)
        posix = await read_all("posix")
        kvikio = await read_all("kvikio")
        for c, g in wanted:
            source = case.source_chunk(g, c).reshape(-1)
            assert torch.equal(posix[(c, g)], source), (c, g)
            assert torch.equal(kvikio[(c, g)], source), (c, g)
        # "auto" picks kvikio when it imports and CUDA is there; a restore through it is exact
        auto = bsr.FileTier(tmp_path, CAP)
        assert auto.reader.name == "kvikio"
        async with case.engine([auto], window=3, io_depth=3) as eng:
            dst = case.destination("cuda")
            r = await eng.restore(case.tokens, dst, case.dst_ids)
            assert r.committed and case.mismatches(dst, case.chunks) == [], r
            total = sum(case.layout.group_chunk_bytes(g) for _, g in wanted)
            assert r.bytes_by_tier == {"file": total}

    await main()
