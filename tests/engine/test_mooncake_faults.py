"""The fault ladder on a REAL Mooncake Store: remote (MooncakeTier) -> SSD (FileTier) -> recompute.

Every test here restores through a :class:`bsr.RestoreEngine` whose first tier is a
:class:`bsr.MooncakeTier` attached to a cluster started on 127.0.0.1 by the fixtures in
tests/mooncake_server.py (standalone-client mode: the test process listens on no port), with or
without a :class:`bsr.FileTier` holding the same prefix below it, and breaks the remote tier for
real (master or memory holder SIGKILLed mid-restore, master frozen by SIGSTOP, a store too small
for the saved prefix, objects deleted or corrupted in the store) or through
``bsr.testing.FaultyTier`` (also on one rank of a two-rank torch.distributed job).

Each restore must end in full reuse of its agreed prefix or zero external reuse, never partial:
Committed with ``committed_tokens == probed_tokens`` and the committed cache blocks byte-equal
to the saved ones, or Invalidated (or Committed with 0 tokens after an empty probe) with 0
tokens; no staging slot in use afterwards; done within its deadline plus a margin.

Marked ``mooncake``: skipped when Mooncake is missing, a failure under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import bsr
from bsr.core._keys import ObjectKey
from bsr.testing import Fault, FaultKind, FaultPlan, FaultyTier, LatencyTier, corrupt_stored
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, shuffled_blocks, two_group_layout

try:
    from mooncake_server import (
        MooncakeCluster,
        fresh_mooncake_cluster,
        frozen_master_cluster,
        mooncake_cluster,
        require_mooncake,
        start_cluster,
    )
except ImportError:  # tests/ imported as a package
    from tests.mooncake_server import (  # type: ignore[no-redef]
        MooncakeCluster,
        fresh_mooncake_cluster,
        frozen_master_cluster,
        mooncake_cluster,
        require_mooncake,
        start_cluster,
    )

# fixtures used by name
__all__ = ["fresh_mooncake_cluster", "frozen_master_cluster", "mooncake_cluster"]

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

WORKER = Path(__file__).parents[1] / "children" / "mooncake_dist_worker.py"
#: slack on top of a restore's deadline
MARGIN_S = 10.0
#: restore deadline in the ladder tests: generous, a broken remote tier costs one tier
#: timeout per object before the SSD serves it
DEADLINE_S = 20.0
#: MooncakeTier timeout while saving (roomy: a loaded 2-core runner must not fail a save)
SAVE_TIMEOUT_S = 5.0
#: MooncakeTier timeout while restoring through a dead process (each remote call may hang this
#: long before the SSD serves the object)
TIER_TIMEOUT_S = 0.5
COMMITTED = bsr.RequestState.COMMITTED
INVALIDATED = bsr.RequestState.INVALIDATED


# ---------------------------------------------------------------------- helpers
@dataclass
class Case:
    """A token sequence, the source cache holding its state, and its block table."""

    layout: bsr.StateLayout
    tokens: list[int]
    src: bsr.PagedKVCache
    ids: torch.Tensor
    num_blocks: int
    block_tokens: int

    @property
    def chunks(self) -> int:
        return len(self.tokens) // self.layout.chunk_tokens

    def new_cache(self) -> bsr.PagedKVCache:
        return bsr.PagedKVCache(self.layout, self.num_blocks, self.block_tokens)

    def objects(self, chunks: int) -> int:
        """Objects (chunk, group) a prefix of ``chunks`` chunks needs (window-aware)."""
        return sum(len(self.layout.needed_chunks(g.name, chunks)) for g in self.layout.groups)

    def prefix_bytes(self, chunks: int) -> int:
        """Payload bytes a prefix of ``chunks`` chunks needs (window-aware)."""
        return sum(
            self.layout.group_chunk_bytes(g.name) * len(self.layout.needed_chunks(g.name, chunks))
            for g in self.layout.groups
        )


def make_case(
    chunks: int, *, layout: bsr.StateLayout | None = None, seed: int = 0, block_tokens: int = 8
) -> Case:
    layout = layout or two_group_layout()  # kv 16 KiB + swa 4 KiB (window 40) per chunk
    n_tokens = chunks * layout.chunk_tokens + 5  # a partial chunk at the end is never stored
    num_blocks = 4 * (n_tokens // block_tokens + 1)
    need = -(-n_tokens // block_tokens)
    gen = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 50_000, (n_tokens,), generator=gen).tolist()
    src = filled_cache(layout, num_blocks, block_tokens, seed=seed)
    ids = shuffled_blocks(num_blocks, need, seed=seed + 1)
    return Case(layout, tokens, src, ids, num_blocks, block_tokens)


def remote_tier(cluster: MooncakeCluster, **kw: Any) -> bsr.MooncakeTier:
    kw.setdefault("timeout_s", SAVE_TIMEOUT_S)
    kw.setdefault("key_prefix", bsr.MooncakeTier.unique_prefix("bsr-faults/"))
    kw.setdefault("local_buffer_size", 32 << 20)
    return bsr.MooncakeTier(client_address=cluster.client_address, **kw)


#: every engine here: a window of 4 in its own namespace (DEADLINE: bounded by DEADLINE_S)
ENGINE: dict[str, Any] = {"window": 4, "model_id": "mooncake-faults-model"}
DEADLINE = {"deadline_s": DEADLINE_S, **ENGINE}


async def settle(tier: bsr.MooncakeTier) -> None:
    """Wait (bounded) until the tier's abandoned, timed-out store calls have ended, so that
    closing the engine really closes the tier's Mooncake client.

    With calls still stuck, ``MooncakeTier.aclose`` skips the client's close; such a client
    keeps reconnecting once the fixture stops the cluster, and was seen to stall the first
    writes of later clients in this process beyond 5 s. The calls end within a few seconds
    (the gateway gives up on a dead master or memory holder).
    """
    with anyio.move_on_after(30):
        while tier._calls.stuck:  # noqa: ASYNC110 - polling a counter of worker threads
            await anyio.sleep(0.05)
    tier.timeout_s = SAVE_TIMEOUT_S  # the client's close() takes up to ~1 s


@contextlib.asynccontextmanager
async def opened(
    engine: bsr.RestoreEngine, remote: bsr.MooncakeTier
) -> AsyncIterator[bsr.RestoreEngine]:
    """``async with engine``, settling ``remote`` (see :func:`settle`) before it closes."""
    async with engine:
        try:
            yield engine
        finally:
            await settle(remote)


async def timed_restore(
    engine: bsr.RestoreEngine, case: Case, dst: bsr.PagedKVCache
) -> tuple[bsr.RestoreResult, float]:
    t0 = time.monotonic()
    r = await engine.restore(case.tokens, dst, case.ids)
    return r, time.monotonic() - t0


def assert_all_or_nothing(
    r: bsr.RestoreResult,
    engine: bsr.RestoreEngine,
    case: Case,
    dst: bsr.PagedKVCache,
    elapsed_s: float,
    *,
    deadline_s: float = DEADLINE_S,
) -> None:
    """Full reuse of the agreed prefix, byte-exact, or zero external reuse; nothing held."""
    detail = f"{r.state} {r.reason} {r.committed_tokens}/{r.probed_tokens} {r.errors[:3]}"
    assert engine.staging.statistics().in_use == 0, detail
    assert elapsed_s < deadline_s + MARGIN_S, (elapsed_s, detail)
    assert r.timings.total_s < deadline_s + MARGIN_S, (r.timings, detail)
    assert r.state in (COMMITTED, INVALIDATED), detail
    if r.state is COMMITTED:
        assert r.committed_tokens == r.probed_tokens, detail  # all-or-nothing: never shorter
        committed = r.committed_tokens // case.layout.chunk_tokens
        assert r.committed_tokens % case.layout.chunk_tokens == 0
        assert r.invalid_block_ids == (), detail
        assert blocks_equal(case.layout, case.src, case.ids, dst, case.ids, committed), detail
        # every needed object was read exactly once, from some tier
        assert r.bytes_read == case.prefix_bytes(committed), (r.bytes_by_tier, detail)
        if committed == 0:
            assert r.reason is bsr.Reason.EMPTY_PREFIX, detail
    else:
        assert r.committed_tokens == 0, detail
        assert set(r.invalid_block_ids) <= {int(b) for b in case.ids}, detail


def assert_zero_reuse(r: bsr.RestoreResult) -> None:
    """Recompute: nothing external is reused (Invalidated, or Committed on an empty probe)."""
    assert r.committed_tokens == 0, r
    assert r.state is INVALIDATED or r.reason is bsr.Reason.EMPTY_PREFIX, r


async def present_prefix(tier: bsr.Tier, engine: bsr.RestoreEngine, case: Case) -> int:
    """Longest prefix (chunks) whose every needed object ``tier`` reports present."""
    keys = engine.keys(case.tokens)
    for p in range(case.chunks, 0, -1):
        objs = [
            ObjectKey(keys[c], g.name)
            for g in case.layout.groups
            for c in case.layout.needed_chunks(g.name, p)
        ]
        if all(await tier.contains_many(objs)):
            return p
    return 0


class KillAfterReads(LatencyTier):
    """Reads through ``inner`` after ``read_latency_s``; runs ``action`` once, right after the
    ``after``-th read succeeded, so the fault lands with other reads of the restore in flight."""

    def __init__(
        self, inner: bsr.Tier, *, after: int, action: Callable[[], None], read_latency_s: float
    ) -> None:
        super().__init__(inner, read_latency_s=read_latency_s)
        self.after = after
        self.action = action
        self.reads = 0
        self.fired_at: float | None = None

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        n = await super().fetch_into(key, group, dst)
        self.reads += 1
        if self.reads == self.after:
            self.fired_at = time.monotonic()
            await anyio.to_thread.run_sync(self.action)  # SIGKILL + wait: blocking
        return n


class PauseMasterAfterReads(LatencyTier):
    """After the ``after``-th read succeeded, SIGSTOP the master (it hangs, answering nothing)."""

    def __init__(self, inner: bsr.Tier, cluster: MooncakeCluster, *, after: int) -> None:
        super().__init__(inner, read_latency_s=0.0)
        self.cluster = cluster
        self.after = after
        self.reads = 0

    async def fetch_into(self, key: bsr.ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        n = await super().fetch_into(key, group, dst)
        self.reads += 1
        if self.reads == self.after:
            self.cluster.pause_master()
        return n


# ---------------------------------------------------------------------- processes killed
@pytest.mark.slow
@pytest.mark.parametrize("with_ssd", [True, False], ids=["ssd", "no_ssd"])
@pytest.mark.parametrize("victim", ["master", "memory"])
@pytest.mark.anyio
async def test_process_killed_mid_restore(
    fresh_mooncake_cluster: MooncakeCluster, tmp_path: Path, victim: str, with_ssd: bool
) -> None:
    """SIGKILL the master or the memory holder after 3 of the restore's remote reads.

    With the SSD holding the prefix: Committed in full, the rest served by the file tier.
    Without: Invalidated with 0 tokens (recompute). A later request is again all-or-nothing.
    """
    c = fresh_mooncake_cluster
    case = make_case(10, seed=1)
    kill = c.kill_master if victim == "master" else c.kill_memory

    mc = remote_tier(c)
    remote = KillAfterReads(mc, after=3, action=kill, read_latency_s=0.02)
    tiers: list[bsr.Tier] = [remote]
    if with_ssd:
        tiers.append(bsr.FileTier(tmp_path / "ssd", 1 << 28))
    async with opened(make_engine(case.layout, tiers, **DEADLINE), mc) as eng:
        saved = await eng.save(case.tokens, case.src, case.ids)
        assert saved.ok, saved.errors
        mc.timeout_s = TIER_TIMEOUT_S  # from now on a dead process costs this per call
        probe = await eng.lookup(case.tokens)
        assert probe.prefix_chunks == case.chunks
        dst = case.new_cache()
        r, elapsed = await timed_restore(eng, case, dst)
        assert remote.fired_at is not None and not c.alive(victim)  # killed mid-restore
        assert_all_or_nothing(r, eng, case, dst, elapsed)
        assert r.probed_tokens == case.chunks * case.layout.chunk_tokens
        if with_ssd:
            assert r.state is COMMITTED and r.reason is bsr.Reason.COMPLETE, r
            assert r.committed_tokens == r.probed_tokens
            assert set(r.bytes_by_tier) == {"mooncake", "file"}, r.bytes_by_tier
            assert r.bytes_by_tier["mooncake"] >= 3 * case.layout.group_chunk_bytes("swa")
            assert r.fallbacks >= 1
        else:
            assert r.state is INVALIDATED and r.reason is bsr.Reason.READ_FAILED, r
            assert r.committed_tokens == 0
            assert r.invalid_block_ids  # the chunks installed before the kill are withdrawn
            assert r.bytes_by_tier.get("mooncake", 0) > 0
        # the next request, with the process still dead: same ladder, all-or-nothing
        dst2 = case.new_cache()
        r2, elapsed2 = await timed_restore(eng, case, dst2)
        assert_all_or_nothing(r2, eng, case, dst2, elapsed2)
        if with_ssd:
            assert r2.state is COMMITTED and r2.committed_tokens == r.committed_tokens, r2
            assert r2.bytes_by_tier.get("file", 0) > 0
        else:
            assert_zero_reuse(r2)


@pytest.mark.parametrize("with_ssd", [True, False], ids=["ssd", "no_ssd"])
@pytest.mark.anyio
async def test_memory_killed_before_restore_probe_still_says_yes(
    fresh_mooncake_cluster: MooncakeCluster, tmp_path: Path, with_ssd: bool
) -> None:
    """The memory holder dies between save and restore: its objects are gone, but the master
    still reports them (until it drops the client, client_ttl=3 s), so the probe hits and every
    remote read fails. SSD: Committed in full from the file tier; no SSD: Invalidated, 0."""
    c = fresh_mooncake_cluster
    case = make_case(6, seed=2)

    remote = remote_tier(c)
    tiers: list[bsr.Tier] = [remote]
    if with_ssd:
        tiers.append(bsr.FileTier(tmp_path / "ssd", 1 << 28))
    async with opened(make_engine(case.layout, tiers, **DEADLINE), remote) as eng:
        saved = await eng.save(case.tokens, case.src, case.ids)
        assert saved.ok, saved.errors
        remote.timeout_s = TIER_TIMEOUT_S
        c.kill_memory()
        dst = case.new_cache()
        r, elapsed = await timed_restore(eng, case, dst)
        assert_all_or_nothing(r, eng, case, dst, elapsed)
        assert r.probed_tokens == case.chunks * case.layout.chunk_tokens, r  # stale "yes"
        if with_ssd:
            assert r.state is COMMITTED and r.committed_tokens == r.probed_tokens, r
            assert r.bytes_by_tier == {"file": case.prefix_bytes(case.chunks)}, r
            assert r.fallbacks == case.objects(case.chunks), r  # every object, once
        else:
            assert r.state is INVALIDATED and r.reason is bsr.Reason.READ_FAILED, r
            assert r.committed_tokens == 0 and r.bytes_by_tier == {}


@pytest.mark.parametrize("with_ssd", [True, False], ids=["ssd", "no_ssd"])
@pytest.mark.anyio
async def test_hung_master_mid_restore_ends_by_its_deadline(
    frozen_master_cluster: MooncakeCluster, tmp_path: Path, with_ssd: bool
) -> None:
    """SIGSTOP the master after 2 remote reads: later remote calls hang for the tier's whole
    timeout (5 s), longer than the restore's 1.5 s deadline, so even with the SSD below the
    restore cannot finish: it must end Invalidated (deadline) with 0 tokens by its deadline,
    not hang. Once the master runs again, the next restore commits in full."""
    c = frozen_master_cluster
    case = make_case(6, seed=7)
    deadline_s = 1.5

    mc = remote_tier(c)  # timeout 5 s > deadline
    tiers: list[bsr.Tier] = [PauseMasterAfterReads(mc, c, after=2)]
    if with_ssd:
        tiers.append(bsr.FileTier(tmp_path / "ssd", 1 << 28))
    async with opened(make_engine(case.layout, tiers, deadline_s=deadline_s, **ENGINE), mc) as eng:
        saved = await eng.save(case.tokens, case.src, case.ids)
        assert saved.ok, saved.errors
        dst = case.new_cache()
        try:
            r, elapsed = await timed_restore(eng, case, dst)
        finally:
            c.resume_master()
        assert_all_or_nothing(r, eng, case, dst, elapsed, deadline_s=deadline_s)
        assert r.state is INVALIDATED and r.reason is bsr.Reason.DEADLINE, r
        assert r.committed_tokens == 0 and r.bytes_by_tier.get("mooncake", 0) > 0, r
        assert r.invalid_block_ids, r
        dst2 = case.new_cache()
        r2, elapsed2 = await timed_restore(eng, case, dst2)
        assert_all_or_nothing(r2, eng, case, dst2, elapsed2, deadline_s=deadline_s)
        assert r2.state is COMMITTED and r2.committed_tokens == r2.probed_tokens > 0, r2


# ---------------------------------------------------------------------- store full
@pytest.mark.parametrize("with_ssd", [True, False], ids=["ssd", "no_ssd"])
@pytest.mark.parametrize("eviction", ["off", "on"])
@pytest.mark.anyio
async def test_store_full_commits_from_ssd_or_a_shorter_prefix(
    tmp_path: Path, eviction: str, with_ssd: bool
) -> None:
    """A 16 MiB store segment (Mooncake's minimum) for a 20 MiB prefix: some remote writes fail
    with no space (counted in SaveResult.errors); with eviction on, the master also drops
    objects, possibly chunk 0. The restore commits the whole prefix from SSD, or (no SSD) exactly
    the prefix the store still holds in full, never more, never part of a chunk."""
    require_mooncake()
    layout = bsr.StateLayout(chunk_tokens=32, groups=(bsr.StateGroup("kv", 2, 16384),))  # 1 MiB
    case = make_case(20, layout=layout, seed=3)
    flags = ["--eviction_ratio=0.0"] if eviction == "off" else []

    async def main(c: MooncakeCluster) -> None:
        remote = remote_tier(c)
        tiers: list[bsr.Tier] = [remote]
        if with_ssd:
            tiers.append(bsr.FileTier(tmp_path / "ssd", 1 << 28, fsync=False))
        async with opened(make_engine(case.layout, tiers, **DEADLINE), remote) as eng:
            saved = await eng.save(case.tokens, case.src, case.ids)
            assert saved.errors["mooncake"] > 0, saved  # the store ran out of space
            assert saved.objects_written["mooncake"] + saved.errors["mooncake"] == case.chunks
            if with_ssd:
                assert saved.errors["file"] == 0 and saved.objects_written["file"] == case.chunks
            held = await present_prefix(remote, eng, case)
            if eviction == "off":
                assert 0 < held < case.chunks, held  # the head fitted, the tail did not
            dst = case.new_cache()
            r, elapsed = await timed_restore(eng, case, dst)
            assert_all_or_nothing(r, eng, case, dst, elapsed)
            assert r.state is COMMITTED, r
            if with_ssd:
                assert r.committed_tokens == case.chunks * layout.chunk_tokens, r
                assert r.bytes_by_tier.get("file", 0) > 0, r.bytes_by_tier
            else:
                # a prefix the store holds in full (eviction may shorten it while we look)
                assert r.committed_tokens <= held * layout.chunk_tokens, (r, held)
                assert set(r.bytes_by_tier) <= {"mooncake"}
                if eviction == "off":
                    assert r.committed_tokens == held * layout.chunk_tokens, (r, held)

    with start_cluster(segment_bytes=16 << 20, client_ttl_s=3, master_flags=flags) as cluster:
        await main(cluster)


# ---------------------------------------------------------------------- absent everywhere
@pytest.mark.parametrize("how", ["never_saved", "deleted_from_both", "chunk3_deleted_from_both"])
@pytest.mark.anyio
async def test_absent_from_remote_and_ssd(
    mooncake_cluster: MooncakeCluster, tmp_path: Path, how: str
) -> None:
    """Nothing (or nothing from chunk 3 on) in either tier: the probe finds that prefix and the
    restore commits exactly it; an empty probe is Committed with 0 tokens (empty_prefix),
    i.e. the caller recomputes everything."""
    case = make_case(6, seed=4)

    remote = remote_tier(mooncake_cluster)
    ssd = bsr.FileTier(tmp_path / "ssd", 1 << 28)
    async with opened(make_engine(case.layout, [remote, ssd], **DEADLINE), remote) as eng:
        expect = 0
        if how != "never_saved":
            if how == "chunk3_deleted_from_both":
                # saved at 3 chunks too, so the sliding-window group's chunks 1-2 exist
                head = case.tokens[: 3 * case.layout.chunk_tokens]
                assert (await eng.save(head, case.src, case.ids)).ok
            saved = await eng.save(case.tokens, case.src, case.ids)
            assert saved.ok, saved.errors
            keys = eng.keys(case.tokens)
            first = 0 if how == "deleted_from_both" else 3
            expect = first
            for c in range(first, case.chunks):
                for g in case.layout.groups:
                    if c in case.layout.needed_chunks(g.name, case.chunks):
                        assert await remote.delete(keys[c], g.name)
                        assert await ssd.delete(keys[c], g.name)
        probe = await eng.lookup(case.tokens)
        assert probe.prefix_chunks == expect, probe
        dst = case.new_cache()
        r, elapsed = await timed_restore(eng, case, dst)
        assert_all_or_nothing(r, eng, case, dst, elapsed)
        assert r.state is COMMITTED, r
        assert r.committed_tokens == expect * case.layout.chunk_tokens
        if expect == 0:
            assert r.reason is bsr.Reason.EMPTY_PREFIX and r.bytes_by_tier == {}, r
            assert [t.trigger for t in r.trace] == ["probe_miss"]
        else:
            assert r.reason is bsr.Reason.COMPLETE
            assert r.bytes_by_tier == {"mooncake": case.prefix_bytes(expect)}, r


# ---------------------------------------------------------------------- remote read faults
@pytest.mark.parametrize("fault", ["read_error", "corrupt"])
@pytest.mark.anyio
async def test_remote_fault_falls_back_to_ssd(
    mooncake_cluster: MooncakeCluster, tmp_path: Path, fault: str
) -> None:
    """Chunks 1 and 4 (group kv) fail on the remote tier: an injected TierIOError
    (FaultyTier READ_ERROR) or a byte really flipped in the stored object (verification fails).
    Those objects come from the SSD, the rest from Mooncake; the failed remote objects are
    quarantined, so the next restore goes to the SSD for them at once. A verified-corrupt object
    is also deleted from the store; after an I/O error the engine only retires it (a possibly
    dead store is not asked to delete anything)."""
    case = make_case(6, seed=5)
    bad = frozenset({1, 4})
    kv = case.layout.group_chunk_bytes("kv")

    remote = remote_tier(mooncake_cluster)
    top: bsr.Tier = remote
    if fault == "read_error":
        plan = FaultPlan(seed=7, faults=(Fault(FaultKind.READ_ERROR, chunks=bad, group="kv"),))
        top = FaultyTier(remote, plan)
    ssd = bsr.FileTier(tmp_path / "ssd", 1 << 28)
    async with opened(make_engine(case.layout, [top, ssd], **DEADLINE), remote) as eng:
        saved = await eng.save(case.tokens, case.src, case.ids)
        assert saved.ok, saved.errors
        keys = eng.keys(case.tokens)
        if fault == "corrupt":
            for ch in bad:
                assert corrupt_stored(remote, keys[ch], "kv")
        total = case.prefix_bytes(case.chunks)
        for attempt in range(2):
            dst = case.new_cache()
            r, elapsed = await timed_restore(eng, case, dst)
            assert_all_or_nothing(r, eng, case, dst, elapsed)
            assert r.state is COMMITTED and r.reason is bsr.Reason.COMPLETE, r
            assert r.committed_tokens == case.chunks * case.layout.chunk_tokens
            assert r.bytes_by_tier == {"mooncake": total - 2 * kv, "file": 2 * kv}, r
            if attempt == 0:
                assert (r.fallbacks, r.quarantined) == (2, 2), r
            else:  # quarantined: the probe no longer offers the remote copies
                assert (r.fallbacks, r.quarantined) == (0, 0), r
        left = await remote.contains_many([ObjectKey(keys[ch], "kv") for ch in sorted(bad)])
        assert left == ([True, True] if fault == "read_error" else [False, False])


# ---------------------------------------------------------------------- one rank's fault
def run_ranks(
    cluster: MooncakeCluster, tmp_path: Path, fault: str, ssd_ranks: str
) -> list[dict[str, Any]]:
    rendezvous = tmp_path / "rendezvous"  # the ranks meet through a file: no port to race for
    env = cluster.subprocess_env()
    env.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    prefix = bsr.MooncakeTier.unique_prefix("bsr-dist/")
    procs: list[tuple[Path, subprocess.Popen[str]]] = []
    for rank in range(2):
        out = tmp_path / f"out{rank}.json"
        argv = [
            sys.executable,
            str(WORKER),
            str(rank),
            "2",
            str(rendezvous),
            str(tmp_path),
            cluster.client_address,
            prefix,
            fault,
            ssd_ranks,
            str(out),
        ]
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append((out, popen))
    results: list[dict[str, Any]] = []
    try:
        for out, p in procs:
            log, _ = p.communicate(timeout=120)
            assert p.returncode == 0, log[-5000:]
            results.append(json.loads(out.read_text()))
    finally:
        for _, p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("fault", "ssd_ranks"),
    [("read_error", "-"), ("read_error", "1"), ("corrupt", "-"), ("corrupt", "1")],
    ids=["read_error-no_ssd", "read_error-ssd_on_rank1", "corrupt-no_ssd", "corrupt-ssd_on_rank1"],
)
def test_one_rank_remote_fault(
    mooncake_cluster: MooncakeCluster, tmp_path: Path, fault: str, ssd_ranks: str
) -> None:
    """Two torch.distributed ranks (gloo on loopback), each with its own MooncakeTier key prefix
    and namespace tp_rank; only rank 1's remote read of chunk 2 fails. No SSD: both ranks
    Invalidated with 0 tokens. An SSD under rank 1's remote tier: both Committed, same prefix."""
    a, b = run_ranks(mooncake_cluster, tmp_path, fault, ssd_ranks)
    full = 6 * 16
    for r in (a, b):
        assert not any(r["save_errors"].values()), r
        assert r["probe_tokens"] == full and r["probed_tokens"] == full, r
        assert r["in_use"] == 0, r
        assert r["elapsed_s"] < 30.0 + MARGIN_S, r
    if ssd_ranks == "-":
        for r in (a, b):
            assert r["state"] == "Invalidated" and r["committed_tokens"] == 0, r
            assert r["invalid_blocks"], r
        assert a["reason"] == "rank_failed", a  # rank 0 installed everything, did not commit
        assert b["reason"] == ("read_failed" if fault == "read_error" else "corrupt"), b
    else:
        for r in (a, b):
            assert r["state"] == "Committed" and r["reason"] == "complete", r
            assert r["committed_tokens"] == full and r["exact"] is True, r
            assert r["invalid_blocks"] == [], r
            assert sum(r["bytes_by_tier"].values()) == sum(r["expected_bytes"].values()), r
        assert set(a["bytes_by_tier"]) == {"mooncake"} and a["fallbacks"] == 0, a
        assert b["bytes_by_tier"]["file"] == b["kv_chunk_bytes"], b  # chunk 2's kv object
        assert b["fallbacks"] == 1 and b["bytes_by_tier"]["mooncake"] > 0, b


# ---------------------------------------------------------------------- deadline vs quarantine
@pytest.mark.anyio
async def test_deadline_holds_when_quarantine_hits_a_hung_master(
    frozen_master_cluster: MooncakeCluster,
) -> None:
    """Deadline 0.5 s, tier timeout 3 s: chunk 0 reads fine, then the master hangs and chunk 1's
    remote read fails (TierIOError, as a killed master's RPC_FAIL does). The restore must still
    end (0 tokens) within deadline + margin. (This once failed: the engine asked the hung store
    to delete the object, shielded from the deadline, and returned ~3 s late. Now an I/O error
    only retires the object in the engine, and any tier-side quarantine is bounded by the
    request's deadline.)"""
    c = frozen_master_cluster
    case = make_case(4, seed=6)
    deadline_s = 0.5

    plan = FaultPlan(faults=(Fault(FaultKind.READ_ERROR, chunks=frozenset({1}), group="kv"),))
    mc = remote_tier(c, timeout_s=3.0)
    inner = PauseMasterAfterReads(mc, c, after=1)
    eng = make_engine(
        case.layout, [FaultyTier(inner, plan)], io_depth=1, deadline_s=deadline_s, **ENGINE
    )
    async with opened(eng, mc):
        saved = await eng.save(case.tokens, case.src, case.ids)
        assert saved.ok, saved.errors
        dst = case.new_cache()
        try:
            r, elapsed = await timed_restore(eng, case, dst)
        finally:
            c.resume_master()
        assert r.committed_tokens == 0 and eng.staging.statistics().in_use == 0, r
        assert elapsed < deadline_s + MARGIN_S, (elapsed, r.reason, r.timings)
