"""Host hits: a HostTier lends its objects where they lie, the pipeline checks each one and copies
it once into the cache; nothing of it passes through a staging slot, and its memory is never
handed to another object while a copy may read it.

Real tiers and caches throughout. The observations are the restored blocks against the saved
ones, the staging buffer's own bytes (a slot a chunk never passed through stays as the pool made
it: zeros), the tier's pins, and what the gate was told.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bsr
from bsr.engine._decisions import RestoreGate, _Batch
from bsr.testing import FaultPlan, FaultyTier, LatencyTier, make_keys
from bsr.transfer._install import HostInstaller
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for, two_group_layout

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8
HEADER = bsr.ObjectCodec.HEADER_SIZE

#: what is done to one stored object of a HostTier after the probe
DAMAGE = ("missing", "payload", "header", "magic", "length", "short", "foreign")


def _engine(tiers: list[bsr.Tier], window: int = 4, io_depth: int = 2) -> bsr.RestoreEngine:
    return make_engine(LAYOUT, tiers, window=window, io_depth=io_depth, model_id="host-reads")


def _damage(tier: bsr.HostTier, key: bsr.ChunkKey, other: bsr.ChunkKey, how: str) -> None:
    """Damage ``(key, "kv")`` where the tier keeps it (its own memory)."""
    hooks = tier.storage_hooks()
    oid = bsr.ObjectKey(key, "kv").object_id
    blob = hooks.peek(key, "kv")
    assert blob is not None
    raw = bytearray(blob)
    if how == "missing":
        tier._index.discard(oid)
        return
    if how == "payload":
        raw[-1] ^= 0x01  # one payload bit
    elif how == "header":
        raw[200] ^= 0x01  # a padding byte of the header: only the header checksum sees it
    elif how == "magic":
        raw[0] ^= 0x01
    elif how == "length":  # a stored object longer than its header says
        raw += bytes(64)
    elif how == "short":  # truncated inside its payload
        raw = raw[:-100]
    elif how == "foreign":  # another chunk's intact object under this id
        alien = hooks.peek(other, "kv")
        assert alien is not None
        raw = bytearray(alien)
    assert hooks.overwrite(key, "kv", bytes(raw))


def _pinned(host: bsr.HostTier) -> int:
    return host._index.statistics().pinned


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    chunks=st.integers(1, 24),
    first=st.integers(0, 3),
    seed=st.integers(0, 1000),
    window=st.integers(1, 5),
    memory_workers=st.integers(1, 3),
    straddle=st.integers(0, CT // BLOCK - 1),
)
@pytest.mark.anyio
async def test_restores_from_host_memory_give_the_saved_bytes(
    chunks: int, first: int, seed: int, window: int, memory_workers: int, straddle: int
) -> None:
    """Whatever the prefix's length, the blocks' order, the window and the workers: the cache
    gets exactly the saved bytes (an independent gather of both caches compares them), the
    staging buffer is never written, and nothing stays pinned."""
    toks = tokens_for(chunks * CT, seed=seed)
    nblocks = chunks * CT // BLOCK
    ids = torch.randperm(2 * nblocks, generator=torch.Generator().manual_seed(seed))[:nblocks]
    src = filled_cache(LAYOUT, 2 * nblocks, BLOCK, seed=seed)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    eng = make_engine(
        LAYOUT, [host], window=window, io_depth=min(3, window), memory_workers=memory_workers
    )
    async with eng:
        assert (await eng.save(toks, src, ids)).ok
        eng.staging.buffer.zero_()  # the save staged through the slots: start clean
        dst = bsr.PagedKVCache(LAYOUT, 2 * nblocks, BLOCK)
        # tokens the caller holds already (never written), possibly inside a chunk
        held = min(min(first, chunks - 1) * CT + straddle * BLOCK, (chunks - 1) * CT)
        for g in LAYOUT.groups:  # ... and they are the saved ones
            dst.tensor(g.name)[:, ids[: held // BLOCK]] = src.tensor(g.name)[
                :, ids[: held // BLOCK]
            ]
        r = await eng.restore(toks, dst, ids, start_tokens=held)
        assert r.committed_tokens == chunks * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, chunks)
        assert not eng.staging.buffer.any()
        assert _pinned(host) == 0 and eng.statistics().staging.in_use == 0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(where=st.integers(0, HEADER + 8191), below=st.booleans())
@pytest.mark.anyio
async def test_a_flipped_byte_anywhere_in_a_host_object_is_caught(
    tmp_path_factory: pytest.TempPathFactory, where: int, below: bool
) -> None:
    """One bit flipped in a host object's memory (header or payload, where it lies): the check
    refuses it and quarantines it; with a FileTier below, that copy is read instead and the
    saved bytes commit; alone, the restore invalidates and commits nothing."""
    n = 6
    toks = tokens_for(n * CT)
    ids = torch.arange(n * CT // BLOCK)
    src = filled_cache(LAYOUT, 64, BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    tiers: list[bsr.Tier] = [host]
    if below:
        tiers.append(bsr.FileTier(tmp_path_factory.mktemp("l2"), 1 << 26))
    async with _engine(tiers) as eng:
        assert (await eng.save(toks, src, ids)).ok
        key = eng.keys(toks)[3]
        blob = bytearray(host.storage_hooks().peek(key, "kv") or b"")
        where %= len(blob)
        blob[where] ^= 0x10
        assert host.storage_hooks().overwrite(key, "kv", bytes(blob))
        dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.quarantined == 1
        if below:
            assert r.committed_tokens == n * CT and r.fallbacks == 1
            assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
        else:
            assert not r.committed and r.committed_tokens == 0
        assert not await host.contains(key, "kv")  # out of the tier, not read again
        assert _pinned(host) == 0


@pytest.mark.parametrize("n", [4, 40])
@pytest.mark.anyio
async def test_host_objects_gone_or_damaged_since_the_probe_fall_to_the_next_tier(
    tmp_path: Path, n: int
) -> None:
    """Evicted after the probe, damaged in place (payload, header, magic, length, truncated),
    or another chunk's object under its id: each falls to the FileTier, one fallback each, the
    damaged ones quarantined; the restore commits the saved bytes (4 chunks: one event-loop
    batch; 40: batches in worker threads)."""
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    hurt = DAMAGE[: min(n, len(DAMAGE)) - 1]
    async with _engine([host, bsr.FileTier(tmp_path, 1 << 27)]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = eng.keys(toks)
        probe = await eng.lookup(toks)
        for i, how in enumerate(hurt, 1):
            _damage(host, keys[i], keys[0], how)
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids, probe=probe)
        assert r.committed and r.committed_tokens == n * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert r.fallbacks == len(hurt)
        assert r.quarantined == sum(how != "missing" for how in hurt)
        assert r.bytes_by_tier["file"] == len(hurt) * LAYOUT.group_chunk_bytes("kv")
        assert _pinned(host) == 0 and eng.statistics().staging.in_use == 0


@pytest.mark.anyio
async def test_a_damaged_host_object_with_no_other_copy_invalidates() -> None:
    n = 40
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    async with _engine([host]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        keys = eng.keys(toks)
        _damage(host, keys[7], keys[0], "header")
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK), ids)
        assert not r.committed and r.committed_tokens == 0
        assert str(r.reason) == "corrupt" and r.quarantined == 1
        assert _pinned(host) == 0 and eng.statistics().staging.in_use == 0


@pytest.mark.anyio
async def test_an_object_dropped_while_its_copy_runs_is_not_reused_before_the_copy_ends() -> None:
    """While the pipeline copies a lent host object into the cache, the object is deleted and
    the tier filled with other objects past its capacity: the lent memory stays the saved bytes
    until the copy ended (its extent is given back only then), so the cache gets them. The
    copy itself is slowed down here to give the tier every chance to reuse the memory."""
    n = 8
    toks = tokens_for(n * CT)
    ids = torch.arange(n * CT // BLOCK)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    per_object = HEADER + LAYOUT.group_chunk_bytes("kv")
    host = bsr.HostTier(capacity_bytes=(n + 2) * per_object * 2)
    others = make_keys(4 * n, model="filler")
    filler = np.full(LAYOUT.group_chunk_bytes("kv"), 0x5A, dtype=np.uint8)
    real = HostInstaller.install
    churned: list[int] = []

    def churn() -> None:  # from the installing thread: delete everything, fill the tier
        for okey in list(host._index.oids()):
            host._index.discard(okey)
        for k in others:
            blob = bsr.ObjectCodec.encode(bsr.ObjectKey(k, "kv"), filler)
            host.storage_hooks().put_raw(k, "kv", blob)

    def install(self: HostInstaller, c: int, groups: Any, slot: Any, lent: Any = None) -> None:
        if lent and not churned:
            churned.append(c)
            churn()
        real(self, c, groups, slot, lent)

    async with _engine([host]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        HostInstaller.install = install  # type: ignore[method-assign]
        try:
            dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
            r = await eng.restore(toks, dst, ids)
        finally:
            HostInstaller.install = real  # type: ignore[method-assign]
        assert churned, "no chunk was installed from lent memory"
        # the chunk whose copy the churn ran under was copied from memory nobody reused
        bpc = CT // BLOCK
        c = churned[0]
        kv = slice(c * bpc, (c + 1) * bpc)
        assert torch.equal(src.tensor("kv")[:, ids[kv]], dst.tensor("kv")[:, ids[kv]])
        assert r.committed_tokens in (0, n * CT)  # the rest: gone (a miss), or all there
        assert _pinned(host) == 0


@pytest.mark.parametrize("chunks", [3, 24])
@pytest.mark.anyio
async def test_a_host_restore_copies_from_the_tier_not_through_a_slot(chunks: int) -> None:
    """Small chunks (inline batches) and enough chunks for every worker: the cache gets the
    saved bytes and the staging buffer stays untouched."""
    toks = tokens_for(chunks * CT)
    src = filled_cache(LAYOUT, 128, BLOCK)
    ids = torch.arange(chunks * CT // BLOCK)
    async with _engine([bsr.HostTier(capacity_bytes=1 << 26)]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        eng.staging.buffer.zero_()
        dst = bsr.PagedKVCache(LAYOUT, 128, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed_tokens == chunks * CT
        assert blocks_equal(LAYOUT, src, ids, dst, ids, chunks)
        assert not eng.staging.buffer.any()
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.acquired == s.released
        assert r.rws_peak_bytes <= eng.window * LAYOUT.slot_bytes


@pytest.mark.anyio
async def test_a_corrupt_file_object_in_an_admitted_batch_falls_to_the_next_file_tier(
    tmp_path: Path,
) -> None:
    """Two FileTiers (no lending): the first holder's batch is admitted at once; its corrupt
    object is reported (quarantined) and read from the second tier."""
    n = 24
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    a = bsr.FileTier(tmp_path / "a", 1 << 27, name="a")
    b = bsr.FileTier(tmp_path / "b", 1 << 27, name="b")
    async with _engine([a, b]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        path = a.object_path(eng.keys(toks)[5], "kv")
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert r.committed and blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert r.fallbacks == 1 and r.quarantined == 1
        assert r.bytes_by_tier["b"] == LAYOUT.group_chunk_bytes("kv")


@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.anyio
async def test_every_admitted_batch_ends_once_and_a_failed_one_is_no_success(
    monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    """Each batch the gate admitted ends exactly once; it counts as the tier's success only when
    the tier served one of its reads (a batch whose every read failed must not close a
    breaker)."""
    admitted: list[str] = []
    ends: list[bool] = []
    real_admit, real_end = RestoreGate.admit_batch, _Batch.end

    def admit(self: RestoreGate, tier: str, objects: Any) -> Any:
        got = real_admit(self, tier, objects)
        if got is not None:
            admitted.append(tier)
        return got

    def end(self: _Batch, served: bool) -> None:
        ends.append(served)
        real_end(self, served)

    monkeypatch.setattr(RestoreGate, "admit_batch", admit)
    monkeypatch.setattr(_Batch, "end", end)
    n = 40
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 8 * n, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    host = bsr.HostTier(capacity_bytes=1 << 26)
    async with _engine([host]) as eng:
        assert (await eng.save(toks, src, ids)).ok
        if damaged:
            _damage(host, eng.keys(toks)[0], eng.keys(toks)[1], "payload")
        admitted.clear()
        ends.clear()
        dst = bsr.PagedKVCache(LAYOUT, 8 * n, BLOCK)
        r = await eng.restore(toks, dst, ids)
        assert admitted and len(ends) == len(admitted)
        if damaged:
            assert not r.committed and str(r.reason) == "corrupt"
        else:
            assert r.committed_tokens == n * CT and all(ends)
            assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
        assert _pinned(host) == 0


def test_a_wrapper_lends_only_while_it_leaves_reads_alone() -> None:
    """A wrapper that changes reads (latency, faults) is read through its own reads, never
    around them; a pass-through wrapper may hand the batch to the tier it wraps."""
    host = bsr.HostTier(capacity_bytes=1 << 20)
    assert host.bulk_reads and host.inline_reads
    for changed in (FaultyTier(host, FaultPlan()), LatencyTier(host)):
        assert not changed.bulk_reads and not changed.inline_reads
    plain = bsr.TierWrapper(host)
    assert plain.bulk_reads and plain.inline_reads and plain.medium is bsr.Medium.HOST
