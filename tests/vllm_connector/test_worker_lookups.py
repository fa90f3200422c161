"""The worker's lookups under ``lookup_timeout_s``: a tier still answering then is cut off by the
engine's own deadline, so the lookup offers what the other tiers hold, the cut counts against
the slow tier's breaker and in the ``lookup_unanswered`` metric (by tier).

Found while looking into a fleet test's "0 cached" turn: the worker bounded each lookup by a
scope of exactly ``lookup_timeout_s`` around the engine's lookup with the same deadline, opened a
moment earlier, so the outer scope always fired first: a host tier holding the whole prefix was
offered nothing while a pool below it was slow, the pool's breaker never counted it, and no
warning or metric said why. A real engine and tiers (a HostTier, a FileTier whose metadata
queries hang on demand); the worker's answers are taken where it hands them to its lookup
server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

import bsr
from support.engines import HangingContains

pytest.importorskip("vllm")
from bsr.vllm._lookup import LookupHints
from bsr.vllm._metadata import LoadJob
from bsr.vllm._worker import BsrWorker, _Load
from vllm_settings import connector_settings

pytestmark = pytest.mark.anyio

CHUNK, BLOCK, CHUNKS = 32, 8, 3
LAYOUT = bsr.StateLayout(chunk_tokens=CHUNK, groups=(bsr.StateGroup("kv", 2, 256),))
TOKENS = np.random.default_rng(5).integers(3, 500, CHUNKS * CHUNK).astype(np.int64)
#: the lookup bound of these tests (the default): the hung tier never answers, the others answer
#: in microseconds, but on a busy machine this process may wait its turn for a while
TIMEOUT_S = 2.0


@dataclass
class Replies:
    """Where the worker hands its answers (the lookup server's ``reply``)."""

    got: list[tuple[int, int]] = field(default_factory=list)  # (seq, hit)
    skips: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq -> tiers to skip

    def reply(
        self, conn_id: int, seq: int, hit: int, by_tier: Sequence[int] = (),
        skip: Sequence[int] = (),
    ) -> None:  # fmt: skip
        self.got.append((seq, hit))
        self.skips[seq] = tuple(skip)


@asynccontextmanager
async def worker_over(
    tiers: list[bsr.Tier], save_to: int, tp_size: int = 1
) -> AsyncIterator[BsrWorker]:
    """A worker whose engine has ``tiers`` (breaker threshold 2), the prompt saved into the
    first ``save_to`` of them; ``tp_size``: the ranks the worker's settings say (its lookups
    are rank 0's alone then, no collective)."""
    settings = connector_settings(BLOCK, CHUNK, {"lookup_timeout_s": TIMEOUT_S}, tp_size=tp_size)
    cache = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
    cache.tensor("kv").random_(0, 255)
    engine = bsr.RestoreEngine(
        LAYOUT, tiers, window=2, io_depth=1, namespace=bsr.Namespace("m"),
        breaker_threshold=2, breaker_cooldown_s=600,
    )  # fmt: skip
    await engine.open()
    names = [t.name for t in tiers[:save_to]]
    saved = await engine.save(TOKENS, cache, list(range(CHUNKS * CHUNK // BLOCK)), tiers=names)
    assert saved.chunks == CHUNKS
    worker = BsrWorker(settings, None)
    worker.engine, worker.cache, worker.groups = engine, cache, ("kv",)
    worker._server = Replies()  # type: ignore[assignment]
    try:
        yield worker
    finally:
        await engine.aclose()


async def lookup(worker: BsrWorker, seq: int, tokens: np.ndarray = TOKENS) -> int:
    """One lookup of ``tokens``, as the lookup server starts it; the hit it answered."""
    with anyio.fail_after(60):  # a hang guard, not a timing claim
        await worker._lookup_job(0, seq, tokens, (), LookupHints())
    replies = worker._server
    assert isinstance(replies, Replies)
    (got,) = [hit for s, hit in replies.got if s == seq]
    return got


async def test_a_slow_pool_below_the_host_tier_leaves_the_host_hit(tmp_path: Path) -> None:
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path / "pool", 1 << 26))
    async with worker_over([host, pool], save_to=1) as w:
        pool.hang = True
        assert await lookup(w, 1) == CHUNKS * CHUNK  # the host's copy, offered
        assert w.engine is not None
        assert w.engine.health.state(pool.name).consecutive_failures == 1
        assert w.engine.health.state(host.name).consecutive_failures == 0
        stats = w.take_stats()
        assert stats is not None and stats.data["lookup_unanswered"] == {pool.name: 1}
        assert await lookup(w, 2) == CHUNKS * CHUNK
        assert w.engine.health.state(pool.name).open  # threshold 2: the pool is skipped now
        assert await lookup(w, 3) == CHUNKS * CHUNK  # at once, and still counted
        stats = w.take_stats()
        assert stats is not None and stats.data["lookup_unanswered"] == {pool.name: 2}


async def test_a_longer_prompt_is_offered_the_host_hit_without_asking_the_pool_again(
    tmp_path: Path,
) -> None:
    """The usual prompt: longer than what is stored. The load needs a probe of exactly the
    prefix offered: it is cut from the lookup's probe (``RestoreEngine.narrow``), leased, and
    the slow pool is not asked a second time (a second lookup of the prefix asked it again: a
    second failure against its breaker for one lookup, or, with the deadline spent, no leased
    probe, so the load probed again and waited for the pool until its own deadline)."""
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path / "pool", 1 << 26))
    longer = np.concatenate([TOKENS, TOKENS[:CHUNK] + 1])
    hit = CHUNKS * CHUNK
    async with worker_over([host, pool], save_to=1) as w:
        pool.hang = True
        assert await lookup(w, 1, longer) == hit
        engine = w.engine
        assert engine is not None
        assert engine.health.state(pool.name).consecutive_failures == 1
        (kept,) = [p for _, p in w._probes.values()]
        assert kept.prefix_tokens == hit and kept.num_tokens == hit and kept.lease is not None
        assert engine.statistics().leases == 1  # the lookup's own lease is given back
        # the load's restore: the kept probe, so no tier is asked (the pool still hangs)
        dst = bsr.PagedKVCache(LAYOUT, 16, BLOCK)
        with anyio.fail_after(60):
            r = await engine.restore(
                longer[:hit], dst, list(range(hit // BLOCK)), probe=kept, deadline_s=30
            )
        assert r.committed_tokens == hit and set(r.bytes_by_tier) == {host.name}
        assert engine.health.state(pool.name).consecutive_failures == 1


class HangingLease(bsr.TierWrapper[bsr.Tier]):
    """A tier that answers lookups but whose leases never come back (nothing bounds them but
    the worker's backstop)."""

    async def lease(self, objects: Sequence[bsr.ObjectKey], ttl_s: float) -> bsr.TierLease:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_lookup_past_the_backstop_is_answered_a_miss_and_counted() -> None:
    host = HangingLease(bsr.HostTier(1 << 24))
    async with worker_over([host], save_to=1) as w:
        assert await lookup(w, 1) == 0  # answered, 0.5 s past lookup_timeout_s
        stats = w.take_stats()
        assert stats is not None and stats.data["lookups_timed_out"] == 1
        assert not stats.data["lookup_unanswered"]  # the tier answered: its lease did not


@pytest.mark.parametrize("hang", [True, False], ids=["hung-pool", "control"])
async def test_with_several_ranks_the_hosts_hit_is_offered_and_the_loads_skip_the_pool(
    tmp_path: Path, hang: bool
) -> None:
    """Rank 0 looks up alone and every rank's load probes again. A pool slow for rank 0 would
    hold each rank's load probe until the load's deadline (10 s of a request's time, then a
    recompute), so such a lookup used to offer nothing, not even the host's hit, for as long as
    the pool was down. Now the answer names the pool (by index) and the load job carries it:
    each rank's load skips it and restores the host's copy."""
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path / "pool", 1 << 26))
    async with worker_over([host, pool], save_to=1, tp_size=2) as w:
        pool.hang = hang
        assert await lookup(w, 1) == CHUNKS * CHUNK
        replies = w._server
        assert isinstance(replies, Replies)
        assert replies.skips[1] == ((1,) if hang else ())
        stats = w.take_stats()  # None: nothing counted
        unanswered = stats.data["lookup_unanswered"] if stats is not None else {}
        assert unanswered == ({pool.name: 1} if hang else {})
        # the load of that answer (its job as the scheduler makes it): no lease was kept with
        # several ranks, so it probes again, without the pool
        calls = pool.calls
        n = CHUNKS * CHUNK // BLOCK  # saved from blocks 0..n-1, loaded into 1..n (vLLM's 0 is
        blocks = tuple(range(1, n + 1))  # its null block)
        job = LoadJob("r1", tuple(int(t) for t in TOKENS), 0, (blocks,), None, (),
                      replies.skips[1])  # fmt: skip
        assert w.cache is not None and w.engine is not None
        kv = w.cache.tensor("kv")
        saved = kv[:, :n].clone()
        kv.zero_()
        with anyio.fail_after(60):  # a hang guard: an asked pool would hold it to its deadline
            r = await w._restore(_Load(job))
        assert r.committed_tokens == CHUNKS * CHUNK and set(r.bytes_by_tier) == {host.name}
        assert torch.equal(kv[:, 1 : n + 1], saved)
        assert r.unanswered == ((pool.name,) if hang else ())
        assert pool.calls == calls + (0 if hang else 1)
        assert w.engine.health.state(pool.name).consecutive_failures == (1 if hang else 0)


async def test_a_slow_only_tier_is_a_miss_counted_against_it(tmp_path: Path) -> None:
    pool = HangingContains(bsr.FileTier(tmp_path / "pool", 1 << 26))
    async with worker_over([pool], save_to=1) as w:
        pool.hang = True
        assert await lookup(w, 1) == 0
        assert w.engine is not None
        assert w.engine.health.state(pool.name).consecutive_failures == 1
        stats = w.take_stats()
        assert stats is not None and stats.data["lookup_unanswered"] == {pool.name: 1}


async def test_control_tiers_that_answer_count_nothing(tmp_path: Path) -> None:
    host = bsr.HostTier(1 << 24)
    pool = HangingContains(bsr.FileTier(tmp_path / "pool", 1 << 26))
    async with worker_over([host, pool], save_to=2) as w:
        assert await lookup(w, 1) == CHUNKS * CHUNK
        assert w.engine is not None
        assert w.engine.health.state(pool.name).consecutive_failures == 0
        stats = w.take_stats()
        assert stats is None or not stats.data["lookup_unanswered"]
