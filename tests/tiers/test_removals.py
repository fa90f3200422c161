"""The removal seam: what tiers report as objects leave them (``Tier.on_removed``), and the
audit (``Tier.recheck_many``) that finds what another process removed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import bsr
import bsr.testing
from bsr.testing import make_keys, payload
from support.helpers import bsr_cli

KEYS = make_keys(6)
SIZE = 8192


class Seen:
    """A removal listener: every record, in order (thread-safe)."""

    def __init__(self) -> None:
        self.records: list[bsr.ObjectRemoved] = []
        self._lock = threading.Lock()

    def __call__(self, record: bsr.ObjectRemoved) -> None:
        with self._lock:
            self.records.append(record)

    def of(self, cause: bsr.Removal) -> list[str]:
        return [r.object_id for r in self.records if r.cause is cause]


def oid(i: int, group: str = "kv") -> str:
    return bsr.ObjectKey(KEYS[i], group).object_id


@pytest.mark.anyio
async def test_host_tier_reports_each_eviction_and_delete_in_order() -> None:
    one = bsr.ObjectCodec.stored_size(SIZE)
    async with bsr.HostTier(2 * one) as tier:
        seen = Seen()
        tier.on_removed(seen)
        for i in range(4):  # room for two: each write past the second evicts the oldest
            assert await tier.write(KEYS[i], "kv", payload(i, SIZE))
        assert seen.of(bsr.Removal.EVICTED) == [oid(0), oid(1)]
        assert await tier.delete(KEYS[3], "kv")
        assert not await tier.delete(KEYS[3], "kv")  # already gone: reported once
        assert seen.of(bsr.Removal.DELETED) == [oid(3)]
        assert {r.tier for r in seen.records} == {"host"}
        # what is reported gone is gone; what is not reported is still there
        held = await tier.contains_many([bsr.ObjectKey(KEYS[i], "kv") for i in range(4)])
        assert held == [False, False, True, False]


@pytest.mark.anyio
async def test_file_tier_reports_evictions_deletes_and_quarantines(tmp_path: Path) -> None:
    one = bsr.ObjectCodec.stored_size(SIZE, padded=True)
    async with bsr.FileTier(tmp_path / "l2", capacity_bytes=3 * one) as tier:
        seen = Seen()
        tier.on_removed(seen)
        for i in range(5):
            await tier.write(KEYS[i], "kv", payload(i, SIZE))
        assert seen.of(bsr.Removal.EVICTED) == [oid(0), oid(1)]
        await tier.quarantine(KEYS[2], "kv", "test")
        await tier.delete(KEYS[3], "kv")
        assert seen.of(bsr.Removal.DELETED) == [oid(2), oid(3)]
        files = {p.stem for p in (tmp_path / "l2" / "objects").glob("*/*.bsr")}
        assert files == {oid(4)}  # nothing reported gone is still served, and vice versa


@pytest.mark.anyio
async def test_recheck_finds_what_bsr_store_gc_removed(tmp_path: Path) -> None:
    """``bsr store gc`` in another process removes files under a running FileTier: its index
    still says held, the audit asks the directory, reports them vanished and forgets them."""
    root = tmp_path / "l2"
    async with bsr.FileTier(root, capacity_bytes=1 << 20) as tier:
        seen = Seen()
        tier.on_removed(seen)
        objs = [bsr.ObjectKey(KEYS[i], "kv") for i in range(3)]
        for i, o in enumerate(objs):
            await tier.write(o.chunk, o.group, payload(i, SIZE))
        assert await tier.recheck_many(objs) == [True, True, True]
        assert seen.records == []
        done = bsr_cli("store", "gc", str(root), "--max-bytes", "0")
        assert done.returncode == 0, done.stderr
        assert await tier.contains_many(objs) == [True, True, True]  # the index does not know
        assert await tier.recheck_many(objs) == [False, False, False]
        assert sorted(seen.of(bsr.Removal.VANISHED)) == sorted(o.object_id for o in objs)
        assert await tier.contains_many(objs) == [False, False, False]  # forgotten now
        # written again: held again, and rechecked as held
        await tier.write(objs[0].chunk, "kv", payload(0, SIZE))
        assert await tier.recheck_many(objs[:1]) == [True]


@pytest.mark.anyio
async def test_a_wrapper_reports_under_its_own_name_and_a_failing_listener_is_ignored() -> None:
    one = bsr.ObjectCodec.stored_size(SIZE)
    inner = bsr.HostTier(one)
    tier = bsr.testing.LatencyTier(inner, read_latency_s=0.0)
    named = bsr.testing.LatencyTier(bsr.HostTier(one, name="h2"), read_latency_s=0.0, name="slow")
    seen = Seen()

    def broken(record: bsr.ObjectRemoved) -> None:
        raise RuntimeError("a listener's bug")

    async with tier, named:
        tier.on_removed(broken)
        tier.on_removed(seen)
        stop = named.on_removed(seen)
        for t in (tier, named):
            await t.write(KEYS[0], "kv", payload(0, SIZE))
            await t.write(KEYS[1], "kv", payload(1, SIZE))  # evicts KEYS[0]; the write succeeds
        assert [(r.tier, r.object_id) for r in seen.records] == [
            ("host", oid(0)), ("slow", oid(0)),
        ]  # fmt: skip
        stop()
        await named.write(KEYS[2], "kv", payload(2, SIZE))
        assert len(seen.records) == 2  # unsubscribed
