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
- **Crashes** only ever make the ledger count too much, never too little: a writer killed after
  its rename leaves its reservation standing, an evictor killed after its unlink leaves the
  bytes counted. A reservation whose temp file is gone or no longer locked belongs to a dead
  writer; when room runs short such reservations are dropped and the ledger recounted from
  ``objects/``. A ledger that cannot be parsed is recounted too.
- **Members.** Every open FileTier holds a shared ``flock`` on the root's marker for its
  lifetime. An opener that can take it exclusively (under the mutex) is alone: it removes every
  leftover temp file and rebuilds the ledger from its scan.
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
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import TierFullError, TierRootError
from ..core._object import HEADER_SIZE
from ._fileroot import (
    DIR_FLAGS,
    LEDGER_NAME,
    MARKER_NAME,
    OBJECT_SUFFIX,
    Dirs,
    Moved,
    ScanReport,
    StoreRoot,
    walk_objects,
)
from ._lru import LruIndex, RoomPending
from ._readers import NotRegularFileError, file_kind, open_regular

LEDGER_KIND = "bsr.FileTier.ledger"
LEDGER_VERSION = 1
#: the ledger is rewritten in place, padded to at least this size (it never shrinks, and
#: rewriting it within its first block needs no new space on a full disk)
_LEDGER_PAD = 512
_LEDGER_MAX = 1 << 20


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

    @property
    def total(self) -> int:
        return self.nbytes + sum(self.reserved.values())

    def encode(self) -> bytes:
        doc = {
            "kind": LEDGER_KIND,
            "version": LEDGER_VERSION,
            "bytes": self.nbytes,
            "reserved": self.reserved,
            "commits": self.commits,
        }
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
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
            ok = False
        if not ok:
            return cls(valid=False)
        return cls(bytes_, dict(reserved), commits)


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
    """

    def __init__(
        self,
        store: StoreRoot,
        dirs: Dirs,
        index: LruIndex[Any] | None,
        capacity_bytes: int,
        *,
        member: bool = True,
    ) -> None:
        self.store = store
        self.dirs = dirs
        self.index = index
        self.capacity_bytes = capacity_bytes
        self._mutex = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._ledger_fd = -1
        self._member_fd = -1
        self.writable = False
        self._rescanned_at = -1
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
        for fd in (self._ledger_fd, self._member_fd):
            if fd >= 0:
                os.close(fd)  # releases the members' lock and any ledger lock
        self._ledger_fd = self._member_fd = -1

    # ------------------------------------------------------------------ the lock
    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the root's mutex; yields the ledger, written back when left (even on error)."""
        with self._mutex:
            if self._ledger_fd < 0:
                led = Ledger(valid=False)
                yield led
                self._saw(led)
                return
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(self._ledger_fd).st_size
                led = Ledger.decode(os.pread(self._ledger_fd, min(size, _LEDGER_MAX), 0))
                before = led.encode() if led.valid else b""
                try:
                    yield led
                finally:
                    self._saw(led)
                    body = led.encode()
                    if self.writable and led.valid and body != before:
                        pad = max(_LEDGER_PAD, size) - len(body)
                        os.pwrite(self._ledger_fd, body + b" " * max(pad, 0), 0)
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)

    def _saw(self, led: Ledger) -> None:
        if led.valid:
            self.seen = dataclasses.replace(led, reserved=dict(led.reserved))
            self.peak = max(self.peak, led.total)

    # ------------------------------------------------------------------ opening
    def attach(self, report: ScanReport) -> None:
        """Join the root: scan it (``report`` gets what was found) and settle the ledger.

        The first process in (no other member holds the marker's lock) removes every leftover
        temp file and rebuilds the ledger from its scan; a later one removes only the temp
        files no live writer holds, and reads the objects without the lock.
        """
        with self.locked() as led:
            alone = self._try_alone()
            if alone:
                self.store.scan_tmp(self.dirs, report, lambda _name: True)
                self.store.scan_objects(self.dirs, report)
                led.nbytes = sum(size for _, _, size in report.found)
                led.reserved.clear()
                led.valid = True
            else:
                self.store.scan_tmp(self.dirs, report, self._temp_dead)
                self._reclaim(led)
            self._join()
        if not alone:
            self.store.scan_objects(self.dirs, report)

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
            OSError: the temp file cannot be created.
        """
        if size > self.capacity_bytes:
            raise TierFullError(
                f"object of {size} bytes exceeds capacity {self.capacity_bytes}; "
                "raise capacity_bytes",
                tier=self.store.tier,
            )
        if not self.writable:
            raise OSError(errno.EROFS, "the store's ledger cannot be written (read-only?)")
        with self.locked() as led:
            evicted = self._make_room(led, size)
            name = f"{oid}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=self.dirs.tmp)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "a live writer holds this"
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=self.dirs.tmp)
                raise
            led.reserved[name] = size
        return Pending(name, fd, size), evicted

    def commit(self, p: Pending, oid: str, sub_fd: int) -> None:
        """Rename the written temp file into ``objects/`` and count its bytes (under the lock)."""
        name = oid + OBJECT_SUFFIX
        with self.locked() as led:
            try:
                st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
                old = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except FileNotFoundError:
                old = 0
            os.replace(p.name, name, src_dir_fd=self.dirs.tmp, dst_dir_fd=sub_fd)
            led.reserved.pop(p.name, None)
            led.nbytes = max(0, led.nbytes + p.size - old)
            led.commits += 1
        os.close(p.fd)
        p.fd = -1

    def abort(self, p: Pending) -> None:
        """Give a reservation back and remove its temp file (the write failed or was cancelled)."""
        with self.locked() as led:
            led.reserved.pop(p.name, None)
            try:
                os.unlink(p.name, dir_fd=self.dirs.tmp)
            except OSError:
                pass
        if p.fd >= 0:
            os.close(p.fd)
            p.fd = -1

    def trim(self) -> int:
        """Evict until the root is within this process's capacity (a smaller one than before);
        the number of objects evicted."""
        if not self.writable:
            return 0
        with self.locked() as led:
            try:
                return self._make_room(led, 0)
            except (TierFullError, RoomPending):
                return 0  # pinned or reserved: trimmed as far as possible

    # ------------------------------------------------------------------ removals
    def unlink(self, oids: list[str]) -> int:
        """Remove the files of ``oids`` (already out of the index) under the lock; how many."""
        with self.locked() as led:
            return sum(1 for oid in oids if self._unlink_counted(led, oid))

    def quarantine(
        self, sub_fd: int, oid: str, reason: str, *, still_bad: Callable[[], bool] | None = None
    ) -> tuple[Moved, str]:
        """Move ``oid``'s file to ``quarantine/`` under the lock (its bytes leave the count);
        what happened and the file's name there.

        ``still_bad``, when given, is asked under the lock first (``bsr store verify``: a
        process may have saved the object again, intact, since it was checked).
        """
        with self.locked() as led:
            if still_bad is not None and not still_bad():
                return Moved.MISSING, ""
            moved, size, dest = self.store.move_to_quarantine(
                self.dirs, sub_fd, oid + OBJECT_SUFFIX, oid, reason
            )
            led.nbytes = max(0, led.nbytes - size)
        return moved, dest

    def _unlink_counted(self, led: Ledger, oid: str) -> bool:
        try:
            size = self.store.unlink_object(self.dirs, oid)
        except OSError as exc:
            self.store.log.warning("bsr.tier.unlink_failed", object_id=oid, error=repr(exc))
            return False
        if size is None:
            return False
        led.nbytes = max(0, led.nbytes - size)
        return True

    # ------------------------------------------------------------------ room
    def _make_room(self, led: Ledger, size: int) -> int:
        if not led.valid:
            self._recount(led)
        evicted = self._evict_known(led, size)
        if led.total + size > self.capacity_bytes and self._reclaim(led):
            evicted += self._evict_known(led, size)
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
        evicted = 0
        while self.index is not None and led.total + size > self.capacity_bytes:
            victim = self.index.pop_victim()
            if victim is None:
                break
            if self._unlink_counted(led, victim[0]):
                evicted += 1
        return evicted

    def _reclaim(self, led: Ledger) -> bool:
        """Drop reservations of dead writers (their temp file gone or unlocked), then recount."""
        dead = [name for name in led.reserved if self._temp_dead(name)]
        for name in dead:
            del led.reserved[name]
            try:
                os.unlink(name, dir_fd=self.dirs.tmp)
            except OSError:
                pass
        if dead:
            self._recount(led)
        return bool(dead)

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
        self._rescanned_at = led.commits
        if self.index is not None:
            on_disk = {oid for _, oid, _ in found}
            for oid in self.index.oids():
                if oid not in on_disk and not self.index.is_pinned(oid):
                    self.index.discard(oid)  # removed by another process
            for _, oid, size in sorted(found, reverse=True):  # newest first: oldest ends first
                self.index.put_lru(oid, size, None)

    def list_objects(self) -> list[tuple[int, str, int]]:
        """``(mtime_ns, object id, size)`` of every object file in ``objects/`` (no content
        check)."""
        out = []
        for sub_fd, name, oid in walk_objects(self.dirs.objects):
            try:
                st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((st.st_mtime_ns, oid, st.st_size))
        return out

    # ------------------------------------------------------------------ visibility
    def probe(self, oids: list[str]) -> list[int]:
        """The size of each object's file if one that could be an object is there, else 0.

        For objects this process's index lacks (another process wrote them): each file is
        opened by directory descriptor like a read opens it (never following a link, never
        blocking on a FIFO; one this process may not read is absent, as on open) and its size
        checked; the read verifies the rest.
        """
        subs: dict[str, int] = {}
        out = []
        try:
            for oid in oids:
                sub = oid[:2]
                if sub not in subs:
                    try:
                        subs[sub] = os.open(sub, DIR_FLAGS, dir_fd=self.dirs.objects)
                    except OSError:
                        subs[sub] = -1
                out.append(_probe_one(oid + OBJECT_SUFFIX, subs[sub]) if subs[sub] >= 0 else 0)
        finally:
            for fd in subs.values():
                if fd >= 0:
                    os.close(fd)
        return out


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
