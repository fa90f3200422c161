"""Opening a shared FileTier root while another process scans it, and the recount after.

The first process to open a root (its first member) scans every object and recounts the
ledger; a fleet restarting its servers together opens one root from several processes at
once. Each test holds the first member at a chosen point of its open (``shared_root_worker``'s
pauses: a real process, kept waiting or SIGSTOPped there, or SIGKILLed), then opens the root
from this process: the assertions are on what happened and in which order, never on durations
(a bound here is a guard against a hang, far above what any step takes).

Before (issue 48, item 5): the first member held the root's lock and the members' lock
exclusively for its whole scan; every other open failed after ``lock_timeout_s`` with a
``TierRootError`` ("cannot use the ledger ... check permissions") wrapping ``TierBusyError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bsr
import bsr.tiers.file._ledger as ledger_module
from bsr.core._keys import ObjectKey
from bsr.core._object import encode_object
from bsr.tiers.file._ledger import SharedSpace
from bsr.tiers.file._root import (
    DIR_FLAGS,
    OBJECTS_DIR,
    ScanReport,
    StoreRoot,
    object_relpath,
)
from children import shared_root_worker as srw
from support.helpers import open_fds
from support.shared_root import (
    LEDGER_NAME,
    OBJECT,
    Worker,
    ledger,
    on_disk,
    wait_stopped,
    watchdog,
)

#: a guard against a hang only (the old code failed in 2 s; a hang would last until the
#: watchdog's 30 s); nothing here is timed
HANG_S = 60.0
SEEDED = 40
CAP = 64 * OBJECT


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: what is tested is between processes (their locks are the kernel's), and
    each test starts a process of its own (about 3 s on a busy machine)."""
    return "asyncio"


def _tier(root: Path, **kw: Any) -> bsr.FileTier:
    return bsr.FileTier(root, CAP, reader="posix", fsync=False, **kw)


async def _seed(root: Path, ids: range) -> None:
    async with _tier(root) as tier:
        for i in ids:
            assert await tier.write(srw.key(i), "kv", srw.payload(i))


async def _contains(tier: bsr.FileTier, ids: range) -> str:
    got = await tier.contains_many([bsr.ObjectKey(srw.key(i), "kv") for i in ids])
    return "".join("1" if g else "0" for g in got)


def _exact(root: Path) -> dict[str, Any]:
    """The ledger, checked to count exactly what objects/ holds, nothing reserved or pending."""
    led = ledger(root)
    assert led["bytes"] == on_disk(root), led
    assert led["reserved"] == {} and "removing" not in led, led
    return led


@contextlib.contextmanager
def _paused(first: Worker, point: str, action: str) -> Iterator[None]:
    """``first`` is paused at ``point`` for the block (stopped, with a watchdog, for "stop")."""
    assert first.read() == f"paused {point}"
    if action != "stop":
        yield
        return
    wait_stopped(first.pid)
    with watchdog(first.pid):
        yield


# ------------------------------------------------------------------ a second server beside a scan
@pytest.mark.anyio
@pytest.mark.parametrize("action", ["wait", "stop"])
async def test_a_server_opens_while_another_one_scans_the_root(tmp_path: Path, action: str) -> None:
    """The first member of a root is held in the middle of its scan (its process running, or
    SIGSTOPped). A second one opens meanwhile, sees every object, writes; the first then ends
    its open, sees the second's objects, and the ledger counts exactly what objects/ holds.

    Before: the second's open failed (``TierRootError`` after ``lock_timeout_s``) while the
    first scanned: 2.0 s beside a 150,000-object scan, with no fault at all."""
    root = tmp_path / "store"
    await _seed(root, range(SEEDED))
    first = Worker(root, CAP, pause=f"scan:{SEEDED // 2}:{action}")
    try:
        second = _tier(root)
        with _paused(first, "scan", action):
            with anyio.fail_after(HANG_S):
                await second.open()
            # the first is still inside its scan: it reads "go" (or SIGCONT) only below
            assert first.proc.poll() is None
            assert await _contains(second, range(SEEDED)) == "1" * SEEDED
            for i in range(100, 110):
                assert await second.write(srw.key(i), "kv", srw.payload(i))
            if action == "wait":
                first.send("go")
        assert first.read() == "ready"
        assert first.ask("contains 100 110") == "present " + "1" * 10
        assert first.ask("read 105") == "same"
        assert first.ask("write 200 205") == "ok"
        assert await _contains(second, range(200, 205)) == "1" * 5
        assert await second.write(srw.key(110), "kv", srw.payload(110))
        led = _exact(root)
        assert "recount" not in led  # the first member's recount ended
        await second.aclose()
    finally:
        first.close()


@pytest.mark.anyio
async def test_opening_beside_a_member_stopped_while_it_claims_the_root_is_a_typed_busy_error(
    tmp_path: Path,
) -> None:
    """What still keeps an open out: a first member stopped inside its first step (it holds
    the root's lock and, alone, the members' lock exclusively, for the moment it takes to
    clear what dead processes left). The open raises ``TierBusyError`` (``root_locked``: not a
    root or permissions error) once ``lock_timeout_s`` passed, holding nothing; once the first
    member goes on, the root opens.

    Before: ``TierRootError`` ("cannot use the ledger ... check the root's permissions")."""
    root = tmp_path / "store"
    await _seed(root, range(4))
    first = Worker(root, CAP, pause="claim:1:stop")
    try:
        with _paused(first, "claim", "stop"):
            fds = open_fds()
            second = _tier(root, lock_timeout_s=0.5)
            with anyio.fail_after(HANG_S), pytest.raises(bsr.TierBusyError) as info:
                await second.open()
            await second.aclose()
            assert open_fds() == fds
        assert not isinstance(info.value, bsr.TierRootError)
        assert info.value.fields["reason"] == "root_locked"
        assert "lock_timeout_s" in str(info.value) and str(root) in str(info.value)
        assert first.read() == "ready"
        async with _tier(root) as again:
            assert await _contains(again, range(4)) == "1111"
        _exact(root)
    finally:
        first.close()


@pytest.mark.anyio
@pytest.mark.parametrize("point", ["scan", "recount"])
async def test_a_first_member_killed_inside_its_open_leaves_the_root_usable(
    tmp_path: Path, point: str
) -> None:
    """The first member is SIGKILLed in the middle of its scan, or of its recount (half the
    fan-out directories counted), while a second member opened beside it. The second writes
    past the capacity: it evicts, the root stays within the capacity, the ledger stays exact;
    the next first member ends what the dead one left (no recount left in the ledger).

    Before: the second could not open beside the scan (``TierRootError``)."""
    root = tmp_path / "store"
    cap = 24 * OBJECT
    await _seed(root, range(20))
    # recount: one fan-out directory per step (the worker sets that), killed before the 129th
    first = Worker(root, cap, pause="scan:10:wait" if point == "scan" else "recount:129:wait")
    try:
        assert first.read() == f"paused {point}"
        second = bsr.FileTier(root, cap, reader="posix", fsync=False)
        with anyio.fail_after(HANG_S):
            await second.open()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait()
        if point == "recount":  # it died half-way: its count stays in the ledger, unused
            assert ledger(root)["recount"]["counted_to"] == "7f"  # 128 of 00..ff
        for i in range(100, 130):
            assert await second.write(srw.key(i), "kv", srw.payload(i))
        assert on_disk(root) <= cap
        assert second.statistics().evictions > 0
        _exact(root)
        assert await _contains(second, range(125, 130)) == "11111"
        await second.aclose()
        async with bsr.FileTier(root, cap, reader="posix", fsync=False) as third:
            assert await _contains(third, range(125, 130)) == "11111"
            led = _exact(root)
            assert "recount" not in led
    finally:
        first.close()


# ------------------------------------------------------------------ the recount, step by step
def _blob(i: int, pages: int) -> bytes:
    """Object ``i`` (a valid object of ``pages`` + 1 pages on disk)."""
    payload = np.full(pages * 4096 - 8, i % 251, dtype=np.uint8)
    return encode_object(ObjectKey(srw.key(i), "kv"), payload)


class _Root:
    """A root and the SharedSpaces opened on it (in this process: each has its own
    descriptors, so their locks exclude each other as two processes' do)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.store = StoreRoot(path, "t", _Quiet())
        self.opened: list[tuple[Any, SharedSpace]] = []

    def space(self) -> SharedSpace:
        dirs = self.store.open()
        space = SharedSpace(self.store, dirs, None, 1 << 40)
        self.opened.append((dirs, space))
        space.attach(ScanReport())
        return space

    def write(self, space: SharedSpace, i: int, pages: int) -> None:
        blob = _blob(i, pages)
        oid = ObjectKey(srw.key(i), "kv").object_id
        pending, _ = space.reserve(oid, len(blob))
        os.pwrite(pending.fd, blob, 0)
        sub = self.path / object_relpath(oid)
        sub.parent.mkdir(exist_ok=True)
        sub_fd = os.open(sub.parent, DIR_FLAGS)
        try:
            space.commit(pending, oid, sub_fd)
        finally:
            os.close(sub_fd)

    def quarantine(self, space: SharedSpace, i: int) -> None:
        oid = ObjectKey(srw.key(i), "kv").object_id
        try:
            sub_fd = os.open(self.path / OBJECTS_DIR / oid[:2], DIR_FLAGS)
        except FileNotFoundError:
            return
        try:
            space.quarantine(sub_fd, oid, "test")
        finally:
            os.close(sub_fd)

    def close(self) -> None:
        for dirs, space in self.opened:
            space.close()
            dirs.close()


class _Quiet:
    def _drop(self, event: str, **fields: object) -> None:
        pass

    info = warning = _drop


def _fan(i: int) -> str:
    """Object ``i``'s fan-out directory."""
    return ObjectKey(srw.key(i), "kv").object_id[:2]


#: another member's changes (object 0..23) and the first member's recount steps: ``step``
#: counts N directories, ``count_to`` counts up to object i's own directory (if not past it),
#: so that the next change to it is on the edge of what is counted
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 23), st.integers(1, 3)),
        st.tuples(st.just("remove"), st.integers(0, 23), st.just(0)),
        st.tuples(st.just("quarantine"), st.integers(0, 23), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 96), st.just(0)),
        st.tuples(st.just("count_to"), st.integers(0, 23), st.just(0)),
    ),
    max_size=40,
)
#: an object whose directory is counted, then written, removed, written again, quarantined
_EDGE = [("count_to", 0, 0), ("write", 0, 3), ("remove", 0, 0), ("write", 0, 2)]
_EDGE += [("quarantine", 0, 0), ("write", 1, 2), ("count_to", 1, 0), ("remove", 1, 0)]


@settings(
    max_examples=int(os.environ.get("BSR_RECOUNT_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@example(seeded={0, 1, 2, 3}, drift=3, behind={24, 25}, ops=_EDGE)
@example(seeded=set(range(24)), drift=0, behind=set(), ops=[("step", 128, 0), *_EDGE])
@given(
    seeded=st.sets(st.integers(0, 23), max_size=12),
    drift=st.integers(0, 8),
    behind=st.sets(st.integers(24, 31), max_size=3),
    ops=OPS,
)
def test_the_recount_is_exact_whatever_others_change_while_it_runs(
    seeded: set[int], drift: int, behind: set[int], ops: list[tuple[str, int, int]]
) -> None:
    """A first member's recount, one fan-out directory per step, interleaved with another
    member's writes (new objects and replacements of another size), removals and quarantine
    moves in directories counted already and not yet. While it runs, the ledger's bytes keep
    whatever drift they had (every change counted once, exactly); when it ends, they are
    exactly what objects/ holds: a drift left by a crash (over) and files put there behind the
    ledger's back (under) are gone.
    """
    path = Path(tempfile.mkdtemp(prefix="bsr-recount-"))
    root = _Root(path)
    hold, pause = ledger_module.RECOUNT_HOLD_S, ledger_module.RECOUNT_PAUSE_S
    ledger_module.RECOUNT_HOLD_S = ledger_module.RECOUNT_PAUSE_S = 0.0  # one directory a step
    try:
        seeder = root.space()
        for i in sorted(seeded):
            root.write(seeder, i, 1 + i % 3)
        root.close()
        root.opened.clear()
        doc = json.loads((path / LEDGER_NAME).read_text())
        assert doc["bytes"] == on_disk(path) and "recount" not in doc
        doc["bytes"] += drift * 4096  # what a crash leaves: an over-count
        (path / LEDGER_NAME).write_text(json.dumps(doc))
        for i in behind:  # and files nobody counted: an under-count
            where = path / object_relpath(ObjectKey(srw.key(i), "kv").object_id)
            where.parent.mkdir(exist_ok=True)
            where.write_bytes(_blob(i, 1))
        off = drift * 4096 - sum(len(_blob(i, 1)) for i in behind)

        first = root.space()  # alone: starts the recount
        assert first.recounting and ledger(path)["recount"] == {"counted_to": "", "bytes": 0}
        other = root.space()
        assert not other.recounting
        done = False
        for op, i, n in ops:
            if op == "write":
                root.write(other, i, n)
            elif op == "remove":
                other.unlink([ObjectKey(srw.key(i), "kv").object_id])
            elif op == "quarantine":
                root.quarantine(other, i)
            elif op == "step":
                for _ in range(i):
                    done = done or first.recount()
            else:  # up to object i's directory: "" is none counted yet, "ff" (done) all
                counted = ledger(path).get("recount", {}).get("counted_to", "ff")
                for _ in range(int(_fan(i), 16) - (int(counted, 16) if counted else -1)):
                    done = done or first.recount()
                assert done or ledger(path)["recount"]["counted_to"] >= _fan(i)
            led = ledger(path)
            assert led["bytes"] - on_disk(path) == (0 if done else off), (op, led)
            assert ("recount" in led) == (not done)
        while not first.recount():
            pass
        led = ledger(path)
        assert led["bytes"] == on_disk(path) and "recount" not in led, led
    finally:
        ledger_module.RECOUNT_HOLD_S, ledger_module.RECOUNT_PAUSE_S = hold, pause
        root.close()
        shutil.rmtree(path, ignore_errors=True)
