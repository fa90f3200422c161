"""A generic conformance suite every Tier implementation must pass.

Subclass :class:`TierConformance` in a pytest module and implement :meth:`make_tier`; pytest
collects the inherited ``test_*`` methods. They are ``async def`` tests marked ``anyio``, run by
anyio's pytest plugin (installed with anyio) once per backend of :data:`BACKENDS`: asyncio, and
trio where trio is installed. The suite's own ``anyio_backend`` fixture picks them; override it
in a subclass to run on fewer.

Seed and damage hooks (:meth:`~TierConformance.corrupt_object`,
:meth:`~TierConformance.truncate_object`, :meth:`~TierConformance.put_raw`) reach behind the tier
under test into its storage; their defaults use :mod:`bsr.testing`'s storage functions, which
go through the tier's :meth:`~bsr.Tier.storage_hooks` (HostTier, FileTier and MooncakeTier offer
them, and any wrapper around them); for a tier without them they return False and the tests
that need the hook skip. Capability attributes switch off tests that do not apply
(``supports_capacity``, ``hostile_store``).

Example::

    class TestMyTier(TierConformance):
        async def make_tier(self, tmp_path, capacity_bytes):
            return MyTier(tmp_path, capacity_bytes=capacity_bytes)

The hostile-store section (``test_hostile_*``) is for tiers that keep their objects as files
under ``tmp_path``: set ``hostile_store = True`` and implement :meth:`object_file` (where the
bytes of one object live) and :meth:`reopen_tier`. It plants junk (foreign files, a temp name
with an overflowing pid, directories, dangling symlinks, FIFOs) in every directory of the store,
replaces objects with a FIFO, a symlink to a FIFO, a symlink out of the store and a directory,
denies access to an object, fills a small filesystem and remounts it read-only, and checks that
the tier never hangs, never follows a link out of its root, never deletes or moves what it did
not write, and answers every case with a typed :class:`~bsr.BsrError`. The filesystem cases
mount a tmpfs (root with ``CAP_SYS_ADMIN``) and skip where ``mount`` is refused; the permission
case skips as root (root ignores permission bits). A FIFO is unblocked by the suite after a
few seconds, so a tier that blocks on it fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from .._errors import (
    BsrError,
    ClosedError,
    ConfigError,
    CorruptObjectError,
    ForeignObjectError,
    ObjectError,
    ObjectNotFoundError,
    ReadWithdrawnError,
    TierError,
    TruncatedObjectError,
)
from ..core._keys import ChunkKey, Namespace, ObjectKey, chunk_keys
from ..core._layout import StateGroup, StateLayout
from ..core._object import HEADER_SIZE, encode_header, encode_object
from ..tiers._abandon import cancellation
from ..tiers._base import Tier
from ..tiers._codec import ObjectCodec
from ..tiers._reads import Borrowed, ReadItem
from ..tiers.file import FileTier
from ._faults import corrupt_stored, put_raw_stored, storage_tier, truncate_stored

#: payload size used by the suite (a multiple of 4 KiB, like real chunks)
PAYLOAD_BYTES = 16 * 4096

#: the anyio backends every test of :class:`TierConformance` runs on: asyncio, and trio where it
#: is installed (``pip install trio``; bsr's ``test`` extra has it)
BACKENDS = ("asyncio", "trio") if importlib.util.find_spec("trio") else ("asyncio",)

_LAYOUT = StateLayout(chunk_tokens=16, groups=(StateGroup("kv", 2, 2048), StateGroup("aux", 1, 64)))


def make_keys(n: int, *, model: str = "conformance", salt: bytes = b"") -> list[ChunkKey]:
    """``n`` chained chunk keys in a test namespace."""
    ns = Namespace(model, salt=salt).fingerprint(_LAYOUT)
    return chunk_keys(ns, list(range(1, n * 16 + 1)), 16)


def payload(seed: int, nbytes: int = PAYLOAD_BYTES) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Deterministic random payload bytes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class TierConformance:
    """Behaviour every :class:`~bsr.Tier` must show. Subclass and implement :meth:`make_tier`.

    A third-party tier: implement :meth:`make_tier` (and :meth:`reopen_tier` if durable); where
    the tier offers no :meth:`~bsr.Tier.storage_hooks`, override :meth:`corrupt_object`,
    :meth:`truncate_object` and :meth:`put_raw` to reach its storage directly (they must bypass
    the tier under test). A tier that keeps its objects as files under ``tmp_path`` also sets
    ``hostile_store = True`` and overrides :meth:`object_file`; the ``test_hostile_*`` tests then
    run (see the module docstring for what they do and when they skip). Wrapper tiers run the
    suite by wrapping a tier inside :meth:`make_tier`; the hooks peel wrappers off.
    """

    pytestmark = pytest.mark.anyio

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

        Return False when the tier offers no way to do that (the test is skipped). Default:
        :func:`bsr.testing.corrupt_stored`.
        """
        return corrupt_stored(tier, key, group, offset)

    async def truncate_object(self, tier: Tier, key: ChunkKey, group: str, size: int) -> bool:
        """Cut the stored object to ``size`` bytes; False when impossible (test skipped)."""
        return truncate_stored(tier, key, group, size)

    async def put_raw(self, tier: Tier, key: ChunkKey, group: str, blob: bytes) -> bool:
        """Store ``blob`` verbatim as ``(key, group)`` so the tier holds it, bypassing its write
        path; False when impossible (test skipped). Default: :func:`bsr.testing.put_raw_stored`.
        """
        return put_raw_stored(tier, key, group, blob)

    #: the tier keeps objects as files under tmp_path: run the hostile-store section
    hostile_store: bool = False

    def object_file(self, tier: Tier, key: ChunkKey, group: str) -> Path | None:
        """The file holding ``(key, group)``'s bytes (for the hostile-store section)."""
        inner = storage_tier(tier)
        return inner.object_path(key, group) if isinstance(inner, FileTier) else None

    # ------------------------------------------------------------------ harness
    @pytest.fixture(params=BACKENDS)
    def anyio_backend(self, request: pytest.FixtureRequest) -> str:
        """Every test of the suite runs once on each of :data:`BACKENDS` (anyio's pytest plugin)."""
        return str(request.param)

    async def run(
        self,
        tmp_path: Path,
        body: Callable[[Tier], Awaitable[None]],
        *,
        capacity: int | None = None,
    ) -> None:
        tier = await self.make_tier(tmp_path, capacity or self.capacity_bytes)
        async with tier:
            await body(tier)

    # ------------------------------------------------------------------ tests
    async def test_round_trip_is_exact(self, tmp_path: Path) -> None:
        keys = make_keys(3)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                assert await tier.write(k, "kv", payload(i)) is True
            for i, k in enumerate(keys):
                dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                n = await tier.read_into(k, "kv", dst)
                assert n == PAYLOAD_BYTES
                assert np.array_equal(dst, payload(i))

        await self.run(tmp_path, body)

    async def test_read_into_larger_buffer_reports_length(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "aux", payload(7, 4096))
            dst = np.full(3 * 4096, 0xAB, dtype=np.uint8)
            assert await tier.read_into(k, "aux", dst) == 4096
            assert np.array_equal(dst[:4096], payload(7, 4096))

        await self.run(tmp_path, body)

    async def test_contains_many_is_metadata_only(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body)

    async def test_missing_object_raises_not_found(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            with pytest.raises(ObjectNotFoundError):
                await tier.read_into(k, "kv", dst)
            with pytest.raises(FileNotFoundError):  # also a builtin
                await tier.read_into(k, "kv", dst)
            assert not dst.any()

        await self.run(tmp_path, body)

    async def test_write_existing_keeps_first_value(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            assert await tier.write(k, "kv", payload(1)) is True
            assert await tier.write(k, "kv", payload(2)) is False
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "kv", dst)
            assert np.array_equal(dst, payload(1))

        await self.run(tmp_path, body)

    async def test_groups_are_distinct_objects(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            await tier.write(k, "aux", payload(2))
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "aux", dst)
            assert np.array_equal(dst, payload(2))

        await self.run(tmp_path, body)

    async def test_delete(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body)

    async def test_foreign_namespace_is_detected(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]
        # same digest and index (so the same object id), another namespace: must not verify
        alien = ChunkKey(k.digest, k.index, bytes(16))

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            with pytest.raises(ForeignObjectError):
                await tier.read_into(alien, "kv", dst)

        await self.run(tmp_path, body)

    async def test_wrong_chunk_index_is_detected(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]
        alien = ChunkKey(k.digest, k.index + 1, k.namespace)

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            with pytest.raises(ForeignObjectError):
                await tier.read_into(alien, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))

        await self.run(tmp_path, body)

    async def test_too_small_destination_is_refused(self, tmp_path: Path) -> None:
        k = make_keys(1)[0]

        async def body(tier: Tier) -> None:
            await tier.write(k, "kv", payload(1))
            with pytest.raises(BsrError):
                await tier.read_into(k, "kv", np.zeros(PAYLOAD_BYTES // 2, dtype=np.uint8))
            # the object is still intact
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            await tier.read_into(k, "kv", dst)
            assert np.array_equal(dst, payload(1))

        await self.run(tmp_path, body)

    async def test_corrupt_payload_and_header_are_detected(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body)

    async def test_statistics_count(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body)

    async def test_lru_eviction_respects_capacity(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body, capacity=capacity)

    async def test_concurrent_reads(self, tmp_path: Path) -> None:
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

        await self.run(tmp_path, body)

    # ------------------------------------------------------------------ the bulk read
    async def test_fetch_moves_the_stored_header_and_payload(self, tmp_path: Path) -> None:
        """``fetch_into`` hands back what was stored: a header that the engine's check accepts
        with the payload it moved (the check, not the tier, vouches for the bytes)."""
        keys = make_keys(2)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(5))
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            got = await tier.fetch_into(keys[0], "kv", dst)
            assert got.nbytes >= PAYLOAD_BYTES and len(got.header) >= HEADER_SIZE
            assert ObjectCodec.check_read(
                got.header, got.nbytes, keys[0], "kv", dst, PAYLOAD_BYTES, got.stored
            ) == PAYLOAD_BYTES  # fmt: skip
            assert np.array_equal(dst, payload(5))
            # the same bytes are not another object's
            assert ObjectCodec.check_read(got.header, got.nbytes, keys[1], "kv", dst, -1) == -1
            assert ObjectCodec.check_read(got.header, got.nbytes, keys[0], "aux", dst, -1) == -1
            with pytest.raises(ObjectNotFoundError):
                await tier.fetch_into(keys[1], "kv", dst)

        await self.run(tmp_path, body)

    async def _read_many(
        self, tier: Tier, items: list[ReadItem], *, lend: bool = False, ahead: int = 4,
        stop_after: int | None = None,
    ) -> list[tuple[ReadItem, Any]]:  # fmt: skip
        """``tier.read_many_blocking`` of ``items`` in a worker thread; each ``end`` call as
        ``(item, result)``, in order."""
        pending = list(reversed(items))
        ended: list[tuple[ReadItem, Any]] = []

        def begin() -> ReadItem | None:
            return pending.pop() if pending else None

        def end(item: ReadItem, result: Any) -> bool:
            ended.append((item, result))
            if isinstance(result, Borrowed):
                # a lent payload and its header stay valid until released
                assert result.header is not None or item.header is not None
            return stop_after is None or len(ended) < stop_after

        await anyio.to_thread.run_sync(
            lambda: tier.read_many_blocking(begin, end, ahead, lend=lend)
        )
        return ended

    async def test_read_many_ends_each_item_once_with_what_was_stored(self, tmp_path: Path) -> None:
        """Every item begun ends exactly once: its stored bytes (the header the check accepts
        with them) or its miss; lent or copied, the bytes are the saved ones."""
        keys = make_keys(6)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys[:4]):
                await tier.write(k, "kv", payload(i))
            for lend in (False, True):
                dsts = [np.full(PAYLOAD_BYTES, 0xEE, dtype=np.uint8) for _ in keys]
                items = [ReadItem(k, "kv", d, PAYLOAD_BYTES, chunk=i)
                         for i, (k, d) in enumerate(zip(keys, dsts))]  # fmt: skip
                ended = await self._read_many(tier, items, lend=lend)
                assert sorted(it.chunk for it, _ in ended) == list(range(len(keys)))
                for item, result in ended:
                    i = item.chunk
                    if i >= 4:
                        assert isinstance(result, ObjectNotFoundError), (i, result)
                        continue
                    if isinstance(result, Borrowed):
                        assert lend, "lent without leave"
                        head = result.header if result.header is not None else item.header
                        view, n = result.payload, len(result.payload)
                    else:
                        assert isinstance(result, int), (i, result)
                        head, view, n = item.header, item.dst, result
                    assert ObjectCodec.check_read(
                        head, n, item.key, "kv", view, PAYLOAD_BYTES
                    ) == PAYLOAD_BYTES  # fmt: skip
                    assert np.array_equal(np.asarray(view)[:PAYLOAD_BYTES], payload(i))
                    if isinstance(result, Borrowed):
                        result.release()
                        result.release()  # idempotent

        await self.run(tmp_path, body)

    async def test_read_many_writes_a_destination_only_between_its_begin_and_its_end(
        self, tmp_path: Path
    ) -> None:
        """A destination is untouched when its item begins and never written after its end
        (nor after the call returned)."""
        keys = make_keys(6)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            dsts = [np.full(PAYLOAD_BYTES, 0xEE, dtype=np.uint8) for _ in keys]
            items = [ReadItem(k, "kv", d, PAYLOAD_BYTES, chunk=i)
                     for i, (k, d) in enumerate(zip(keys, dsts))]  # fmt: skip
            pending = list(reversed(items))
            at_end: dict[int, bytes] = {}

            def begin() -> ReadItem | None:
                if not pending:
                    return None
                item = pending.pop()
                assert (item.dst == 0xEE).all(), "written before its begin"
                return item

            def end(item: ReadItem, result: Any) -> bool:
                at_end[item.chunk] = item.dst.tobytes()
                if isinstance(result, Borrowed):
                    result.release()
                return True

            await anyio.to_thread.run_sync(lambda: tier.read_many_blocking(begin, end, 3))
            await anyio.sleep(0.05)
            assert sorted(at_end) == list(range(len(keys)))
            for i, d in enumerate(dsts):
                assert d.tobytes() == at_end[i], f"item {i}'s destination written after its end"

        await self.run(tmp_path, body)

    async def test_read_many_begins_no_more_once_end_says_so(self, tmp_path: Path) -> None:
        """``end`` returning False stops the beginning; every item begun still ends once."""
        keys = make_keys(8)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            begun: list[int] = []
            pending = [ReadItem(k, "kv", np.zeros(PAYLOAD_BYTES, np.uint8), PAYLOAD_BYTES,
                                chunk=i) for i, k in enumerate(keys)][::-1]  # fmt: skip
            ended: list[int] = []

            def begin() -> ReadItem | None:
                if not pending:
                    return None
                item = pending.pop()
                begun.append(item.chunk)
                return item

            def end(item: ReadItem, result: Any) -> bool:
                ended.append(item.chunk)
                return len(ended) < 2

            await anyio.to_thread.run_sync(lambda: tier.read_many_blocking(begin, end, 2))
            assert sorted(ended) == sorted(begun) and len(set(ended)) == len(ended)
            assert len(begun) < len(keys)

        await self.run(tmp_path, body)

    async def test_read_many_lent_payload_outlives_eviction_until_released(
        self, tmp_path: Path
    ) -> None:
        """A payload a tier lends stays the saved bytes while it is lent, even if its object is
        deleted and the tier is filled past its capacity meanwhile (its memory is never
        handed to another object before the release)."""
        n = max(4, self.capacity_bytes // (PAYLOAD_BYTES + 4096) + 2)
        keys = make_keys(n + 1)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            item = ReadItem(keys[0], "kv", np.zeros(PAYLOAD_BYTES, np.uint8), PAYLOAD_BYTES)
            ((_, result),) = await self._read_many(tier, [item], lend=True)
            if not isinstance(result, Borrowed):
                pytest.skip("the tier lends nothing (it copies into the destination)")
            try:
                await tier.delete(keys[0], "kv")
                for i, k in enumerate(keys[1:], 1):  # reuse every byte the tier could
                    await tier.write(k, "kv", payload(i))
                assert np.array_equal(np.asarray(result.payload)[:PAYLOAD_BYTES], payload(0))
            finally:
                result.release()

        await self.run(tmp_path, body)

    async def test_read_many_damage_never_passes_the_check(self, tmp_path: Path) -> None:
        """A damaged object read in a batch ends as an error, or as bytes the check refuses."""
        keys = make_keys(3)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            if not await self.corrupt_object(tier, keys[1], "kv", HEADER_SIZE + 77):
                pytest.skip("tier offers no corruption hook")
            for lend in (False, True):
                items = [ReadItem(k, "kv", np.zeros(PAYLOAD_BYTES, np.uint8), PAYLOAD_BYTES,
                                  chunk=i) for i, k in enumerate(keys)]  # fmt: skip
                for item, result in await self._read_many(tier, items, lend=lend):
                    if isinstance(result, BaseException):
                        assert item.chunk == 1 and isinstance(result, BsrError), result
                        continue
                    lent = isinstance(result, Borrowed)
                    head = result.header if lent and result.header is not None else item.header
                    view = result.payload if lent else item.dst
                    n = len(view) if lent else result
                    ok = ObjectCodec.check_read(head, n, item.key, "kv", view, PAYLOAD_BYTES)
                    assert (ok == -1) is (item.chunk == 1)
                    if lent:
                        result.release()

        await self.run(tmp_path, body)

    async def test_read_many_withdrawn_when_the_request_ends(self, tmp_path: Path) -> None:
        """Under a request that has ended (``cancellation``), a bulk read still ends every
        item it began exactly once (read, or withdrawn) and returns."""
        keys = make_keys(5)

        async def body(tier: Tier) -> None:
            for i, k in enumerate(keys):
                await tier.write(k, "kv", payload(i))
            items = [ReadItem(k, "kv", np.zeros(PAYLOAD_BYTES, np.uint8), PAYLOAD_BYTES,
                              chunk=i) for i, k in enumerate(keys)][::-1]  # fmt: skip
            begun: list[int] = []
            ended: list[tuple[int, Any]] = []

            def begin() -> ReadItem | None:
                if not items:
                    return None
                begun.append(items[-1].chunk)
                return items.pop()

            def end(item: ReadItem, result: Any) -> bool:
                ended.append((item.chunk, result))
                if isinstance(result, Borrowed):
                    result.release()
                return True

            def work() -> None:
                with cancellation(lambda: True):
                    tier.read_many_blocking(begin, end, 4)

            with anyio.fail_after(30):
                await anyio.to_thread.run_sync(work)
            assert sorted(c for c, _ in ended) == sorted(begun)
            for _, result in ended:
                assert isinstance(result, (int, Borrowed, ReadWithdrawnError, BsrError)), result

        await self.run(tmp_path, body)

    async def test_closed_tier_refuses_calls(self, tmp_path: Path) -> None:
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

        await main()

    async def test_reopen_keeps_objects(self, tmp_path: Path) -> None:
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

        await main()

    # ------------------------------------------------------------------ seeded damage
    async def test_raw_seeded_damage_is_an_object_error(self, tmp_path: Path) -> None:
        keys = make_keys(6)
        okeys = [ObjectKey(k, "kv") for k in keys]
        good = encode_object(okeys[0], payload(0))
        forged = bytearray(encode_object(okeys[4], payload(4, 4096)))
        # a header with a valid checksum claiming a 1 TiB payload over a 4 KiB file
        forged[:HEADER_SIZE] = _forged_header(okeys[4], 1 << 40)
        seeds = {
            1: b"",  # an empty object
            2: good[: HEADER_SIZE // 2],  # shorter than a header
            3: encode_object(okeys[3], payload(3))[: HEADER_SIZE + 4096],  # half a payload
            4: bytes(forged),
            5: os.urandom(HEADER_SIZE + 4096),  # no bsr header at all
        }

        async def body(tier: Tier) -> None:
            if not await self.put_raw(tier, keys[0], "kv", good):
                pytest.skip("tier offers no raw seeding hook")
            refused = {
                i for i, blob in seeds.items() if not await self.put_raw(tier, keys[i], "kv", blob)
            }
            dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
            assert await tier.read_into(keys[0], "kv", dst) == PAYLOAD_BYTES
            assert np.array_equal(dst, payload(0))
            for i in set(seeds) - refused:  # a store may refuse e.g. an empty value
                # a valid read first: no buffer may keep its header for the damaged one
                await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
                with pytest.raises(ObjectError) as info:
                    await tier.read_into(keys[i], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
                assert not isinstance(info.value, ConfigError), (i, info.value)
                if i in (1, 2, 3, 4):
                    assert isinstance(info.value, TruncatedObjectError), (i, info.value)

        await self.run(tmp_path, body)

    async def test_truncated_object_is_detected(self, tmp_path: Path) -> None:
        keys = make_keys(2)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            await tier.write(keys[1], "kv", payload(1))
            if not await self.truncate_object(tier, keys[0], "kv", HEADER_SIZE + 100):
                pytest.skip("tier offers no truncation hook")
            emptied = await self.truncate_object(tier, keys[1], "kv", 0)  # a store may refuse
            for k in keys if emptied else keys[:1]:
                with pytest.raises(TruncatedObjectError):
                    await tier.read_into(k, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))

        await self.run(tmp_path, body)

    # ------------------------------------------------------------------ leases and capacity
    async def test_lease_release_is_idempotent_and_ttl_checked(self, tmp_path: Path) -> None:
        keys = make_keys(2)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            objs = [ObjectKey(k, "kv") for k in keys]
            lease = await tier.lease(objs, 10.0)
            lease.release()
            lease.release()
            with await tier.lease(objs, 10.0):
                dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                await tier.read_into(keys[0], "kv", dst)
                assert np.array_equal(dst, payload(0))
            for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
                with pytest.raises(ConfigError):
                    await tier.lease(objs, bad)  # type: ignore[arg-type]

        await self.run(tmp_path, body)

    async def test_lease_pins_against_eviction_until_release(self, tmp_path: Path) -> None:
        if not self.supports_capacity:
            pytest.skip("tier does not enforce capacity")
        keys = make_keys(5)
        capacity = 3 * (PAYLOAD_BYTES + 4096)

        async def body(tier: Tier) -> None:
            for i in range(3):
                await tier.write(keys[i], "kv", payload(i))
            lease = await tier.lease([ObjectKey(keys[0], "kv")], 60.0)
            await tier.write(keys[3], "kv", payload(3))  # 0 is leased: 1 goes
            present = await tier.contains_many([ObjectKey(k, "kv") for k in keys[:4]])
            assert present == [True, False, True, True]
            lease.release()
            await tier.write(keys[4], "kv", payload(4))  # released: 0 is the LRU again
            assert await tier.contains(keys[0], "kv") is False

        await self.run(tmp_path, body, capacity=capacity)

    async def test_expired_lease_stops_pinning(self, tmp_path: Path) -> None:
        if not self.supports_capacity:
            pytest.skip("tier does not enforce capacity")
        keys = make_keys(3)
        capacity = 2 * (PAYLOAD_BYTES + 4096)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            await tier.write(keys[1], "kv", payload(1))
            await tier.lease([ObjectKey(keys[0], "kv")], 0.05)  # never released
            await anyio.sleep(0.1)
            await tier.write(keys[2], "kv", payload(2))
            assert await tier.contains(keys[0], "kv") is False

        await self.run(tmp_path, body, capacity=capacity)

    async def test_fully_leased_tier_refuses_writes_typed(self, tmp_path: Path) -> None:
        if not self.supports_capacity:
            pytest.skip("tier does not enforce capacity")
        keys = make_keys(3)
        capacity = 2 * (PAYLOAD_BYTES + 4096)

        async def body(tier: Tier) -> None:
            await tier.write(keys[0], "kv", payload(0))
            await tier.write(keys[1], "kv", payload(1))
            with await tier.lease([ObjectKey(k, "kv") for k in keys[:2]], 60.0):
                with pytest.raises(TierError):
                    await tier.write(keys[2], "kv", payload(2))
                assert await tier.contains_many([ObjectKey(k, "kv") for k in keys[:2]]) == [
                    True,
                    True,
                ]
            assert await tier.write(keys[2], "kv", payload(2)) is True

        await self.run(tmp_path, body, capacity=capacity)

    async def test_concurrent_writes_never_exceed_capacity(self, tmp_path: Path) -> None:
        if not self.supports_capacity:
            pytest.skip("tier does not enforce capacity")
        keys = make_keys(48)
        capacity = 5 * (PAYLOAD_BYTES + 4096)

        async def main() -> None:
            tier = await self.make_tier(tmp_path, capacity)
            async with tier:
                async with anyio.create_task_group() as tg:
                    for i, k in enumerate(keys):
                        tg.start_soon(tier.write, k, "kv", payload(i))
                s = tier.statistics()
                assert s.bytes <= capacity, s
                assert s.peak_bytes <= capacity, s
            again = await self.reopen_tier(tier, tmp_path)
            if again is not None:
                async with again:
                    assert again.statistics().bytes <= capacity

        await main()

    # ------------------------------------------------------------------ hostile store
    def _hostile_file(self, tier: Tier, key: ChunkKey, group: str = "kv") -> Path:
        if not self.hostile_store:
            pytest.skip("hostile_store is False: the tier keeps no files under tmp_path")
        path = self.object_file(tier, key, group)
        if path is None:
            pytest.skip("object_file() does not know where this tier keeps an object")
        return path

    async def test_hostile_fifo_in_place_of_object_never_blocks(self, tmp_path: Path) -> None:
        keys = make_keys(3)

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                for i, k in enumerate(keys):
                    await tier.write(k, "kv", payload(i))
                fifo = self._hostile_file(tier, keys[0])
                fifo.unlink()
                os.mkfifo(fifo)
                link = self._hostile_file(tier, keys[1])
                target = tmp_path / "outside.fifo"
                os.mkfifo(target)
                link.unlink()
                link.symlink_to(target)
                for k, pipe in ((keys[0], fifo), (keys[1], target)):
                    await _read_fails_promptly(tier, k, pipe)
            again = await self.reopen_tier(tier, tmp_path)
            if again is None:
                return
            # a blocked open() is freed at 30 s and then fails the 10 s bound
            with fifo_unblocker(fifo, after_s=30), fifo_unblocker(target, after_s=30):
                with anyio.fail_after(10):
                    await again.open()
            async with again:
                for k, pipe in ((keys[0], fifo), (keys[1], target)):
                    if await again.contains(k, "kv"):
                        await _read_fails_promptly(again, k, pipe)
                dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                await again.read_into(keys[2], "kv", dst)
                assert np.array_equal(dst, payload(2))
            assert fifo.is_fifo() and link.is_symlink()  # not ours: left where they are

        await main()

    async def test_hostile_symlink_out_of_the_store_is_never_followed(self, tmp_path: Path) -> None:
        keys = make_keys(2)
        outside = tmp_path / "outside"
        outside.mkdir()

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                await tier.write(keys[0], "kv", payload(0))
                await tier.write(keys[1], "kv", payload(1))
                path = self._hostile_file(tier, keys[0])
                copy = outside / "copy"
                shutil.copyfile(path, copy)  # a valid object: following the link would verify
                original = copy.read_bytes()
                path.unlink()
                path.symlink_to(copy)
                with pytest.raises(BsrError):
                    await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
                await tier.quarantine(keys[0], "kv", "test")
                assert copy.read_bytes() == original
            again = await self.reopen_tier(tier, tmp_path)
            if again is not None:
                async with again:
                    if await again.contains(keys[0], "kv"):
                        with pytest.raises(BsrError):
                            await again.read_into(
                                keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                            )
                    dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                    await again.read_into(keys[1], "kv", dst)
                    assert np.array_equal(dst, payload(1))
            assert (outside / "copy").read_bytes() == original
            assert _lexists(path)  # the link is not the tier's to delete

        await main()

    async def test_hostile_directory_in_place_of_object(self, tmp_path: Path) -> None:
        keys = make_keys(2)

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                await tier.write(keys[0], "kv", payload(0))
                await tier.write(keys[1], "kv", payload(1))
                path = self._hostile_file(tier, keys[0])
                path.unlink()
                path.mkdir()
                (path / "keep.txt").write_bytes(b"not bsr's")
                with pytest.raises(BsrError):
                    await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
                await tier.quarantine(keys[0], "kv", "test")
            again = await self.reopen_tier(tier, tmp_path)
            if again is not None:
                async with again:
                    dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                    await again.read_into(keys[1], "kv", dst)
                    assert np.array_equal(dst, payload(1))
            assert (path / "keep.txt").read_bytes() == b"not bsr's"

        await main()

    async def test_hostile_junk_entries_are_left_alone(self, tmp_path: Path) -> None:
        keys = make_keys(3)
        oid = ObjectKey(keys[2], "kv").object_id

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                await tier.write(keys[0], "kv", payload(0))
                await tier.write(keys[1], "kv", payload(1))
                self._hostile_file(tier, keys[0])
            planted = _plant_junk(tmp_path, oid)
            again = await self.reopen_tier(tier, tmp_path)
            if again is None:
                pytest.skip("tier is not durable")
            with anyio.fail_after(10):
                await again.open()
            async with again:
                for i in range(2):
                    dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                    await again.read_into(keys[i], "kv", dst)
                    assert np.array_equal(dst, payload(i))
                assert await again.contains(keys[2], "kv") is False
            for path, content in planted.items():
                assert _lexists(path), f"the tier removed {path}"
                if content is not None:
                    assert path.read_bytes() == content, f"the tier changed {path}"

        await main()

    async def test_hostile_permission_denied_is_an_io_error(self, tmp_path: Path) -> None:
        keys = make_keys(2)
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits (FileTier's own tests drop privileges)")

        async def main() -> None:
            tier = await self.make_tier(tmp_path, self.capacity_bytes)
            async with tier:
                await tier.write(keys[0], "kv", payload(0))
                await tier.write(keys[1], "kv", payload(1))
                path = self._hostile_file(tier, keys[0])
                before = path.read_bytes()
                path.chmod(0)
                try:
                    with pytest.raises(TierError) as info:
                        await tier.read_into(keys[0], "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
                    assert not isinstance(info.value, ObjectError)
                    again = await self.reopen_tier(tier, tmp_path)
                    if again is not None:
                        async with again:
                            assert await again.contains(keys[1], "kv")
                finally:
                    path.chmod(0o644)
                assert path.read_bytes() == before  # intact and in place: never quarantined

        await main()

    async def test_hostile_disk_full_is_typed_and_leaks_nothing(self, tmp_path: Path) -> None:
        if not self.hostile_store:
            pytest.skip("hostile_store is False: the tier keeps no files under tmp_path")
        keys = make_keys(40)
        with tmpfs_mount(tmp_path / "small", 1 << 20) as fs:

            async def main() -> None:
                tier = await self.make_tier(fs, self.capacity_bytes)
                async with tier:
                    stored: list[int] = []
                    failures = 0
                    for i, k in enumerate(keys):
                        try:
                            await tier.write(k, "kv", payload(i))
                            stored.append(i)
                        except TierError as exc:
                            assert not isinstance(exc, ObjectError)
                            failures += 1
                    assert failures >= 20 and stored, (failures, stored)
                    objects = {self.object_file(tier, keys[i], "kv") for i in stored}
                    others = [
                        p
                        for p in fs.rglob("*")
                        if p.is_file() and not p.is_symlink() and p not in objects
                    ]
                    assert sum(p.stat().st_size for p in others) <= 4096, others
                    for i in stored:
                        dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                        await tier.read_into(keys[i], "kv", dst)
                        assert np.array_equal(dst, payload(i))
                    for i in stored:
                        await tier.delete(keys[i], "kv")
                    for i in stored:  # the failed writes leaked no space
                        assert await tier.write(keys[i], "kv", payload(i)) is True

            await main()

    async def test_hostile_read_only_filesystem(self, tmp_path: Path) -> None:
        if not self.hostile_store:
            pytest.skip("hostile_store is False: the tier keeps no files under tmp_path")
        keys = make_keys(3)
        with tmpfs_mount(tmp_path / "ro", 8 << 20) as fs:

            async def main() -> None:
                tier = await self.make_tier(fs, self.capacity_bytes)
                async with tier:
                    await tier.write(keys[0], "kv", payload(0))
                    await tier.write(keys[1], "kv", payload(1))
                remount_read_only(fs)
                again = await self.reopen_tier(tier, fs)
                if again is None:
                    pytest.skip("tier is not durable")
                async with again:
                    for i in range(2):
                        dst = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
                        await again.read_into(keys[i], "kv", dst)
                        assert np.array_equal(dst, payload(i))
                    with pytest.raises(TierError):
                        await again.write(keys[2], "kv", payload(2))

            await main()


async def _read_fails_promptly(tier: Tier, key: ChunkKey, pipe: Path) -> None:
    """read_into of an object replaced by a FIFO: a typed error within 10 s (a FIFO's open(2)
    waits forever; the slack is for a busy machine), never a hang."""
    t0 = time.monotonic()
    with fifo_unblocker(pipe, after_s=30), pytest.raises(BsrError):
        with anyio.fail_after(10):
            await tier.read_into(key, "kv", np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
    assert time.monotonic() - t0 < 10, "read_into blocked on a FIFO"


def _lexists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _forged_header(okey: ObjectKey, payload_len: int) -> bytes:
    return encode_header(okey, payload_len, 0)


def _plant_junk(root: Path, oid: str) -> dict[Path, bytes | None]:
    """Put junk in every directory under ``root``; ``{path: content or None}`` planted."""
    planted: dict[Path, bytes | None] = {}
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    for n, d in enumerate(dirs):
        entries: dict[str, bytes | None] = {
            "report.1999.final.pdf": b"someone's report",
            f"{oid}.{'9' * 20}.abcdef012345.tmp": b"a pid that overflows",
            f"{oid}.bsr.orig": b"not an object name",
        }
        for name, content in entries.items():
            (d / name).write_bytes(content or b"")
            planted[d / name] = content
        sub = d / f"{oid}.4206649.abcdef01234{n % 10}.tmp"  # a directory where a temp file goes
        sub.mkdir()
        (sub / "inner.txt").write_bytes(b"inner")
        planted[sub / "inner.txt"] = b"inner"
        link = d / "dangling"
        link.symlink_to(root / "nowhere")
        planted[link] = None
        fifo = d / f"{oid}.4206649.0123456789a{n % 10}.tmp"  # a FIFO named like a dead temp
        os.mkfifo(fifo)
        planted[fifo] = None
    return planted


@contextlib.contextmanager
def fifo_unblocker(path: Path, after_s: float = 4.0) -> Iterator[None]:
    """After ``after_s``, keep opening ``path`` read-write (a reader and a writer at once), so
    an open blocked on it returns, whether it opened it for reading or for writing.

    Lets a test of a tier that blocks on a FIFO fail (too slow) instead of hanging forever.
    """
    stop = threading.Event()

    def run() -> None:
        if stop.wait(after_s):
            return
        while not stop.is_set():
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
            stop.wait(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@contextlib.contextmanager
def tmpfs_mount(path: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (skips the test where mounting is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def remount_read_only(path: Path) -> None:
    """Remount the filesystem mounted at ``path`` read-only (see :func:`tmpfs_mount`)."""
    r = subprocess.run(
        ["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True, timeout=30
    )
    if r.returncode != 0:
        raise OSError(errno.EIO, f"remount read-only failed: {r.stderr.strip()}")


def flip_file_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Flip every bit of one byte of a file in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))
