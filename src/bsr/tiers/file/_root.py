"""FileTier's root on disk: its names, the marker that claims it, and the scan on open.

Where it runs: worker threads (FileTier opens its root and scans it off the event loop).

How it works: :meth:`StoreRoot.open` claims the root (checks or writes the ``.bsr-tier`` marker)
and opens descriptors of ``objects/``, ``tmp/`` and ``quarantine/`` with ``O_NOFOLLOW``, so every
later name resolves inside the tree (:meth:`StoreRoot.open_existing` opens one without changing
anything, for ``bsr store``). :meth:`StoreRoot.scan_tmp` removes dead writers' temp files and
:meth:`StoreRoot.scan_objects` lists intact objects (through :func:`walk_objects`, the one walk of
``objects/``); they delete or move only regular files of bsr's exact name grammar and report
everything else as junk, and files they cannot read (EACCES, EIO) as unreadable. The names and
regular expressions here are the layout's single definition (``bsr store`` reads them too).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..._check import is_int
from ..._errors import TierRootError, UntrustedRootError
from ...core._object import HEADER_SIZE, MAGIC, object_size
from ...core._object import PAYLOAD_LEN_OFFSET as _PLEN_OFFSET
from ._fstype import locks_untrusted, mount_type
from ._readers import NotRegularFileError, file_kind, open_regular

# ---------------------------------------------------------------------- on-disk layout
#: the marker file that claims a root for bsr (JSON: {"kind": MARKER_KIND, "version": N})
MARKER_NAME = ".bsr-tier"
MARKER_KIND = "bsr.FileTier"
#: layout version this bsr writes and reads; a marker with a higher version is refused
MARKER_VERSION = 1
#: the shared ledger (bytes and reservations; its exclusive flock is the root's mutex)
LEDGER_NAME = ".bsr-ledger"
#: the nodes' journals and locks of a root shared in network mode (``_network``)
NODES_DIR = "nodes"
OBJECTS_DIR = "objects"
TMP_DIR = "tmp"
QUARANTINE_DIR = "quarantine"
OBJECT_SUFFIX = ".bsr"
#: ``<40 hex id>.bsr`` inside ``objects/<id[:2]>/``
OBJECT_NAME_RE = re.compile(r"^([0-9a-f]{40})\.bsr$")
#: ``<40 hex id>.<pid>.<12 hex>.tmp`` inside ``tmp/`` (pid: 1 to 10 digits, no leading zero)
TMP_NAME_RE = re.compile(r"^([0-9a-f]{40})\.([1-9][0-9]{0,9})\.([0-9a-f]{12})\.tmp$")
#: ``<40 hex id>.<reason>.<8 hex>`` inside ``quarantine/``
QUARANTINE_NAME_RE = re.compile(r"^([0-9a-f]{40})\.([a-z0-9_-]{1,40})\.([0-9a-f]{8})$")
#: an object id: 40 lowercase hex digits
_ID_RE = re.compile(r"^[0-9a-f]{40}$")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")
_MARKER_TMP_RE = re.compile(r"^\.bsr-tier\.[1-9][0-9]{0,9}\.tmp$")
#: the entries a bsr 0.1 root (before the marker) may hold
_LEGACY_ENTRIES = frozenset({OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR})
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
JUNK_EXAMPLES = 5


def object_relpath(oid: str) -> str:
    """Where object ``oid`` lives, relative to the root: ``objects/<id[:2]>/<id>.bsr``."""
    return f"{OBJECTS_DIR}/{oid[:2]}/{oid}{OBJECT_SUFFIX}"


class ReadFailure(str, enum.Enum):
    """What a failed open or read of an object file means."""

    MISSING = "missing"  #: the file is gone: a miss
    NOT_REGULAR = "not_regular"  #: a symlink, FIFO, device or directory: a corrupt object
    IO = "io"  #: permission denied, EIO...: an I/O error, never corruption


def classify_read_error(exc: BaseException) -> ReadFailure:
    """Classify an exception raised while opening or reading an object file.

    Permission errors (``EACCES``, ``EPERM``) are I/O errors: the bytes may be intact, so the
    object is skipped and reported, never quarantined.
    """
    if isinstance(exc, NotRegularFileError):
        return ReadFailure.NOT_REGULAR
    if isinstance(exc, OSError) and exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
        return ReadFailure.NOT_REGULAR
    if isinstance(exc, FileNotFoundError):
        return ReadFailure.MISSING
    return ReadFailure.IO


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _quarantine_name(oid: str, reason: str) -> str:
    word = re.sub(r"[^a-z0-9_-]", "_", reason.lower())[:40] or "failed"
    return f"{oid}.{word}.{secrets.token_hex(4)}"


@dataclasses.dataclass
class Dirs:
    """Directory descriptors of one open root (reads and writes resolve names relative to them).

    -1 stands for a subdirectory that does not exist (only in a root opened read-only).
    """

    root: int
    objects: int
    tmp: int
    quarantine: int
    #: ``objects/<id[:2]>`` descriptors opened by :meth:`subdir`, kept until :meth:`close`
    subdirs: dict[str, int] = dataclasses.field(default_factory=dict, init=False)
    #: descriptors :meth:`reopen_subdir` replaced (closed by :meth:`close` only)
    retired: list[int] = dataclasses.field(default_factory=list, init=False)
    _swap: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def subdir(self, sub: str) -> int:
        """The descriptor of ``objects/<sub>`` (``DIR_FLAGS``: a symlink or a file there is
        refused), opened once and kept: a read of a 256-object restore otherwise opened and
        closed a fan-out directory for most of its objects (two syscalls of about 3 us each).

        bsr never removes a fan-out directory; one removed and made anew behind the tier is
        opened again at the first object missing there (:meth:`reopen_subdir`). The tier's
        ``_busy`` count keeps :meth:`close` from running while a read uses one.

        Raises:
            OSError: the directory cannot be opened (missing: no object there yet).
        """
        fd = self.subdirs.get(sub)
        if fd is not None:
            return fd
        new = os.open(sub, DIR_FLAGS, dir_fd=self.objects)
        fd = self.subdirs.setdefault(sub, new)  # another thread may have opened it meanwhile
        if fd != new:
            os.close(new)
        return fd

    def reopen_subdir(self, sub: str, stale: int) -> int:
        """:meth:`subdir` anew after an object was missing under ``stale`` (its descriptor):
        the directory may have been removed and made again. ``stale`` itself when the name
        still names that directory (the object is simply gone: a peer evicted it). A replaced
        descriptor stays open until :meth:`close` (another thread may be opening a file under
        it right now); one per directory made anew, not per missing object."""
        new = os.open(sub, DIR_FLAGS, dir_fd=self.objects)
        was, now = os.fstat(stale), os.fstat(new)
        if (was.st_dev, was.st_ino) == (now.st_dev, now.st_ino):
            os.close(new)  # the same directory: the object is missing, not the directory
            return stale
        with self._swap:
            if self.subdirs.get(sub) == stale:
                self.subdirs[sub] = new
                self.retired.append(stale)
                return new
        os.close(new)  # another thread replaced it first
        return self.subdir(sub)

    def close(self) -> None:
        subs = [*self.subdirs.values(), *self.retired]
        self.subdirs.clear()
        self.retired.clear()
        for fd in (*subs, self.objects, self.tmp, self.quarantine, self.root):
            if fd < 0:  # absent (a root opened by open_existing)
                continue
            try:
                os.close(fd)
            except OSError:
                pass


@dataclasses.dataclass
class ScanReport:
    junk: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)
    removed_temps: int = 0
    quarantined: int = 0
    #: (mtime_ns, object id, size) of every intact object found
    found: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)


def walk_objects(
    objects_fd: int, report: ScanReport | None = None
) -> Iterator[tuple[int, str, str]]:
    """``(subdir fd, file name, object id)`` of every entry of bsr's object grammar in
    ``objects/`` that is a regular file, by directory descriptors (nothing is followed).

    Everything else (foreign names, symlinks, FIFOs, a symlinked or unopenable fan-out
    directory) is reported in ``report.junk`` or ``report.unreadable`` and skipped. The subdir
    descriptor is valid until the next item.
    """
    with os.scandir(objects_fd) as it:
        subs = list(it)
    for sub in sorted(subs, key=lambda e: e.name):
        if not _FANOUT_RE.fullmatch(sub.name) or not sub.is_dir(follow_symlinks=False):
            if report is not None:
                report.junk.append(f"{OBJECTS_DIR}/{sub.name}")
            continue
        yield from walk_fanout(objects_fd, sub.name, report)


def walk_fanout(
    objects_fd: int, sub: str, report: ScanReport | None = None
) -> Iterator[tuple[int, str, str]]:
    """:func:`walk_objects` for one fan-out directory ``objects/<sub>`` (nothing when it is
    missing; a symlink or a file there is junk)."""
    where = f"{OBJECTS_DIR}/{sub}"
    try:
        sub_fd = os.open(sub, DIR_FLAGS, dir_fd=objects_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        kind = classify_read_error(exc)
        if report is not None and kind is ReadFailure.NOT_REGULAR:
            report.junk.append(where)
        elif report is not None and kind is ReadFailure.IO:
            report.unreadable.append(f"{where} ({exc.strerror or exc})")
        return
    try:
        with os.scandir(sub_fd) as it:
            files = sorted(it, key=lambda e: e.name)
        for f in files:
            m = OBJECT_NAME_RE.match(f.name)
            if m is None or m.group(1)[:2] != sub or not f.is_file(follow_symlinks=False):
                if report is not None:  # not ours (or not a file bsr wrote): left alone
                    report.junk.append(f"{where}/{f.name}")
                continue
            yield sub_fd, f.name, m.group(1)
    finally:
        os.close(sub_fd)


#: the fan-out directories of ``objects/`` in the order every walk takes them
FANOUTS = tuple(f"{i:02x}" for i in range(256))


class Moved(str, enum.Enum):
    """What :meth:`StoreRoot.move_to_quarantine` did."""

    MOVED = "moved"  #: our regular file is in quarantine/ now
    NOT_REGULAR = "not_regular"  #: something else stands there (left alone: not bsr's)
    MISSING = "missing"  #: nothing there
    FAILED = "failed"  #: the rename failed (logged)


#: how a scan moves a damaged object aside: ``(fan-out dir fd, file name, object id, reason)``
Quarantine = Callable[[int, str, str, str], Moved]


class StoreRoot:
    """One FileTier root on disk.

    Args:
        root: the root directory.
        tier: the tier's name (for errors).
        log: the tier's bound logger.
        trust_locks: open a root on a filesystem whose flock may be local to each client
            (:func:`_fstype.locks_untrusted`); else :meth:`open` refuses it.
        network: the root is shared in network mode (``_network``: no lock is trusted, so
            any filesystem will do); a root once used so (it holds ``nodes/``) is refused
            otherwise.
    """

    def __init__(
        self,
        root: Path,
        tier: str,
        log: Any,
        *,
        trust_locks: bool = False,
        network: bool = False,
    ) -> None:
        self.root = root
        self.tier = tier
        self.log = log
        self.trust_locks = trust_locks
        self.network = network

    def scan_tmp(self, dirs: Dirs, report: ScanReport, dead: Callable[[str], bool]) -> None:
        """Remove the temp files of dead writers (``dead(name)`` says which) from ``tmp/``.

        Raises:
            TierRootError: ``tmp/`` cannot be listed.
        """
        try:
            self._scan_tmp(dirs, report, dead)
        except OSError as exc:
            raise self._io_error(exc, self.root / TMP_DIR) from exc

    def scan_objects(
        self, dirs: Dirs, report: ScanReport, quarantine: Quarantine | None = None
    ) -> None:
        """List the intact objects (oldest first); damaged ones are moved to quarantine, by
        ``quarantine`` when given (a shared root's move under its lock), else directly.

        Raises:
            TierRootError: ``objects/`` cannot be listed.
        """
        try:
            self._scan_objects(dirs, report, quarantine)
        except OSError as exc:
            raise self._io_error(exc, self.root / OBJECTS_DIR) from exc

    def _io_error(self, exc: OSError, path: Path) -> TierRootError:
        return self.error(
            f"cannot list it ({exc.strerror or exc})",
            "check its permissions and the device",
            path,
            errno=exc.errno,
        )

    def error(self, what: str, todo: str, path: Path | None = None, **fields: Any) -> TierRootError:
        where = path or self.root
        return TierRootError(f"{where}: {what}; {todo}", tier=self.tier, path=str(where), **fields)

    def open(self) -> Dirs:
        root = self.root
        self._check_locks()  # before anything is made there
        try:
            root.mkdir(parents=True, exist_ok=True)
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):
            raise self.error(
                "is not a directory", "give FileTier a directory path (empty or missing)"
            ) from None
        except OSError as exc:
            raise self.error(
                f"cannot open the root ({exc.strerror or exc})",
                "check the path, its permissions and the filesystem",
                errno=exc.errno,
            ) from exc
        fds: list[int] = []
        try:
            try:
                self.claim(root_fd)
            except OSError as exc:  # e.g. listing the root failed
                raise self._io_error(exc, self.root) from exc
            if not self.network:
                self._check_local(root_fd)
            for name in (OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR):
                fds.append(self._subdir(root_fd, name))
        except BaseException:
            for fd in (*fds, root_fd):
                os.close(fd)
            raise
        return Dirs(root_fd, *fds)

    def _check_local(self, root_fd: int) -> None:
        """Refuse a root nodes share in network mode: the local mode's ledger would not know
        what they write, nor they its lock."""
        try:
            os.stat(NODES_DIR, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._io_error(exc, self.root) from exc
        raise self.error(
            f"is shared by nodes in network mode (it holds {NODES_DIR}/)",
            "open it with shared='network' and this node's id, or use another directory",
            reason="network_root",
        )

    def _check_locks(self) -> None:
        """Refuse a root whose filesystem may keep flock local to each client (before anything
        is written there), unless told to trust it or shared in network mode."""
        if self.network:
            return
        fstype = mount_type(self.root)
        if self.trust_locks or not locks_untrusted(fstype):
            return
        raise UntrustedRootError(
            f"{self.root}: is on a {fstype} filesystem, whose flock may be local to each "
            "client: processes on several nodes sharing this root would each hold its lock at "
            "once and together fill it past capacity_bytes; share it with "
            "shared='network' and a node id per node (each node within its own share), use a "
            "root on a local filesystem, or pass trust_locks=True if only this node opens it "
            "(or its locks are coherent across clients)",
            tier=self.tier,
            path=str(self.root),
            fstype=fstype,
            reason="untrusted_locks",
        )

    def open_existing(self, refuse: type[TierRootError] = TierRootError) -> Dirs:
        """Open a root someone made, changing nothing (for ``bsr store``): the root must hold
        a valid marker or be a bsr 0.1 store; a missing ``tmp/`` or ``quarantine/`` is -1.

        Raises:
            TierRootError: a subdirectory that is not a real directory (a symlink, a file), or a
                bad marker; ``refuse`` (a subclass) when the path is not a directory or not a
                bsr FileTier root.
        """
        hint = "pass the directory given to FileTier(path, ...)"
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise refuse(
                f"{self.root}: is not a directory ({exc.strerror or exc}); {hint}",
                tier=self.tier,
                path=str(self.root),
            ) from None
        fds: list[int] = []
        try:
            try:
                if not self.check_marker(root_fd):
                    entries, legacy = self.unmarked_entries(root_fd)
                    if not legacy:
                        raise refuse(
                            f"{self.root}: is not a bsr FileTier store (no {MARKER_NAME} marker, "
                            f"and it holds {len(entries)} entries, not just {OBJECTS_DIR}/, "
                            f"{TMP_DIR}/ and {QUARANTINE_DIR}/); {hint}",
                            tier=self.tier,
                            path=str(self.root),
                        )
            except OSError as exc:
                raise self._io_error(exc, self.root) from exc
            for name in (OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR):
                fds.append(self._subdir(root_fd, name, create=False))
        except BaseException:
            for fd in (*fds, root_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        return Dirs(root_fd, *fds)

    def claim(self, root_fd: int) -> None:
        """Check the marker, or write it when the root is empty (or a bsr 0.1 store).

        Several processes may claim one fresh root at once (a fleet's instances starting on a
        shared root): each writes the same marker through its own temporary name, and one that
        fails because another got there first (the marker and the directories appeared between
        its check and its write) finds the other's marker and uses it.
        """
        if self.check_marker(root_fd):
            return
        try:
            self._claim_unmarked(root_fd)
        except TierRootError:
            if self.check_marker(root_fd):  # claimed by another process meanwhile
                return
            raise

    def check_marker(self, root_fd: int) -> bool:
        """Whether the root holds a valid marker (False: none at all).

        Raises:
            TierRootError: the marker is not a regular file, cannot be read, is not a bsr
                FileTier marker, or has a newer layout version.
        """
        marker = self.root / MARKER_NAME
        try:
            fd, st = open_regular(MARKER_NAME, dir_fd=root_fd)
        except FileNotFoundError:
            return False
        except NotRegularFileError as exc:
            raise self.error(
                f"the marker is a {exc.kind}", "remove it, or use another directory", marker
            ) from None
        except OSError as exc:
            raise self.error(
                f"cannot read the marker ({exc.strerror or exc})",
                "check its permissions",
                marker,
                errno=exc.errno,
            ) from exc
        try:
            raw = os.pread(fd, 4096, 0) if st.st_size <= 4096 else b""
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw.decode("utf-8"))
            ok = isinstance(doc, dict) and doc.get("kind") == MARKER_KIND
            version = doc.get("version") if ok else None
        except (UnicodeDecodeError, ValueError):
            ok, version = False, None
        if not ok or not is_int(version) or version < 1:
            raise self.error(
                "the marker is not a bsr FileTier marker",
                "this directory belongs to something else: use another directory",
                marker,
            )
        if version > MARKER_VERSION:
            raise self.error(
                f"the store has layout version {version}, this bsr reads {MARKER_VERSION}",
                "open it with a newer bsr, or use another directory",
                marker,
            )
        return True

    @staticmethod
    def unmarked_entries(root_fd: int) -> tuple[list[str], bool]:
        """The root's entries (leftover marker temp files aside) and whether they make a bsr 0.1
        store: ``objects/`` and nothing but ``objects/``, ``tmp/`` and ``quarantine/``, all
        real directories (and bsr's regular ledger file)."""
        entries = [e for e in os.listdir(root_fd) if not _MARKER_TMP_RE.match(e)]

        def ours(e: str) -> bool:
            mode = os.stat(e, dir_fd=root_fd, follow_symlinks=False).st_mode
            if e == LEDGER_NAME:  # a ledger left by a newer bsr whose marker was removed
                return stat.S_ISREG(mode)
            return e in _LEGACY_ENTRIES and stat.S_ISDIR(mode)

        legacy = OBJECTS_DIR in entries and all(ours(e) for e in entries)
        return entries, legacy

    def _claim_unmarked(self, root_fd: int) -> None:
        # a claim that died left its temporary marker: removed, unless its process (on this
        # host) still runs, where it is a claim in progress
        leftovers = [
            e
            for e in os.listdir(root_fd)
            if _MARKER_TMP_RE.match(e) and not _pid_alive(int(e.split(".")[2]))
        ]
        others, legacy = self.unmarked_entries(root_fd)
        if others and not legacy:
            shown = ", ".join(sorted(others)[:JUNK_EXAMPLES])
            raise self.error(
                f"the directory is not empty ({len(others)} entries: {shown}) and holds no "
                f"{MARKER_NAME} marker, so bsr does not own it",
                "give FileTier an empty (or missing) directory that only bsr uses",
            )
        body = json.dumps({"kind": MARKER_KIND, "version": MARKER_VERSION}).encode() + b"\n"
        tmp = f"{MARKER_NAME}.{os.getpid()}.tmp"
        try:
            for name in leftovers:
                os.unlink(name, dir_fd=root_fd)
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=root_fd
            )
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, MARKER_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            os.fsync(root_fd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=root_fd)
            except OSError:
                pass
            raise self.error(
                f"cannot claim the directory: writing {MARKER_NAME} failed ({exc.strerror or exc})",
                "give FileTier a writable directory",
                errno=exc.errno,
            ) from exc
        self.log.info("bsr.tier.claimed", path=str(self.root), legacy=bool(others))

    def _subdir(self, root_fd: int, name: str, *, create: bool = True) -> int:
        path = self.root / name
        try:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=root_fd)
                except FileExistsError:
                    pass
            return os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            if not create and exc.errno == errno.ENOENT:
                return -1
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                kind = file_kind(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode)
                raise self.error(
                    f"is a {kind}, not a directory",
                    f"FileTier keeps its {name}/ directory there: remove or rename it",
                    path,
                ) from None
            raise self.error(
                f"cannot open or create it ({exc.strerror or exc})",
                "check the permissions and the filesystem",
                path,
                errno=exc.errno,
            ) from exc

    def _scan_tmp(self, dirs: Dirs, report: ScanReport, dead: Callable[[str], bool]) -> None:
        with os.scandir(dirs.tmp) as it:
            entries = list(it)
        for entry in entries:
            m = TMP_NAME_RE.match(entry.name)
            if m is None or not entry.is_file(follow_symlinks=False):
                report.junk.append(f"{TMP_DIR}/{entry.name}")
                continue
            if not dead(entry.name):
                continue  # a live writer's file
            try:
                os.unlink(entry.name, dir_fd=dirs.tmp)
                report.removed_temps += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # EROFS, EACCES...: leave it, open anyway
                report.unreadable.append(f"{TMP_DIR}/{entry.name} ({exc.strerror or exc})")

    def _scan_objects(self, dirs: Dirs, report: ScanReport, quarantine: Quarantine | None) -> None:
        move = quarantine or (
            lambda sub_fd, name, oid, why: self.move_to_quarantine(dirs, sub_fd, name, oid, why)[0]
        )
        for sub_fd, name, oid in walk_objects(dirs.objects, report):
            self._scan_one(sub_fd, name, oid, report, move)
        report.found.sort()

    def _scan_one(
        self, sub_fd: int, name: str, oid: str, report: ScanReport, move: Quarantine
    ) -> None:
        where = f"{object_relpath(oid)}"
        try:
            fd, st = open_regular(name, dir_fd=sub_fd)
        except (OSError, NotRegularFileError) as exc:
            kind = classify_read_error(exc)
            if kind is ReadFailure.NOT_REGULAR:
                report.junk.append(where)
            elif kind is ReadFailure.IO:
                report.unreadable.append(f"{where} ({getattr(exc, 'strerror', None) or exc})")
            return
        try:
            problem = self.check_file(fd, st.st_size)
        except OSError as exc:
            report.unreadable.append(f"{where} ({exc.strerror or exc})")
            return
        finally:
            os.close(fd)
        if problem:
            moved = move(sub_fd, name, oid, problem)
            if moved is Moved.MOVED:
                report.quarantined += 1
            elif moved is Moved.NOT_REGULAR:
                report.junk.append(where)
            return
        report.found.append((st.st_mtime_ns, oid, st.st_size))

    def problem(self, sub_fd: int, name: str) -> str | None:
        """What :meth:`check_file` says of the object file ``name`` now ("" when intact);
        None when it is missing, not a regular file, or cannot be read."""
        try:
            fd, st = open_regular(name, dir_fd=sub_fd)
        except (OSError, NotRegularFileError):
            return None
        try:
            return self.check_file(fd, st.st_size)
        except OSError:
            return None
        finally:
            os.close(fd)

    @staticmethod
    def check_file(fd: int, size: int) -> str:
        """Cheap structural check on open: magic and length agree with the file size."""
        if size < HEADER_SIZE or size % 4096:
            return "truncated"
        head = os.pread(fd, _PLEN_OFFSET + 8, 0)
        if head[:8] != MAGIC:
            return "badmagic"
        plen = int.from_bytes(head[_PLEN_OFFSET : _PLEN_OFFSET + 8], "little")
        if object_size(plen) != size:
            return "truncated"
        return ""

    def move_to_quarantine(
        self, dirs: Dirs, sub_fd: int, name: str, oid: str, why: str
    ) -> tuple[Moved, int, str]:
        """Move our regular file ``name`` aside; anything else in its place is left alone.

        Returns what happened, the size of the file moved (0 unless moved) and its name in
        ``quarantine/`` ("" unless moved).
        """
        dest = _quarantine_name(oid, why)
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                self.log.warning("bsr.tier.junk", object_id=oid, kind=file_kind(st.st_mode))
                return Moved.NOT_REGULAR, 0, ""
            if dirs.quarantine < 0:
                self.log.warning("bsr.tier.quarantine_failed", object_id=oid, reason=why,
                                 error=f"no {QUARANTINE_DIR}/ directory")  # fmt: skip
                return Moved.FAILED, 0, ""
            os.replace(name, dest, src_dir_fd=sub_fd, dst_dir_fd=dirs.quarantine)
        except FileNotFoundError:
            return Moved.MISSING, 0, ""
        except OSError as exc:
            self.log.warning(
                "bsr.tier.quarantine_failed", object_id=oid, reason=why, error=repr(exc)
            )
            return Moved.FAILED, 0, ""
        self.log.warning("bsr.tier.quarantine", object_id=oid, reason=why)
        return Moved.MOVED, st.st_size, dest


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal runs too)."""
    if pid == os.getpid():
        return False  # our own leftover: a claim of ours that failed earlier
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
