"""Memory handed to the kernel is never reused until the kernel is done with it.

A device that answers late (the read end of a pipe: a read stays in flight until the test writes
into it) and a ring that fails under the reads (``io_uring_enter`` refused with ``ENOMEM`` from
then on: no cancel can be submitted either). Before: the reader drained for 5 s and re-raised;
the restore raised an untyped ``ExceptionGroup``, its staging slots went back to the pool while
its reads were still in flight into them, and those late reads overwrote the slots of other
restores, which failed their checksums and quarantined valid objects. ``FileTier.read_into``
raised at 5 s and the late bytes landed in the caller's buffer afterwards.

Now: the reading thread waits for the kernel (polling the completion queue), so the restore ends
at its deadline with a typed result while its slots stay parked (counted in the staging
statistics) until the late reads landed; restores reading meanwhile never get those slots and
commit the saved bytes; no valid object is quarantined; a one-object read's late bytes land in
its worker's own buffer, never the caller's.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import bsr
from bsr.testing import make_keys
from bsr.tiers.file._readers import UringReader, aligned_buffer, cancellation
from bsr.tiers.file._uring import RingError, uring_status
from support.helpers import blocks_equal, filled_cache, tokens_for

pytestmark = pytest.mark.skipif(
    not uring_status().usable, reason=f"no io_uring here: {uring_status().reason}"
)

LAYOUT = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 256),))
BLOCK = 16
PAYLOAD = LAYOUT.group_chunk_bytes("kv")  # 8 KiB: one request per object (header + payload)
OBJECT = 4096 + PAYLOAD
LATE = 0xAB  # the late bytes the "device" delivers


class LateDevice(UringReader):
    """A real io_uring reader. Objects in ``stall`` (object ids) are read from the read end of
    a pipe (their request stays in flight until the test writes); once ``break_after``
    requests are in the kernel, every ``io_uring_enter`` fails with ``ENOMEM`` until
    ``mend``."""

    def __init__(self) -> None:
        super().__init__(depth=16)
        self.pipe = os.pipe()
        self.stall: set[str] = set()
        self.break_after = 2
        self.broken = False
        self.refused_enters = 0
        self._guard = threading.Lock()

    def _in_flight(self) -> int:
        return self._depth.limit - self._depth.free

    def _ring(self) -> Any:
        ring = super()._ring()
        if ring is not None and not getattr(ring, "_late_device", False):
            real = ring.enter

            def enter(wait: int = 0, timeout_s: float | None = None) -> None:
                # once the reads were handed to the kernel (nothing left queued) and wait there
                if self.stall and not ring._pending and self._in_flight() >= self.break_after:
                    self.broken = True
                if self.broken:
                    self.refused_enters += 1
                    raise RingError(errno.ENOMEM, "injected: io_uring_enter refused")
                real(wait, timeout_s)

            ring.enter = enter
            ring._late_device = True
        return ring

    def _stream_pieces(self, r: Any, bufs: Any) -> Any:
        item = r.token
        if bsr.ObjectKey(item.key, item.group).object_id in self.stall:
            os.close(r.fd)
            r.fd = os.dup(self.pipe[0])  # the whole object's request waits on the pipe
        return super()._stream_pieces(r, bufs)

    def read_fd(self, fd: int, header: Any, payload: Any, *, size: int | None = None) -> int:
        if self.stall:  # a one-object read of a stalled tier: from the pipe too
            return super().read_fd(self.pipe[0], header, payload, size=size)
        return super().read_fd(fd, header, payload, size=size)

    def deliver(self, objects: int) -> None:
        """The device answers: ``objects`` objects' worth of late bytes."""
        os.write(self.pipe[1], bytes([LATE]) * (objects * OBJECT))

    def mend(self) -> None:
        self.broken = False
        self.stall.clear()

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)


async def _until(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():  # noqa: ASYNC110 - a thread's progress, nothing to await
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_ring_failing_under_late_reads_parks_their_slots_until_the_reads_land(
    tmp_path: Path,
) -> None:
    device = LateDevice()
    slow = bsr.FileTier(tmp_path / "slow", 1 << 26, name="slow", reader=device)
    fast = bsr.FileTier(tmp_path / "fast", 1 << 26, name="fast", reader="posix")
    a_toks, b_toks = tokens_for(3 * 16, seed=1), tokens_for(8 * 16, seed=2)
    a_ids, b_ids = torch.arange(3), torch.arange(8)
    a_src, b_src = filled_cache(LAYOUT, 8, BLOCK, seed=1), filled_cache(LAYOUT, 8, BLOCK, seed=2)
    eng = bsr.RestoreEngine(
        LAYOUT, [fast, slow], window=8, io_depth=2, namespace=bsr.Namespace("late"),
        breaker_threshold=1_000_000,
    )  # fmt: skip
    try:
        async with eng:
            assert (await eng.save(a_toks, a_src, a_ids)).ok
            assert (await eng.save(b_toks, b_src, b_ids)).ok
            a_keys, b_keys = eng.keys(a_toks), eng.keys(b_toks)
            for k in a_keys:  # A only on the slow device, B only on the fast one
                assert await fast.delete(k, "kv")
            for k in b_keys:
                assert await slow.delete(k, "kv")
            device.stall = {bsr.ObjectKey(k, "kv").object_id for k in a_keys}

            # A: its three reads stall in the kernel and the ring fails under them
            a_dst = bsr.PagedKVCache(LAYOUT, 8, BLOCK)
            with anyio.fail_after(20):  # typed, at its deadline: never an ExceptionGroup
                ra = await eng.restore(a_toks, a_dst, a_ids, deadline_s=1.0)
            assert ra.state is bsr.RequestState.INVALIDATED and ra.committed_tokens == 0
            assert device.refused_enters >= 1 and device.settling == 1
            s = eng.statistics().staging
            assert s.parked == 3 and s.in_use == 3  # A's slots: the kernel may still write

            # B, meanwhile and again: never one of A's slots; its bytes are the saved ones
            for _ in range(3):
                b_dst = bsr.PagedKVCache(LAYOUT, 8, BLOCK)
                rb = await eng.restore(b_toks, b_dst, b_ids)
                assert rb.committed_tokens == len(b_toks), rb
                assert blocks_equal(LAYOUT, b_src, b_ids, b_dst, b_ids, 8)
            assert eng.statistics().staging.parked == 3

            # the device answers: A's late reads land in A's parked slots, then they come back
            device.deliver(3)
            await _until(lambda: eng.statistics().staging.parked == 0, "A's slots back")
            s = eng.statistics().staging
            assert s.in_use == 0 and s.acquired == s.released
            assert device.settling == 0 and device._depth.free == device.depth
            assert not (a_dst.tensor("kv").view(torch.uint8) == LATE).any()

            # nothing valid was quarantined: every object is still where it was saved
            for t in (slow, fast):
                assert t.statistics().quarantined == 0
            assert eng.statistics().quarantined == 0
            device.mend()
            a_dst = bsr.PagedKVCache(LAYOUT, 8, BLOCK)
            ra = await eng.restore(a_toks, a_dst, a_ids)
            assert ra.committed_tokens == len(a_toks)
            assert blocks_equal(LAYOUT, a_src, a_ids, a_dst, a_ids, 3)
    finally:
        device.close()


@pytest.mark.anyio
async def test_a_one_object_read_abandoned_under_a_failed_ring_never_writes_the_callers_buffer(
    tmp_path: Path,
) -> None:
    device = LateDevice()
    tier = bsr.FileTier(tmp_path / "t", 1 << 26, reader=device, io_threads=2)
    key = make_keys(1)[0]
    try:
        async with tier:
            assert await tier.write(key, "kv", np.arange(PAYLOAD, dtype=np.uint8) % 251)
            device.stall = {"any"}  # one-object reads come from the pipe
            device.break_after = 1
            dst = np.full(PAYLOAD, 0x11, dtype=np.uint8)
            with anyio.move_on_after(0.5) as scope:
                await tier.read_into(key, "kv", dst)
            assert scope.cancelled_caught  # the caller left; the worker is still in the kernel
            await _until(lambda: device.settling == 1, "the worker waits for the kernel")
            assert tier.statistics().abandoned_reads == 1
            device.deliver(1)  # the late bytes arrive ...
            await _until(lambda: tier._reads.stuck == 0, "the worker returned")
            assert (dst == 0x11).all()  # ... in the worker's own buffer, never the caller's
            device.mend()
            out = np.zeros(PAYLOAD, dtype=np.uint8)
            assert await tier.read_into(key, "kv", out) == PAYLOAD
            assert np.array_equal(out, np.arange(PAYLOAD, dtype=np.uint8) % 251)
    finally:
        device.close()


def test_a_read_under_a_failed_ring_returns_only_once_the_kernel_let_go() -> None:
    """The reader alone: the ring fails with a request in flight on a late device; the read
    does not return (its buffers are the kernel's) until the device answered, then raises the
    ring's error, its place in the depth back."""
    device = LateDevice()
    device.stall = {"any"}
    device.break_after = 1
    header, payload = aligned_buffer(4096), aligned_buffer(PAYLOAD)
    out: list[Any] = []

    def work() -> None:
        try:
            with cancellation(lambda: False):  # waits on the ring in short rounds
                out.append(device.read_fd(0, header, payload, size=OBJECT))
        except OSError as exc:
            out.append(exc)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while device.settling == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert t.is_alive() and not out and device.settling == 1  # waiting for the kernel
        device.deliver(1)
        t.join(10)
        assert not t.is_alive()
        assert isinstance(out[0], OSError) and out[0].errno == errno.ENOMEM
        assert bytes(payload[:16]) == bytes([LATE]) * 16  # landed while the read waited
        assert device._depth.free == device.depth and device.settling == 0
    finally:
        device.close()
