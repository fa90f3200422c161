"""The transfer pipeline on its own: slot accounting, early stop, outcomes reported to the gate,
one test per install mode.

A small in-memory tier (each object a real stored object whose payload is a known byte pattern
per (chunk, group)) stands in for storage, so each test controls exactly which reads succeed;
the pipeline, the staging pool, the ladder and the paged cache are the real ones.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

import bsr
from bsr.core._keys import ChunkKey, ObjectKey, chunk_keys
from bsr.core._object import encode_object
from bsr.core._plan import plan_restore
from bsr.core._results import Probe
from bsr.transfer._install import HostInstaller
from bsr.transfer._ladder import Outcome, ReadOutcome
from bsr.transfer._pipeline import WindowPipeline
from bsr.transfer._run import RestoreRun
from bsr.transfer._staging import StagingPool, WholePlanBuffer

LAYOUT = bsr.StateLayout(
    chunk_tokens=16,
    groups=(bsr.StateGroup("kv", 2, 128), bsr.StateGroup("aux", 1, 256)),
)
NS = bsr.Namespace("pipeline-test").fingerprint(LAYOUT)


def pattern(chunk: int, group: str) -> torch.Tensor:
    n = LAYOUT.group_chunk_bytes(group)
    seed = chunk * 31 + (7 if group == "kv" else 13)
    return (torch.arange(n, dtype=torch.int64) * 131 + seed).remainder(256).to(torch.uint8)


class MemTier(bsr.Tier):
    """Holds the pattern of every (chunk, group); ``fail`` names objects whose read raises."""

    def __init__(
        self,
        name: str,
        keys: Sequence[ChunkKey],
        *,
        blocking: bool,
        inline: bool = False,
        fail: dict[tuple[int, str], Exception] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        super().__init__(name)
        self.blocking_reads = blocking  # type: ignore[misc]
        self.inline_reads = inline  # type: ignore[misc]
        self.index = {k.hex: c for c, k in enumerate(keys)}
        self.fail = fail or {}
        self.gate = gate
        self.reads: list[tuple[int, str]] = []
        self.threads: set[str] = set()

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        return [o.chunk.hex in self.index for o in objects]

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(10)
        c = self.index[key.hex]
        self.reads.append((c, group))
        if (c, group) in self.fail:
            raise self.fail[(c, group)]
        blob = encode_object(ObjectKey(key, group), pattern(c, group).numpy())
        return bsr.ObjectCodec.copy_out(blob, dst)

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        await anyio.lowlevel.checkpoint()
        return self.fetch_into_blocking(key, group, dst)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        raise NotImplementedError

    async def delete(self, key: ChunkKey, group: str) -> bool:
        return False


class RecordingGate:
    """A ReadGate that admits everything (or refuses named tiers) and records outcomes."""

    def __init__(self, refuse: Sequence[str] = ()) -> None:
        self.refuse = set(refuse)
        self.outcomes: list[ReadOutcome] = []
        self.withdrawn: list[str] = []

    def admit(self, tier: str, key: ChunkKey, group: str) -> str | None:
        return "refused by test" if tier in self.refuse else None

    def admit_batch(self, tier: str, objects: Any) -> Any:
        return None  # every object admitted and reported on its own

    def report(self, outcome: ReadOutcome) -> None:
        self.outcomes.append(outcome)

    def withdraw(self, tier: str) -> None:
        self.withdrawn.append(tier)


def make_probe(keys: Sequence[ChunkKey], holders: Sequence[str]) -> Probe:
    names = tuple(holders)
    return Probe(
        num_tokens=len(keys) * LAYOUT.chunk_tokens,
        chunk_tokens=LAYOUT.chunk_tokens,
        keys=tuple(keys),
        holders=tuple({g.name: names for g in LAYOUT.groups} for _ in keys),
        local_chunks=len(keys),
        prefix_chunks=len(keys),
        bytes_by_tier={},
        duration_s=0.0,
    )


def setup(n: int) -> tuple[list[ChunkKey], bsr.PagedKVCache, torch.Tensor]:
    keys = chunk_keys(NS, list(range(n * LAYOUT.chunk_tokens)), LAYOUT.chunk_tokens)
    cache = bsr.PagedKVCache(LAYOUT, num_blocks=2 * n, block_tokens=8)
    ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(n))
    return keys, cache, ids


def chunk_in_cache(cache: bsr.PagedKVCache, ids: torch.Tensor, c: int, group: str) -> bool:
    out = torch.empty(LAYOUT.slot_bytes, dtype=torch.uint8)
    from bsr.transfer._cache import gather_chunk

    gather_chunk(cache, group, cache.chunk_blocks(ids, c), out[LAYOUT.slot_offset(group) :])
    off = LAYOUT.slot_offset(group)
    return torch.equal(out[off : off + LAYOUT.group_chunk_bytes(group)], pattern(c, group))


async def run_pipeline(
    tiers: Sequence[bsr.Tier],
    n: int,
    *,
    window: int = 3,
    io_depth: int = 2,
    policy: bsr.Policy = bsr.Policy.ALL_OR_NOTHING,
    strategy: bsr.Strategy = bsr.Strategy.BOUNDED,
    gate: RecordingGate | None = None,
    keys: list[ChunkKey] | None = None,
) -> tuple[RestoreRun, StagingPool, bsr.PagedKVCache, torch.Tensor, RecordingGate]:
    k, cache, ids = setup(n)
    keys = keys or k
    pool = StagingPool(window, LAYOUT.slot_bytes, pin=False, prefault=False)
    pipe = WindowPipeline(LAYOUT, tiers, window=window, io_depth=io_depth)
    run = RestoreRun(plan_restore(LAYOUT, n), policy)
    gate = gate or RecordingGate()
    slots = (
        pool.account()
        if strategy is bsr.Strategy.BOUNDED
        else WholePlanBuffer(n, LAYOUT.slot_bytes, pin=False)
    )
    try:
        tables = cache.block_tables(ids, n * LAYOUT.chunk_tokens)
        await pipe.run(run, slots, make_probe(keys, [t.name for t in tiers]), cache, tables,
                       strategy, gate)  # fmt: skip
    finally:
        pipe.release_all(run, slots)
    return run, pool, cache, ids, gate


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.anyio
async def test_every_chunk_lands_and_every_slot_comes_back(blocking: bool, n: int) -> None:
    keys, _, _ = setup(n)
    tier = MemTier("mem", keys, blocking=blocking)

    run, pool, cache, ids, gate = await run_pipeline([tier], n, keys=keys)
    assert run.installed == {(c, g.name) for c in range(n) for g in LAYOUT.groups}
    assert all(chunk_in_cache(cache, ids, c, g.name) for c in range(n) for g in LAYOUT.groups)
    s = pool.statistics()
    assert s.in_use == 0 and s.acquired == s.released and s.peak_in_use <= 3
    assert run.held == set() and run.failure is None
    assert [o.outcome for o in gate.outcomes] == [Outcome.OK] * (2 * n)
    assert run.bytes_by_tier == {"mem": n * LAYOUT.chunk_bytes}


@pytest.mark.anyio
async def test_small_chunks_are_batched_into_few_thread_calls() -> None:
    """Many small chunks: one worker-thread call reads and installs a whole batch."""
    n = 64
    keys, _, _ = setup(n)
    tier = MemTier("mem", keys, blocking=True)

    async def main() -> None:
        run, pool, *_ = await run_pipeline([tier], n, window=2, io_depth=2, keys=keys)
        assert len(run.installed) == 2 * n
        # each worker-thread call takes one slot: far fewer acquisitions than chunks
        assert pool.statistics().acquired <= n // 4

    await main()


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.anyio
async def test_memory_speed_tiers_run_small_batches_on_the_event_loop(inline: bool) -> None:
    """inline_reads: small batches skip the thread hop; other blocking tiers never run inline."""
    n = 16
    keys, _, _ = setup(n)
    tier = MemTier("mem", keys, blocking=True, inline=inline)
    loop_thread = threading.current_thread().name

    async def main() -> None:
        run, *_ = await run_pipeline([tier], n, keys=keys)
        assert len(run.installed) == 2 * n

    await main()
    assert (tier.threads == {loop_thread}) is inline


@pytest.mark.anyio
async def test_all_or_nothing_stops_early_and_reports_the_failure() -> None:
    n = 30
    keys, _, _ = setup(n)
    err = bsr.TierIOError("disk on fire", tier="mem")
    tier = MemTier("mem", keys, blocking=True, fail={(3, "kv"): err})

    async def main() -> None:
        run, pool, _, _, gate = await run_pipeline([tier], n, window=2, io_depth=1, keys=keys)
        assert run.failure is not None and run.failure.chunk == 3
        assert run.failure.reason is bsr.Reason.READ_FAILED
        assert run.must_stop and run.limit == 3
        # it stopped: far fewer than all chunks were read after the failure
        assert len(tier.reads) < 2 * n
        assert (3, "kv") not in run.installed
        io = [o for o in gate.outcomes if o.outcome is Outcome.IO_ERROR]
        assert [(o.chunk, o.group, o.tier) for o in io] == [(3, "kv", "mem")]
        assert pool.statistics().in_use == 0

    await main()


@pytest.mark.anyio
async def test_truncate_keeps_reading_below_the_failure() -> None:
    n = 12
    keys, _, _ = setup(n)
    bad = bsr.CorruptObjectError("bad checksum", tier="mem")
    tier = MemTier("mem", keys, blocking=True, fail={(8, "aux"): bad})

    async def main() -> None:
        run, *_, gate = await run_pipeline(
            [tier], n, policy=bsr.Policy.TRUNCATE, io_depth=1, keys=keys
        )
        assert run.failure is not None and run.failure.reason is bsr.Reason.CORRUPT
        assert run.limit == 8
        assert {(c, g.name) for c in range(8) for g in LAYOUT.groups} <= run.installed
        assert any(o.outcome is Outcome.CORRUPT and o.chunk == 8 for o in gate.outcomes)

    await main()


@pytest.mark.anyio
async def test_ladder_falls_back_and_skips_refused_tiers() -> None:
    n = 6
    keys, _, _ = setup(n)
    broken = MemTier("l1", keys, blocking=True, fail={(2, "kv"): bsr.TierIOError("eio")})
    l2 = MemTier("l2", keys, blocking=True)

    async def main() -> None:
        run, _, cache, ids, gate = await run_pipeline([broken, l2], n, keys=keys)
        assert len(run.installed) == 2 * n and run.fallbacks == 1
        chunk2 = [(o.tier, o.group, o.outcome) for o in gate.outcomes if o.chunk == 2]
        assert chunk2 == [
            ("l1", "kv", Outcome.IO_ERROR),
            ("l2", "kv", Outcome.OK),  # the ladder went one tier lower
            ("l1", "aux", Outcome.OK),
        ]
        assert chunk_in_cache(cache, ids, 2, "kv")
        assert run.bytes_by_tier["l2"] == LAYOUT.group_chunk_bytes("kv")
        # a refused tier is never asked
        refused = RecordingGate(refuse=["l1"])
        l1 = MemTier("l1", keys, blocking=True)
        run2, *_ = await run_pipeline([l1, l2], n, gate=refused, keys=keys)
        assert l1.reads == [] and len(run2.installed) == 2 * n
        assert all(o.tier == "l2" for o in refused.outcomes)

    await main()


@pytest.mark.anyio
async def test_whole_plan_reads_everything_before_installing() -> None:
    n = 7
    keys, _, _ = setup(n)
    tier = MemTier("mem", keys, blocking=True)

    async def main() -> None:
        installs: list[int] = []
        orig = HostInstaller.install

        def counting(self: HostInstaller, c: int, *args: Any, **kw: Any) -> None:
            installs.append(len(tier.reads))  # reads done when this chunk is installed
            orig(self, c, *args, **kw)

        HostInstaller.install = counting  # type: ignore[method-assign]
        try:
            run, pool, cache, ids, _ = await run_pipeline(
                [tier], n, strategy=bsr.Strategy.WHOLE_PLAN, keys=keys
            )
        finally:
            HostInstaller.install = orig  # type: ignore[method-assign]
        # every chunk was read before the first install
        assert installs and min(installs) == 2 * n
        assert len(run.installed) == 2 * n
        assert all(chunk_in_cache(cache, ids, c, "kv") for c in range(n))
        assert pool.statistics().acquired == 0  # the private buffer, not the pool

    await main()


@pytest.mark.anyio
async def test_a_stuck_read_parks_its_slot_until_the_thread_returns() -> None:
    """A read that cannot return must not hold the caller; its slot is never reused early."""
    n = 4
    keys, _, _ = setup(n)
    release = threading.Event()
    tier = MemTier("mem", keys, blocking=True, gate=release)

    async def main() -> None:
        _, cache, ids = setup(n)
        pool = StagingPool(2, LAYOUT.slot_bytes, pin=False, prefault=False)
        pipe = WindowPipeline(LAYOUT, [tier], window=2, io_depth=1)
        run = RestoreRun(plan_restore(LAYOUT, n), bsr.Policy.ALL_OR_NOTHING)
        acct = pool.account()
        with anyio.move_on_after(0.2) as scope:
            await pipe.run(run, acct, make_probe(keys, ["mem"]), cache,
                           cache.block_tables(ids, n * LAYOUT.chunk_tokens),
                           bsr.Strategy.BOUNDED, RecordingGate())  # fmt: skip
        assert scope.cancelled_caught  # the caller was not held by the stuck read
        await pipe.drain(run, 0.05)
        pipe.release_all(run, acct)
        s = pool.statistics()
        assert s.parked >= 1 and pipe.abandoned_workers >= 1
        assert run.abandoned and run.installed == set()
        release.set()  # the stuck read returns ...
        with anyio.fail_after(5):
            while pool.statistics().parked:  # noqa: ASYNC110 - polling a thread's end
                await anyio.sleep(0.01)
        s = pool.statistics()
        assert s.in_use == 0 and s.acquired == s.released
        # ... and copied nothing into the cache after the request ended
        assert run.installed == set()
        assert not any(cache.tensor(g.name).any() for g in LAYOUT.groups)

    await main()
