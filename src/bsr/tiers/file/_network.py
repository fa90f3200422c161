"""One FileTier root shared by nodes of a network filesystem: no cross-node lock, per-node
accounting, reads verified as everywhere.

Where it runs: FileTier's worker threads (every method does file I/O; nothing here runs on an
event loop). Chosen with ``FileTier(..., shared="network", node="<id>")``.

Why: on NFS, Lustre, CephFS or any FUSE filesystem (sshfs), ``flock`` may be local to each client:
two nodes each "hold" the root's lock at once, so the local shared mode's ledger
(:mod:`bsr.tiers.file._ledger`) cannot keep them within one capacity. This mode takes no lock
that spans nodes and relies only on what such filesystems do keep: a rename within one directory
is atomic, and a file opened after another client closed it shows that client's bytes
(close-to-open consistency).

How it works::

    <root>/objects/<id[:2]>/<id>.bsr        content-addressed objects (id: digest of key + group)
    <root>/tmp/<id>.<pid>.<rand>.tmp        objects being written (never visible)
    <root>/nodes/<node>.log                 what this node wrote: "+ <id> <bytes>" / "- <id>"
    <root>/nodes/<node>.lock                held (flock) by the process using <node> on this node

- **Writes** go to a temp file of a unique name, are written (and fsync'ed), then renamed into
  ``objects/``: a reader sees no object or a whole one, and two nodes writing the same object
  race harmlessly (the same key names the same computed state; the last rename wins, and both
  are verified on read).
- **Capacity is kept per node.** ``capacity_bytes`` is this node's share of the root's declared
  budget. A node accounts the objects it wrote (its journal, ``nodes/<node>.log``, replayed and
  compacted on open, each entry checked against the file) plus its writes in progress, and
  evicts only its own least recently used objects to make room. An object another node wrote
  is read, never evicted (an explicit :meth:`~bsr.FileTier.delete` removes it). Where two nodes
  wrote one object both count it (a node over-counts, never under-counts); an object gone
  behind a node's back (another node's eviction, ``bsr store gc``) leaves the node's count at
  its next eviction or open.
- **What no node owns any more** (a node gone for good, journal lines lost in a crash, temp files
  of a writer killed mid-write) is collected by ``bsr store gc --budget B`` run by one node or a
  cron job: oldest objects first down to ``B``, and temp files older than ``--tmp-age``. It takes
  no lock either: a read of an object it removes is a miss, a write whose temp file it removed
  fails cleanly (the grace keeps live writers' temp files).
- **Verification and quarantine.** Reads verify every object as in every mode. An object that
  fails is moved to ``quarantine/`` only after this node read it again from a fresh open and it
  failed again (:class:`NodeSpace` takes a ``still_bad`` proof): a stale view (a client cache
  behind another node's rename) is a miss, not a quarantine.
- **Errors.** ESTALE, EIO, ENOTCONN and the like are I/O errors: a read becomes a miss (the
  engine falls down its ladder), a probe that cannot see a file says absent; reads and probes are
  abandonable, so a hung server costs the caller its deadline, never a hang.

Several processes on one node must use distinct node ids (``nodes/<node>.lock`` refuses a second
process using one id on the same mount; on two mounts of one filesystem nothing can tell, so
give every node its own id, such as its host name plus a rank).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import threading
from collections.abc import Callable
from typing import Any

from ..._errors import ConfigError, TierFullError, TierRootError
from .._lru import LruIndex, RoomPending
from ._ledger import (
    Ledger,
    Pending,
    _open_regular_rw,
    check_fits,
    create_temp,
    list_objects,
    probe_sizes,
)
from ._readers import NotRegularFileError, open_regular
from ._root import (
    DIR_FLAGS,
    NODES_DIR,
    OBJECT_SUFFIX,
    Dirs,
    Moved,
    ScanReport,
    StoreRoot,
)

#: a node id: what ``node=`` accepts (a file name on every filesystem)
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_JOURNAL_HEAD = b"bsr.FileTier.node 1\n"
#: a journal's temp file while it is written anew: ``<node>.log.<12 hex>.tmp``
JOURNAL_TMP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\.log\.[0-9a-f]{12}\.tmp$")
_LINE_RE = re.compile(rb"^([+-]) ([0-9a-f]{40})(?: ([0-9]{1,19}))?$")
#: a journal is compacted on open, and when it holds this many more lines than live entries
_COMPACT_SLACK = 4096


def check_node(node: Any, key: str = "node") -> str:
    """A node id, or a :class:`~bsr.ConfigError` saying what to give."""
    if not isinstance(node, str) or not NODE_RE.match(node):
        raise ConfigError(
            f"{key}: {node!r} is not a node id; give each node sharing a network root its own "
            "id of 1 to 63 letters, digits, '.', '_' or '-' (such as its host name)",
            key=key,
        )
    return node


def read_journal(raw: bytes) -> dict[str, int]:
    """The objects a journal says its node holds (``oid -> bytes``), replayed in order; a
    line that cannot be parsed (a torn last line) ends the replay."""
    owned: dict[str, int] = {}
    if not raw.startswith(_JOURNAL_HEAD):
        return owned
    for line in raw[len(_JOURNAL_HEAD) :].split(b"\n"):
        m = _LINE_RE.match(line)
        if m is None:
            break
        oid = m.group(2).decode()
        if m.group(1) == b"+" and m.group(3) is not None:
            owned[oid] = int(m.group(3))
        elif m.group(1) == b"-":
            owned.pop(oid, None)
        else:
            break
    return owned


class NodeSpace:
    """The accounting of one node in a root shared over a network filesystem (see the module
    docstring); the interface FileTier uses of :class:`~bsr.tiers.file._ledger.SharedSpace`.

    Args:
        store: the root's layout helper (errors, quarantine moves).
        dirs: the root's open directory descriptors.
        index: this process's index of the root's objects (LRU order, pins): the objects this
            node wrote and those its probes found (only the former are ever evicted).
        capacity_bytes: this node's share of the root's budget.
        node: this node's id.
    """

    recounting = False
    writable = True

    def __init__(
        self,
        store: StoreRoot,
        dirs: Dirs,
        index: LruIndex[Any],
        capacity_bytes: int,
        node: str,
    ) -> None:
        self.store = store
        self.dirs = dirs
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.node = node
        self._mutex = threading.Lock()
        #: object id -> bytes, of the objects this node wrote (its journal)
        self.owned: dict[str, int] = {}
        self._bytes = 0  # the sum of ``owned`` (kept as it changes: eviction asks per victim)
        #: temp file name -> bytes, of this node's writes in progress
        self.reserved: dict[str, int] = {}
        self.seen = Ledger()
        self.peak = 0
        self._lines = 0
        self._nodes_fd = self._lock_fd = self._journal_fd = -1
        self._journal_end = 0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Open ``nodes/`` and take this node's lock; a root that cannot be written (a
        read-only filesystem) is opened for reads: nothing is created, locked or journaled,
        and writes fail (``EROFS``). Anything but a directory and regular files bsr made in
        their places is a typed error, never followed."""
        where = self.store.root / NODES_DIR
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(NODES_DIR, 0o755, dir_fd=self.dirs.root)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise self._error(exc, where) from exc
            self.writable = False
        try:
            self._nodes_fd = os.open(NODES_DIR, DIR_FLAGS, dir_fd=self.dirs.root)
        except FileNotFoundError:
            return  # read-only, and no node ever wrote here: nothing to read either
        except OSError as exc:
            raise self._error(exc, where) from exc
        if not self.writable:
            return
        lock = f"{self.node}.lock"
        try:
            self._lock_fd, self.writable = _open_regular_rw(lock, self._nodes_fd, create=True)
        except (OSError, NotRegularFileError) as exc:
            raise self._error(exc, where / lock) from exc
        if not self.writable:
            return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self.store.error(
                f"node id {self.node!r} is in use by another process on this node",
                "give every process sharing a network root its own node id",
                where / lock,
                reason="node_in_use",
            ) from None
        except OSError as exc:  # ENOLCK, ENOSYS: no locks here at all; ids are the user's
            self.store.log.info("bsr.tier.node_unlocked", node=self.node, error=repr(exc))

    def _error(self, exc: BaseException, path: Any) -> TierRootError:
        if isinstance(exc, NotRegularFileError):
            what = f"is a {exc.kind}, not a file bsr made"
        elif isinstance(exc, OSError) and exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "is a symlink or a file in place of bsr's own"
        else:
            what = f"cannot be used ({getattr(exc, 'strerror', None) or exc})"
        return self.store.error(
            what,
            "remove it: the network mode keeps nodes/ (a directory) and each node's .log and "
            ".lock files (regular files) there",
            path,
            errno=getattr(exc, "errno", None),
        )

    def close(self) -> None:
        for fd in (self._journal_fd, self._lock_fd, self._nodes_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._journal_fd = self._lock_fd = self._nodes_fd = -1

    # ------------------------------------------------------------------ opening
    def attach(self, report: ScanReport) -> None:
        """Replay this node's journal, keep the entries whose file is still there (at its
        size now), write it back compacted; ``report.found`` gets them (oldest first).

        ``objects/`` is not walked: objects other nodes wrote are found by probes when asked
        for (a walk per node per open costs a metadata round trip per object on a network
        filesystem).
        """
        raw = self._read_journal()
        if self.writable:
            self._remove_journal_temps()
        claimed = read_journal(raw)
        present = dict(zip(claimed, probe_sizes(self.dirs, list(claimed))))
        found = []
        for oid, size in present.items():
            if size:
                self._own(oid, size)
                found.append((0, oid, size))
        report.found.extend(found)
        if self.writable:
            try:
                self._compact()
            except OSError as exc:
                raise self._error(exc, self.store.root / NODES_DIR / f"{self.node}.log") from exc
        self._saw()

    def _read_journal(self) -> bytes:
        """This node's journal as it is (b"" when there is none), opened like an object is
        (never following a link, never blocking on a FIFO)."""
        name = f"{self.node}.log"
        if self._nodes_fd < 0:
            return b""
        try:
            fd, _ = open_regular(name, dir_fd=self._nodes_fd)
        except FileNotFoundError:
            return b""
        except (OSError, NotRegularFileError) as exc:
            raise self._error(exc, self.store.root / NODES_DIR / name) from exc
        try:
            return _read_all(fd)
        finally:
            os.close(fd)

    attach_unlocked = attach

    def _remove_journal_temps(self) -> None:
        """Remove this node's journal temp files (a compaction killed midway; this process
        holds the node's lock, so none is live)."""
        prefix = f"{self.node}.log."
        for name in os.listdir(self._nodes_fd):
            if name.startswith(prefix) and JOURNAL_TMP_RE.match(name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._nodes_fd)

    def recount(self) -> bool:
        return True

    def trim(self) -> int:
        """Evict this node's objects until it is within its share; how many."""
        with self._mutex:
            try:
                return self._make_room(0)
            except (TierFullError, RoomPending):
                return 0

    # ------------------------------------------------------------------ the journal
    def _compact(self) -> None:
        """Write the journal anew (temp name, then rename): the live entries only."""
        body = _JOURNAL_HEAD + b"".join(
            f"+ {oid} {size}\n".encode() for oid, size in self.owned.items()
        )
        tmp = f"{self.node}.log.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=self._nodes_fd)
        try:
            os.write(fd, body)
            os.replace(tmp, f"{self.node}.log", src_dir_fd=self._nodes_fd,
                       dst_dir_fd=self._nodes_fd)  # fmt: skip
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._nodes_fd)
            raise
        old, self._journal_fd = self._journal_fd, fd
        self._journal_end, self._lines = len(body), len(self.owned)
        if old >= 0:
            with contextlib.suppress(OSError):  # released even when it fails (EIO)
                os.close(old)

    def _note(self, line: str) -> None:
        """Append one line to the journal (at its end as this node wrote it: one writer).

        A journal whose descriptor went bad (a network filesystem's client reconnected: file
        handles opened before fail with EIO for ever, directories work) is written anew
        through the ``nodes/`` directory, the line included."""
        data = line.encode()
        try:
            if self._lines > 2 * len(self.owned) + _COMPACT_SLACK:
                self._compact()
                return
            os.pwrite(self._journal_fd, data, self._journal_end)
            self._journal_end += len(data)
            self._lines += 1
            return
        except OSError as exc:
            first = exc
        try:
            self._compact()  # self.owned already holds the change the line records
        except OSError as exc:  # the object stays (found by probes, collected by gc)
            self.store.log.warning(
                "bsr.tier.journal_failed", node=self.node, error=repr(exc), first=repr(first)
            )

    def _saw(self) -> None:
        self.seen = Ledger(nbytes=self._bytes, reserved=dict(self.reserved))
        self.peak = max(self.peak, self.seen.total)

    # ------------------------------------------------------------------ writes
    def reserve(self, oid: str, size: int) -> tuple[Pending, int]:
        """Set ``size`` bytes of this node's share aside for a write of ``oid`` (evicting its
        own least recently used objects) and create its temp file.

        Raises:
            TierFullError: no room even after evicting everything this node may evict.
            RoomPending: room will come once this node's writes in progress finish (retry).
            OSError: the temp file cannot be created.
        """
        check_fits(size, self.capacity_bytes, self.store.tier, of="this node's capacity")
        if not self.writable:
            raise OSError(errno.EROFS, "the root cannot be written (read-only?)")
        with self._mutex:
            evicted = self._make_room(size)
            name, fd = create_temp(self.dirs, oid)
            self.reserved[name] = size
            self._saw()
        return Pending(name, fd, size), evicted

    def commit(self, p: Pending, oid: str, sub_fd: int) -> bool:
        """Close the written temp file (a network filesystem may report a write's failure
        only there: then the write fails and nothing is visible), rename it into
        ``objects/`` (replacing another node's copy of the same object, harmlessly) and
        journal and index it as this node's; whether the index lacked it."""
        fd, p.fd = p.fd, -1  # never kept once closed: a failed close still releases it
        os.close(fd)
        os.replace(p.name, oid + OBJECT_SUFFIX, src_dir_fd=self.dirs.tmp, dst_dir_fd=sub_fd)
        with self._mutex:
            self.reserved.pop(p.name, None)
            self._own(oid, p.size)
            # indexed with the rename, under the mutex: a write making room meanwhile sees
            # it in the index (never removes it behind a write about to index it)
            new = oid not in self.index
            self.index.put(oid, p.size, None)
            self._note(f"+ {oid} {p.size}\n")
            self._saw()
        return new

    def abort(self, p: Pending) -> None:
        """Give a reservation back and remove its temp file (never raises: a failed write's
        own error is the one its caller sees)."""
        fd, p.fd = p.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(p.name, dir_fd=self.dirs.tmp)
        with self._mutex:
            self.reserved.pop(p.name, None)
            self._saw()

    def _own(self, oid: str, size: int) -> None:
        self._bytes += size - self.owned.get(oid, 0)
        self.owned[oid] = size

    def _disown(self, oid: str) -> int | None:
        """Leave ``oid`` out of this node's count; its bytes (None: not this node's)."""
        size = self.owned.pop(oid, None)
        if size is not None:
            self._bytes -= size
        return size

    def _over(self, size: int) -> bool:
        return self._bytes + sum(self.reserved.values()) + size > self.capacity_bytes

    def _make_room(self, size: int) -> int:
        """Evict this node's least recently used unpinned objects until ``size`` more bytes
        fit in its share; how many. Other nodes' objects are passed over (neither removed nor
        reported as evicted); then objects of this node's journal that the index no longer
        holds (forgotten by a recheck), oldest first."""
        evicted = 0
        while self._over(size):
            victim = self.index.pop_victim(only=self.owned.__contains__)
            if victim is None:
                break
            evicted += self._remove(victim[0]) is not None
        if self._over(size):
            for oid in [o for o in self.owned if o not in self.index]:
                evicted += self._remove(oid) is not None
                if not self._over(size):
                    break
        if self._over(size):
            if self.reserved:
                raise RoomPending(
                    f"{self.store.tier!r} has room for {size} bytes once this node's writes in "
                    "progress finish",
                    tier=self.store.tier,
                )
            raise TierFullError(
                f"{self.store.tier!r} has no room for {size} bytes in node {self.node!r}'s "
                f"share ({self.capacity_bytes} bytes): the rest is pinned by reads or leases; "
                "retry later or raise capacity_bytes",
                tier=self.store.tier,
            )
        self._saw()
        return evicted

    # ------------------------------------------------------------------ removals
    def _remove(self, oid: str) -> int | None:
        """Unlink ``oid``'s file (gone already counts as removed) and leave this node's
        count; the bytes it held by this node's count, None where the unlink failed."""
        try:
            sub_fd = self.dirs.subdir(oid[:2])
            os.unlink(oid + OBJECT_SUFFIX, dir_fd=sub_fd)
        except FileNotFoundError:
            pass  # evicted by another node that wrote it too, or collected
        except OSError as exc:
            self.store.log.warning("bsr.tier.unlink_failed", object_id=oid, error=repr(exc))
            return None
        size = self._disown(oid)
        if size is not None:
            self._note(f"- {oid}\n")
        return size or 0

    def unlink(self, oids: list[str]) -> int:
        """Remove the files of ``oids`` (already out of the index); how many were there."""
        with self._mutex:
            n = sum(1 for oid in oids if self._remove(oid) is not None)
            self._saw()
        return n

    def quarantine(
        self, sub_fd: int, oid: str, reason: str, *, still_bad: Callable[[], bool] | None = None
    ) -> tuple[Moved, str]:
        """Move ``oid``'s file to ``quarantine/`` if ``still_bad()`` (a fresh read by this
        node) proves it bad; a file that reads well now (a stale view) stays."""
        if still_bad is not None and not still_bad():
            return Moved.MISSING, ""
        moved, _, dest = self.store.move_to_quarantine(
            self.dirs, sub_fd, oid + OBJECT_SUFFIX, oid, reason
        )
        with self._mutex:
            if self._disown(oid) is not None:
                self._note(f"- {oid}\n")
            self._saw()
        return moved, dest

    # ------------------------------------------------------------------ visibility
    def probe(self, oids: list[str]) -> list[int]:
        return probe_sizes(self.dirs, oids)

    def list_objects(self) -> list[tuple[int, str, int]]:
        return list_objects(self.dirs)

    def peek(self) -> None:
        pass


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
