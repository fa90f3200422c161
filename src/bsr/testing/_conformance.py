"""A generic conformance suite every Tier implementation must pass.

Subclass :class:`TierConformance` in a pytest module and implement :meth:`make_tier`; pytest
collects the inherited ``test_*`` methods. Optional hooks (:meth:`corrupt_object`) enable the
tests that need to reach behind the tier's API; capability attributes switch off tests that do
not apply (``supports_capacity``). Each test runs its body with ``anyio.run`` (asyncio backend),
so no async pytest plugin is needed.

Example::

    class TestMyTier(TierConformance):
        async def make_tier(self, tmp_path):
            return MyTier(tmp_path, capacity_bytes=self.capacity_bytes)
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from .._errors import (
    BsrError,
    ClosedError,
    CorruptObjectError,
    ForeignObjectError,
    ObjectError,
    ObjectNotFoundError,
)
from ..core._keys import ChunkKey, Namespace, ObjectKey, chunk_keys
from ..core._layout import StateGroup, StateLayout
from ..tiers._base import Tier

#: payload size used by the suite (a multiple of 4 KiB, like real chunks)
PAYLOAD_BYTES = 16 * 4096

_LAYOUT = StateLayout(chunk_tokens=16, groups=(StateGroup("kv", 2, 2048), StateGroup("aux", 1, 64)))


def make_keys(n: int, *, model: str = "conformance", salt: bytes = b"") -> list[ChunkKey]:
    """``n`` chained chunk keys in a test namespace."""
    ns = Namespace(model, salt=salt).fingerprint(_LAYOUT)
    return chunk_keys(ns, list(range(1, n * 16 + 1)), 16)


def payload(seed: int, nbytes: int = PAYLOAD_BYTES) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Deterministic random payload bytes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class TierConformance:
    """Behaviour every :class:`~bsr.Tier` must show. Subclass and implement :meth:`make_tier`."""

    #: capacity handed to tiers in the suite; must hold at least 8 payloads
    capacity_bytes: int = 64 * 1024 * 1024
    #: whether the tier enforces capacity_bytes by LRU eviction
    supports_capacity: bool = True

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        """Return a new, unopened tier storing under ``tmp_path``."""
        raise NotImplementedError

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier | None:
        """Return a fresh tier over the same storage (for durable tiers), or None to skip."""
        return None

    async def corrupt_object(self, tier: Tier, key: ChunkKey, group: str, offset: int) -> bool:
        """Flip a stored byte at ``offset`` of the stored object (header included).

        Return False when the tier offers no way to do that (the test is skipped).
        """
        return False

    # ------------------------------------------------------------------ harness
    def run(
        self,
        tmp_path: Path,
        body: Callable[[Tier], Awaitable[None]],
        *,
        capacity: int | None = None,
    ) -> None:
        async def main() -> None:
            tier = await self.make_tier(tmp_path, capacity or self.capacity_bytes)
            async with tier:
                await body(tier)

        anyio.run(main)

    # ------------------------------------------------------------------ tests
    def test_round_trip_is_exact(self, tmp_path: Path) -> None:
        keys = make_keys(3)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                assert await tier.write(k, "kv", payload(i)) is True
            for i, k in enumerate(keys):
                dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                n = await tier.read_into(k, "kv", dst)
                assert n == PAYLOAD_BYTES
                assert np.array_equal(dst, payload(i))

        self.run(tmp_path, body)

    def test_read_into_larger_buffer_reports_length(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "aux", payload(7, 4096))
            dst = np.full(3 * 4096, 0xAB, dtype=np.uint8)
            assert await tier.read_into(k, "aux", dst) == 4096
            assert np.array_equal(dst[:4096], payload(7, 4096))

        self.run(tmp_path, body)

    def test_contains_many_is_metadata_only(self, tmp_path: Path) -> None:
        keys = make_keys(4)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            await tier.write(keys[2], "aux", payload(2, 4096))
            before = tier.statistics()
            got = await tier.contains_many(
                [
                    ObjectKey(keys[0], "kv"),
                    ObjectKey(keys[0], "aux"),
                    ObjectKey(keys[1], "kv"),
                    ObjectKey(keys[2], "aux"),
                    ObjectKey(keys[3], "kv"),
                ]
            )
            assert got == [True, False, False, True, False]
            after = tier.statistics()
            assert after.bytes_read == before.bytes_read
            assert after.reads == before.reads

        self.run(tmp_path, body)

    def test_missing_object_raises_not_found(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            with pytest.raises(ObjectNotFoundError):
                await tier.read_into(k, "kv", dst)
            with pytest.raises(FileNotFoundError):  # also a builtin
                await tier.read_into(k, "kv", dst)
            assert not dst.any()

        self.run(tmp_path, body)

    def test_write_existing_keeps_first_value(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            assert await tier.write(k, "kv", payload(1)) is True
            assert await tier.write(k, "kv", payload(2)) is False
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "kv", dst)
            assert np.array_equal(dst, payload(1))

        self.run(tmp_path, body)

    def test_groups_are_distinct_objects(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            await tier.write(k, "aux", payload(2))
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "aux", dst)
            assert np.array_equal(dst, payload(2))

        self.run(tmp_path, body)

    def test_delete(self, tmp_path: Path) -> None:
        keys = make_keys(2)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            await tier.write(keys[1], "kv", payload(1))
            assert await tier.delete(keys[0], "kv") is True
            assert await tier.delete(keys[0], "kv") is False
            assert await tier.contains_many(
                [ObjectKey(keys[0], "kv"), ObjectKey(keys[1], "kv")]
            ) == [False, True]
            with pytest.raises(ObjectNotFoundError):
                await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))

        self.run(tmp_path, body)

    def test_foreign_namespace_is_detected(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]
        # same digest and index (so the same object id), another namespace: must not verify
        alien = ChunkKey(k.digest, k.index, bytes(16))

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            with pytest.raises(ForeignObjectError):
                await tier.read_into(alien, "kv", dst)

        self.run(tmp_path, body)

    def test_wrong_chunk_index_is_detected(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]
        alien = ChunkKey(k.digest, k.index + 1, k.namespace)

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            with pytest.raises(ForeignObjectError):
                await tier.read_into(alien, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))

        self.run(tmp_path, body)

    def test_too_small_destination_is_refused(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            with pytest.raises(BsrError):
                await tier.read_into(k, "kv", np.zeros(PAYLOAD_BYTES // 2, dtype=np.uint8))
            # the object is still intact
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "kv", dst)
            assert np.array_equal(dst, payload(1))

        self.run(tmp_path, body)

    def test_corrupt_payload_and_header_are_detected(self, tmp_path: Path) -> None:
        keys = make_keys(2)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(1))
            await tier.write(keys[1], "kv", payload(2))
            if not await self.corrupt_object(tier, keys[0], "kv", 4096 + 1234):
                pytest.skip("tier offers no corruption hook")
            await self.corrupt_object(tier, keys[1], "kv", 8 + 2 + 2 + 3)  # namespace field
            for k in keys:
                with pytest.raises(ObjectError):
                    await tier.read_into(k, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
            with pytest.raises(CorruptObjectError):
                await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))

        self.run(tmp_path, body)

    def test_statistics_count(self, tmp_path: Path) -> None:
        keys = make_keys(3)

        async def body(tier: Tier) -> None:
            s0 = tier.statistics()
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
            with pytest.raises(ObjectNotFoundError):
                await tier.read_into(keys[0], "aux", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
            s = tier.statistics()
            assert s.objects == s0.objects + 3
            assert s.bytes >= s0.bytes + 3 * PAYLOAD_BYTES
            assert s.writes == s0.writes + 3
            assert s.hits == s0.hits + 1
            assert s.misses == s0.misses + 1
            assert s.bytes_read == s0.bytes_read + PAYLOAD_BYTES
            assert s.name == tier.name

        self.run(tmp_path, body)

    def test_lru_eviction_respects_capacity(self, tmp_path: Path) -> None:
        if not self.supports_capacity:
            pytest.skip("tier does not enforce capacity")
        keys = make_keys(5)
        per_object = PAYLOAD_BYTES + 4096
        capacity = 3 * per_object

        async def body(tier: Tier) -> None:
            for i in range(3):
                await tier.write(keys[i], "kv", payload(i))
            await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))  # 0 is hot
            await tier.write(keys[3], "kv", payload(3))  # evicts 1, the least recently used
            present = await tier.contains_many([ObjectKey(k, "kv") for k in keys[:4]])
            assert present == [True, False, True, True]
            s = tier.statistics()
            assert s.bytes <= capacity
            assert s.evictions >= 1

        self.run(tmp_path, body, capacity=capacity)

    def test_concurrent_reads(self, tmp_path: Path) -> None:
        keys = make_keys(4)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            bufs = [np.zeros(PAYLOAD_BYTES, dtype=np.uint8) for _ in range(8)]

            async def read(j: int) -> None:
                await tier.read_into(keys[j % 4], "kv", bufs[j])

            async with anyio.create_task_group() as tg:
                for j in range(8):
                    tg.start_soon(read, j)
            for j in range(8):
                assert np.array_equal(bufs[j], payload(j % 4))

        self.run(tmp_path, body)

    def test_closed_tier_refuses_calls(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                await tier.write(k, "kv", payload(1))
            with pytest.raises(ClosedError):
                await tier.read_into(k, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
            with pytest.raises(ClosedError):
                await tier.write(k, "aux", payload(2))
            with pytest.raises(ClosedError):
                await tier.contains_many([ObjectKey(k, "kv")])

        anyio.run(main)

    def test_reopen_keeps_objects(self, tmp_path: Path) -> None:
        keys = make_keys(3)

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                for i, k in enumerate(keys):
                    await tier.write(k, "kv", payload(i))
            again = await self.reopen_tier(tier, tmp_path)
            if again is None:
                pytest.skip("tier is not durable")
            async with again:
                assert await again.contains_many([ObjectKey(k, "kv") for k in keys]) == [True] * 3
                for i, k in enumerate(keys):
                    dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                    await again.read_into(k, "kv", dst)
                    assert np.array_equal(dst, payload(i))

        anyio.run(main)


def flip_file_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Flip every bit of one byte of a file in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))
