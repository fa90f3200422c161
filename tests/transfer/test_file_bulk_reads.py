"""A FileTier's bulk read inside a restore: its reads kept in flight by one worker thread.

A restore whose every object is first asked of one FileTier reading through io_uring hands each
batch to :meth:`~bsr.FileTier.read_many_blocking`: one worker thread keeps several reads in
flight on its ring (a read per object of each staging slot it holds) and the pipeline checks and
copies each chunk as its reads complete. These tests damage real object files in the
middle of such a window (corrupt, truncated, missing, a kernel error, a read that never
completes) and check what the per-object path guarantees: the damaged object goes down the
ladder to the next tier or ends the prefix there, a partial prefix is never exposed, and the
window's slots and the reader's depth all come back. The Hypothesis test compares what a
restore commits with a model that knows only which objects were damaged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bsr
from bsr.tiers.file._readers import UringReader, _OwnedRing, _StreamState
from bsr.tiers.file._uring import Ring, RingError, uring_status
from bsr.transfer import _pipeline as pipeline
from support.engines import restore_all_at_once
from support.helpers import blocks_equal, filled_cache, retarget_stream_read, tokens_for

pytestmark = pytest.mark.skipif(
    not uring_status().usable, reason=f"no io_uring here: {uring_status().reason}"
)

#: two groups per chunk (two objects per slot), payloads of 8 and 4 KiB
LAYOUT = bsr.StateLayout(
    chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 256), bsr.StateGroup("idx", 1, 256))
)
BLOCK = 16
CHUNKS = 8
TOKENS = tokens_for(CHUNKS * LAYOUT.chunk_tokens)
IDS = torch.arange(CHUNKS)
DAMAGE = ("ok", "corrupt", "truncated", "missing", "ebadf")


class CountingReader(UringReader):
    """A real io_uring reader that counts the objects it streams and, for the objects named in
    ``traps`` (by object id), reads a write-only descriptor instead (``EBADF`` from the
    kernel) or the read end of an empty pipe (the read stalls until withdrawn)."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__(depth=depth)
        self.streamed = 0
        self.traps: dict[str, str] = {}
        self.pipe = os.pipe()
        self._guard = threading.Lock()

    def _stream_pieces(self, r: Any, bufs: Any) -> Any:
        with self._guard:
            self.streamed += 1
        trap = self.traps.get(_item_oid(r))  # FileTier's token: the ReadItem
        if trap is not None:
            retarget_stream_read(r, trap, self.pipe[0])
        return super()._stream_pieces(r, bufs)

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)


def _item_oid(r: Any) -> str:
    """The object id of a streamed read (its token is the pipeline's :class:`bsr.ReadItem`)."""
    return bsr.ObjectKey(r.token.key, r.token.group).object_id


def _engine(tiers: list[bsr.Tier], **kw: Any) -> bsr.RestoreEngine:
    kw.setdefault("window", 4)
    kw.setdefault("io_depth", 4)
    # breakers off: each damaged object must meet the ladder, whatever the others did
    return bsr.RestoreEngine(
        LAYOUT, tiers, namespace=bsr.Namespace("stream"), breaker_threshold=1_000_000, **kw
    )


def _damage(tier: bsr.FileTier, key: bsr.ChunkKey, group: str, how: str) -> None:
    path = tier.object_path(key, group)
    if how == "corrupt":
        with open(path, "r+b") as f:
            f.seek(4096 + 8)
            f.write(b"\x5a" * 16)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "missing":
        path.unlink()


def _oid(keys: list[bsr.ChunkKey], c: int, group: str) -> str:
    return bsr.ObjectKey(keys[c], group).object_id


def _objects() -> list[tuple[int, str]]:
    return [(c, g.name) for c in range(CHUNKS) for g in LAYOUT.groups]


# ---------------------------------------------------------------------- mid-window damage
@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing", "ebadf"])
@pytest.mark.anyio
async def test_a_damaged_object_mid_window_goes_down_the_ladder(tmp_path: Path, how: str) -> None:
    """Chunk 3's ``idx`` object is damaged in the first tier while reads of chunks 2-5 are in
    flight around it: it is read from the second tier, everything commits, and the first tier
    served every other object through the stream."""
    reader = CountingReader()
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    b = bsr.FileTier(tmp_path / "b", 1 << 26, name="b")
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=3)
    try:
        async with _engine([a, b]) as eng:
            assert (await eng.save(TOKENS, src, IDS)).ok
            keys = eng.keys(TOKENS)
            if how == "ebadf":
                reader.traps = {_oid(keys, 3, "idx"): "ebadf"}
            else:
                _damage(a, keys[3], "idx", how)
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS)
            assert r.committed_tokens == len(TOKENS) and r.fallbacks == 1
            assert blocks_equal(LAYOUT, src, IDS, dst, IDS, CHUNKS)
            assert r.bytes_by_tier["b"] == LAYOUT.group_chunk_bytes("idx")
            assert reader.streamed == 2 * CHUNKS - (how == "missing")  # its open failed
            assert a.statistics().errors == 1
            assert a.statistics().quarantined == (how in ("corrupt", "truncated"))
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released
            assert reader._depth.free == reader.depth
    finally:
        reader.close()


@pytest.mark.parametrize("policy", ["truncate", "all_or_nothing"])
@pytest.mark.anyio
async def test_a_corrupt_object_mid_window_ends_the_prefix_there(
    tmp_path: Path, policy: str
) -> None:
    """No second tier: chunk 5's ``kv`` object is corrupt. ``truncate`` commits chunks 0-4 (and
    nothing of chunk 5, although its ``idx`` object may have been read and copied);
    ``all_or_nothing`` commits nothing."""
    reader = CountingReader()
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=4)
    try:
        async with _engine([a]) as eng:
            assert (await eng.save(TOKENS, src, IDS)).ok
            _damage(a, eng.keys(TOKENS)[5], "kv", "corrupt")
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS, policy=policy)
            want = 5 if policy == "truncate" else 0
            assert r.committed_tokens == want * LAYOUT.chunk_tokens
            assert r.committed == bool(want)
            assert r.reason is (bsr.Reason.TRUNCATED if want else bsr.Reason.CORRUPT)
            assert blocks_equal(LAYOUT, src, IDS, dst, IDS, want)
            assert reader.streamed > 0
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released
    finally:
        reader.close()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
@pytest.mark.anyio
async def test_a_read_stuck_mid_window_ends_the_restore_and_everything_comes_back(
    tmp_path: Path, how: str
) -> None:
    """Chunk 2's first object stalls in the ring while the stream keeps other reads in flight:
    the restore ends by its deadline (or its caller's cancel), the stalled request is
    withdrawn, every slot and every place in the depth comes back, and the next restore
    commits."""
    reader = CountingReader(depth=4)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=5)
    try:
        async with _engine([a]) as eng:
            assert (await eng.save(TOKENS, src, IDS)).ok
            # chunk 2's kv: chunks 0-1 were begun before it, chunk 3 and on after
            reader.traps = {_oid(eng.keys(TOKENS), 2, "kv"): "stall"}
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            t0 = time.monotonic()
            result = None
            if how == "deadline":
                result = await eng.restore(TOKENS, dst, IDS, deadline_s=0.5)
            else:
                with anyio.move_on_after(0.5):
                    await eng.restore(TOKENS, dst, IDS)
            assert time.monotonic() - t0 < 3
            assert reader.streamed >= 6
            if result is not None:
                assert result.reason is bsr.Reason.DEADLINE and result.committed_tokens == 0
            for _ in range(1000):  # a hang guard: the withdrawn read ends within a poll
                s = eng.staging.statistics()
                if s.in_use == 0 and reader._depth.free == reader.depth:
                    break
                await anyio.sleep(0.01)
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.parked == 0 and s.acquired == s.released
            assert reader._depth.free == reader.depth
            reader.traps = {}
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS)
            assert r.committed_tokens == len(TOKENS)
            assert blocks_equal(LAYOUT, src, IDS, dst, IDS, CHUNKS)
    finally:
        reader.close()


@pytest.mark.parametrize(("depth", "peak"), [(64, 4), (3, 3)])
@pytest.mark.anyio
async def test_the_stream_keeps_a_read_in_flight_per_slot_within_the_tiers_depth(
    tmp_path: Path, depth: int, peak: int
) -> None:
    """The stream lane is what runs: one worker holds the W slots of the window and keeps a
    read in flight per slot (``io_depth`` is 1 here: one worker-thread call), never more than
    the tier's own read depth; RWS stays W x slot."""
    reader = CountingReader(depth=depth)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    one = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 256),))
    src = filled_cache(one, CHUNKS, BLOCK, seed=6)
    try:
        eng = bsr.RestoreEngine(one, [a], window=4, io_depth=1, namespace=bsr.Namespace("s"))
        async with eng:
            assert (await eng.save(TOKENS, src, IDS)).ok
            dst = bsr.PagedKVCache(one, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS)
            assert r.committed_tokens == len(TOKENS)
            assert blocks_equal(one, src, IDS, dst, IDS, CHUNKS)
            assert reader.streamed == CHUNKS
            assert reader.peak_in_flight == peak  # one request per object of 12 KiB
            assert r.rws_peak_bytes == 4 * one.slot_bytes  # the window: W slots
    finally:
        reader.close()


@pytest.mark.anyio
async def test_the_next_read_is_in_flight_while_an_object_is_verified_and_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a read depth of 1 and requests of 4 KiB, the ring is refilled and handed to the
    kernel before the end (verify and copy, the CPU work of the stream) of each object of
    several requests: the next object's first request is in the kernel meanwhile (queued and
    entered), for every such object but the last. An object of one request ends without."""
    in_flight: list[tuple[int, int]] = []
    real_end = _StreamState.end_read
    reader = UringReader(depth=1, block_bytes=4096)

    def end_read(self: _StreamState, r: Any) -> None:
        ring = reader._local.ring.ring  # this worker thread's
        # requests queued, less those not handed to the kernel yet
        in_flight.append((len(r.lengths), len(self.reads) - ring._pending))
        real_end(self, r)

    monkeypatch.setattr(_StreamState, "end_read", end_read)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=10)
    async with _engine([a]) as eng:
        assert (await eng.save(TOKENS, src, IDS)).ok
        dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
        r = await eng.restore(TOKENS, dst, IDS)
        assert r.committed_tokens == len(TOKENS)
        assert blocks_equal(LAYOUT, src, IDS, dst, IDS, CHUNKS)
    # each chunk: its kv object (8 KiB: header + 4 KiB, then 4 KiB), then its idx (one request)
    assert in_flight == [(2, 1), (1, 0)] * CHUNKS


@pytest.mark.parametrize("announce", [False, True])
@pytest.mark.anyio
async def test_one_streamed_batch_per_worker_unless_chunks_are_awaited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, announce: bool
) -> None:
    """The device queue runs dry at the end of each streamed batch (its worker-thread call
    returns once its last read is in), so a restore nobody watches chunk by chunk is one batch
    per worker: one call here (``memory_workers`` 1). With ``on_installed`` the chunks are
    announced batch by batch, so batches keep their size (two chunks here)."""
    monkeypatch.setattr(pipeline, "MEMORY_BATCH_BYTES", 2 * LAYOUT.chunk_bytes)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=UringReader(depth=8))
    calls: list[int] = []
    real = a.read_many_blocking

    def counting(*args: Any, **kw: Any) -> None:
        calls.append(1)
        real(*args, **kw)

    monkeypatch.setattr(a, "read_many_blocking", counting)
    announced: list[int] = []
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=8)
    async with _engine([a]) as eng:
        assert (await eng.save(TOKENS, src, IDS)).ok
        dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
        hook = (lambda c, groups: announced.append(c)) if announce else None
        r = await eng.restore(TOKENS, dst, IDS, on_installed=hook)
        assert r.committed_tokens == len(TOKENS)
        assert blocks_equal(LAYOUT, src, IDS, dst, IDS, CHUNKS)
    if announce:
        assert len(calls) == CHUNKS // 2 and sorted(announced) == list(range(CHUNKS))
    else:
        assert len(calls) == 1


class HoldingReader(UringReader):
    """Holds the read of the object ``hold`` (an object id) until another caller waits for a
    slot of ``pool``; ``streaming`` is set once the held read has begun."""

    def __init__(self) -> None:
        super().__init__(depth=8)
        self.hold = ""
        self.pool: Any = None
        self.streaming = threading.Event()
        self.begun: list[str] = []  # object ids, in the order their reads began

    def _stream_pieces(self, r: Any, bufs: Any) -> Any:
        self.begun.append(_item_oid(r))
        if _item_oid(r) == self.hold and not self.streaming.is_set():
            self.streaming.set()
            deadline = time.monotonic() + 30  # a hang guard
            while not self.pool.contended and time.monotonic() < deadline:
                time.sleep(0.001)
        return super()._stream_pieces(r, bufs)


@pytest.mark.anyio
async def test_a_long_streamed_restore_yields_the_window_to_a_waiting_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed restore holds its share of the window for its whole run only while nobody
    else wants it: a short restore that starts while a long one streams through all W = 2
    slots waits for a slot, and is handed one once each of the long one's slots has taken a
    chunk (two chunks begun of eight), not when the long one is done. Both commit their own
    bytes, and every slot comes back."""
    reader = HoldingReader()
    handed: list[int] = []  # objects of the long restore begun when a waiter got a slot
    real_give = bsr.StagingPool._give

    def give(self: bsr.StagingPool, slot: Any) -> None:
        if self.contended and reader.streaming.is_set():  # a waiter, once the long one streams
            handed.append(sum(1 for o in reader.begun if o in long_objects))
        real_give(self, slot)

    monkeypatch.setattr(bsr.StagingPool, "_give", give)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    long_p, short_p = tokens_for(8 * 16, seed=70), tokens_for(2 * 16, seed=71)
    src = filled_cache(LAYOUT, 10, BLOCK, seed=12)
    long_ids, short_ids = torch.arange(8), torch.arange(8, 10)
    ended: list[str] = []
    async with _engine([a], window=2, io_depth=2) as eng:
        assert (await eng.save(long_p, src, long_ids)).ok
        assert (await eng.save(short_p, src, short_ids)).ok
        long_keys = eng.keys(long_p)
        long_objects = {_oid(long_keys, c, g.name) for c in range(8) for g in LAYOUT.groups}
        reader.hold = _oid(long_keys, 0, "kv")
        reader.pool = eng.staging
        dst = bsr.PagedKVCache(LAYOUT, 10, BLOCK)

        async def restore(name: str, prompt: list[int], ids: torch.Tensor) -> None:
            r = await eng.restore(prompt, dst, ids)
            assert r.committed_tokens == len(prompt), (name, r.reason)
            ended.append(name)

        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(restore, "long", long_p, long_ids)
                assert await anyio.to_thread.run_sync(reader.streaming.wait, 30)
                tg.start_soon(restore, "short", short_p, short_ids)
        assert sorted(ended) == ["long", "short"]
        assert handed[0] == 2 * len(LAYOUT.groups)  # the long one's first window, no more
        assert blocks_equal(LAYOUT, src, long_ids, dst, long_ids, 8)
        assert blocks_equal(LAYOUT, src, short_ids, dst, short_ids, 2)
        s = eng.staging.statistics()
        assert s.in_use == 0 and s.acquired == s.released and s.peak_in_use <= 2


@pytest.mark.anyio
async def test_concurrent_streamed_restores_share_the_window(tmp_path: Path) -> None:
    """Six restores stream from one FileTier at once through a window of 3 slots: each worker
    waits for one slot and takes more only when free, so every restore commits its own bytes,
    staging never holds more than W slots, and every slot comes back."""
    reader = CountingReader()
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    n_req, chunks = 6, 4
    prompts = [tokens_for(chunks * LAYOUT.chunk_tokens, seed=50 + i) for i in range(n_req)]
    src = filled_cache(LAYOUT, chunks * n_req, BLOCK, seed=9)
    ids = [torch.arange(chunks * i, chunks * (i + 1)) for i in range(n_req)]
    try:
        async with _engine([a], window=3, io_depth=2) as eng:
            for p, i in zip(prompts, ids):
                assert (await eng.save(p, src, i)).ok
            dst = bsr.PagedKVCache(LAYOUT, chunks * n_req, BLOCK)
            with anyio.fail_after(120):  # a hang guard
                results, peak = await restore_all_at_once(eng, prompts, dst, ids)
            assert all(r.committed_tokens == len(prompts[0]) for r in results)
            for i in range(n_req):
                assert blocks_equal(LAYOUT, src, ids[i], dst, ids[i], chunks)
            s = eng.staging.statistics()
            assert max(peak, s.peak_in_use) <= 3
            assert s.in_use == 0 and s.acquired == s.released
            assert reader.streamed == 2 * chunks * n_req
    finally:
        reader.close()


class FailingRing(Ring):
    """A real ring whose ``fail_at``-th wait raises :class:`RingError` before entering the
    kernel (as a ring that fails under a stream would); later calls work."""

    def __init__(self, entries: int, fail_at: int) -> None:
        super().__init__(entries)
        self.calls = 0
        self.fail_at = fail_at

    def enter(self, wait: int = 0, timeout_s: float | None = None) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RingError(5, "io_uring_enter: Input/output error (injected)")
        super().enter(wait, timeout_s)


class RingFailsReader(CountingReader):
    """Each thread's first ring fails at its ``fail_at``-th wait."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.rings: list[FailingRing] = []

    def _ring(self) -> Any:
        owned = getattr(self._local, "ring", None)
        if owned is not None:
            return owned.ring
        ring = FailingRing(64, self.fail_at) if not self.rings else Ring(64)
        self.rings.append(ring)
        self._local.ring = _OwnedRing(ring)
        return ring


@pytest.mark.anyio
async def test_a_ring_failing_mid_stream_ends_its_reads_and_the_rest_go_by_preadv(
    tmp_path: Path,
) -> None:
    """The ring fails at its second wait with reads in flight: those reads are waited for and
    end with the error (each read again from the second tier), the objects left are read from
    the first tier with ``preadv``, and the restore commits the saved bytes."""
    reader = RingFailsReader(fail_at=2)
    a = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=reader)
    b = bsr.FileTier(tmp_path / "b", 1 << 26, name="b")
    src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=8)
    try:
        async with _engine([a, b], window=2, io_depth=2) as eng:  # 4 reads in flight of 16
            assert (await eng.save(TOKENS, src, IDS)).ok
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS)
            assert reader.rings and reader.rings[0].calls >= 2  # the injected failure fired
            assert r.committed_tokens == len(TOKENS)
            assert blocks_equal(LAYOUT, src, IDS, dst, IDS, CHUNKS)
            assert r.fallbacks >= 1 and r.bytes_by_tier.get("b", 0) > 0  # those in flight
            assert reader.fallback_reads > 0  # the rest: preadv from the first tier
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released
            assert reader._depth.free == reader.depth
    finally:
        reader.close()


# ---------------------------------------------------------------------- against a model
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    damage=st.dictionaries(st.sampled_from(_objects()), st.sampled_from(DAMAGE[1:]), max_size=5),
    second=st.booleans(),
    policy=st.sampled_from(["truncate", "all_or_nothing"]),
    io_depth=st.integers(1, 4),
)
def test_what_a_streamed_restore_commits_matches_the_model(
    damage: dict[tuple[int, str], str], second: bool, policy: str, io_depth: int
) -> None:
    """Any set of damaged objects in the first tier (corrupt, truncated, missing, a kernel
    error), with or without an undamaged second tier: the restore commits exactly what the
    model says (a chunk is good when each of its objects is undamaged or the second tier holds
    it; ``truncate`` keeps the good chunks before the first bad one, ``all_or_nothing`` all or
    none), the committed blocks hold the saved bytes, and the window is idle after."""
    good = [all((c, g.name) not in damage or second for g in LAYOUT.groups) for c in range(CHUNKS)]
    first_bad = good.index(False) if False in good else CHUNKS
    want = first_bad if policy == "truncate" else (CHUNKS if first_bad == CHUNKS else 0)
    root = Path(tempfile.mkdtemp(prefix="bsr-stream-"))
    reader = CountingReader()

    async def main() -> None:
        a = bsr.FileTier(root / "a", 1 << 26, name="a", reader=reader)
        tiers: list[bsr.Tier] = [a]
        if second:
            tiers.append(bsr.FileTier(root / "b", 1 << 26, name="b"))
        src = filled_cache(LAYOUT, CHUNKS, BLOCK, seed=len(damage))
        async with _engine(tiers, window=4, io_depth=io_depth) as eng:
            assert (await eng.save(TOKENS, src, IDS)).ok
            keys = eng.keys(TOKENS)
            for (c, g), how in damage.items():
                if how == "ebadf":
                    reader.traps[_oid(keys, c, g)] = "ebadf"
                else:
                    _damage(a, keys[c], g, how)
            dst = bsr.PagedKVCache(LAYOUT, CHUNKS, BLOCK)
            r = await eng.restore(TOKENS, dst, IDS, policy=policy)
            assert r.committed_tokens == want * LAYOUT.chunk_tokens, (r, damage)
            assert r.committed == (want > 0)
            if first_bad == CHUNKS:
                assert r.reason is bsr.Reason.COMPLETE
            elif want:
                assert r.reason is bsr.Reason.TRUNCATED
            else:  # why the first bad chunk failed: one of its objects' reasons
                why = {
                    bsr.Reason.CORRUPT
                    if how in ("corrupt", "truncated")
                    else bsr.Reason.READ_FAILED
                    for (c, _), how in damage.items()
                    if c == first_bad
                }
                assert r.reason in why, (r.reason, why)
            assert blocks_equal(LAYOUT, src, IDS, dst, IDS, want)
            assert reader.streamed > 0 or damage.get((0, "kv")) == "missing"  # the lane ran
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released
            assert reader._depth.free == reader.depth

    try:
        anyio.run(main)
    finally:
        reader.close()
        shutil.rmtree(root, ignore_errors=True)
