"""FileTier's io_uring reader: same bytes as preadv, the depth it keeps, and every hostile case.

Real conditions: real files (``O_DIRECT`` on the test filesystem where it works), a real ring,
real kernel errors from it (a write-only descriptor: ``EBADF``; too many open files: ``EMFILE``
at setup, in a child process with a lowered ``RLIMIT_NOFILE``), and a read that really stalls in
the ring (a pipe with no writer data: the kernel parks the request until data comes). The one
injected failure is a kernel that refuses ``io_uring_setup`` with ``EPERM`` (io_uring disabled
or filtered), which a test process cannot cause without changing the machine for everyone.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsr
from bsr.testing import make_keys
from bsr.tiers.file import _readers
from bsr.tiers.file._readers import (
    PosixReader,
    UringReader,
    aligned_buffer,
    cancellation,
    default_reader,
)
from bsr.tiers.file._uring import RingError, UringStatus, _reset_status_for_tests, uring_status
from support.engines import make_engine
from support.helpers import (
    blocks_equal,
    filled_cache,
    retarget_stream_read,
    tokens_for,
    two_group_layout,
)

#: tests that need a working ring; the fallback tests (a refused ring, no io_uring) run anywhere
needs_uring = pytest.mark.skipif(
    not uring_status().usable, reason=f"no io_uring here: {uring_status().reason}"
)

LAYOUT = two_group_layout()
CT = LAYOUT.chunk_tokens
BLOCK = 8


def _file(path: Path, nbytes: int, seed: int = 0) -> Path:
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes())
    return path


def _read(reader: Any, path: Path, payload_len: int) -> tuple[int, bytes]:
    header = aligned_buffer(4096)
    payload = aligned_buffer(max(4096, payload_len))[:payload_len]
    n = reader.read(str(path), header, payload)
    return n, bytes(header[: min(n, 4096)]) + bytes(payload[: max(0, n - 4096)])


# ---------------------------------------------------------------------- the reader
@needs_uring
@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 5 * 8192 + 100),
    room=st.integers(0, 6).map(lambda k: k * 4096),
    block=st.sampled_from([4096, 8192, 65536]),
    depth=st.integers(1, 8),
    direct=st.booleans(),
)
def test_reads_match_preadv(
    tmp_path_factory: pytest.TempPathFactory,
    size: int,
    room: int,
    block: int,
    depth: int,
    direct: bool,
) -> None:
    """Any file length (short, unaligned, empty), any buffer, block and depth: the same bytes
    and the same count as one preadv (bytes read contiguously from the start)."""
    path = _file(tmp_path_factory.mktemp("u") / "obj", size, seed=size)
    uring = UringReader(direct=direct, depth=depth, block_bytes=block)
    got = _read(uring, path, room)
    assert got == _read(PosixReader(direct=direct), path, room)
    assert uring.fallback_reads == 0 and uring.disabled_reason is None


@needs_uring
def test_depth_caps_requests_in_flight_across_threads(tmp_path: Path) -> None:
    paths = [_file(tmp_path / f"o{i}", 4096 + (1 << 20), seed=i) for i in range(8)]
    reader = UringReader(depth=3, block_bytes=64 << 10)
    errors: list[BaseException] = []

    def work(mine: list[Path]) -> None:
        try:
            for p in mine:
                n, data = _read(reader, p, 1 << 20)
                assert n == 4096 + (1 << 20) and data == p.read_bytes()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(paths[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert reader.peak_in_flight == 3  # reached, never passed, by four threads together
    reader.set_depth(1)
    _read(reader, paths[0], 1 << 20)
    assert reader._depth.free == 1  # every request gave its place back


@needs_uring
def test_a_read_error_in_the_ring_raises_its_errno_and_the_ring_goes_on(tmp_path: Path) -> None:
    path = _file(tmp_path / "obj", 3 * 4096)
    reader = UringReader(depth=4, block_bytes=4096)
    fd = os.open(path, os.O_WRONLY)  # the kernel refuses to read it: EBADF, from the ring
    try:
        with pytest.raises(OSError) as info:
            reader.read_fd(fd, aligned_buffer(4096), aligned_buffer(8192))
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert _read(reader, path, 8192) == (3 * 4096, path.read_bytes())
    assert reader.fallback_reads == 0 and reader._depth.free == 4


@needs_uring
def test_a_stalled_read_is_withdrawn_from_the_ring_when_abandoned() -> None:
    """A pipe with nothing in it: the kernel parks the read. Once the caller's check says the
    read was abandoned, its request is cancelled; the read then raises ECANCELED and nothing
    lands in the buffer afterwards."""
    r, w = os.pipe()
    reader = UringReader(depth=2)
    header = aligned_buffer(4096)
    header[:] = b"\x01" * 4096
    abandoned = threading.Event()
    out: list[Any] = []

    def work() -> None:
        with cancellation(abandoned.is_set):
            try:
                out.append(reader.read_fd(r, header, aligned_buffer(4096)[:0], size=4096))
            except OSError as exc:
                out.append(exc)

    t = threading.Thread(target=work)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not out  # stalled in the ring
    abandoned.set()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(out[0], OSError) and out[0].errno == errno.ECANCELED
    os.write(w, b"\x02" * 4096)  # data that the cancelled read must never deliver
    time.sleep(0.1)
    assert bytes(header) == b"\x01" * 4096
    assert reader._depth.free == 2
    os.close(r)
    os.close(w)


def test_a_refused_ring_turns_the_reader_into_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """io_uring disabled or filtered (EPERM from io_uring_setup): every read still works,
    through preadv, and the reader says why."""

    class Refused:
        def __init__(self, entries: int) -> None:
            raise RingError(errno.EPERM, "io_uring_setup: Operation not permitted")

    monkeypatch.setattr(_readers, "Ring", Refused)
    path = _file(tmp_path / "obj", 4 * 4096)
    reader = UringReader()
    assert _read(reader, path, 3 * 4096) == (4 * 4096, path.read_bytes())
    assert _read(reader, path, 3 * 4096)[0] == 4 * 4096
    assert reader.disabled_reason is not None and "not permitted" in reader.disabled_reason
    assert reader.fallback_reads == 2


_EMFILE_CHILD = """
import os, resource, sys
from bsr.tiers.file._readers import UringReader, aligned_buffer
path = sys.argv[1]
reader = UringReader()
want = open(path, "rb").read()
fd = os.open(path, os.O_RDONLY)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 1, hard))  # no room for the ring's fd
header, payload = aligned_buffer(4096), aligned_buffer(8192)
n = reader.read_fd(fd, header, payload)
ok = bytes(header) + bytes(payload) == want
print(n, ok, reader.fallback_reads, reader.disabled_reason)
"""


@needs_uring
def test_no_descriptor_for_a_ring_reads_that_object_with_preadv(tmp_path: Path) -> None:
    """EMFILE from io_uring_setup (a real refusal) is not permanent: that read goes through
    preadv and the reader keeps io_uring for later."""
    path = _file(tmp_path / "obj", 3 * 4096)
    out = subprocess.run(
        [sys.executable, "-c", _EMFILE_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["12288", "True", "1", "None"]


def test_without_io_uring_the_default_reader_is_preadv(tmp_path: Path) -> None:
    try:
        _reset_status_for_tests(UringStatus(False, "kernel.io_uring_disabled is 2"))
        assert type(default_reader("auto")) is PosixReader
        assert type(default_reader("uring")) is PosixReader
        assert type(bsr.FileTier(tmp_path, 1 << 20).reader) is PosixReader
    finally:
        _reset_status_for_tests(None)


@needs_uring
def test_with_io_uring_the_default_reader_is_uring(tmp_path: Path) -> None:
    assert isinstance(bsr.FileTier(tmp_path, 1 << 20).reader, UringReader)
    assert isinstance(default_reader("uring"), UringReader)


# ---------------------------------------------------------------------- FileTier and the engine
def _engine(tiers: list[bsr.Tier], window: int = 2, io_depth: int = 2) -> bsr.RestoreEngine:
    return make_engine(LAYOUT, tiers, window=window, io_depth=io_depth, model_id="uring")


@needs_uring
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("reader", ["uring", "posix"])
def test_restore_through_each_reader_gives_the_saved_bytes(
    tmp_path: Path, reader: str, direct: bool
) -> None:
    n = 6
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = torch.arange(n * CT // BLOCK)

    async def main() -> None:
        ft = bsr.FileTier(tmp_path, 1 << 26, reader=reader, direct_io=direct)
        assert isinstance(ft.reader, UringReader) == (reader == "uring")
        async with _engine([ft], window=4, io_depth=2) as eng:
            assert (await eng.save(toks, src, ids)).ok
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            r = await eng.restore(toks, dst, ids)
            assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)
            if isinstance(ft.reader, UringReader):
                assert ft.reader.fallback_reads == 0 and ft.reader.peak_in_flight >= 1

    anyio.run(main)


@pytest.mark.parametrize("direct", [True, False])
def test_a_restore_through_a_refused_ring_reads_every_object_with_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """io_uring refused (EPERM from io_uring_setup: disabled or filtered): a FileTier built to
    read through it restores every chunk through preadv, commits the saved bytes, and gives every
    slot back. Runs with or without io_uring on the machine."""

    class Refused:
        def __init__(self, entries: int) -> None:
            raise RingError(errno.EPERM, "io_uring_setup: Operation not permitted")

    monkeypatch.setattr(_readers, "Ring", Refused)
    n = 5
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    reader = UringReader(direct=direct, depth=4)

    async def main() -> None:
        ft = bsr.FileTier(tmp_path, 1 << 26, reader=reader, direct_io=direct)
        async with _engine([ft], window=2, io_depth=2) as eng:
            assert (await eng.save(toks, src, ids)).ok
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            r = await eng.restore(toks, dst, ids)
            assert r.committed_tokens == n * CT and r.fallbacks == 0
            assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released
        assert ft.statistics().errors == 0

    anyio.run(main)
    assert reader.disabled_reason is not None and "not permitted" in reader.disabled_reason
    assert reader.fallback_reads >= len(LAYOUT.needed_objects(n))  # every object, by preadv
    assert reader.peak_in_flight == 0  # nothing ever went through a ring


class HostileReader(UringReader):
    """A real io_uring reader that, for the first ``traps`` objects it reads, reads another
    descriptor instead of the object: a write-only one (``EBADF`` from the ring) or the read
    end of an empty pipe (the request stalls in the ring until cancelled)."""

    def __init__(self, kind: str, traps: int = 1) -> None:
        super().__init__(depth=4)
        self.kind = kind
        self.traps = traps
        self.trapped = threading.Event()
        self.pipe = os.pipe()
        self._guard = threading.Lock()

    def read_fd(
        self, fd: int, header: memoryview, payload: memoryview, *, size: int | None = None
    ) -> int:
        with self._guard:
            trap = self.traps > 0
            self.traps -= trap
        if not trap:
            return super().read_fd(fd, header, payload, size=size)
        self.trapped.set()
        if self.kind == "stall":
            return super().read_fd(self.pipe[0], header, payload[:0], size=4096)
        bad = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
        try:
            return super().read_fd(bad, header, payload, size=size)
        finally:
            os.close(bad)

    def _stream_pieces(self, r: Any, bufs: Any) -> Any:
        # a restore into a host cache streams its reads (UringReader.stream): the same traps,
        # on the descriptor the stream reads (the tier closes it when the object ends)
        with self._guard:
            trap = self.traps > 0
            self.traps -= trap
        if trap:
            self.trapped.set()
            retarget_stream_read(r, "stall" if self.kind == "stall" else "ebadf", self.pipe[0])
        return super()._stream_pieces(r, bufs)

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)


async def _poll(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await anyio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


@needs_uring
def test_a_read_error_in_the_ring_falls_to_the_next_tier(tmp_path: Path) -> None:
    n = 4
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    hostile = HostileReader("ebadf", traps=1)

    async def main() -> None:
        bad = bsr.FileTier(tmp_path / "a", 1 << 26, name="a", reader=hostile)
        good = bsr.FileTier(tmp_path / "b", 1 << 26, name="b")
        async with _engine([bad, good]) as eng:
            assert (await eng.save(toks, src, ids)).ok
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            r = await eng.restore(toks, dst, ids)
            assert hostile.trapped.is_set()
            assert r.committed and r.fallbacks == 1 and r.bytes_by_tier.get("b", 0) > 0
            assert blocks_equal(LAYOUT, src, ids, dst, ids, n)
            assert bad.statistics().errors == 1
            s = eng.staging.statistics()
            assert s.in_use == 0 and s.acquired == s.released

    try:
        anyio.run(main)
    finally:
        hostile.close()


@needs_uring
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_read_stalled_in_the_ring_ends_the_restore_and_returns_its_slot(
    tmp_path: Path, backend: str, how: str
) -> None:
    """The restore ends by its deadline (or the caller's cancel) although a request is stuck in
    the ring; the run's end withdraws the request, so the parked slot comes back without
    anyone feeding the pipe, and the next restore of the same tier commits."""
    n = 4
    toks = tokens_for(n * CT)
    src = filled_cache(LAYOUT, 64, BLOCK)
    ids = torch.arange(n * CT // BLOCK)
    hostile = HostileReader("stall", traps=1)

    async def main() -> None:
        ft = bsr.FileTier(tmp_path, 1 << 26, reader=hostile)
        async with _engine([ft]) as eng:
            assert (await eng.save(toks, src, ids)).ok
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            t0 = time.monotonic()
            result = None
            if how == "deadline":
                result = await eng.restore(toks, dst, ids, deadline_s=0.5)
            else:
                with anyio.move_on_after(0.5):
                    await eng.restore(toks, dst, ids)
            assert time.monotonic() - t0 < 3
            assert hostile.trapped.is_set()
            if result is not None:
                assert result.reason is bsr.Reason.DEADLINE and result.committed_tokens == 0
            await _poll(lambda: eng.staging.statistics().in_use == 0, "every slot is back")
            s = eng.staging.statistics()
            assert s.parked == 0 and s.acquired == s.released
            assert hostile._depth.free == hostile.depth  # the stuck request gave its place back
            dst = bsr.PagedKVCache(LAYOUT, 64, BLOCK)
            r = await eng.restore(toks, dst, ids)
            assert r.committed_tokens == n * CT and blocks_equal(LAYOUT, src, ids, dst, ids, n)

    try:
        anyio.run(main, backend=backend)
    finally:
        hostile.close()


@needs_uring
def test_read_depth_is_calibrated_or_chosen(tmp_path: Path) -> None:
    keys = make_keys(6)
    blob = np.random.default_rng(0).integers(0, 256, 1 << 20, np.uint8)

    async def main() -> None:
        async with bsr.FileTier(tmp_path / "a", 1 << 26, direct_io=True) as t:
            assert isinstance(t.reader, UringReader)
            assert t.read_calibration == {"depth": 32, "source": "default", "bandwidth_Bps": {}}
            for k in keys:
                await t.write(k, "kv", blob)
            cal = await t.calibrate_read_depth()
            assert cal is not None and cal["source"] == "calibrated"
            assert set(cal["bandwidth_Bps"]) == {4, 16, 64} and cal["depth"] in (4, 16, 64)
            best = max(cal["bandwidth_Bps"].values())
            assert cal["bandwidth_Bps"][cal["depth"]] >= 0.9 * best
            assert t.reader.depth == cal["depth"]
            d = np.zeros(1 << 20, np.uint8)
            await t.read_into(keys[0], "kv", d)
            assert np.array_equal(d, blob)
        fixed = bsr.FileTier(tmp_path / "b", 1 << 26, read_depth=8)
        async with fixed:
            assert isinstance(fixed.reader, UringReader) and fixed.reader.depth == 8
            assert fixed.read_calibration is None
        with pytest.raises(bsr.ConfigError, match="read_depth"):
            bsr.FileTier(tmp_path / "c", 1 << 26, read_depth=0)

    anyio.run(main)


@needs_uring
def test_config_builds_a_file_tier_with_its_reader_and_depth(tmp_path: Path) -> None:
    cfg = bsr.EngineConfig.from_dict(
        {
            "tiers": [
                {
                    "kind": "file",
                    "path": str(tmp_path),
                    "capacity_bytes": "1MiB",
                    "reader": "uring",
                    "read_depth": 12,
                }
            ]
        }
    )
    (tier,) = cfg.build_tiers()
    assert isinstance(tier, bsr.FileTier) and isinstance(tier.reader, UringReader)
    assert tier.reader.depth == 12 and tier.reader.depth_chosen
    with pytest.raises(bsr.ConfigError, match="read_depth"):
        bsr.EngineConfig.from_dict(
            {
                "tiers": [
                    {
                        "kind": "file",
                        "path": str(tmp_path),
                        "capacity_bytes": "1MiB",
                        "read_depth": -1,
                    }
                ]
            }
        )


@needs_uring
def test_a_depth_beyond_the_threads_ring_never_overfills_it(tmp_path: Path) -> None:
    """The depth can grow after a thread made its ring (calibration does this): a read then
    keeps no more requests in flight than the ring holds (an overfilled ring loses entries)."""
    path = _file(tmp_path / "obj", 4096 + (4 << 20))
    reader = UringReader(depth=2, block_bytes=4096)  # 1024 payload requests of 4 KiB
    assert _read(reader, path, 4 << 20) == (4096 + (4 << 20), path.read_bytes())
    ring = reader._ring()
    assert ring is not None
    reader.set_depth(4 * ring.entries)
    assert _read(reader, path, 4 << 20) == (4096 + (4 << 20), path.read_bytes())
    assert reader.peak_in_flight == ring.entries
