"""lookup(deadline_s=..., local=...): a hung tier is cut off, counted against its breaker, and the
probe answers from the tiers that answered; a local lookup runs no collective.

Found through the vLLM connector: a lookup cut off by its timeout did not count against the hung
tier's breaker, so every later lookup waited on the same tier again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest
import torch

import bsr
from support.engines import HangingContains, make_engine
from support.helpers import filled_cache, tokens_for

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 128),))
CHUNKS = 4


def engine(tiers: list[bsr.Tier], **kw: object) -> bsr.RestoreEngine:
    return make_engine(LAYOUT, tiers, window=2, io_depth=1, model_id="m", **kw)


@contextlib.asynccontextmanager
async def over_a_hung_tier(
    tmp_path: Path, **kw: object
) -> AsyncIterator[tuple[bsr.RestoreEngine, bsr.HostTier, HangingContains, bsr.PagedKVCache]]:
    """An engine (``kw``: its options) over a HostTier and, below it, a FileTier whose metadata
    queries hang: the prefix of ``tokens_for(CHUNKS * 16)`` saved in both, then the hang on.
    Yields the engine, the two tiers and the saved cache."""
    src = filled_cache(LAYOUT, 8, 16)
    host = bsr.HostTier(1 << 24)
    slow = HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    async with engine([host, slow], **kw) as eng:
        await eng.save(tokens_for(CHUNKS * 16), src, list(range(CHUNKS)))
        slow.hang = True
        yield eng, host, slow, src


@pytest.mark.anyio
async def test_a_cut_off_lookup_counts_against_the_hung_tier_only(tmp_path: Path) -> None:
    toks = tokens_for(CHUNKS * 16)
    hung = over_a_hung_tier(tmp_path, breaker_threshold=2, breaker_cooldown_s=600)
    async with hung as (eng, host, slow, _):
        for i in (1, 2):
            with anyio.fail_after(30):  # a hang fails the test instead of holding it
                probe = await eng.lookup(toks, deadline_s=0.2)
            # what the host holds is still found; the hung tier holds nothing
            assert probe.prefix_chunks == CHUNKS
            assert all(h["kv"] == ("host",) for h in probe.holders)
            assert probe.unanswered == (slow.name,)  # said, so a server can count it
            assert eng.health.state(slow.name).consecutive_failures == i
            assert eng.health.state(host.name).consecutive_failures == 0
        assert eng.health.state(slow.name).open  # threshold 2: tripped
        calls = slow.calls
        probe = await eng.lookup(toks, deadline_s=0.2)
        assert slow.calls == calls  # an open breaker: the hung tier is not asked again
        assert probe.prefix_chunks == CHUNKS
        assert probe.unanswered == (slow.name,)  # and still did not answer


@pytest.mark.anyio
async def test_a_cut_off_lookup_of_the_only_tier_is_a_miss(tmp_path: Path) -> None:
    toks = tokens_for(CHUNKS * 16)
    src = filled_cache(LAYOUT, 8, 16)

    slow = HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    async with engine([slow]) as eng:
        await eng.save(toks, src, list(range(CHUNKS)))
        slow.hang = True
        with anyio.fail_after(30):
            probe = await eng.lookup(toks, deadline_s=0.2, lease_ttl_s=5)
        assert probe.prefix_chunks == 0 and probe.lease is None
        assert probe.unanswered == (slow.name,)
        assert eng.health.state(slow.name).consecutive_failures == 1
        assert eng.statistics().leases == 0


class FailingContains(bsr.TierWrapper[bsr.Tier]):
    """A tier whose metadata queries fail while ``fail`` is set (a pool refusing connections)."""

    fail = True

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        if self.fail:
            raise bsr.TierIOError("connection refused", tier=self.name)
        return await self.inner.contains_many(objects)


@pytest.mark.anyio
async def test_unanswered_names_failed_tiers_and_only_them(tmp_path: Path) -> None:
    toks = tokens_for(CHUNKS * 16)
    src = filled_cache(LAYOUT, 8, 16)

    host = bsr.HostTier(1 << 24)
    down = FailingContains(bsr.FileTier(tmp_path / "down", 1 << 26, name="down"))
    ok = bsr.FileTier(tmp_path / "ok", 1 << 26)
    async with engine([host, down, ok]) as eng:
        await eng.save(toks, src, list(range(CHUNKS)), tiers=[host.name, ok.name])
        probe = await eng.lookup(toks)
        assert probe.prefix_chunks == CHUNKS and probe.unanswered == (down.name,)
        assert all(h["kv"] == (host.name, ok.name) for h in probe.holders)
        down.fail = False  # control: every tier answers
        probe = await eng.lookup(toks)
        assert probe.prefix_chunks == CHUNKS and probe.unanswered == ()


@pytest.mark.anyio
async def test_a_restore_whose_probe_is_cut_off_counts_the_tier_too(tmp_path: Path) -> None:
    toks = tokens_for(CHUNKS * 16)
    src = filled_cache(LAYOUT, 8, 16)

    slow = HangingContains(bsr.FileTier(tmp_path, 1 << 26))
    async with engine([slow]) as eng:
        await eng.save(toks, src, list(range(CHUNKS)))
        slow.hang = True
        dst = bsr.PagedKVCache(LAYOUT, 8, 16)
        with anyio.fail_after(30):
            r = await eng.restore(toks, dst, list(range(CHUNKS)), deadline_s=0.2)
        # cut off at half the deadline: a miss, said early, not the whole deadline
        assert r.reason is bsr.Reason.EMPTY_PREFIX and r.committed_tokens == 0
        assert r.unanswered == (slow.name,)
        assert eng.health.state(slow.name).consecutive_failures == 1


@pytest.mark.parametrize("share", [0.5, 0.25])
@pytest.mark.anyio
async def test_a_hung_tier_below_the_host_leaves_the_restore_the_hosts_hit(
    tmp_path: Path, share: float
) -> None:
    """The host tier holds the prefix, the file tier below it hangs on every metadata query:
    a restore given a deadline waits for it ``probe_share`` of the deadline, then commits the
    host's hit in the rest (it used to spend the whole deadline probing and end ``deadline``,
    a recompute, until the breaker opened). Every byte is the saved state's."""
    toks = tokens_for(CHUNKS * 16)
    deadline = 4.0
    hung = over_a_hung_tier(
        tmp_path, probe_share=share, breaker_threshold=2, breaker_cooldown_s=600
    )
    async with hung as (eng, host, slow, src):
        for i in (1, 2):
            dst = bsr.PagedKVCache(LAYOUT, 8, 16)
            with anyio.fail_after(30):
                r = await eng.restore(toks, dst, list(range(CHUNKS)), deadline_s=deadline)
            assert r.committed and r.committed_tokens == CHUNKS * 16, r
            assert r.bytes_by_tier.keys() == {host.name}
            assert r.unanswered == (slow.name,)
            assert torch.equal(dst.tensor("kv")[:, :CHUNKS], src.tensor("kv")[:, :CHUNKS])
            # the probe waited its share of the deadline for the hung tier, no more
            assert share * deadline * 0.9 <= r.timings.probe_s < deadline
            assert eng.health.state(slow.name).consecutive_failures == i
        calls = slow.calls  # tripped: the next restore does not wait for it at all
        r = await eng.restore(toks, bsr.PagedKVCache(LAYOUT, 8, 16), list(range(CHUNKS)))
        assert r.committed and slow.calls == calls and r.unanswered == (slow.name,)


@pytest.mark.anyio
async def test_a_probe_share_of_one_is_the_whole_deadline(tmp_path: Path) -> None:
    """``probe_share=1``: the probe may spend the whole deadline (a hung tier then ends the
    restore ``deadline``); control for the share above, and the option's checks."""
    toks = tokens_for(CHUNKS * 16)
    async with over_a_hung_tier(tmp_path, probe_share=1) as (eng, _, _, _):
        with anyio.fail_after(30):
            r = await eng.restore(
                toks, bsr.PagedKVCache(LAYOUT, 8, 16), list(range(CHUNKS)), deadline_s=0.3
            )
        assert r.reason is bsr.Reason.DEADLINE and r.committed_tokens == 0
    for bad, match in [(0, "> 0"), (1.5, "at most 1"), ("half", "int or float")]:
        with pytest.raises(bsr.ConfigError, match=f"probe_share must be .*{match}"):
            engine([bsr.HostTier(1 << 20)], probe_share=bad)


@pytest.mark.anyio
async def test_local_lookup_runs_no_collective(tmp_path: Path) -> None:
    """Rank 0 of two looks up alone (the vLLM scheduler asks rank 0 only): an agreed lookup
    would wait for rank 1 and time out, a local one answers this rank's prefix."""
    toks = tokens_for(CHUNKS * 16)
    src = filled_cache(LAYOUT, 8, 16)

    group = bsr.InProcessGroup(2, timeout_s=0.5)
    tier = bsr.FileTier(tmp_path, 1 << 26)
    eng = bsr.RestoreEngine(
        LAYOUT, [tier], window=2, io_depth=1,
        namespace=bsr.Namespace("m", tp_rank=0, tp_size=2), coordinator=group.coordinator(0),
    )  # fmt: skip
    async with eng:
        await eng.save(toks, src, list(range(CHUNKS)))
        with anyio.fail_after(30):
            probe = await eng.lookup(toks, local=True)
        assert probe.prefix_chunks == probe.local_chunks == CHUNKS
        with pytest.raises(bsr.CoordinatorError):
            await eng.lookup(toks)  # the agreed one needs rank 1
        with pytest.raises(bsr.ConfigError, match="local lookup takes no lease"):
            await eng.lookup(toks, local=True, lease_ttl_s=5)
        with pytest.raises(bsr.ConfigError, match="deadline_s"):
            await eng.lookup(toks, deadline_s=-1)


@pytest.mark.anyio
async def test_split_deadline_keeps_a_servers_lookup_and_restore_within_one_deadline(
    tmp_path: Path,
) -> None:
    """``engine.split_deadline(d)``: the lookup gets ``probe_share`` of ``d``, the restore what
    is left; a server admitting with it while a tier below the host hangs commits the host's
    hit within ``d``. Its checks: ``None`` takes the engine's deadline (none: unbounded), a
    bad value is a ConfigError naming ``deadline_s``, and a split whose time is spent gives
    the restore a deadline that has passed (it ends ``deadline``, nothing read)."""
    toks = tokens_for(CHUNKS * 16)
    async with over_a_hung_tier(tmp_path, probe_share=0.25) as (eng, _, _, src):
        split = eng.split_deadline(2.0)
        assert isinstance(split, bsr.DeadlineSplit)
        assert split.total_s == 2.0 and split.lookup_s == 0.5
        with anyio.fail_after(30):
            probe = await eng.lookup(toks, deadline_s=split.lookup_s)
            left = split.restore_s()
            assert left is not None and 1.0 < left <= 1.5  # the lookup spent its 0.5 s
            dst = bsr.PagedKVCache(LAYOUT, 8, 16)
            r = await eng.restore(toks, dst, list(range(CHUNKS)), probe=probe, deadline_s=left)
        assert r.committed and r.committed_tokens == CHUNKS * 16
        assert time.perf_counter() - split.started < 2.0
        assert torch.equal(dst.tensor("kv")[:, :CHUNKS], src.tensor("kv")[:, :CHUNKS])

        spent = bsr.DeadlineSplit(1.0, 0.5, time.perf_counter() - 5)
        assert spent.restore_s() == pytest.approx(1e-6)  # passed: a restore ends at once
        r = await eng.restore(
            toks, bsr.PagedKVCache(LAYOUT, 8, 16), list(range(CHUNKS)),
            deadline_s=spent.restore_s(),
        )  # fmt: skip
        assert r.reason is bsr.Reason.DEADLINE and r.bytes_by_tier == {}

        unbounded = eng.split_deadline()  # the engine has no deadline
        assert unbounded.total_s is None and unbounded.lookup_s is None
        assert unbounded.restore_s() is None
        for bad in (0, -1.0, float("inf"), "2"):
            with pytest.raises(bsr.ConfigError, match="deadline_s"):
                eng.split_deadline(bad)  # type: ignore[arg-type]
    async with engine([bsr.HostTier(1 << 20)], deadline_s=3.0, probe_share=0.5) as eng:
        split = eng.split_deadline()  # None: the engine's
        assert split.total_s == 3.0 and split.lookup_s == 1.5


@pytest.mark.anyio
async def test_a_cancelled_lookup_gives_back_a_half_open_tiers_trial(tmp_path: Path) -> None:
    """The tiers are asked at once. A lookup its caller cancels while a half-open tier's one
    trial call is out must give the trial back, or no call would ever be let through to that
    tier again (its breaker waits for the trial's outcome)."""
    toks = tokens_for(CHUNKS * 16)
    hung = over_a_hung_tier(tmp_path, breaker_threshold=1, breaker_cooldown_s=0.05)
    async with hung as (eng, _, slow, _):
        with anyio.fail_after(30):
            await eng.lookup(toks, deadline_s=0.2)  # cut off: threshold 1, so tripped
        assert eng.health.state(slow.name).open
        await anyio.sleep(0.1)  # past the cooldown: half-open, one trial call
        calls = slow.calls
        with anyio.move_on_after(0.2) as scope:  # the caller gives up (no deadline of its own)
            await eng.lookup(toks)
        assert scope.cancelled_caught and slow.calls == calls + 1  # the trial was out
        slow.hang = False
        with anyio.fail_after(30):
            probe = await eng.lookup(toks, deadline_s=5)
        assert slow.calls == calls + 2 and probe.unanswered == ()  # asked again, and answered
        assert not eng.health.state(slow.name).open
