"""The io_uring reader under a storm: every request it submits completes or is withdrawn.

Real ring, real kernel errors, real stalls (see ``test_uring.py`` for how each is made): a read
whose requests fail in the kernel (``EBADF`` from a write-only descriptor, ``EISDIR`` from a
directory), end short (a truncated copy of the object) or stall (the read end of an empty pipe)
must end, give every place in the depth back and never leave its thread spinning, also when the
object needs more requests than the depth lets in flight and when its caller abandons it
part-way. Before: such a read spun for good once its in-flight requests were gone but pieces
were left (its thread never returned, so its staging slot stayed parked and, after a few, every
later read failed fast).
"""

from __future__ import annotations

import collections
import errno
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import bsr
from bsr.tiers.file._readers import UringReader, aligned_buffer, cancellation
from bsr.tiers.file._uring import uring_status
from support.helpers import blocks_equal, filled_cache

pytestmark = pytest.mark.skipif(
    not uring_status().usable, reason=f"no io_uring here: {uring_status().reason}"
)

#: one group; a chunk's object is a 4 KiB header and 16 KiB of payload: 5 requests of 4 KiB,
#: more than the depth of 2 lets in flight
LAYOUT = bsr.StateLayout(chunk_tokens=64, groups=(bsr.StateGroup("kv", 2, 128, dtype="uint8"),))
BLOCK = 16
CHUNKS = 4
DEPTH = 2
FAULTS = ("ok", "ebadf", "eisdir", "short", "stall")


def _join(t: threading.Thread, timeout_s: float = 10.0) -> None:
    t.join(timeout_s)
    assert not t.is_alive(), "the reading thread never returned (spinning or stuck)"


# ---------------------------------------------------------------------- the reader alone
@pytest.mark.parametrize("how", ["ebadf", "eisdir"])
def test_a_kernel_error_with_more_requests_than_the_depth_ends_the_read(
    tmp_path: Path, how: str
) -> None:
    """Depth 1, five requests: the first fails in the kernel; the read raises its errno at once
    and gives its place back (before: the thread spun, nothing left in flight, pieces left)."""
    path = tmp_path / "obj"
    path.write_bytes(os.urandom(5 * 4096))
    reader = UringReader(depth=1, block_bytes=4096)
    fd = os.open(path, os.O_WRONLY) if how == "ebadf" else os.open(tmp_path, os.O_RDONLY)
    out: list[Any] = []

    def work() -> None:
        try:
            out.append(reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(4 * 4096)))
        except OSError as exc:
            out.append(exc)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        _join(t)
    finally:
        os.close(fd)
    want = errno.EBADF if how == "ebadf" else errno.EISDIR
    assert isinstance(out[0], OSError) and out[0].errno == want
    assert reader._depth.free == 1
    path_fd = os.open(path, os.O_RDONLY)  # the same thread's ring reads on
    try:
        assert reader.read_fd(path_fd, aligned_buffer(4096), aligned_buffer(4 * 4096)) == 5 * 4096
    finally:
        os.close(path_fd)


def test_an_abandoned_read_with_pieces_left_is_withdrawn_and_returns() -> None:
    """Depth 1: the header's request stalls in the ring (an empty pipe) with four payload
    requests still to queue. Once abandoned, the stalled request is cancelled and the read
    raises ECANCELED, its place back, nothing landing in the buffers afterwards."""
    r, w = os.pipe()
    reader = UringReader(depth=1, block_bytes=4096)
    header, payload = aligned_buffer(4096), aligned_buffer(4 * 4096)
    header[:] = b"\x01" * 4096
    abandoned = threading.Event()
    out: list[Any] = []

    def work() -> None:
        with cancellation(abandoned.is_set):
            try:
                out.append(reader.read_fd(r, header, payload, size=5 * 4096))
            except OSError as exc:
                out.append(exc)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and not out  # stalled in the ring
        abandoned.set()
        _join(t)
        assert isinstance(out[0], OSError) and out[0].errno == errno.ECANCELED
        os.write(w, b"\x02" * 4096)  # what a withdrawn request must never deliver
        time.sleep(0.1)
        assert bytes(header) == b"\x01" * 4096 and reader._depth.free == 1
    finally:
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------------- the storm
class StormReader(UringReader):
    """A real io_uring reader whose next object reads take faults from a queue: ``ebadf`` (a
    write-only descriptor of the object), ``eisdir`` (a directory), ``short`` (a copy of the
    object's first half), ``stall`` (the read end of an empty pipe), or ``ok``."""

    def __init__(self, scratch: Path) -> None:
        super().__init__(depth=DEPTH, block_bytes=4096)
        self.scratch = scratch
        self.faults: collections.deque[str] = collections.deque()
        self.fired: collections.Counter[str] = collections.Counter()
        self.pipe = os.pipe()
        self._guard = threading.Lock()

    def read_fd(
        self, fd: int, header: memoryview, payload: memoryview, *, size: int | None = None
    ) -> int:
        with self._guard:
            fault = self.faults.popleft() if self.faults else "ok"
            self.fired[fault] += 1
        if fault == "ok":
            return super().read_fd(fd, header, payload, size=size)
        if fault == "stall":
            return super().read_fd(self.pipe[0], header, payload, size=size)
        if fault == "short":
            half = os.pread(fd, (size or 0) // 2, 0)
            copy = self.scratch / f"short.{threading.get_ident()}"
            copy.write_bytes(half)
            bad = os.open(copy, os.O_RDONLY)
            size = len(half)
        elif fault == "ebadf":
            bad = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
        else:
            bad = os.open(self.scratch, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return super().read_fd(bad, header, payload, size=size)
        finally:
            os.close(bad)

    def _stream_pieces(self, r: Any, bufs: Any) -> Any:
        # a restore into a host cache streams its reads (UringReader.stream): the same faults,
        # on the descriptor the stream reads (the tier closes it when the object ends)
        with self._guard:
            fault = self.faults.popleft() if self.faults else "ok"
            self.fired[fault] += 1
        if fault != "ok":
            if fault == "stall":
                bad = os.dup(self.pipe[0])
            elif fault == "short":
                half = os.pread(r.fd, r.size // 2, 0)
                copy = self.scratch / f"short.{threading.get_ident()}"
                copy.write_bytes(half)
                bad = os.open(copy, os.O_RDONLY)
                r.size = len(half)
            elif fault == "ebadf":
                bad = os.open(f"/proc/self/fd/{r.fd}", os.O_WRONLY)
            else:
                bad = os.open(self.scratch, os.O_RDONLY | os.O_DIRECTORY)
            os.close(r.fd)
            r.fd = bad
        return super()._stream_pieces(r, bufs)

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)


TOKENS = list(range(CHUNKS * LAYOUT.chunk_tokens))
IDS = torch.arange(CHUNKS * LAYOUT.chunk_tokens // BLOCK)


class UringStorm(RuleBasedStateMachine):
    """Restores cancelled at random points and reads failing in the kernel, on one engine over
    one FileTier reading through a real ring; the staging window, the read depth and the
    tier's worker threads must come back after every step."""

    backend = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="bsr-uring-storm-"))
        (self.dir / "scratch").mkdir()
        self.reader = StormReader(self.dir / "scratch")
        self.src = filled_cache(LAYOUT, len(IDS), BLOCK, seed=7)
        self._cm = start_blocking_portal(self.backend)
        self.portal = self._cm.__enter__()
        self.tier = bsr.FileTier(self.dir / "root", 1 << 26, reader=self.reader, io_threads=4)
        # breakers off: every step must reach the ring, whatever the last one did
        self.engine = bsr.RestoreEngine(
            LAYOUT, [self.tier], window=2, io_depth=2, namespace=bsr.Namespace("storm"),
            breaker_threshold=1_000_000, deadline_s=5.0,
        )  # fmt: skip
        self.portal.call(self.engine.open)

    async def _save_and_restore(
        self, restores: int, cancel_s: float, deadline_s: float | None
    ) -> list[bsr.RestoreResult | None]:
        assert (await self.engine.save(TOKENS, self.src, IDS)).chunks == CHUNKS
        out: list[bsr.RestoreResult | None] = [None] * restores

        async def one(i: int) -> None:
            dst = bsr.PagedKVCache(LAYOUT, len(IDS), BLOCK)
            with anyio.move_on_after(cancel_s):
                out[i] = r = await self.engine.restore(TOKENS, dst, IDS, deadline_s=deadline_s)
                if r.committed:  # whatever failed around it, what commits is the saved bytes
                    n = r.committed_tokens // LAYOUT.chunk_tokens
                    assert blocks_equal(LAYOUT, self.src, IDS, dst, IDS, n)

        async with anyio.create_task_group() as tg:
            for i in range(restores):
                tg.start_soon(one, i)
        return out

    @rule(
        faults=st.lists(st.sampled_from(FAULTS), max_size=6),
        restores=st.integers(1, 3),
        cancel_ms=st.integers(0, 80),
    )
    def cancelled_restores(self, faults: list[str], restores: int, cancel_ms: int) -> None:
        self.reader.faults.extend(faults)
        self.portal.call(self._save_and_restore, restores, cancel_ms / 1000, None)

    @rule(faults=st.lists(st.sampled_from(FAULTS), max_size=6), deadline_ms=st.integers(1, 300))
    def restore_by_deadline(self, faults: list[str], deadline_ms: int) -> None:
        self.reader.faults.extend(faults)
        (r,) = self.portal.call(self._save_and_restore, 1, 30.0, deadline_ms / 1000)
        assert r is not None  # a deadline ends a restore with a result

    @invariant()
    def everything_comes_back(self) -> None:
        """The steps' reads all ended: no slot in use or parked, no abandoned read still
        running (a spinning thread never returns), every place in the depth free."""
        deadline = time.monotonic() + 20.0
        while True:
            s = self.engine.statistics().staging
            stuck = self.tier._reads.stuck
            free = self.reader._depth.free
            if s.in_use == 0 and s.parked == 0 and stuck == 0 and free == DEPTH:
                return
            assert time.monotonic() < deadline, (
                f"after 20 s: {s.in_use} slots in use, {s.parked} parked, {stuck} reads still "
                f"running after their callers left, {DEPTH - free} places of the depth taken"
            )
            time.sleep(0.02)

    def teardown(self) -> None:
        try:
            self.reader.faults.clear()
            (r,) = self.portal.call(self._save_and_restore, 1, 30.0, None)
            assert r is not None and r.committed and r.committed_tokens == len(TOKENS), r
            s = self.engine.statistics().staging
            assert s.in_use == 0 and s.parked == 0 and s.acquired == s.released
            assert self.reader._depth.free == DEPTH
        finally:
            try:
                self.portal.call(self.engine.aclose)
            finally:
                self._cm.__exit__(None, None, None)
                self.reader.close()
                shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_storm_of_cancels_and_kernel_errors_leaves_the_engine_whole(backend: str) -> None:
    """Hypothesis drives the storm (the state machine above); after every step everything is
    back, and at the end a restore commits the saved bytes with staging exactly idle."""
    machine = type(f"UringStorm_{backend}", (UringStorm,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=8,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_the_storm_fires_every_fault(tmp_path: Path) -> None:
    """The faults are real: each one, alone, does to a read what its name says."""
    reader = StormReader(tmp_path)
    path = tmp_path / "obj"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 5 * 4096, np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for fault, want in (("ebadf", errno.EBADF), ("eisdir", errno.EISDIR)):
            reader.faults.append(fault)
            with pytest.raises(OSError) as info:
                reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(4 * 4096), size=5 * 4096)
            assert info.value.errno == want
        reader.faults.append("short")
        n = reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(4 * 4096), size=5 * 4096)
        assert n == 5 * 4096 // 2  # all the copy holds, the last request short
        reader.faults.append("stall")
        with cancellation(lambda: True), pytest.raises(OSError) as info:
            reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(4 * 4096), size=5 * 4096)
        assert info.value.errno == errno.ECANCELED
        assert reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(4 * 4096)) == 5 * 4096
        assert reader._depth.free == DEPTH
    finally:
        os.close(fd)
        reader.close()
