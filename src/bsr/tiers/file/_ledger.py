"""One FileTier root shared coherently by several processes: the ledger, its lock, eviction.

Where it runs: FileTier's worker threads and ``bsr store`` (every method takes a file lock or
does file I/O; nothing here runs on an event loop).

How it works: ``<root>/.bsr-ledger`` holds, as JSON, the bytes of the object files in
``objects/`` and the bytes reserved by writes in progress (keyed by their temp file's name).
An exclusive ``flock`` on the ledger is the root's mutex: every change bsr makes to
``objects/`` (a write's rename, an eviction, a delete, a quarantine move, ``bsr store gc``)
happens while holding it, together with the ledger update, so whichever process writes, the
bytes in ``objects/`` plus the reservations never exceed the writer's ``capacity_bytes``.

- **Reserve, write, commit.** A write reserves its size under the lock, evicting if needed, and
  creates its temp file there, holding an exclusive ``flock`` on it until the write ends (that
  lock is how other processes tell a live writer's temp file from a dead one's). The bytes are
  written and fsync'ed without the lock; the rename into ``objects/`` and the ledger update
  happen under it.
- **Eviction** takes the least recently used unpinned object this process knows (its own
  writes, what it found on open and what its probes found) and unlinks it; only bytes whose
  unlink succeeded are subtracted, so an object that another process already removed is never
  subtracted twice. When what this process knows is not enough and others have committed since
  it last looked, it rescans ``objects/`` (under the lock, so the count is exact) and may evict
  their objects too. Reads are not locked: an object removed by another process is a miss.
- **Crashes** only ever make the ledger count too much, never too little, and what they leave is
  healed before it can cost an object. A removal (eviction, delete, quarantine move) is
  journaled: its object's id and size go into the ledger's ``removing`` before the unlink, and
  leave it with the subtraction; a holder that finds ``removing`` entries when it takes the lock
  is looking at a holder that died mid-removal, and subtracts those whose file is gone. A
  writer killed after its rename or its reservation leaves a reservation whose temp file is gone
  or no longer locked: it belongs to a dead writer. Before a write evicts anything, such
  reservations are dropped (and the ledger recounted from ``objects/``); and when the ledger
  says the root is already over capacity, it is recounted before anything is evicted, so one
  write evicts no more than the bytes it needs. A ledger that cannot be parsed is recounted too.
- **Bounded.** A FileTier never blocks on the lock: :meth:`SharedSpace.locked` tries it
  (non-blocking ``flock``, every half millisecond) for at most :data:`PATIENCE_S`, then raises
  :class:`RootBusy` holding nothing, and FileTier tries again from its event loop until its
  bound or its caller's cancel (``FileTier.lock_timeout_s``). A write's reservation given back
  while the lock is held elsewhere is "owed": its temp file is removed at once (so any process
  may reclaim it as a dead writer's) and the reservation dropped by this process's next locked
  step. ``bsr store`` waits for the lock (``wait=True``).
- **Members.** Every open FileTier holds a shared ``flock`` on the root's marker for its
  lifetime. An opener that can take it exclusively (under the mutex) is alone: it removes every
  leftover temp file, drops every reservation and starts a recount of the ledger, then holds
  the members' lock shared like the others, all in one short locked step. Every opener scans
  ``objects/`` (reading each header) without the lock, so a process opening the root while
  another scans it joins at once, as a later member; only an opener stopped inside that short
  step keeps the others out (they raise ``RootBusy``; FileTier's open: ``TierBusyError``).
- **Recount.** The first member recounts the ledger's bytes after its scan, fan-out directory
  (``objects/<xx>``) after fan-out directory, in steps that hold the lock for about
  :data:`RECOUNT_HOLD_S` each (one ``stat`` per object, of inodes its scan just read), never
  for ``objects/`` whole. The ledger keeps the count in progress (``recount``: the last fan-out
  directory counted and the bytes counted so far), and every change to ``objects/`` (all made
  under the lock, ``bsr store`` included) is applied to the count too when its fan-out
  directory is counted already (:meth:`Ledger.count`); so the count is exact when the last
  directory is counted, and replaces the ledger's bytes, whatever others wrote, evicted or
  moved meanwhile. A recount left unfinished (its process killed, or the lock held elsewhere
  past the opener's bound) changes nothing: the ledger's bytes stay what they were, kept up to
  date by every change, and the next full recount (a write that finds the root over capacity
  or a dead writer's reservation) or the next first member settles it. A ledger that cannot be
  parsed (or a new root's empty one) is counted whole in the first step instead: there is
  nothing to keep exact meanwhile.
- **Visibility.** A process sees objects others wrote by asking the filesystem for those its
  index lacks (:meth:`SharedSpace.probe`: one ``stat`` per object, by directory descriptor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..._errors import TierFullError, TierRootError
from ...core._object import HEADER_SIZE
from .._lru import LruIndex, RoomPending
from .._watch import Removal
from ._readers import NotRegularFileError, file_kind, open_regular
from ._root import (
    DIR_FLAGS,
    FANOUTS,
    LEDGER_NAME,
    MARKER_NAME,
    OBJECT_SUFFIX,
    Dirs,
    Moved,
    ScanReport,
    StoreRoot,
    walk_fanout,
    walk_objects,
)

LEDGER_KIND = "bsr.FileTier.ledger"
LEDGER_VERSION = 1
#: the ledger is rewritten in place, padded to at least this size (it never shrinks, and
#: rewriting it within its first block needs no new space on a full disk)
_LEDGER_PAD = 512
_LEDGER_MAX = 1 << 20


@dataclasses.dataclass
class Recount:
    """A count of ``objects/`` in progress (see the module docstring): the bytes of the
    fan-out directories up to ``counted_to`` (in :data:`FANOUTS` order; "" none yet), kept
    exact by every change made to them since they were counted."""

    counted_to: str = ""
    nbytes: int = 0

    def encode(self) -> dict[str, Any]:
        return {"counted_to": self.counted_to, "bytes": self.nbytes}

    @classmethod
    def decode(cls, doc: Any) -> Recount | None:
        """The count in ``doc`` (None: not a count bsr wrote)."""
        if not isinstance(doc, dict) or set(doc) != {"counted_to", "bytes"}:
            return None
        counted_to, nbytes = doc["counted_to"], doc["bytes"]
        if not (counted_to == "" or counted_to in _FANOUT_SET) or not _count(nbytes):
            return None
        return cls(counted_to, nbytes)


@dataclasses.dataclass
class Ledger:
    """The shared accounting of one root, as read under the lock."""

    #: bytes of the object files in objects/
    nbytes: int = 0
    #: temp file name -> bytes reserved by that write in progress
    reserved: dict[str, int] = dataclasses.field(default_factory=dict)
    #: objects committed by anyone, ever (a process rescans when it changed)
    commits: int = 0
    #: False when the file was missing or unreadable: recount before use
    valid: bool = True
    #: object id -> bytes of removals in progress (journaled by the holder of the lock; left
    #: behind only by a holder that died mid-removal)
    removing: dict[str, int] = dataclasses.field(default_factory=dict)
    #: a recount of objects/ in progress (started by the first member on open)
    recount: Recount | None = None

    @property
    def total(self) -> int:
        return self.nbytes + sum(self.reserved.values())

    def count(self, oid: str, delta: int) -> None:
        """Count a change of ``delta`` bytes in object ``oid``'s file (under the lock): in the
        ledger's bytes, and in a recount in progress when it counted ``oid``'s fan-out
        directory already (one it has not reached yet, it counts as it finds it)."""
        self.nbytes = max(0, self.nbytes + delta)
        rc = self.recount
        if rc is not None and oid[:2] <= rc.counted_to:
            rc.nbytes = max(0, rc.nbytes + delta)

    def encode(self) -> bytes:
        doc = {
            "kind": LEDGER_KIND,
            "version": LEDGER_VERSION,
            "bytes": self.nbytes,
            "reserved": self.reserved,
            "commits": self.commits,
        }
        if self.removing:
            doc["removing"] = self.removing
        if self.recount is not None:
            doc["recount"] = self.recount.encode()
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Ledger:
        try:
            doc = json.loads(raw.decode("utf-8"))
            ok = isinstance(doc, dict) and doc.get("kind") == LEDGER_KIND
            ok = ok and doc.get("version") == LEDGER_VERSION
            bytes_, reserved, commits = doc["bytes"], doc["reserved"], doc["commits"]
            ok = ok and _count(bytes_) and _count(commits) and isinstance(reserved, dict)
            ok = ok and all(isinstance(k, str) and _count(v) for k, v in reserved.items())
            removing = doc.get("removing", {})
            ok = ok and isinstance(removing, dict)
            ok = ok and all(isinstance(k, str) and _count(v) for k, v in removing.items())
            recount = Recount.decode(doc["recount"]) if "recount" in doc else None
            ok = ok and (recount is not None or "recount" not in doc)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
            ok = False
        if not ok:
            return cls(valid=False)
        return cls(bytes_, dict(reserved), commits, removing=dict(removing), recount=recount)


class RootBusy(Exception):
    """The root's lock is held by another process (or thread of this one) right now; nothing
    was done: try again later."""


#: how long one locked step (without ``wait``) keeps trying for the root's lock before it
#: raises RootBusy; FileTier tries again from its event loop until its bound or its caller's
#: cancel, so this is also how late a cancel may be noticed
PATIENCE_S = 0.05
#: the pause between two tries (short: a process changing the root holds the lock for most
#: of its changes, and the one that tries more often wins it)
_TRY_EVERY_S = 0.0005
#: how long one step of a recount holds the lock (it counts fan-out directories until then;
#: one at least: about 400 objects of a 100k-object root, 1 to 3 ms warm), and the pause after
#: it, without the lock, that lets waiting processes in (they try every half millisecond)
RECOUNT_HOLD_S = 0.02
RECOUNT_PAUSE_S = 0.001
_FANOUT_SET = frozenset(FANOUTS)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclasses.dataclass
class Pending:
    """A write's reservation: its temp file (open, flock'ed) in ``tmp/`` and its size."""

    name: str
    fd: int
    size: int


def _open_regular_rw(name: str, dir_fd: int, *, create: bool) -> tuple[int, bool]:
    """Open ``name`` read-write (or read-only where the filesystem refuses writes), never
    following a link or blocking on a FIFO; returns the descriptor and whether it is writable.

    Raises:
        NotRegularFileError: something other than a regular file stands there.
        OSError: it cannot be opened (FileNotFoundError when missing and not created).
    """
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags | os.O_RDWR | (os.O_CREAT if create else 0), 0o644, dir_fd=dir_fd)
        writable = True
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        fd = os.open(name, flags | os.O_RDONLY, dir_fd=dir_fd)
        writable = False
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(name, file_kind(st.st_mode))
    return fd, writable


class SharedSpace:
    """The shared capacity accounting of one open root (see the module docstring).

    Args:
        store: the root's layout helper (for errors, the scan and quarantine moves).
        dirs: the root's open directory descriptors.
        index: this process's index of the root's objects (LRU order, pins, leases).
        capacity_bytes: the bound this process keeps ``objects/`` plus reservations under.
        member: hold the members' lock (FileTier) or not (``bsr store``, which only takes the
            mutex for each change).
        wait: wait for the root's lock (``bsr store``); without it (FileTier) a locked step
            tries it for at most :data:`PATIENCE_S`, then raises :class:`RootBusy`.
    """

    def __init__(
        self,
        store: StoreRoot,
        dirs: Dirs,
        index: LruIndex[Any] | None,
        capacity_bytes: int,
        *,
        member: bool = True,
        wait: bool = False,
    ) -> None:
        self.store = store
        self.dirs = dirs
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.wait = wait
        self._mutex = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._ledger_fd = -1
        self._member_fd = -1
        self.writable = False
        self._rescanned_at = -1
        #: this process started a recount on open that it has not seen end yet
        self._recounting = False
        #: reservations given back while the lock was held elsewhere (dropped at the next step)
        self._owed: set[str] = set()
        self._owed_lock = threading.Lock()  # added to without the mutex (it may be busy)
        #: the ledger as last seen under the lock (for usage and statistics)
        self.seen = Ledger()
        self.peak = 0
        self._open(member)

    def _open(self, member: bool) -> None:
        path = self.store.root / LEDGER_NAME
        try:
            self._ledger_fd, self.writable = _open_regular_rw(
                LEDGER_NAME, self.dirs.root, create=True
            )
        except FileNotFoundError:  # a read-only root without a ledger: nothing can change
            self._ledger_fd, self.writable = -1, False
        except NotRegularFileError as exc:
            raise self.store.error(
                f"the ledger is a {exc.kind}", "remove it; bsr writes a regular file there", path
            ) from None
        except OSError as exc:
            raise self.store.error(
                f"cannot open the ledger ({exc.strerror or exc})",
                "check the root's permissions and the filesystem",
                path,
                errno=exc.errno,
            ) from exc
        if member:
            try:
                self._member_fd = os.open(
                    MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    dir_fd=self.dirs.root,
                )  # fmt: skip
            except OSError:
                self._member_fd = -1  # a 0.1 store on a read-only filesystem: no marker

    def close(self) -> None:
        if self._owed and self._ledger_fd >= 0 and self.writable:
            try:  # one try to settle what this process owes; else a dead writer's, reclaimed
                with self.locked():
                    pass
            except (RootBusy, OSError):
                pass
        for fd in (self._ledger_fd, self._member_fd):
            if fd >= 0:
                os.close(fd)  # releases the members' lock and any ledger lock
        self._ledger_fd = self._member_fd = -1

    # ------------------------------------------------------------------ the lock
    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the root's mutex; yields the ledger, written back when left (even on error).

        Raises:
            RootBusy: (without ``wait``) another process or thread holds it; nothing was done.
        """
        give_up = time.monotonic() + PATIENCE_S
        if self.wait:
            self._mutex.acquire()
        elif not self._mutex.acquire(timeout=PATIENCE_S):
            raise RootBusy
        try:
            if self._ledger_fd < 0:
                led = Ledger(valid=False)
                yield led
                self._saw(led)
                return
            self._flock(give_up)
            try:
                size = os.fstat(self._ledger_fd).st_size
                led = Ledger.decode(os.pread(self._ledger_fd, min(size, _LEDGER_MAX), 0))
                before = led.encode() if led.valid else b""
                self._heal(led)
                try:
                    yield led
                finally:
                    if led.removing:  # an error cut a removal short: settle it from the files
                        self._settle_removals(led)
                    self._saw(led)
                    if led.encode() != before:
                        self._write(led)
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _flock(self, give_up: float) -> None:
        if self.wait:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            return
        while True:
            try:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    raise RootBusy from None
            time.sleep(_TRY_EVERY_S)

    def _write(self, led: Ledger) -> None:
        """Write the ledger back in place (under the lock), padded to its old size."""
        if not (self.writable and led.valid):
            return
        body = led.encode()
        size = os.fstat(self._ledger_fd).st_size
        pad = max(_LEDGER_PAD, size) - len(body)
        os.pwrite(self._ledger_fd, body + b" " * max(pad, 0), 0)

    def _heal(self, led: Ledger) -> None:
        """Settle, just after taking the lock, what earlier steps left: removals of a holder
        that died mid-removal (subtracted where the file is gone) and reservations this
        process gave back while the lock was held elsewhere."""
        if led.valid and led.removing:
            n, subtracted = len(led.removing), self._settle_removals(led)
            self.store.log.warning(
                "bsr.tier.ledger_healed", removals=n, subtracted=subtracted,
                note="a process died while removing objects under the root's lock",
            )  # fmt: skip
        with self._owed_lock:
            owed, self._owed = self._owed, set()
        for name in owed:
            led.reserved.pop(name, None)

    def _settle_removals(self, led: Ledger) -> int:
        """Subtract the journaled removals whose file is gone, clear the journal; the bytes."""
        gone = 0
        for oid, n in led.removing.items():
            if not self._present(oid):
                led.count(oid, -n)
                gone += n
        led.removing.clear()
        return gone

    def _present(self, oid: str) -> bool:
        try:
            sub_fd = os.open(oid[:2], DIR_FLAGS, dir_fd=self.dirs.objects)
        except OSError:
            return False
        try:
            st = os.stat(oid + OBJECT_SUFFIX, dir_fd=sub_fd, follow_symlinks=False)
        except OSError:
            return False
        finally:
            os.close(sub_fd)
        return stat.S_ISREG(st.st_mode)

    def _saw(self, led: Ledger) -> None:
        if led.valid:
            self.seen = dataclasses.replace(
                led,
                reserved=dict(led.reserved),
                removing=dict(led.removing),
                recount=None if led.recount is None else dataclasses.replace(led.recount),
            )
            self.peak = max(self.peak, led.total)

    def peek(self) -> None:
        """Read the ledger without the lock (for usage and statistics only: it may be torn)."""
        if self._ledger_fd < 0:
            return
        try:
            size = os.fstat(self._ledger_fd).st_size
            led = Ledger.decode(os.pread(self._ledger_fd, min(size, _LEDGER_MAX), 0))
        except OSError:
            return
        self._saw(led)

    # ------------------------------------------------------------------ opening
    def attach(self, report: ScanReport) -> None:
        """Join the root, then scan it (``report`` gets what was found).

        Only the first step holds the root's lock, briefly (``tmp/`` and the ledger, never a
        walk of ``objects/``): the first process in (no other member holds the marker's lock)
        removes every leftover temp file, drops every reservation and starts a recount
        (:meth:`recount` continues it); a later one removes only the temp files no live writer
        holds. Both then scan the objects without the lock, so a process opening the root
        meanwhile joins at once.

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done; try again, or
                :meth:`attach_unlocked`).
        """
        with self.locked() as led:
            alone = self._try_alone()
            if alone:
                self.store.scan_tmp(self.dirs, report, lambda _name: True)
                led.reserved.clear()
                if self.writable:
                    self._start_recount(led)
            else:
                self.store.scan_tmp(self.dirs, report, self._temp_dead)
                self._reclaim(led)
            self._join()
        self._scan(report)

    def attach_unlocked(self, report: ScanReport) -> None:
        """Join the root without its lock (another process held it past the opener's bound):
        take the members' lock (shared, never waiting) and scan the objects, as a later member
        does; temp files and the ledger are left as they are (the next locked step of any
        member settles them).

        Raises:
            RootBusy: a first member is claiming the root (it holds the members' lock
                exclusively inside its first step: stopped there, it keeps others out).
        """
        if self._member_fd >= 0:
            try:
                fcntl.flock(self._member_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RootBusy from None
        self._scan(report)
        self.peek()

    def _scan(self, report: ScanReport) -> None:
        """Scan ``objects/`` without the lock; a damaged object is moved to ``quarantine/``
        under it (if still damaged then) and its bytes leave the count; while another process
        holds the lock, damaged objects are left in place (the read that finds one moves it)."""
        busy = False

        def move(sub_fd: int, name: str, oid: str, why: str) -> Moved:
            nonlocal busy
            if not busy:
                try:
                    moved, _ = self.quarantine(
                        sub_fd, oid, why, still_bad=lambda: bool(self.store.problem(sub_fd, name))
                    )
                    return moved
                except RootBusy:
                    busy = True
            self.store.log.warning(
                "bsr.tier.quarantine_failed", object_id=oid, reason=why,
                error="the root's lock is held by another process: left in place",
            )  # fmt: skip
            return Moved.FAILED

        self.store.scan_objects(self.dirs, report, move)

    def _start_recount(self, led: Ledger) -> None:
        if led.valid:
            led.recount = Recount()
            self._recounting = True
            return
        # unparseable or new (empty): nothing to keep exact meanwhile; count it now
        led.nbytes = sum(size for _, _, size in self.list_objects())
        led.recount = None
        led.valid = True

    @property
    def recounting(self) -> bool:
        """Whether this process started a recount on open that :meth:`recount` has not ended."""
        return self._recounting

    def recount(self) -> bool:
        """Count the next fan-out directories of the recount this process started on open,
        under the lock for about :data:`RECOUNT_HOLD_S`, then pause without it; True once
        the count is over (the ledger's bytes are then what ``objects/`` holds) or another
        step settled it (a full recount, a ledger that cannot be parsed).

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done; try again).
        """
        if not self._recounting:
            return True
        with self.locked() as led:
            rc = led.recount
            if rc is None or not led.valid:
                self._recounting = False
                return True
            start = FANOUTS.index(rc.counted_to) + 1 if rc.counted_to else 0
            until = time.monotonic() + RECOUNT_HOLD_S
            for sub in FANOUTS[start:]:
                rc.nbytes += self._fanout_bytes(sub)
                rc.counted_to = sub
                if time.monotonic() >= until:
                    break
            if rc.counted_to == FANOUTS[-1]:
                if rc.nbytes != led.nbytes:
                    self.store.log.info(
                        "bsr.tier.ledger_recounted", counted=rc.nbytes, ledger=led.nbytes
                    )
                led.nbytes, led.recount = rc.nbytes, None
                self._recounting = False
        if self._recounting:
            time.sleep(RECOUNT_PAUSE_S)
        return not self._recounting

    def _fanout_bytes(self, sub: str) -> int:
        """The bytes of the object files in ``objects/<sub>`` (those :meth:`list_objects`
        counts: regular files of bsr's object grammar)."""
        total = 0
        for sub_fd, name, _ in walk_fanout(self.dirs.objects, sub):
            total += _regular_size(name, sub_fd) or 0
        return total

    def _try_alone(self) -> bool:
        if self._member_fd < 0:
            return True
        try:
            fcntl.flock(self._member_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _join(self) -> None:
        if self._member_fd >= 0:  # (from exclusive, if alone) to shared, under the mutex
            fcntl.flock(self._member_fd, fcntl.LOCK_SH)

    # ------------------------------------------------------------------ writes
    def reserve(self, oid: str, size: int) -> tuple[Pending, int]:
        """Set ``size`` bytes aside for a write of ``oid`` and create its temp file.

        Returns the reservation and the number of objects evicted for it.

        Raises:
            TierFullError: no room even after evicting everything evictable.
            RoomPending: room will come once writes in progress end (retry).
            RootBusy: the root's lock is held elsewhere (nothing done; retry).
            OSError: the temp file cannot be created.
        """
        check_fits(size, self.capacity_bytes, self.store.tier)
        if not self.writable:
            raise OSError(errno.EROFS, "the store's ledger cannot be written (read-only?)")
        with self.locked() as led:
            evicted = self._make_room(led, size)
            name, fd = create_temp(self.dirs, oid)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "a live writer holds this"
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=self.dirs.tmp)
                raise
            led.reserved[name] = size
        return Pending(name, fd, size), evicted

    def commit(self, p: Pending, oid: str, sub_fd: int) -> bool:
        """Rename the written temp file into ``objects/``, count its bytes and index it (under
        the lock: a write making room meanwhile sees it in the index, never evicts it behind a
        write about to index it); whether the index lacked it.

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done; retry or :meth:`abort`).
        """
        name = oid + OBJECT_SUFFIX
        with self.locked() as led:
            try:
                st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
                old = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except FileNotFoundError:
                old = 0
            os.replace(p.name, name, src_dir_fd=self.dirs.tmp, dst_dir_fd=sub_fd)
            led.reserved.pop(p.name, None)
            led.count(oid, p.size - old)
            led.commits += 1
            new = self.index is None or oid not in self.index
            if self.index is not None:
                self.index.put(oid, p.size, None)
        fd, p.fd = p.fd, -1  # never kept once closed (a failed close releases it too)
        with contextlib.suppress(OSError):  # written and fsync'ed before: visible and whole
            os.close(fd)
        return new

    def abort(self, p: Pending) -> None:
        """Give a reservation back and remove its temp file (the write failed or was cancelled).

        Never waits: with the lock held elsewhere the temp file is removed and its descriptor
        closed at once (any process may now reclaim the reservation as a dead writer's), and
        the reservation is dropped by this process's next locked step.
        """
        try:
            with self.locked() as led:
                led.reserved.pop(p.name, None)
                with contextlib.suppress(OSError):
                    os.unlink(p.name, dir_fd=self.dirs.tmp)
        except (RootBusy, OSError):
            with contextlib.suppress(OSError):
                os.unlink(p.name, dir_fd=self.dirs.tmp)
            with self._owed_lock:
                self._owed.add(p.name)
        fd, p.fd = p.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def trim(self) -> int:
        """Evict until the root is within this process's capacity (a smaller one than before);
        the number of objects evicted.

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done).
        """
        if not self.writable:
            return 0
        with self.locked() as led:
            try:
                return self._make_room(led, 0)
            except (TierFullError, RoomPending):
                return 0  # pinned or reserved: trimmed as far as possible

    # ------------------------------------------------------------------ removals
    def unlink(self, oids: list[str]) -> int:
        """Remove the files of ``oids`` (already out of the index) under the lock; how many.

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done).
        """
        with self.locked() as led:
            return sum(1 for size in self.remove_counted(led, oids) if size is not None)

    def quarantine(
        self, sub_fd: int, oid: str, reason: str, *, still_bad: Callable[[], bool] | None = None
    ) -> tuple[Moved, str]:
        """Move ``oid``'s file to ``quarantine/`` under the lock (its bytes leave the count);
        what happened and the file's name there.

        ``still_bad``, when given, is asked under the lock first (``bsr store verify``: a
        process may have saved the object again, intact, since it was checked).

        Raises:
            RootBusy: the root's lock is held elsewhere (nothing done).
        """
        with self.locked() as led:
            if still_bad is not None and not still_bad():
                return Moved.MISSING, ""
            size = _regular_size(oid + OBJECT_SUFFIX, sub_fd)
            if size is not None:
                self._journal(led, {oid: size})
            moved, size, dest = self.store.move_to_quarantine(
                self.dirs, sub_fd, oid + OBJECT_SUFFIX, oid, reason
            )
            led.removing.pop(oid, None)
            led.count(oid, -size)
        return moved, dest

    def remove_counted(self, led: Ledger, oids: list[str]) -> list[int | None]:
        """Unlink the object files of ``oids`` (under the lock, ``led`` its ledger), journaled:
        their sizes go into the ledger's ``removing`` (written) before the first unlink. The
        bytes each removal took off the count, or None where there was no file of ours (or
        the unlink failed, logged)."""
        subs: dict[str, int] = {}
        try:
            sizes: dict[str, int] = {}
            for oid in oids:
                sub = oid[:2]
                if sub not in subs:
                    try:
                        subs[sub] = os.open(sub, DIR_FLAGS, dir_fd=self.dirs.objects)
                    except OSError:
                        subs[sub] = -1
                if subs[sub] >= 0:
                    size = _regular_size(oid + OBJECT_SUFFIX, subs[sub])
                    if size is not None:
                        sizes[oid] = size
            self._journal(led, sizes)
            out: list[int | None] = []
            for oid in oids:
                size = sizes.get(oid)
                if size is not None:
                    try:
                        os.unlink(oid + OBJECT_SUFFIX, dir_fd=subs[oid[:2]])
                    except FileNotFoundError:
                        size = None
                    except OSError as exc:
                        self.store.log.warning(
                            "bsr.tier.unlink_failed", object_id=oid, error=repr(exc)
                        )
                        size = None
                    led.removing.pop(oid, None)
                    if size is not None:
                        led.count(oid, -size)
                out.append(size)
            return out
        finally:
            for fd in subs.values():
                if fd >= 0:
                    os.close(fd)

    def _journal(self, led: Ledger, sizes: dict[str, int]) -> None:
        """Record removals about to happen, in the ledger on disk, before they happen."""
        if sizes and led.valid:
            led.removing.update(sizes)
            self._write(led)

    # ------------------------------------------------------------------ room
    def _make_room(self, led: Ledger, size: int) -> int:
        """Make room for ``size`` more bytes within the capacity, evicting least recently used
        objects; returns how many were evicted.

        The ledger is verified before it costs an object: first the reservations of dead
        writers are dropped (which recounts); and when the ledger says the root is over
        capacity already (so that more than ``size`` bytes would have to go), ``objects/`` is
        recounted before anything is evicted. Eviction then stops as soon as the write fits,
        so one write evicts what it needs and no more.
        """
        fresh = False  # the ledger's bytes were counted from objects/ in this step
        if not led.valid:
            self._recount(led)
            fresh = True
        if self._reclaim(led, sweep=False):  # cheap: one lock test per write in progress
            fresh = True
        if led.total + size <= self.capacity_bytes:
            return 0
        if self._reclaim(led, sweep=True):
            fresh = True
        if led.total > self.capacity_bytes and not fresh:
            self._recount(led)  # over capacity before this write: trust a count, not the ledger
            fresh = True
        evicted = self._evict_known(led, size)
        if led.total + size > self.capacity_bytes and led.commits != self._rescanned_at:
            self._recount(led)  # others committed since we last looked: learn their objects
            evicted += self._evict_known(led, size)
        if led.total + size > self.capacity_bytes:
            if led.reserved:
                raise RoomPending(
                    f"{self.store.tier!r} has room for {size} bytes once writes in progress finish",
                    tier=self.store.tier,
                )
            raise TierFullError(
                f"{self.store.tier!r} has no room for {size} bytes: the rest is pinned by reads "
                "or leases of this process; retry later or raise capacity_bytes",
                tier=self.store.tier,
            )
        return evicted

    def _evict_known(self, led: Ledger, size: int) -> int:
        """Evict this process's least recently used unpinned objects until ``size`` bytes fit;
        how many (a victim whose file another process removed already costs nothing)."""
        evicted = 0
        while self.index is not None and led.total + size > self.capacity_bytes:
            victim = self.index.pop_victim()
            if victim is None:
                break
            if self.remove_counted(led, [victim[0]])[0] is not None:
                evicted += 1
        return evicted

    def _reclaim(self, led: Ledger, *, sweep: bool = True) -> bool:
        """Drop reservations of dead writers (their temp file gone or unlocked), recounting
        when one was dropped (a writer killed after its rename left its bytes uncounted);
        with ``sweep``, also remove dead writers' temp files the ledger does not know (a
        writer killed inside its reservation). Whether it recounted."""
        dead = [name for name in led.reserved if self._temp_dead(name)]
        for name in dead:
            del led.reserved[name]
            try:
                os.unlink(name, dir_fd=self.dirs.tmp)
            except OSError:
                pass
        if sweep:
            self._sweep_tmp(led)
        if dead:
            self._recount(led)
        return bool(dead)

    def _sweep_tmp(self, led: Ledger) -> None:
        with contextlib.suppress(OSError, TierRootError):
            self.store.scan_tmp(
                self.dirs,
                ScanReport(),
                lambda name: name not in led.reserved and self._temp_dead(name),
            )

    def _temp_dead(self, name: str) -> bool:
        """Whether no live writer holds temp file ``name`` (its writer holds an exclusive lock)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.dirs.tmp)  # fmt: skip
        except OSError:
            return True  # gone (renamed or removed), or not a file bsr could have written
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def _recount(self, led: Ledger) -> None:
        """Set the ledger's bytes to what ``objects/`` holds (exact: every change takes the
        lock), and let the index learn the objects it did not know, as least recently used."""
        found = self.list_objects()
        led.nbytes = sum(size for _, _, size in found)
        led.valid = True
        led.recount = None  # counted whole: a recount in progress has nothing left to say
        self._rescanned_at = led.commits
        if self.index is not None:
            on_disk = {oid for _, oid, _ in found}
            for oid in self.index.oids():
                if oid not in on_disk and not self.index.is_pinned(oid):
                    self.index.discard(oid, Removal.VANISHED)  # removed by another process
            for _, oid, size in sorted(found, reverse=True):  # newest first: oldest ends first
                self.index.put_lru(oid, size, None)

    def list_objects(self) -> list[tuple[int, str, int]]:
        """``(mtime_ns, object id, size)`` of every object file in ``objects/`` (no content
        check)."""
        return list_objects(self.dirs)

    # ------------------------------------------------------------------ visibility
    def probe(self, oids: list[str]) -> list[int]:
        """For objects this process's index lacks (another process wrote them):
        :func:`probe_sizes`."""
        return probe_sizes(self.dirs, oids)


def list_objects(dirs: Dirs) -> list[tuple[int, str, int]]:
    """``(mtime_ns, object id, size)`` of every object file in ``objects/`` (no content
    check)."""
    out = []
    for sub_fd, name, oid in walk_objects(dirs.objects):
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((st.st_mtime_ns, oid, st.st_size))
    return out


def probe_sizes(dirs: Dirs, oids: list[str]) -> list[int]:
    """The size of each object's file if one that could be an object is there, else 0.

    Each file is opened by directory descriptor like a read opens it (never following a link,
    never blocking on a FIFO; one this process may not read, or that the filesystem cannot
    show now, ESTALE or EIO, is absent, as on open) and its size checked; the read verifies
    the rest.
    """
    subs: dict[str, int] = {}
    out = []
    try:
        for oid in oids:
            sub = oid[:2]
            if sub not in subs:
                try:
                    subs[sub] = os.open(sub, DIR_FLAGS, dir_fd=dirs.objects)
                except OSError:
                    subs[sub] = -1
            out.append(_probe_one(oid + OBJECT_SUFFIX, subs[sub]) if subs[sub] >= 0 else 0)
    finally:
        for fd in subs.values():
            if fd >= 0:
                os.close(fd)
    return out


def check_fits(size: int, capacity: int, tier: str, *, of: str = "capacity") -> None:
    """Refuse an object larger than the whole ``capacity`` (no eviction can make room)."""
    if size > capacity:
        raise TierFullError(
            f"object of {size} bytes exceeds {of} {capacity}; raise capacity_bytes", tier=tier
        )


def create_temp(dirs: Dirs, oid: str) -> tuple[str, int]:
    """A new temp file for a write of ``oid`` in ``tmp/`` (``TMP_NAME_RE``: unique by pid and
    12 random hex digits); its name and write descriptor."""
    name = f"{oid}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return name, os.open(name, flags, 0o644, dir_fd=dirs.tmp)


def _regular_size(name: str, sub_fd: int) -> int | None:
    """The size of our regular file ``name`` in ``sub_fd``; None when missing or not ours."""
    try:
        st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _probe_one(name: str, sub_fd: int) -> int:
    try:
        fd, st = open_regular(name, dir_fd=sub_fd)
    except (OSError, NotRegularFileError):
        return 0
    os.close(fd)
    size = st.st_size
    return size if size >= HEADER_SIZE and size % 4096 == 0 else 0


def ledger_error(root: StoreRoot, exc: OSError) -> TierRootError:
    """The error for a failed lock or ledger update (names the ledger)."""
    return root.error(
        f"cannot use the ledger ({exc.strerror or exc})",
        "check the root's permissions and the filesystem",
        root.root / LEDGER_NAME,
        errno=exc.errno,
    )
