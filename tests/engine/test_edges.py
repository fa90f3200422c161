"""Engine edges (issue 19): leases reclaimed by their TTL, probes bound to their engine, the
deadline agreed by every rank, admission inside the deadline, a caller's cancel not held by
bsr's own cleanup."""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.core._keys import OFFLOAD_TOKENS as OFFLOAD
from bsr.core._keys import ObjectKey
from bsr.testing import LatencyTier
from support.engines import make_engine
from support.helpers import filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))


# ------------------------------------------------------------------ item 9: admission
class SlowTable:
    """A block table whose conversion takes ``delay_s`` (at least: a sleep never ends early)."""

    def __init__(self, ids: list[int], delay_s: float) -> None:
        self.ids = ids
        self.delay_s = delay_s
        self.converted = 0

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        self.converted += 1
        time.sleep(self.delay_s)
        return np.asarray(self.ids, dtype=dtype)


@pytest.mark.anyio
async def test_admission_counts_against_the_deadline() -> None:
    """The deadline runs from the call: an admission that alone outlasts it ends the restore
    Invalidated(deadline) with nothing read, installed or committed."""
    toks = tokens_for(4 * 16)
    src = filled_cache(LAYOUT, 8, 16)

    async with make_engine(LAYOUT, [bsr.HostTier(1 << 22)]) as eng:
        await eng.save(toks, src, torch.arange(4))
        before = eng.statistics()
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        table = SlowTable(list(range(4)), delay_s=1.0)
        r = await eng.restore(toks, dst, table, deadline_s=0.5)
        assert table.converted == 1
        assert r.state is bsr.RequestState.INVALIDATED and r.reason is bsr.Reason.DEADLINE, r
        assert r.committed_tokens == 0 and r.bytes_by_tier == {}
        assert r.timings.total_s >= 1.0  # the admission is part of the request's time
        assert not dst.tensor("kv").any()
        after = eng.statistics()
        assert after.staging.acquired == before.staging.acquired  # no slot taken
        # the same admission with room in the deadline commits
        r = await eng.restore(toks, dst, SlowTable(list(range(4)), 0.2), deadline_s=30)
        assert r.committed and r.committed_tokens == 4 * 16


# ------------------------------------------------------------------ item 5: leases
class LeaseRecordingTier(bsr.TierWrapper[bsr.Tier]):
    """Counts the leases it hands out and the ones given back (a tier that cannot expire
    leases on its own relies on those calls)."""

    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.taken = 0
        self.released = 0

    async def lease(self, objects: Any, ttl_s: float) -> bsr.TierLease:
        inner = await self.inner.lease(objects, ttl_s)
        self.taken += 1
        tier = self

        class Recorded(bsr.TierLease):
            __slots__ = ("done",)

            def __init__(self) -> None:
                super().__init__(inner.objects, inner.expires_at)
                self.done = False

            def release(self) -> None:
                if not self.done:
                    self.done = True
                    tier.released += 1
                    inner.release()

        return Recorded()


@pytest.mark.anyio
async def test_expired_leases_are_reclaimed_without_any_call_to_release() -> None:
    """5,000 lookups leasing for 0.2 s, never released: once the TTL passed, the engine holds
    none of them, every tier lease was given back, and the memory they took is free again
    (before the fix all of them stayed: about 0.8 KiB each)."""
    import gc
    import tracemalloc

    n = 5_000
    toks = tokens_for(2 * 16)
    src = filled_cache(LAYOUT, 4, 16)

    tier = LeaseRecordingTier(bsr.HostTier(1 << 22))
    async with make_engine(LAYOUT, [tier]) as eng:
        await eng.save(toks, src, torch.arange(2))
        await eng.lookup(toks, lease_ttl_s=0.2)  # warm every code path before measuring
        await anyio.sleep(0.3)
        eng.statistics()
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(n):
                probe = await eng.lookup(toks, lease_ttl_s=0.2)
                assert probe.prefix_chunks == 2
            del probe
            await anyio.sleep(0.3)  # every lease is now past its TTL
            assert eng.statistics().leases == 0
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert tier.taken == n + 1 and tier.released == n + 1
        assert grown < 256 << 10, f"{grown} bytes still held after the leases expired"


@pytest.mark.anyio
async def test_a_probe_of_another_engine_is_refused_before_anything_moves(tmp_path: Any) -> None:
    """Same namespace, same tokens, another engine: a typed error, no slot taken, no restore
    counted, and the other engine's lease is left alone."""
    toks = tokens_for(4 * 16)
    src = filled_cache(LAYOUT, 8, 16)
    ids = torch.arange(4)

    a = make_engine(LAYOUT, [bsr.HostTier(1 << 22, name="a-host")])
    b = make_engine(LAYOUT, [bsr.FileTier(tmp_path, 1 << 24, name="b-file")])
    async with a, b:
        await a.save(toks, src, ids)
        await b.save(toks, src, ids)
        probe = await a.lookup(toks, lease_ttl_s=60)
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        before = b.statistics()
        with pytest.raises(bsr.ConfigError, match="another RestoreEngine"):
            await b.restore(toks, dst, ids, probe=probe)
        st = b.statistics()
        assert st.restores == before.restores == 0
        assert st.staging.acquired == before.staging.acquired
        assert not dst.tensor("kv").any()
        assert a.statistics().leases == 1  # still a's to use
        r = await a.restore(toks, dst, ids, probe=probe)
        assert r.committed and r.committed_tokens == 4 * 16
        assert a.statistics().leases == 0


# ------------------------------------------------------------------ item 8: the deadline, agreed
def _two_ranks(root: Any, **kw: Any) -> tuple[list[bsr.RestoreEngine], list[LatencyTier]]:
    """Two ranks of one InProcessGroup, each over its own FileTier behind a LatencyTier
    (``kw``: the engines' options)."""
    group = bsr.InProcessGroup(2, timeout_s=30)
    tiers = [
        LatencyTier(bsr.FileTier(root / f"rank{r}", 1 << 26), read_latency_s=0) for r in range(2)
    ]
    engines = []
    for r in range(2):
        ns = bsr.Namespace("m", tp_rank=r, tp_size=2)
        engines.append(
            make_engine(LAYOUT, [tiers[r]], namespace=ns, coordinator=group.coordinator(r), **kw)
        )
    return engines, tiers


@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("with_probe", [False, True])
@pytest.mark.parametrize("slow", [0, 1])
@pytest.mark.anyio
async def test_one_ranks_probe_deadline_ends_every_rank_invalidated(
    tmp_path: Any, slow: int, with_probe: bool, share: float
) -> None:
    """Only one rank runs out of time while probing; the other has no deadline at all. Every
    rank ends Invalidated with nothing read or committed: the late one for `deadline`, the
    other for `rank_failed`.

    Without a probe, the late rank's tier answers probes after 5 s (deadline 0.3 s). With each
    rank's own lookup probe, the late rank's admission alone outlasts its deadline, so the key
    derivation (offloaded: the prompt is long) is cancelled at once.

    With ``probe_share=0.5`` (the default) and no probe, the late rank's tier is cut off at
    half its deadline instead: it holds nothing there, the ranks agree on an empty prefix, and
    both end `empty_prefix`, the late one saying which tier did not answer."""
    n_tokens = 6 * 16 if not with_probe else OFFLOAD + 16
    toks = tokens_for(n_tokens)
    blocks = n_tokens // 16
    out: list[bsr.RestoreResult | None] = [None, None]

    async def main() -> None:
        engines, tiers = _two_ranks(tmp_path, probe_share=share)
        async with engines[0], engines[1]:
            async with anyio.create_task_group() as tg:
                for r in range(2):
                    src = filled_cache(LAYOUT, 8, 16, seed=r)
                    tg.start_soon(engines[r].save, toks[: 6 * 16], src, torch.arange(6))
            if not with_probe:
                tiers[slow].probe_latency_s = 5.0
            probes: list[bsr.Probe | None] = [None, None]

            async def look(r: int) -> None:
                probes[r] = await engines[r].lookup(toks)

            if with_probe:
                async with anyio.create_task_group() as tg:
                    for r in range(2):
                        tg.start_soon(look, r)
                assert all(p is not None and p.prefix_chunks == 6 for p in probes)

            async def one(r: int) -> None:
                ids: Any = list(range(blocks))
                deadline = None
                if r == slow:
                    deadline = 0.3 if not with_probe else 0.01
                    if with_probe:
                        ids = SlowTable(ids, delay_s=0.05)
                out[r] = await engines[r].restore(
                    toks, bsr.PagedKVCache(LAYOUT, blocks, 16), ids, probe=probes[r],
                    deadline_s=deadline,
                )  # fmt: skip

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for r in range(2):
                        tg.start_soon(one, r)
            for e in engines:
                assert e.statistics().staging.in_use == 0

    await main()
    results = [r for r in out if r is not None]
    assert [r.committed_tokens for r in results] == [0, 0]
    assert all(r.bytes_by_tier == {} for r in results)  # nothing was read
    if share < 1 and not with_probe:  # cut off, not late: a miss agreed by both ranks
        assert [(r.state, r.reason) for r in results] == [
            (bsr.RequestState.COMMITTED, bsr.Reason.EMPTY_PREFIX)
        ] * 2, results
        assert results[slow].unanswered == ("file",)  # the late rank's own tier
        assert results[1 - slow].unanswered == ()
        return
    assert [r.state for r in results] == [bsr.RequestState.INVALIDATED] * 2, results
    assert results[slow].reason is bsr.Reason.DEADLINE
    assert results[1 - slow].reason is bsr.Reason.RANK_FAILED


# ------------------------------------------------------------------ item 10: a caller's cancel
class HangingQuarantineTier(bsr.TierWrapper[bsr.Tier]):
    """Reads of ``bad`` objects fail verification; ``quarantine`` hangs while ``hang`` is set."""

    blocking_reads = False

    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.bad: set[str] = set()
        self.hang = True
        self.entered = anyio.Event()
        self.moved: list[str] = []

    async def fetch_into(self, key: Any, group: str, dst: Any) -> bsr.Fetched:
        if ObjectKey(key, group).object_id in self.bad:
            raise bsr.CorruptObjectError("checksum mismatch (test)", tier=self.name)
        return await self.inner.fetch_into(key, group, dst)

    async def quarantine(self, key: Any, group: str, reason: str) -> None:
        self.entered.set()
        if self.hang:
            await anyio.sleep_forever()
        self.moved.append(ObjectKey(key, group).object_id)
        await self.inner.quarantine(key, group, reason)


@pytest.mark.parametrize("how", ["cancel", "caller_deadline"])
@pytest.mark.anyio
async def test_a_callers_cancel_does_not_wait_for_the_tiers_quarantine(
    tmp_path: Any, how: str
) -> None:
    """No deadline_s; the tier's quarantine call hangs; shield_timeout_s is 60 s. The caller
    cancels (its task group, once the quarantine call started) or its own move_on_after runs
    out: the restore ends at once, not after the shield bound. The object stays quarantined in
    the engine (a later probe misses it) and the tier's move is retried at close."""
    toks = tokens_for(4 * 16)
    src = filled_cache(LAYOUT, 8, 16)
    ids = torch.arange(4)

    tier = HangingQuarantineTier(bsr.HostTier(1 << 22))
    eng = make_engine(LAYOUT, [tier], shield_timeout_s=60.0)
    async with eng:
        await eng.save(toks, src, ids)
        bad = eng.objects(await eng.lookup(toks))[1][1].object_id
        tier.bad = {bad}
        t0 = time.perf_counter()
        with anyio.fail_after(30):  # the old code waited the whole 60 s shield
            if how == "cancel":
                async with anyio.create_task_group() as tg:

                    async def canceller() -> None:
                        await tier.entered.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(canceller)
                    await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), ids)
                    pytest.fail("the restore was not cancelled")
            else:
                with anyio.move_on_after(0.5):
                    await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), ids)
        elapsed = time.perf_counter() - t0
        assert tier.entered.is_set()
        assert elapsed < 15, elapsed  # far below the 60 s shield, whatever the load
        st = eng.statistics()
        assert st.staging.in_use == 0 and st.quarantined == 1
        assert (await eng.lookup(toks)).prefix_chunks == 1  # chunk 1 is out of use
        tier.hang = False
    assert tier.moved == [bad]  # the move owed was made when the engine closed
