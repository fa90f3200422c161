"""Engine edges (issue 10 items 2, 3, 7, 11): bounded shielded calls, typed option errors, keys
under the deadline and off the event loop; probe reuse and leases (issue 11 item 3)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import bsr
from bsr.core._keys import ChunkKey, ObjectKey
from support.engines import make_engine
from support.helpers import blocks_equal, filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))


class HangingTier(bsr.TierWrapper[bsr.Tier]):
    """Reads of ``bad`` objects fail verification; quarantine and close never return."""

    blocking_reads = False

    def __init__(self, inner: bsr.Tier, *, hang_close: bool = False) -> None:
        super().__init__(inner)
        self.bad: set[str] = set()
        self.hang_close = hang_close
        self.quarantine_calls = 0

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> bsr.Fetched:
        if ObjectKey(key, group).object_id in self.bad:
            raise bsr.CorruptObjectError("checksum mismatch (test)", tier=self.name)
        return await self.inner.fetch_into(key, group, dst)

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        self.quarantine_calls += 1
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        if self.hang_close:
            await anyio.sleep_forever()
        await super().aclose()


@pytest.mark.anyio
async def test_hanging_tier_quarantine_is_bounded_without_a_deadline(tmp_path: Path) -> None:
    """Item 2: no deadline_s, the tier's quarantine hangs: the restore still ends, bounded."""
    toks = tokens_for(4 * 16)
    src = filled_cache(LAYOUT, 8, 16)
    ids = torch.arange(4)

    tier = HangingTier(bsr.HostTier(1 << 22))
    eng = make_engine(LAYOUT, [tier, bsr.FileTier(tmp_path, 1 << 24)], shield_timeout_s=0.3)
    async with eng:
        await eng.save(toks, src, ids)
        tier.bad = {o.object_id for _, o in eng.objects(await eng.lookup(toks))[:1]}
        t0 = time.perf_counter()
        with anyio.fail_after(5):
            r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), ids)
        assert time.perf_counter() - t0 < 3
        assert tier.quarantine_calls == 1
        assert r.committed and r.fallbacks == 1 and r.quarantined == 1
        # outside cancellation still ends the request while the tier hangs
        tier.bad = {o.object_id for _, o in eng.objects(await eng.lookup(toks))[1:2]}
        with anyio.move_on_after(0.1) as scope:
            await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), ids)
        assert eng.statistics().staging.in_use == 0
        del scope


@pytest.mark.anyio
async def test_hanging_tier_close_is_bounded(tmp_path: Path) -> None:
    eng = make_engine(LAYOUT, [HangingTier(bsr.HostTier(1 << 20), hang_close=True)],
                      shield_timeout_s=0.2)  # fmt: skip
    await eng.open()
    with anyio.fail_after(3):
        await eng.aclose()
    with pytest.raises(bsr.ClosedError):
        eng.statistics()


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("deadline_s", True, "deadline_s must be an int or float"),
        ("deadline_s", "1", "deadline_s must be an int or float"),
        ("deadline_s", math.nan, "deadline_s must be a finite number"),
        ("deadline_s", math.inf, "deadline_s must be a finite number"),
        ("deadline_s", 0, "deadline_s must be > 0"),
        ("breaker_cooldown_s", math.nan, "breaker_cooldown_s must be a finite number"),
        ("breaker_cooldown_s", -1.0, "breaker_cooldown_s must be >= 0"),
        ("breaker_threshold", True, "breaker_threshold must be a positive int"),
        ("breaker_threshold", 0, "breaker_threshold must be a positive int"),
        ("shield_timeout_s", math.inf, "shield_timeout_s must be a finite number"),
        ("shield_timeout_s", 0, "shield_timeout_s must be > 0"),
        ("pin_staging", 1, "pin_staging must be True or False"),
        ("staging_budget_bytes", 100, "lower window"),
        ("staging_budget_bytes", "lots", "staging_budget_bytes must be a byte count"),
    ],
)
def test_engine_options_are_checked(option: str, value: Any, fragment: str) -> None:
    """Items 3 and 7: bools, strings, NaN and inf are refused with a message naming the option."""
    with pytest.raises(bsr.ConfigError) as info:
        make_engine(LAYOUT, [bsr.HostTier(1 << 20)], **{option: value})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(True, "int or float"), ("1", "int or float"), (math.nan, "finite"), (-2, "> 0")],
)
@pytest.mark.anyio
async def test_restore_deadline_is_checked_before_anything_moves(value: Any, fragment: str) -> None:
    toks = tokens_for(2 * 16)

    async with make_engine(LAYOUT, [bsr.HostTier(1 << 22)]) as eng:
        await eng.save(toks, filled_cache(LAYOUT, 4, 16), torch.arange(2))
        before = eng.statistics()
        with pytest.raises(bsr.ConfigError, match=fragment):
            await eng.restore(
                toks, bsr.PagedKVCache(LAYOUT, 4, 16), torch.arange(2), deadline_s=value
            )
        with pytest.raises(bsr.ConfigError, match=fragment):
            await eng.lookup(toks, lease_ttl_s=value)
        after = eng.statistics()
        assert (
            after.restores == before.restores and after.staging.acquired == before.staging.acquired
        )


@pytest.mark.anyio
async def test_key_derivation_is_under_the_deadline_and_off_the_loop() -> None:
    """Item 11: a 1M-token prompt with a tiny deadline ends Invalidated(deadline) promptly and
    never holds the event loop for long (a ticker task keeps running)."""
    toks = list(range(1 << 20))
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await anyio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tiny = bsr.StateLayout(chunk_tokens=1024, groups=(bsr.StateGroup("kv", 1, 4),))

    async def main() -> None:
        async with make_engine(tiny, [bsr.HostTier(1 << 22)]) as eng:
            cache = bsr.PagedKVCache(tiny, 1024, 1024)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await anyio.sleep(0.01)
                r = await eng.restore(toks, cache, torch.arange(1024), deadline_s=0.001)
                tg.cancel_scope.cancel()
            assert not r.committed and r.reason is bsr.Reason.DEADLINE

    await main()
    # generous: the conversion runs in a worker thread, so the loop only pauses for the hop
    assert max(gaps) < 0.15, max(gaps)


# ------------------------------------------------------------------ probe reuse and leases
class CountingTier(bsr.TierWrapper[bsr.Tier]):
    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.probes = 0

    async def contains_many(self, objects: Any) -> list[bool]:
        self.probes += 1
        return await self.inner.contains_many(objects)


@pytest.mark.anyio
async def test_restore_reuses_the_lookup_probe(tmp_path: Path) -> None:
    toks = tokens_for(5 * 16)
    src = filled_cache(LAYOUT, 10, 16)
    ids = torch.arange(5)

    tier = CountingTier(bsr.FileTier(tmp_path, 1 << 24))
    async with make_engine(LAYOUT, [tier]) as eng:
        await eng.save(toks, src, ids)
        probe = await eng.lookup(toks)
        n = tier.probes
        dst = bsr.PagedKVCache(LAYOUT, 10, 16)
        r = await eng.restore(toks, dst, ids, probe=probe)
        assert tier.probes == n  # no second probe
        assert r.committed and r.committed_tokens == 5 * 16
        assert blocks_equal(LAYOUT, src, ids, dst, ids, 5)
        # a probe for other tokens is refused before anything moves
        other = await eng.lookup(tokens_for(5 * 16, seed=9))
        with pytest.raises(bsr.ConfigError, match="other tokens"):
            await eng.restore(toks, dst, ids, probe=other)
        assert eng.statistics().staging.in_use == 0


@pytest.mark.anyio
async def test_a_lease_keeps_the_hit_until_the_restore(tmp_path: Path) -> None:
    """Probe-then-restore is not lost to eviction in between; the lease ends with the restore."""
    toks = tokens_for(4 * 16)
    src = filled_cache(LAYOUT, 8, 16)
    ids = torch.arange(4)
    obj = LAYOUT.chunk_bytes + 4096  # payload + header

    host = bsr.HostTier(5 * obj)  # room for 5 objects
    async with make_engine(LAYOUT, [host]) as eng:
        await eng.save(toks, src, ids)
        probe = await eng.lookup(toks, lease_ttl_s=30)
        assert eng.statistics().leases == 1
        # another conversation's save needs room: the leased objects must not be evicted
        with pytest.raises(bsr.TierFullError):
            await host.write(bsr.ChunkKey(bytes(32), 0, b"x" * 16), "kv", bytes(obj * 2))
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), ids, probe=probe)
        assert r.committed and r.committed_tokens == 4 * 16
        assert eng.statistics().leases == 0  # released by the restore
        # without the lease the same save now evicts
        await eng.save(tokens_for(4 * 16, seed=5), src, ids)
        assert (await eng.lookup(toks)).prefix_chunks < 4


@pytest.mark.anyio
async def test_a_lease_expires_with_its_ttl() -> None:
    toks = tokens_for(2 * 16)
    src = filled_cache(LAYOUT, 4, 16)
    obj = LAYOUT.chunk_bytes + 4096

    host = bsr.HostTier(2 * obj)
    async with make_engine(LAYOUT, [host]) as eng:
        await eng.save(toks, src, torch.arange(2))
        probe = await eng.lookup(toks, lease_ttl_s=0.05)
        await anyio.sleep(0.1)
        await eng.save(tokens_for(2 * 16, seed=3), src, torch.arange(2))  # evicts: expired
        assert (await eng.lookup(toks)).prefix_chunks == 0
        probe.release()  # idempotent after expiry
        assert eng.statistics().leases == 0


@pytest.mark.parametrize("how", ["fifo", "symlink-to-fifo"])
@pytest.mark.anyio
async def test_an_object_path_that_blocks_on_open_cannot_hold_a_restore(
    tmp_path: Path, how: str
) -> None:
    """Item 1: an object file replaced by a FIFO (directly or through a symlink) after the tier
    opened: the restore ends within its deadline, and inside move_on_after, and falls back."""
    import os

    toks = tokens_for(3 * 16)
    src = filled_cache(LAYOUT, 6, 16)
    ids = torch.arange(3)

    file_tier = bsr.FileTier(tmp_path / "l2", 1 << 24, reader="posix")
    lower = bsr.FileTier(tmp_path / "l3", 1 << 24, name="l3")
    async with make_engine(LAYOUT, [file_tier, lower], deadline_s=1.0) as eng:
        await eng.save(toks, src, ids)
        probe = await eng.lookup(toks)
        path = file_tier.object_path(probe.keys[1], "kv")
        path.unlink()
        if how == "fifo":
            os.mkfifo(path)
        else:
            fifo = tmp_path / "elsewhere.fifo"
            os.mkfifo(fifo)
            path.symlink_to(fifo)
        t0 = time.perf_counter()
        dst = bsr.PagedKVCache(LAYOUT, 6, 16)
        r = await eng.restore(toks, dst, ids)
        assert time.perf_counter() - t0 < 1.5
        # the lower tier supplied the chunk the FIFO stood in for
        assert r.committed and r.fallbacks >= 1
        assert blocks_equal(LAYOUT, src, ids, dst, ids, 3)
        with anyio.move_on_after(1.0):
            await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 6, 16), ids, deadline_s=30)
        assert time.perf_counter() - t0 < 3.0
        assert eng.statistics().staging.in_use == 0


# ------------------------------------------------------------------ on_installed
@pytest.mark.parametrize("policy", ["all_or_nothing", "truncate"])
@pytest.mark.anyio
async def test_on_installed_sees_each_chunk_in_the_cache_before_the_commit(
    tmp_path: Path, policy: str
) -> None:
    """The hook is told about every chunk once, when its bytes are already in the cache; a
    hook that fails on a chunk keeps that chunk from being committed."""
    n = 6
    toks = tokens_for(n * 16)
    src = filled_cache(LAYOUT, 2 * n, 16)
    ids = torch.arange(n)

    async with make_engine(LAYOUT, [bsr.FileTier(tmp_path, 1 << 24)], window=3) as eng:
        await eng.save(toks, src, ids)
        dst = bsr.PagedKVCache(LAYOUT, 2 * n, 16)
        seen: list[int] = []

        async def hook(chunk: int, groups: tuple[str, ...]) -> None:
            assert groups == ("kv",)
            # the chunk's bytes are there already
            assert blocks_equal(LAYOUT, src, ids[chunk:], dst, ids[chunk:], 1)
            seen.append(chunk)
            await anyio.lowlevel.checkpoint()

        r = await eng.restore(toks, dst, ids, on_installed=hook, policy=policy)
        assert r.committed and sorted(seen) == list(range(n))
        for bad in (0, 3, n - 1):  # the first, a middle and the last chunk to land
            for is_async in (False, True):

                async def afail(chunk: int, groups: tuple[str, ...], bad: int = bad) -> None:
                    await anyio.sleep(0.001)
                    if chunk == bad:
                        raise RuntimeError("projection failed")

                def sfail(chunk: int, groups: tuple[str, ...], bad: int = bad) -> None:
                    if chunk == bad:
                        raise RuntimeError("projection failed")

                r = await eng.restore(
                    toks, bsr.PagedKVCache(LAYOUT, 2 * n, 16), ids,
                    on_installed=afail if is_async else sfail, policy=policy,
                )  # fmt: skip
                if policy == "all_or_nothing":
                    assert not r.committed and r.reason is bsr.Reason.INSTALL_FAILED, r
                else:
                    assert r.committed_tokens == bad * 16, (bad, is_async, r)
                assert any("projection failed" in e for e in r.errors)
        assert eng.statistics().staging.in_use == 0
