"""FileTier against a hostile store: what it owns, what it leaves alone, what it never waits on.

Each test names the defect class it pins down (issue "Hardening", items 1, 4, 5, 6, 8, 9, 10, 12);
each fails on bsr 0.1's FileTier. The generic hostile-store section of
``bsr.testing.TierConformance`` runs on FileTier in ``test_tiers.py`` as well.

Real conditions, no mocks: FIFOs from ``os.mkfifo``, real symlinks, a tmpfs mounted small (disk
full) or remounted read-only (skipped where ``mount`` is refused), EACCES produced by a forked
child that drops root (``os.setuid``) so permission bits apply, a reader that blocks in a worker
thread as a read stuck in the kernel would.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import bsr
from bsr.core._object import HEADER_SIZE, object_size
from bsr.testing import (
    Fault,
    FaultKind,
    FaultPlan,
    FaultyTier,
    make_keys,
    payload,
    remount_read_only,
    tmpfs_mount,
)
from bsr.tiers.file import _tier as _file
from bsr.tiers.file._readers import PosixReader
from bsr.tiers.file._root import LEDGER_NAME
from bsr.tiers.file._tier import (
    MARKER_KIND,
    MARKER_NAME,
    MARKER_VERSION,
    OBJECTS_DIR,
    QUARANTINE_DIR,
    TMP_DIR,
    ReadFailure,
    classify_read_error,
)
from support.helpers import open_fds

PER_OBJECT = object_size(len(payload(0)))
DEAD_PID = 2**22 + 12345  # above Linux's PID_MAX_LIMIT: no live process has it


def tier(root: Path, capacity: int = 1 << 26, **kw: Any) -> bsr.FileTier:
    return bsr.FileTier(root, capacity, reader="posix", **kw)


def dst() -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.zeros(len(payload(0)), dtype=np.uint8)


def temp_name(oid: str, pid: int = DEAD_PID) -> str:
    return f"{oid}.{pid}.abcdef012345.tmp"  # the writer's exact grammar


def oid_of(key: bsr.ChunkKey, group: str = "kv") -> str:
    return bsr.ObjectKey(key, group).object_id


# ---------------------------------------------------------------------- layout constants
def test_layout_names_are_module_constants() -> None:
    assert (MARKER_NAME, OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR) == (
        ".bsr-tier",
        "objects",
        "tmp",
        "quarantine",
    )
    oid = "ab" * 20
    assert _file.object_relpath(oid) == f"objects/ab/{oid}.bsr"
    assert _file.TMP_NAME_RE.match(temp_name(oid))
    assert not _file.TMP_NAME_RE.match(f"{oid}.{'9' * 20}.abcdef012345.tmp")
    assert not _file.TMP_NAME_RE.match("report.1999.final.pdf")


# ---------------------------------------------------------------------- 4: ownership
@pytest.mark.anyio
async def test_empty_and_missing_roots_are_claimed_with_a_marker(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "missing" / "deeper"):
        async with tier(root):
            pass
        doc = json.loads((root / MARKER_NAME).read_text())
        assert doc == {"kind": MARKER_KIND, "version": MARKER_VERSION}
        async with tier(root):  # ours now: opens again
            pass


@pytest.mark.anyio
async def test_non_empty_directory_without_marker_is_refused_and_untouched(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    report = tmp_path / "tmp" / "report.1999.final.pdf"
    report.write_bytes(b"quarterly figures")
    (tmp_path / "notes.txt").write_text("mine")

    async def main() -> None:
        with pytest.raises(bsr.TierRootError, match="empty") as info:
            await tier(tmp_path).open()
        assert isinstance(info.value, bsr.TierError)
        assert str(tmp_path) in str(info.value)

    await main()
    assert report.read_bytes() == b"quarterly figures"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "tmp"]


@pytest.mark.anyio
async def test_foreign_or_newer_marker_is_refused(tmp_path: Path) -> None:
    for body in (b"hello", json.dumps({"kind": "other"}).encode(), b"\xff\xfe"):
        (tmp_path / MARKER_NAME).write_bytes(body)
        with pytest.raises(bsr.TierRootError, match="not a bsr FileTier marker"):
            await tier(tmp_path).open()
    (tmp_path / MARKER_NAME).write_text(json.dumps({"kind": MARKER_KIND, "version": 99}))
    with pytest.raises(bsr.TierRootError, match="newer bsr"):
        await tier(tmp_path).open()
    (tmp_path / MARKER_NAME).unlink()
    os.mkfifo(tmp_path / MARKER_NAME)
    with anyio.fail_after(5), pytest.raises(bsr.TierRootError, match="FIFO"):
        await tier(tmp_path).open()


@pytest.mark.anyio
async def test_pre_marker_store_is_claimed(tmp_path: Path) -> None:
    keys = make_keys(1)

    async with tier(tmp_path) as t:
        await t.write(keys[0], "kv", payload(0))
    (tmp_path / MARKER_NAME).unlink()  # a bsr 0.1 store: objects/, tmp/, quarantine/ only
    async with tier(tmp_path) as again:
        d = dst()
        await again.read_into(keys[0], "kv", d)
        assert np.array_equal(d, payload(0))
    assert (tmp_path / MARKER_NAME).exists()


@pytest.mark.anyio
async def test_only_files_of_the_exact_temp_grammar_are_deleted(tmp_path: Path) -> None:
    keys = make_keys(2)
    oid = oid_of(keys[1])

    async with tier(tmp_path) as t:
        await t.write(keys[0], "kv", payload(0))
    tmp = tmp_path / TMP_DIR
    dead = tmp / temp_name(oid)
    dead.write_bytes(b"x" * 4096)
    keep = {
        tmp / "report.1999.final.pdf": b"someone's report",  # 0.1 deleted this one
        tmp / f"{oid}.{DEAD_PID}.abcdef.tmp": b"short random part",
        tmp / f"{oid}.0{DEAD_PID}.abcdef012345.tmp": b"leading zero",
        tmp / f"{oid}.{DEAD_PID}.abcdef012345.tmp.bak": b"suffix",
        tmp / f"{oid.upper()}.{DEAD_PID}.abcdef012345.tmp": b"upper case",
    }
    for path, body in keep.items():
        path.write_bytes(body)
    async with tier(tmp_path) as again:
        assert again.statistics().junk == len(keep)
    assert not dead.exists()
    for path, body in keep.items():
        assert path.read_bytes() == body


# ---------------------------------------------------------------------- 5: junk never blocks open
@pytest.mark.anyio
async def test_junk_in_tmp_is_skipped_and_counted(tmp_path: Path) -> None:
    keys = make_keys(2)
    oid = oid_of(keys[1])

    async with tier(tmp_path) as t:
        await t.write(keys[0], "kv", payload(0))
    tmp = tmp_path / TMP_DIR
    overflow = tmp / f"{oid}.{'9' * 25}.abcdef012345.tmp"  # 0.1: OverflowError
    overflow.write_bytes(b"junk")
    as_dir = tmp / temp_name(oid)  # 0.1: IsADirectoryError
    as_dir.mkdir()
    (as_dir / "inner").write_bytes(b"inner")
    fifo = tmp / temp_name(oid, DEAD_PID + 1)
    os.mkfifo(fifo)
    link = tmp / temp_name(oid, DEAD_PID + 2)
    link.symlink_to(tmp_path / OBJECTS_DIR)
    with anyio.fail_after(10):
        async with tier(tmp_path) as again:
            assert again.statistics().junk == 4
            assert await again.contains(keys[0], "kv")
    assert overflow.exists() and (as_dir / "inner").exists()
    assert fifo.is_fifo() and link.is_symlink()


@pytest.mark.anyio
async def test_tmp_as_a_regular_file_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    async with tier(tmp_path):
        pass
    shutil.rmtree(tmp_path / TMP_DIR)
    (tmp_path / TMP_DIR).write_bytes(b"not a directory")  # 0.1: FileExistsError
    with pytest.raises(bsr.TierRootError, match="remove or rename it") as info:
        await tier(tmp_path).open()
    assert str(tmp_path / TMP_DIR) in str(info.value)
    (tmp_path / TMP_DIR).unlink()
    (tmp_path / TMP_DIR).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(bsr.TierRootError, match="symlink"):
        await tier(tmp_path).open()


@pytest.mark.anyio
async def test_dead_writers_temp_file_on_a_read_only_filesystem(tmp_path: Path) -> None:
    keys = make_keys(2)
    with tmpfs_mount(tmp_path / "fs", 4 << 20) as fs:

        async def main() -> None:
            async with tier(fs) as t:
                await t.write(keys[0], "kv", payload(0))
            dead = fs / TMP_DIR / temp_name(oid_of(keys[1]))
            dead.write_bytes(b"half an object")
            remount_read_only(fs)  # unlink now fails with EROFS (0.1: open raised OSError)
            async with tier(fs) as again:
                assert again.statistics().unreadable == 1
                d = dst()
                await again.read_into(keys[0], "kv", d)
                assert np.array_equal(d, payload(0))
                with pytest.raises(bsr.TierIOError):
                    await again.write(keys[1], "kv", payload(1))
            assert dead.exists()

        await main()


@pytest.mark.anyio
async def test_read_only_empty_root_cannot_be_claimed_typed(tmp_path: Path) -> None:
    with tmpfs_mount(tmp_path / "fs", 1 << 20) as fs:
        remount_read_only(fs)

        async def main() -> None:
            with pytest.raises(bsr.TierRootError, match="writable"):
                await tier(fs).open()

        await main()


# ---------------------------------------------------------------------- 6: no temp-file leaks
@pytest.mark.anyio
async def test_failed_renames_leave_no_temp_files(tmp_path: Path) -> None:
    keys = make_keys(20)

    async with tier(tmp_path, capacity=PER_OBJECT) as t:
        for k in keys:  # a non-empty directory at the final path: rename(2) fails
            final = t.object_path(k, "kv")
            final.mkdir(parents=True)
            (final / "occupied").write_bytes(b"")
        for i, k in enumerate(keys):
            with pytest.raises(bsr.TierIOError):
                await t.write(k, "kv", payload(i))
        assert list((tmp_path / TMP_DIR).iterdir()) == []  # 0.1 left 20 temp files
        s = t.statistics()
        assert (s.objects, s.bytes, s.errors) == (0, 0, 20)
        other = make_keys(1, model="other")[0]
        assert await t.write(other, "kv", payload(0)) is True  # no bytes stayed reserved


@pytest.mark.anyio
async def test_cancelled_save_leaves_no_temp_file_and_no_reservation(tmp_path: Path) -> None:
    keys = make_keys(8)

    async with tier(tmp_path, capacity=2 * PER_OBJECT) as t:
        for i, k in enumerate(keys):
            with anyio.move_on_after(0.0005 * i):
                await t.write(k, "kv", payload(i))
        assert list((tmp_path / TMP_DIR).iterdir()) == []
        s = t.statistics()
        on_disk = sum(p.stat().st_size for p in (tmp_path / OBJECTS_DIR).rglob("*.bsr"))
        assert s.bytes == on_disk <= 2 * PER_OBJECT
        # whatever reached objects/ is indexed; everything else gave its bytes back
        assert s.objects == len(list((tmp_path / OBJECTS_DIR).rglob("*.bsr")))
        assert t._space is not None and t._space.seen.reserved == {}


# ---------------------------------------------------------------------- 8: capacity
@pytest.mark.anyio
async def test_concurrent_saves_never_exceed_capacity_also_after_reopen(tmp_path: Path) -> None:
    keys = make_keys(64)
    capacity = 6 * PER_OBJECT
    peaks: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        # What is on disk, objects and temp files together, counted under the root's ledger lock
        # so a file renamed from tmp/ to objects/ during the walk is not seen twice (the tier
        # reserves, renames and evicts under that lock; a temp file grows only up to its
        # reservation outside it).
        while not stop.is_set():
            try:
                fd = os.open(tmp_path / LEDGER_NAME, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # not opened yet
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                total = 0
                for sub in (OBJECTS_DIR, TMP_DIR):
                    for p in (tmp_path / sub).rglob("*"):
                        try:
                            if p.is_file():
                                total += p.stat().st_size
                        except FileNotFoundError:
                            pass
                peaks.append(total)
            finally:
                os.close(fd)  # releases the lock
            stop.wait(0.002)  # let the writers have the lock too

    async def main() -> None:
        # 64 writes into room for 6: a write waits for room as long as it takes (the default
        # lock_timeout_s, 2 s, ran out on a busy machine: a skipped write is not what this checks)
        async with tier(
            tmp_path, capacity=capacity, io_threads=16, fsync=False, lock_timeout_s=300.0
        ) as t:
            w = threading.Thread(target=watch)
            w.start()
            try:
                async with anyio.create_task_group() as tg:
                    for i, k in enumerate(keys):
                        tg.start_soon(t.write, k, "kv", payload(i % 7))
            finally:
                stop.set()
                w.join()
            s = t.statistics()
            assert s.peak_bytes <= capacity and s.bytes <= capacity, s
        async with tier(tmp_path, capacity=capacity) as again:
            assert again.statistics().bytes <= capacity
        on_disk = sum(p.stat().st_size for p in (tmp_path / OBJECTS_DIR).rglob("*.bsr"))
        assert on_disk <= capacity, on_disk / capacity  # 0.1: 1.09x, and it stayed there

    await main()
    # victims are removed under the lock of the write that evicts them: never over, seen whole
    assert peaks and max(peaks) <= capacity, max(peaks) / capacity


@pytest.mark.anyio
async def test_reopen_with_a_smaller_capacity_trims_lru_first(tmp_path: Path) -> None:
    keys = make_keys(4)

    async with tier(tmp_path) as t:
        for i, k in enumerate(keys):
            await t.write(k, "kv", payload(i))
            os.utime(t.object_path(k, "kv"), (1000 + i, 1000 + i))
    async with tier(tmp_path, capacity=2 * PER_OBJECT) as small:
        present = await small.contains_many([bsr.ObjectKey(k, "kv") for k in keys])
        assert present == [False, False, True, True]
        assert small.statistics().evictions == 2
        assert small.statistics().peak_bytes <= 2 * PER_OBJECT  # trimmed before counting
    assert len(list((tmp_path / OBJECTS_DIR).rglob("*.bsr"))) == 2


# ---------------------------------------------------------------------- 1 and 9: FIFOs, links
@pytest.mark.anyio
async def test_fifo_and_symlink_to_fifo_after_open_never_block(tmp_path: Path) -> None:
    keys = make_keys(2)

    async with tier(tmp_path) as t:
        for i, k in enumerate(keys):
            await t.write(k, "kv", payload(i))
        p0, p1 = (t.object_path(k, "kv") for k in keys)
        p0.unlink()
        os.mkfifo(p0)
        p1.unlink()
        os.mkfifo(tmp_path / "outside.fifo")
        p1.symlink_to(tmp_path / "outside.fifo")
        for k in keys:  # 0.1: blocked in open(2) forever, past any deadline
            t0 = time.monotonic()
            with anyio.fail_after(10), pytest.raises(bsr.CorruptObjectError):
                await t.read_into(k, "kv", dst())
            assert time.monotonic() - t0 < 10  # a FIFO's open(2) waits forever
            await t.quarantine(k, "kv", "not_regular")  # what the engine does next
        assert p0.is_fifo() and p1.is_symlink()  # not bsr's: neither moved nor deleted
        assert list((tmp_path / QUARANTINE_DIR).iterdir()) == []


@pytest.mark.anyio
async def test_symlinked_object_is_junk_and_never_read(tmp_path: Path) -> None:
    keys = make_keys(2)
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "l2"

    async with tier(root) as t:
        await t.write(keys[0], "kv", payload(0))
        await t.write(keys[1], "kv", payload(1))
        path = t.object_path(keys[0], "kv")
        shutil.copyfile(path, outside / "copy")
        path.unlink()
        path.symlink_to(outside / "copy")  # a valid object: 0.1 followed it and read it
        with pytest.raises(bsr.CorruptObjectError, match="not a regular file"):
            await t.read_into(keys[0], "kv", dst())
        sub = t.object_path(keys[1], "kv").parent
        shutil.move(sub, outside / "sub")
        sub.symlink_to(outside / "sub")  # a whole object directory links out of the root
        with pytest.raises(bsr.CorruptObjectError):
            await t.read_into(keys[1], "kv", dst())
    async with tier(root) as again:
        assert await again.contains_many([bsr.ObjectKey(k, "kv") for k in keys]) == [
            False,
            False,
        ]
        assert again.statistics().junk == 2
        assert again.statistics().quarantined == 0
    assert path.is_symlink() and sub.is_symlink()
    assert (outside / "copy").exists() and (outside / "sub").is_dir()


@pytest.mark.anyio
async def test_write_never_follows_a_symlinked_object_directory(tmp_path: Path) -> None:
    keys = make_keys(1)
    outside = tmp_path / "outside"
    outside.mkdir()

    async with tier(tmp_path / "l2") as t:
        sub = t.object_path(keys[0], "kv").parent
        sub.symlink_to(outside)
        with pytest.raises(bsr.TierIOError, match="not a directory bsr made"):
            await t.write(keys[0], "kv", payload(0))
    assert list(outside.iterdir()) == []
    assert list((tmp_path / "l2" / TMP_DIR).iterdir()) == []


# ---------------------------------------------------------------------- kept fan-out directories
# A tier opens each objects/<id[:2]> directory once and reads through that descriptor (a
# restore of 256 objects opened and closed a directory for most of them).


@pytest.mark.anyio
async def test_a_fan_out_directory_made_anew_is_read_through_a_fresh_descriptor(
    tmp_path: Path,
) -> None:
    """The directory a tier keeps open is removed and made again (the object copied in as
    another process would write it): the next read finds the object, not a miss forever."""
    keys = make_keys(1)
    async with tier(tmp_path / "l2") as t:
        await t.write(keys[0], "kv", payload(0))
        out = dst()
        assert await t.read_into(keys[0], "kv", out) == len(payload(0))
        path = t.object_path(keys[0], "kv")
        old = path.parent.with_name(path.parent.name + ".old")
        path.parent.rename(old)
        path.parent.mkdir()
        shutil.copyfile(old / path.name, path)
        shutil.rmtree(old)  # the kept descriptor now names a removed directory
        out[:] = 0
        assert await t.read_into(keys[0], "kv", out) == len(payload(0))
        assert bytes(out) == bytes(payload(0))
        assert t.read_into_blocking(keys[0], "kv", dst()) == len(payload(0))


@pytest.mark.anyio
async def test_missing_objects_cost_no_descriptor_and_a_closed_tier_holds_none(
    tmp_path: Path,
) -> None:
    """Objects removed behind the tier's back are misses through the kept directories (no
    descriptor per missing object), and closing the tier closes every directory it kept."""
    keys = make_keys(24)
    before = open_fds()
    async with tier(tmp_path / "l2") as t:
        for i, k in enumerate(keys):
            await t.write(k, "kv", payload(i))
        for k in keys:
            await t.read_into(k, "kv", dst())
        kept = open_fds()
        subdirs = {t.object_path(k, "kv").parent.name for k in keys}
        assert kept - before <= len(subdirs) + 8  # the tier's own descriptors, and one per dir
        for k in keys:
            t.object_path(k, "kv").unlink()
        for k in keys:
            with pytest.raises(bsr.ObjectNotFoundError):
                await t.read_into(k, "kv", dst())
        assert open_fds() == kept
    assert open_fds() == before


# ---------------------------------------------------------------------- 1: abandonable reads
class BlockingReader(PosixReader):
    """A POSIX reader whose reads wait for ``gate``: a read stuck in the kernel, as on a hung
    mount, seen from the tier (its worker thread does not return)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def read_fd(self, fd: int, header: memoryview, payload: memoryview) -> int:
        self.entered.release()
        self.gate.wait(30)
        return super().read_fd(fd, header, payload)


@pytest.mark.anyio
async def test_stuck_read_is_abandoned_counted_and_bounded(tmp_path: Path) -> None:
    keys = make_keys(2)
    reader = BlockingReader()

    async with bsr.FileTier(tmp_path, 1 << 26, reader=reader, io_threads=1) as t:
        await t.write(keys[0], "kv", payload(0))
        await t.write(keys[1], "kv", payload(1))
        t0 = time.monotonic()
        with anyio.move_on_after(0.3):
            await t.read_into(keys[0], "kv", dst())
        assert time.monotonic() - t0 < 5  # the caller is not held by the stuck worker (forever)
        assert t.statistics().abandoned_reads == 1
        # io_threads (1) reads are stuck: new reads fail fast instead of piling up threads
        with anyio.fail_after(1), pytest.raises(bsr.TierIOError, match="stuck"):
            await t.read_into(keys[1], "kv", dst())
        reader.gate.set()
        with anyio.fail_after(5):
            while t._reads.stuck:  # noqa: ASYNC110 (the worker returns once the gate opens)
                await anyio.sleep(0.01)
        d = dst()
        await t.read_into(keys[1], "kv", d)
        assert np.array_equal(d, payload(1))


# ---------------------------------------------------------------------- 10: permission errors
def test_permission_errors_classify_as_io_not_corruption() -> None:
    import errno

    assert classify_read_error(PermissionError(errno.EACCES, "denied")) is ReadFailure.IO
    assert classify_read_error(PermissionError(errno.EPERM, "denied")) is ReadFailure.IO
    assert classify_read_error(OSError(errno.EIO, "io")) is ReadFailure.IO
    assert classify_read_error(FileNotFoundError(errno.ENOENT, "gone")) is ReadFailure.MISSING
    assert classify_read_error(OSError(errno.ELOOP, "link")) is ReadFailure.NOT_REGULAR


@pytest.mark.anyio
async def test_permission_denied_through_a_faulty_tier_is_an_io_error_to_the_engine(
    tmp_path: Path,
) -> None:
    """The engine retires an I/O error in memory and never quarantines the file."""
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 1, 256),))
    tokens = list(range(1, 33))

    inner = tier(tmp_path)
    faulty = FaultyTier(inner, FaultPlan(seed=1))
    engine = bsr.RestoreEngine(
        layout,
        tiers=[faulty],
        window=2,
        io_depth=2,
        namespace=bsr.Namespace(model_id="hostile"),
    )
    cache = bsr.PagedKVCache(layout, num_blocks=8, block_tokens=16, device="cpu")
    async with engine:
        await engine.save(tokens, cache, [0, 1])
        faulty.plan = FaultPlan(seed=1, faults=(Fault(FaultKind.READ_ERROR),))
        result = await engine.restore(tokens, cache, [2, 3])
        assert not result.committed  # retired in the engine's memory (logical) only:
        assert faulty.statistics().quarantined == 0  # the tier moved nothing
    assert list((tmp_path / QUARANTINE_DIR).iterdir()) == []
    assert len(list((tmp_path / OBJECTS_DIR).rglob("*.bsr"))) == 2


def _as_nobody(fn: Any) -> dict[str, Any]:
    """Run ``fn()`` in a forked child that dropped root (uid/gid 65534); its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no return from here
        os.close(r)
        code = 0
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = fn()
        except BaseException as exc:  # report anything, exit nonzero
            out, code = {"error": repr(exc)}, 1
        os.write(w, json.dumps(out).encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, result
    return result


def _open_to_nobody(tmp_path: Path, root: Path) -> None:
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        p.chmod(p.stat().st_mode | 0o005)  # the child may traverse to the store
    for p in [root, *root.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o644)


def test_unreadable_objects_are_skipped_not_quarantined(tmp_path: Path) -> None:
    # sync on purpose: the check runs in a forked child as another user, with its own event loop
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges in a child (as non-root, see conformance)")
    keys = make_keys(3)
    root = tmp_path / "store"

    async def prepare() -> None:
        async with tier(root) as t:
            for i, k in enumerate(keys):
                await t.write(k, "kv", payload(i))
            await t.read_into(keys[2], "kv", dst())  # warm every import the child will use

    anyio.run(prepare)
    _open_to_nobody(tmp_path, root)
    victims = [tier(root).object_path(k, "kv") for k in keys[:2]]
    for v in victims:
        v.chmod(0o600)  # root's: EACCES for the child
    before = [v.read_bytes() for v in victims]

    def child() -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            async with tier(root) as t:
                s = t.statistics()
                present = await t.contains_many([bsr.ObjectKey(k, "kv") for k in keys])
                d = dst()
                await t.read_into(keys[2], "kv", d)
                return {
                    "uid": os.geteuid(),
                    "unreadable": s.unreadable,
                    "quarantined": s.quarantined,
                    "present": present,
                    "ok": bool(np.array_equal(d, payload(2))),
                }

        return anyio.run(go)

    got = _as_nobody(child)
    # 0.1 moved both intact objects to quarantine/ ("unreadable:13")
    assert got == {
        "uid": 65534,
        "unreadable": 2,
        "quarantined": 0,
        "present": [False, False, True],
        "ok": True,
    }
    assert [v.read_bytes() for v in victims] == before
    assert list((root / QUARANTINE_DIR).iterdir()) == []


@pytest.mark.anyio
async def test_permission_denied_at_read_is_a_tier_io_error(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges in a child")
    keys = make_keys(1)
    root = tmp_path / "store"

    async with tier(root) as t:
        await t.write(keys[0], "kv", payload(0))
        t.read_into_blocking(keys[0], "kv", dst())  # warm imports
        _open_to_nobody(tmp_path, root)
        victim = t.object_path(keys[0], "kv")
        victim.chmod(0o600)  # indexed while readable, denied now

        def read_in_child() -> dict[str, Any]:
            try:
                t.read_into_blocking(keys[0], "kv", dst())
            except bsr.BsrError as exc:
                return {
                    "type": type(exc).__name__,
                    "object_error": isinstance(exc, bsr.ObjectError),
                    "errno": getattr(exc, "errno", None),
                }
            return {"type": None}

        got = _as_nobody(read_in_child)
        assert got == {"type": "TierIOError", "object_error": False, "errno": 13}
        assert victim.exists()


# ---------------------------------------------------------------------- 12: misleading errors
@pytest.mark.anyio
async def test_empty_file_is_truncated_even_after_a_valid_read_on_the_same_thread(
    tmp_path: Path,
) -> None:
    keys = make_keys(2)

    async with tier(tmp_path, io_threads=1) as t:  # one worker thread: one header buffer
        await t.write(keys[0], "kv", payload(0))
        await t.write(keys[1], "kv", payload(1))
        os.truncate(t.object_path(keys[1], "kv"), 0)
        for _ in range(3):
            await t.read_into(keys[0], "kv", dst())
            # 0.1: ForeignObjectError, from keys[0]'s header left in the thread's buffer
            with pytest.raises(bsr.TruncatedObjectError):
                await t.read_into(keys[1], "kv", dst())
            t.read_into_blocking(keys[0], "kv", dst())
            with pytest.raises(bsr.TruncatedObjectError):
                t.read_into_blocking(keys[1], "kv", dst())


@pytest.mark.anyio
async def test_forged_oversized_length_is_an_object_error(tmp_path: Path) -> None:
    from bsr.core._object import encode_header

    keys = make_keys(1)

    async with tier(tmp_path) as t:
        await t.write(keys[0], "kv", payload(0))
        path = t.object_path(keys[0], "kv")
        blob = bytearray(path.read_bytes())
        blob[:HEADER_SIZE] = encode_header(bsr.ObjectKey(keys[0], "kv"), 1 << 40, 0)
        path.write_bytes(bytes(blob))
        # 0.1: ConfigError (destination too small), then treated as an I/O error
        with pytest.raises(bsr.ObjectError) as info:
            await t.read_into(keys[0], "kv", dst())
        assert not isinstance(info.value, bsr.ConfigError)


def test_unlistable_store_directory_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    # sync on purpose: the check runs in a forked child as another user, with its own event loop
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges in a child")
    root = tmp_path / "store"

    async def prepare() -> None:
        async with tier(root) as t:
            await t.write(make_keys(1)[0], "kv", payload(0))

    anyio.run(prepare)
    _open_to_nobody(tmp_path, root)
    (root / TMP_DIR).chmod(0o311)  # enter, but not list
    (root / OBJECTS_DIR).chmod(0o700)  # root's: the child can neither open nor list it

    def child() -> dict[str, Any]:
        async def go() -> None:
            async with tier(root):
                pass

        try:
            anyio.run(go)
        except bsr.TierRootError as exc:
            return {"error": "TierRootError", "path": exc.fields.get("path")}
        return {"error": None}

    got = _as_nobody(child)
    assert got["error"] == "TierRootError"
    assert got["path"] in (str(root / TMP_DIR), str(root / OBJECTS_DIR))


@pytest.mark.anyio
async def test_restore_over_a_fifo_ends_within_its_deadline(tmp_path: Path) -> None:
    """The issue's reproduction end to end: 0.1 was still blocked 20 s later."""
    layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 1, 256),))
    tokens = list(range(1, 65))
    outside = tmp_path / "outside.fifo"
    os.mkfifo(outside)

    ft = tier(tmp_path / "l2")
    engine = bsr.RestoreEngine(
        layout, tiers=[ft], window=2, io_depth=2, namespace=bsr.Namespace(model_id="fifo")
    )
    cache = bsr.PagedKVCache(layout, num_blocks=16, block_tokens=16, device="cpu")
    async with engine:
        assert (await engine.save(tokens, cache, [0, 1, 2, 3])).ok
        paths = sorted((tmp_path / "l2" / OBJECTS_DIR).rglob("*.bsr"))
        paths[0].unlink()
        os.mkfifo(paths[0])
        paths[1].unlink()
        paths[1].symlink_to(outside)
        t0 = time.monotonic()
        result = await engine.restore(tokens, cache, [4, 5, 6, 7], deadline_s=1.0)
        assert time.monotonic() - t0 < 6  # a FIFO's open(2) waits forever
        assert result.committed_tokens < len(tokens)
        t0 = time.monotonic()
        with anyio.move_on_after(1.0):
            await engine.restore(tokens, cache, [8, 9, 10, 11])
        assert time.monotonic() - t0 < 6  # a FIFO's open(2) waits forever
