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

import anyio
import pytest
import torch

import bsr
from bsr.testing import corrupt_stored, truncate_stored
from bsr.transfer._pipeline import WindowPipeline
from gpu.cuda_kit import (
    BLOCK,
    Case,
    FailingInstallCache,
    SlowSideStreamCache,
    chunk_bytes,
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
        # bounded: W slots for a state 3x the window; whole-plan: one region per chunk
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


async def _release_then_wait(self: WindowPipeline, job: Any, c: int, slot: Any, event: Any) -> None:
    """A broken ``_await_device``: gives the slot back before its copy completed."""
    self._installed(job, slot)
    if event is None:
        return
    while not event.query():  # noqa: ASYNC110
        await anyio.sleep(0.0005)
    job.run.record_installed(c, job.run.needed[c])
    await self._announce(job, [c])


@pytest.mark.parametrize("release_early", [False, True], ids=["on-event", "early-mutant"])
@pytest.mark.anyio
async def test_a_slot_is_refilled_only_after_its_copy_event(
    real_cuda: None, monkeypatch: pytest.MonkeyPatch, release_early: bool
) -> None:
    """W=2 slots carry 12 chunks, each copy held back on the GPU by a spin kernel while the
    next reads (HostTier, microseconds) wait for a slot. Released on the event, every chunk
    lands intact and is readable on the default stream when announced. The mutant that
    releases first must show corruption: proof that this test can fail."""
    if release_early:
        monkeypatch.setattr(WindowPipeline, "_await_device", _release_then_wait)
    case = Case(chunks=12, seed=3)
    announced: list[tuple[int, bool]] = []

    async def main() -> bsr.RestoreResult:
        async with case.engine([bsr.HostTier(CAP)], window=2, io_depth=2) as eng:
            await eng.save(case.tokens, case.src, case.src_ids)
            dst = case.destination("cuda", SlowSideStreamCache)
            dst.cycles = DELAY_CYCLES
            bpc = case.layout.chunk_tokens // BLOCK

            def on_installed(chunk: int, groups: tuple[str, ...]) -> None:
                blocks = case.dst_ids[chunk * bpc : (chunk + 1) * bpc]
                same = all(
                    torch.equal(chunk_bytes(dst, g, blocks), case.source_chunk(g, chunk))
                    for g in groups
                )  # read on the default stream: no wait on bsr's side stream
                announced.append((chunk, same))

            r = await eng.restore(case.tokens, dst, case.dst_ids, on_installed=on_installed)
            settled, stats = staging_settled(eng)
            assert settled, stats
            bad = case.mismatches(dst, case.chunks)
            if release_early:
                assert bad, "slots given back before their copy: some chunk must be wrong"
            else:
                assert bad == []
                assert sorted(c for c, _ in announced) == list(range(case.chunks))
                assert all(same for _, same in announced), announced
                assert r.rws_peak_bytes == 2 * case.layout.slot_bytes
            return r

    r = await main()
    assert r.state is COMMITTED


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
