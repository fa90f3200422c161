"""Tier conformance for HostTier and FileTier, plus FileTier's durability behaviour."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import bsr
from bsr.core._object import HEADER_SIZE
from bsr.testing import FaultPlan, FaultyTier, LatencyTier, TierConformance, make_keys, payload


class TestHostTierConformance(TierConformance):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return bsr.HostTier(capacity_bytes)


class TestFileTierConformance(TierConformance):
    hostile_store = True

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return bsr.FileTier(tmp_path / "l2", capacity_bytes, reader="posix")

    async def reopen_tier(self, tier: bsr.Tier, tmp_path: Path) -> bsr.Tier | None:
        capacity = tier.statistics().capacity_bytes
        return bsr.FileTier(tmp_path / "l2", capacity, reader="posix")


class TestFileTierDirectIO(TestFileTierConformance):
    """The same suite with O_DIRECT requested (falls back where the filesystem refuses it)."""

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return bsr.FileTier(tmp_path / "l2", capacity_bytes, reader="posix", direct_io=True)


# every wrapper tier runs the suite too (an empty fault plan injects nothing)
class TestFaultyHostTierConformance(TierConformance):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return FaultyTier(bsr.HostTier(capacity_bytes), FaultPlan())


class TestFaultyFileTierConformance(TestFileTierConformance):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return FaultyTier(await super().make_tier(tmp_path, capacity_bytes), FaultPlan())

    async def reopen_tier(self, tier: bsr.Tier, tmp_path: Path) -> bsr.Tier | None:
        inner = await super().reopen_tier(tier, tmp_path)
        return None if inner is None else FaultyTier(inner, FaultPlan())


class TestLatencyFileTierConformance(TestFileTierConformance):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        inner = await super().make_tier(tmp_path, capacity_bytes)
        return LatencyTier(inner, read_latency_s=0.0, name="slow-file")

    async def reopen_tier(self, tier: bsr.Tier, tmp_path: Path) -> bsr.Tier | None:
        inner = await super().reopen_tier(tier, tmp_path)
        return None if inner is None else LatencyTier(inner, read_latency_s=0.0, name="slow-file")


class TestPlainWrapperHostTierConformance(TierConformance):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> bsr.Tier:
        return bsr.TierWrapper(bsr.HostTier(capacity_bytes))


@pytest.mark.anyio
async def test_leftover_temp_file_is_never_visible_and_is_removed(tmp_path: Path) -> None:
    keys = make_keys(2)

    async with bsr.FileTier(tmp_path, 1 << 26) as tier:
        await tier.write(keys[0], "kv", payload(0))
        # a crashed writer leaves a temp file holding a complete-looking object
        src = tier.object_path(keys[0], "kv")
        oid = bsr.ObjectKey(keys[1], "kv").object_id
        dead_pid = 2**22 + 12345
        tmp = tmp_path / "tmp" / f"{oid}.{dead_pid}.abcdef012345.tmp"  # the writer's exact grammar
        tmp.write_bytes(src.read_bytes())
    async with bsr.FileTier(tmp_path, 1 << 26) as again:
        assert await again.contains_many([bsr.ObjectKey(keys[1], "kv")]) == [False]
        assert await again.contains_many([bsr.ObjectKey(keys[0], "kv")]) == [True]
        assert not tmp.exists()


@pytest.mark.anyio
async def test_reopen_quarantines_truncated_files(tmp_path: Path) -> None:
    keys = make_keys(2)

    async with bsr.FileTier(tmp_path, 1 << 26) as tier:
        for i, k in enumerate(keys):
            await tier.write(k, "kv", payload(i))
        victim = tier.object_path(keys[0], "kv")
    os.truncate(victim, HEADER_SIZE + 10)
    async with bsr.FileTier(tmp_path, 1 << 26) as again:
        present = await again.contains_many([bsr.ObjectKey(k, "kv") for k in keys])
        assert present == [False, True]
        assert again.statistics().quarantined == 1
        assert any((tmp_path / "quarantine").iterdir())
        assert again.statistics().objects == 1


@pytest.mark.anyio
async def test_reopen_restores_lru_order_and_capacity(tmp_path: Path) -> None:
    keys = make_keys(4)
    per = PAYLOAD = len(payload(0)) + HEADER_SIZE

    async with bsr.FileTier(tmp_path, 10 * per) as tier:
        for i, k in enumerate(keys[:3]):
            await tier.write(k, "kv", payload(i))
            os.utime(tier.object_path(k, "kv"), (1000 + i, 1000 + i))
    async with bsr.FileTier(tmp_path, 3 * PAYLOAD) as again:
        await again.write(keys[3], "kv", payload(3))  # evicts the oldest (keys[0])
        present = await again.contains_many([bsr.ObjectKey(k, "kv") for k in keys])
        assert present == [False, True, True, True]


@pytest.mark.anyio
async def test_file_names_derive_only_from_hex_digests(tmp_path: Path) -> None:
    keys = make_keys(1)

    async with bsr.FileTier(tmp_path, 1 << 26) as tier:
        await tier.write(keys[0], "weird group/../name", payload(0, 4096))
        files = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
        assert len(files) == 1
        stem = files[0].name.removesuffix(".bsr")
        assert all(c in "0123456789abcdef" for c in stem) and len(stem) == 40


@pytest.mark.anyio
async def test_directory_in_place_of_object_is_a_corrupt_object(tmp_path: Path) -> None:
    # not a regular file bsr wrote: a corrupt object (the engine quarantines it), not an I/O
    # error (which would trip the breaker); permission errors are covered in
    # test_file_tier_hostile.py
    keys = make_keys(1)

    async with bsr.FileTier(tmp_path, 1 << 26) as tier:
        await tier.write(keys[0], "kv", payload(0))
        path = tier.object_path(keys[0], "kv")
        path.unlink()
        path.mkdir()
        with pytest.raises(bsr.CorruptObjectError):
            await tier.read_into(keys[0], "kv", np.zeros(len(payload(0)), dtype=np.uint8))


@pytest.mark.anyio
async def test_vanished_file_is_a_miss(tmp_path: Path) -> None:
    keys = make_keys(1)

    async with bsr.FileTier(tmp_path, 1 << 26) as tier:
        await tier.write(keys[0], "kv", payload(0))
        tier.object_path(keys[0], "kv").unlink()
        with pytest.raises(bsr.ObjectNotFoundError):
            await tier.read_into(keys[0], "kv", np.zeros(len(payload(0)), dtype=np.uint8))
        assert await tier.contains(keys[0], "kv") is False


def test_capacity_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(bsr.ConfigError, match="capacity_bytes"):
        bsr.FileTier(tmp_path, 0)
    with pytest.raises(bsr.ConfigError, match="capacity_bytes"):
        bsr.HostTier(-1)


@pytest.mark.anyio
async def test_wrappers_read_flags_through_and_report_their_own_name(tmp_path: Path) -> None:
    file_tier = bsr.FileTier(tmp_path, 1 << 26, reader="posix")
    host = bsr.HostTier(1 << 20)
    assert (bsr.FileTier.durable, bsr.FileTier.blocking_reads) == (True, True)
    assert (bsr.HostTier.durable, bsr.HostTier.blocking_reads) == (False, True)
    plain = bsr.TierWrapper(file_tier)
    assert (plain.durable, plain.blocking_reads, plain.name) == (True, True, "file")
    # a wrapper that changes reads must not let a batching pipeline bypass it
    faulty = FaultyTier(file_tier, FaultPlan())
    assert (faulty.durable, faulty.blocking_reads) == (True, False)
    assert repr(faulty) == "FaultyTier(inner=FileTier('file'))"
    slow = LatencyTier(host, name="slow-host")
    assert (slow.durable, slow.blocking_reads, slow.name) == (False, False, "slow-host")
    assert repr(slow) == "LatencyTier('slow-host', inner=HostTier('host'))"
    nested = bsr.TierWrapper(bsr.TierWrapper(host))
    assert nested.blocking_reads is True
    assert not hasattr(bsr.Tier, "metadata_only_probe")  # read by nothing: removed
    assert not hasattr(bsr.Tier, "default_io_depth")

    async with slow:
        await slow.write(make_keys(1)[0], "kv", payload(0))
        s = slow.statistics()
        assert (s.name, s.objects, s.writes) == ("slow-host", 1, 1)
        assert host.statistics().name == "host"
        assert slow.usage() == host.usage() == bsr.TierUsage(1, s.bytes, 1 << 20)


@pytest.mark.anyio
async def test_base_tier_defaults_work_for_a_minimal_tier() -> None:
    class Minimal(bsr.Tier):
        async def contains_many(self, objects):  # type: ignore[no-untyped-def]
            return [False] * len(objects)

        async def fetch_into(self, key, group, dst):  # type: ignore[no-untyped-def]
            raise bsr.ObjectNotFoundError("none")

        async def write(self, key, group, payload):  # type: ignore[no-untyped-def]
            return False

        async def delete(self, key, group):  # type: ignore[no-untyped-def]
            return False

    t = Minimal("mini")
    assert t.usage() == bsr.TierUsage()
    assert t.statistics().objects == 0
    assert t.blocking_reads is False
    with pytest.raises(NotImplementedError, match="blocking_reads"):
        t.read_into_blocking(make_keys(1)[0], "kv", np.zeros(4, np.uint8))

    lease = await t.lease([bsr.ObjectKey(make_keys(1)[0], "kv")], 1.0)
    assert isinstance(lease, bsr.TierLease) and len(lease.objects) == 1
    lease.release()
    lease.release()
