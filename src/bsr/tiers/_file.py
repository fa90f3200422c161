"""FileTier: L2, one file per object in a local (SSD) directory bsr owns.

Where it runs: the serving process; every blocking step (open, scan, reads, writes, renames)
runs in worker threads, at most ``io_threads`` at once. Reads are abandonable: a read stuck in the
kernel (a hung mount) never holds its caller past a deadline or a cancellation.

How it works::

    <root>/.bsr-tier                        marker: {"kind": "bsr.FileTier", "version": 1}
    <root>/objects/<id[:2]>/<id>.bsr        visible objects (id = hex digest of key + group)
    <root>/tmp/<id>.<pid>.<rand>.tmp        objects being written (never visible)
    <root>/quarantine/<id>.<reason>.<rand>  objects that failed verification, kept for inspection

Ownership: a root is bsr's when it holds the marker. Opening an empty or missing directory
claims it (writes the marker); a non-empty directory without the marker is refused with
:class:`~bsr.TierRootError` (a bsr 0.1 store, which holds nothing but ``objects/``, ``tmp/``
and ``quarantine/``, is claimed). Inside the root the tier deletes or moves only entries it can
prove are its own: regular files whose names match its exact grammar (``TMP_NAME_RE``,
``OBJECT_NAME_RE``). Anything else (foreign files, symlinks, FIFOs, devices, directories in place
of files) is junk: skipped, counted (``statistics().junk``), logged once per open, never
followed, opened, deleted or moved.

A write reserves its bytes in the :class:`~bsr.tiers._lru.LruIndex` (evicting least recently
used, unpinned objects) before the temp file is written, is fsync'ed, renamed into ``objects/``
and the directory fsync'ed; only then is it committed to the index, so a probe never sees a
partial object (invariant 6) and concurrent writers never overshoot ``capacity_bytes``. Every
failure path removes the temp file and gives the reservation back. On open the index is rebuilt
by scanning ``objects/`` (each header is checked against the file size; damaged files are
quarantined), temp files of dead writers are removed, and the index is trimmed to capacity.
Files are opened relative to directory descriptors of the tree with ``O_NOFOLLOW | O_NONBLOCK``
and ``fstat``-checked (:func:`~bsr.tiers._readers.open_regular`): a read never leaves the root
and never blocks on a FIFO. Permission and I/O errors are I/O errors (``TierIOError``; skipped
and counted as ``unreadable`` on open), never corruption.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from .._check import positive_int
from .._errors import (
    ClosedError,
    ConfigError,
    CorruptObjectError,
    ObjectError,
    ObjectNotFoundError,
    TierIOError,
    TierRootError,
    TruncatedObjectError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..core._layout import align_up
from ..core._object import (
    HEADER_SIZE,
    MAGIC,
    decode_header,
    encode_header,
    object_size,
    payload_checksum,
    verify_payload,
)
from ..core._object import (
    PAYLOAD_LEN_OFFSET as _PLEN_OFFSET,
)
from ._base import Tier, TierLease, TierStatistics, TierUsage, as_byte_view, as_payload_view
from ._lru import LruIndex
from ._readers import (
    NotRegularFileError,
    ObjectReader,
    PosixReader,
    aligned_buffer,
    default_reader,
    file_kind,
    open_regular,
)

# ---------------------------------------------------------------------- on-disk layout
#: the marker file that claims a root for bsr (JSON: {"kind": MARKER_KIND, "version": N})
MARKER_NAME = ".bsr-tier"
MARKER_KIND = "bsr.FileTier"
#: layout version this bsr writes and reads; a marker with a higher version is refused
MARKER_VERSION = 1
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
_MARKER_TMP_RE = re.compile(r"^\.bsr-tier\.[1-9][0-9]{0,9}\.tmp$")
#: the entries a bsr 0.1 root (before the marker) may hold
_LEGACY_ENTRIES = frozenset({OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR})
#: Linux's PID_MAX_LIMIT: a larger pid in a temp name cannot belong to a live process
_PID_MAX = 1 << 22
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_THREAD = threading.local()
_JUNK_EXAMPLES = 5


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


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def _quarantine_name(oid: str, reason: str) -> str:
    word = re.sub(r"[^a-z0-9_-]", "_", reason.lower())[:40] or "failed"
    return f"{oid}.{word}.{secrets.token_hex(4)}"


@dataclasses.dataclass
class _Dirs:
    """Directory descriptors of one open root (reads and writes resolve names relative to them)."""

    root: int
    objects: int
    tmp: int
    quarantine: int

    def close(self) -> None:
        for fd in (self.objects, self.tmp, self.quarantine, self.root):
            try:
                os.close(fd)
            except OSError:
                pass


@dataclasses.dataclass
class _ScanReport:
    junk: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)
    removed_temps: int = 0
    quarantined: int = 0


class _Call:
    __slots__ = ("abandoned", "finished", "started")

    def __init__(self) -> None:
        self.started = self.finished = self.abandoned = False


class FileTier(Tier):
    """L2 tier: a directory on local storage that bsr owns.

    Args:
        path: the root: an empty or missing directory (claimed with a ``.bsr-tier`` marker), or
            one this tier claimed before. One process should own a root at a time.
        capacity_bytes: upper bound on stored bytes (file sizes, writes in progress included);
            LRU eviction beyond it, never of an object being read or leased.
        name: tier name for statistics, logs and ``bytes_by_tier``.
        reader: ``"auto"`` (kvikio when the ``gpu`` extra and a CUDA driver are present, else
            POSIX), ``"posix"``, ``"kvikio"`` or an :class:`ObjectReader` instance.
        direct_io: open files with O_DIRECT for POSIX reads (falls back when unsupported).
        fsync: fsync each object and its directory before it becomes visible (keep True unless
            the data is disposable).
        io_threads: worker threads for this tier's blocking I/O; also the number of abandoned
            reads (stuck in the kernel) after which new reads fail fast with TierIOError.
    """

    durable = True
    blocking_reads = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "file",
        reader: str | ObjectReader = "auto",
        direct_io: bool = False,
        fsync: bool = True,
        io_threads: int = 8,
    ) -> None:
        super().__init__(name)
        self.capacity_bytes = positive_int(capacity_bytes, "FileTier.capacity_bytes")
        self.io_threads = positive_int(io_threads, "FileTier.io_threads")
        self.root = Path(path)
        self.reader: ObjectReader = (
            default_reader(reader, direct=direct_io) if isinstance(reader, str) else reader
        )
        self.fsync = fsync
        self._limiter = anyio.CapacityLimiter(io_threads)
        self._index: LruIndex[None] = LruIndex(capacity_bytes, name=name)
        self._opened = False
        # guards _dirs, _busy and _stuck: worker threads touch them
        self._lock = threading.Lock()
        self._dirs: _Dirs | None = None
        self._busy = 0  # worker calls using _dirs now (the descriptors close after the last)
        self._closing: _Dirs | None = None  # closed by the last worker to leave after aclose()
        self._stuck = 0  # abandoned reads whose worker has not returned yet

    # ------------------------------------------------------------------ paths
    def _obj_path(self, oid: str) -> Path:
        return self.root / object_relpath(oid)

    def object_path(self, key: ChunkKey, group: str) -> Path:
        """Where ``(key, group)`` is (or would be) stored; for tests and tooling."""
        return self._obj_path(ObjectKey(key, group).object_id)

    def object_paths(self) -> list[Path]:
        """Paths of every visible object, least recently used first."""
        return [self._obj_path(oid) for oid in self._index.oids()]

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        if self._opened:
            return
        report = await anyio.to_thread.run_sync(self._open_sync, limiter=self._limiter)
        self._opened = True
        self._log.info(
            "bsr.tier.opened",
            path=str(self.root),
            objects=len(self._index),
            bytes=self._index.bytes,
            removed_temps=report.removed_temps,
        )
        if report.junk:
            self._log.warning(
                "bsr.tier.junk",
                path=str(self.root),
                count=len(report.junk),
                examples=report.junk[:_JUNK_EXAMPLES],
                hint="FileTier leaves entries it did not write alone; remove them, or give "
                "FileTier a directory only bsr uses",
            )
        if report.unreadable:
            self._log.warning(
                "bsr.tier.unreadable",
                path=str(self.root),
                count=len(report.unreadable),
                examples=report.unreadable[:_JUNK_EXAMPLES],
                hint="check permissions and the device; these entries were skipped, not moved",
            )

    def _open_sync(self) -> _ScanReport:
        dirs = self._open_root()
        report = _ScanReport()
        try:
            self._scan_tmp(dirs, report)
            self._scan_objects(dirs, report)
            victims = self._index.trim()
            if victims:
                self._count(evictions=len(victims))
                self._unlink_objects(dirs, [oid for oid, _ in victims])
        except BaseException:
            dirs.close()
            self._index.clear()
            raise
        self._count(junk=len(report.junk), unreadable=len(report.unreadable))
        with self._lock:
            self._dirs = dirs
        return report

    def _root_error(
        self, what: str, todo: str, path: Path | None = None, **fields: Any
    ) -> TierRootError:
        where = path or self.root
        return TierRootError(f"{where}: {what}; {todo}", tier=self.name, path=str(where), **fields)

    def _open_root(self) -> _Dirs:
        root = self.root
        try:
            root.mkdir(parents=True, exist_ok=True)
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):
            raise self._root_error(
                "is not a directory", "give FileTier a directory path (empty or missing)"
            ) from None
        except OSError as exc:
            raise self._root_error(
                f"cannot open the root ({exc.strerror or exc})",
                "check the path, its permissions and the filesystem",
                errno=exc.errno,
            ) from exc
        fds: list[int] = []
        try:
            self._claim(root_fd)
            for name in (OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR):
                fds.append(self._subdir(root_fd, name))
        except BaseException:
            for fd in (*fds, root_fd):
                os.close(fd)
            raise
        return _Dirs(root_fd, *fds)

    def _claim(self, root_fd: int) -> None:
        """Check the marker, or write it when the root is empty (or a bsr 0.1 store)."""
        marker = self.root / MARKER_NAME
        try:
            fd, st = open_regular(MARKER_NAME, dir_fd=root_fd)
        except FileNotFoundError:
            self._claim_unmarked(root_fd)
            return
        except NotRegularFileError as exc:
            raise self._root_error(
                f"the marker is a {exc.kind}", "remove it, or use another directory", marker
            ) from None
        except OSError as exc:
            raise self._root_error(
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
        if not ok or isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise self._root_error(
                "the marker is not a bsr FileTier marker",
                "this directory belongs to something else: use another directory",
                marker,
            )
        if version > MARKER_VERSION:
            raise self._root_error(
                f"the store has layout version {version}, this bsr reads {MARKER_VERSION}",
                "open it with a newer bsr, or use another directory",
                marker,
            )

    def _claim_unmarked(self, root_fd: int) -> None:
        entries = os.listdir(root_fd)
        leftovers = [e for e in entries if _MARKER_TMP_RE.match(e)]
        others = [e for e in entries if e not in leftovers]
        legacy = OBJECTS_DIR in others and all(
            e in _LEGACY_ENTRIES
            and stat.S_ISDIR(os.stat(e, dir_fd=root_fd, follow_symlinks=False).st_mode)
            for e in others
        )
        if others and not legacy:
            shown = ", ".join(sorted(others)[:_JUNK_EXAMPLES])
            raise self._root_error(
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
            raise self._root_error(
                f"cannot claim the directory: writing {MARKER_NAME} failed ({exc.strerror or exc})",
                "give FileTier a writable directory",
                errno=exc.errno,
            ) from exc
        self._log.info("bsr.tier.claimed", path=str(self.root), legacy=bool(others))

    def _subdir(self, root_fd: int, name: str) -> int:
        path = self.root / name
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=root_fd)
            except FileExistsError:
                pass
            return os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                kind = file_kind(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode)
                raise self._root_error(
                    f"is a {kind}, not a directory",
                    f"FileTier keeps its {name}/ directory there: remove or rename it",
                    path,
                ) from None
            raise self._root_error(
                f"cannot open or create it ({exc.strerror or exc})",
                "check the permissions and the filesystem",
                path,
                errno=exc.errno,
            ) from exc

    def _scan_tmp(self, dirs: _Dirs, report: _ScanReport) -> None:
        me = os.getpid()
        with os.scandir(dirs.tmp) as it:
            entries = list(it)
        for entry in entries:
            m = TMP_NAME_RE.match(entry.name)
            if m is None or not entry.is_file(follow_symlinks=False):
                report.junk.append(f"{TMP_DIR}/{entry.name}")
                continue
            pid = int(m.group(2))
            if pid != me and _pid_alive(pid):
                continue  # a live writer's file
            try:
                os.unlink(entry.name, dir_fd=dirs.tmp)
                report.removed_temps += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # EROFS, EACCES...: leave it, open anyway
                report.unreadable.append(f"{TMP_DIR}/{entry.name} ({exc.strerror or exc})")

    def _scan_objects(self, dirs: _Dirs, report: _ScanReport) -> None:
        found: list[tuple[int, str, int]] = []
        with os.scandir(dirs.objects) as it:
            subs = list(it)
        for sub in subs:
            where = f"{OBJECTS_DIR}/{sub.name}"
            if not re.fullmatch(r"[0-9a-f]{2}", sub.name) or not sub.is_dir(follow_symlinks=False):
                report.junk.append(where)
                continue
            try:
                sub_fd = os.open(sub.name, _DIR_FLAGS, dir_fd=dirs.objects)
            except OSError as exc:
                if classify_read_error(exc) is ReadFailure.NOT_REGULAR:
                    report.junk.append(where)
                elif classify_read_error(exc) is ReadFailure.IO:
                    report.unreadable.append(f"{where} ({exc.strerror or exc})")
                continue
            try:
                with os.scandir(sub_fd) as it:
                    files = list(it)
                for f in files:
                    self._scan_one(dirs, sub_fd, sub.name, f, found, report)
            finally:
                os.close(sub_fd)
        found.sort()
        for _, oid, size in found:
            self._index.put(oid, size, None)

    def _scan_one(
        self,
        dirs: _Dirs,
        sub_fd: int,
        sub: str,
        f: os.DirEntry[str],
        found: list[tuple[int, str, int]],
        report: _ScanReport,
    ) -> None:
        where = f"{OBJECTS_DIR}/{sub}/{f.name}"
        m = OBJECT_NAME_RE.match(f.name)
        if m is None or m.group(1)[:2] != sub or not f.is_file(follow_symlinks=False):
            report.junk.append(where)  # not ours (or not a file bsr wrote): leave it alone
            return
        oid = m.group(1)
        try:
            fd, st = open_regular(f.name, dir_fd=sub_fd)
        except (OSError, NotRegularFileError) as exc:
            kind = classify_read_error(exc)
            if kind is ReadFailure.NOT_REGULAR:
                report.junk.append(where)
            elif kind is ReadFailure.IO:
                report.unreadable.append(f"{where} ({getattr(exc, 'strerror', None) or exc})")
            return
        try:
            problem = self._check_file(fd, st.st_size)
        except OSError as exc:
            report.unreadable.append(f"{where} ({exc.strerror or exc})")
            return
        finally:
            os.close(fd)
        if problem:
            if self._move_to_quarantine(dirs, sub_fd, f.name, oid, problem):
                report.quarantined += 1
            return
        found.append((st.st_mtime_ns, oid, st.st_size))

    @staticmethod
    def _check_file(fd: int, size: int) -> str:
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

    def _move_to_quarantine(self, dirs: _Dirs, sub_fd: int, name: str, oid: str, why: str) -> bool:
        """Move our regular file ``name`` aside; anything else in its place is left alone."""
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                self._count(junk=1)
                self._log.warning("bsr.tier.junk", object_id=oid, kind=file_kind(st.st_mode))
                return False
            os.replace(
                name, _quarantine_name(oid, why), src_dir_fd=sub_fd, dst_dir_fd=dirs.quarantine
            )
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._log.warning(
                "bsr.tier.quarantine_failed", object_id=oid, reason=why, error=repr(exc)
            )
            return False
        self._count(quarantined=1)
        self._log.warning("bsr.tier.quarantine", object_id=oid, reason=why)
        return True

    async def aclose(self) -> None:
        self._index.clear()
        await super().aclose()
        with self._lock:
            dirs, self._dirs = self._dirs, None
            if dirs is not None and self._busy:
                self._closing = dirs  # the last worker closes them
                dirs = None
        if dirs is not None:
            dirs.close()

    def _ensure_open(self) -> None:
        self._check_open()
        if not self._opened:
            raise ConfigError(
                f"FileTier {self.name!r} is not open; use 'async with tier' or await tier.open()",
                tier=self.name,
            )

    def _enter(self) -> _Dirs:
        with self._lock:
            if self._dirs is None:
                raise ClosedError(f"tier {self.name!r} is closed; open a new one", tier=self.name)
            self._busy += 1
            return self._dirs

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            closing = self._closing if not self._busy else None
            if closing is not None:
                self._closing = None
        if closing is not None:
            closing.close()

    # ------------------------------------------------------------------ statistics
    def usage(self) -> TierUsage:
        s = self._index.statistics()
        return TierUsage(s.objects, s.bytes, self.capacity_bytes)

    def statistics(self) -> TierStatistics:
        st = super().statistics()
        return dataclasses.replace(
            st, peak_bytes=max(st.peak_bytes, self._index.statistics().peak_bytes)
        )

    # ------------------------------------------------------------------ core
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._ensure_open()
        return [o.object_id in self._index for o in objects]

    async def lease(self, objects: Sequence[ObjectKey], ttl_s: float) -> TierLease:
        """Pin the held ``objects`` against eviction until ``release()`` or ``ttl_s`` passes."""
        self._ensure_open()
        return self._index.lease([o.object_id for o in objects], ttl_s)

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        """Read and verify ``(key, group)`` into ``dst`` in a worker thread.

        Abandonable: on cancellation (a deadline, an outer scope) this returns at once even if
        the worker is stuck in the kernel; ``dst`` may then still be written until the worker
        returns, so the caller must not reuse it before (the transfer pipeline parks the slot).
        Abandoned reads are counted (``statistics().abandoned_reads``); once ``io_threads`` of
        them are still stuck, new reads fail fast with :class:`~bsr.TierIOError`.
        """
        self._ensure_open()
        with self._lock:
            if self._stuck >= self.io_threads:
                raise TierIOError(
                    f"{self._stuck} reads of {self.name!r} are stuck in the kernel (a hung "
                    f"mount or device under {self.root}?); new reads fail fast until they return",
                    tier=self.name,
                )
        call = _Call()

        def work() -> int:
            with self._lock:
                call.started = True
            try:
                return self.read_into_blocking(key, group, dst)
            finally:
                with self._lock:
                    call.finished = True
                    if call.abandoned:
                        self._stuck -= 1

        try:
            return await anyio.to_thread.run_sync(
                work, limiter=self._limiter, abandon_on_cancel=True
            )
        except anyio.get_cancelled_exc_class():
            with self._lock:
                if call.started and not call.finished:
                    call.abandoned = True
                    self._stuck += 1
                    abandoned = True
                else:
                    abandoned = False
            if abandoned:
                self._count(abandoned_reads=1)
            raise

    def read_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> int:
        self._ensure_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.pin(oid) is None:
            self._count(misses=1)
            raise ObjectNotFoundError(
                "object not in file tier", tier=self.name, key=key.hex[:16], group=group
            )
        try:
            view = as_byte_view(dst)
            dirs = self._enter()
            try:
                plen = self._read_verify(dirs, oid, okey, view)
            finally:
                self._leave()
        except ObjectError:
            self._count(errors=1)
            raise
        except (OSError, NotRegularFileError) as exc:
            self._count(errors=1)
            raise self._read_error(exc, oid, okey) from exc
        finally:
            self._index.unpin(oid)
        self._count(hits=1, reads=1, bytes_read=plen)
        return plen

    def _read_error(self, exc: BaseException, oid: str, okey: ObjectKey) -> Exception:
        ctx = {"tier": self.name, "key": okey.chunk.hex[:16], "group": okey.group}
        kind = classify_read_error(exc)
        if kind is ReadFailure.MISSING:
            self._index.discard(oid)
            return ObjectNotFoundError("object file vanished", **ctx)
        if kind is ReadFailure.NOT_REGULAR:
            return CorruptObjectError(
                f"{object_relpath(oid)} is not a regular file bsr wrote ({exc}); "
                "it is never followed or read",
                **ctx,
            )
        assert isinstance(exc, OSError)
        return TierIOError(
            f"reading {object_relpath(oid)} failed: {exc.strerror or exc}",
            errno=exc.errno,
            **ctx,
        )

    def _open_object(self, dirs: _Dirs, oid: str) -> tuple[int, os.stat_result]:
        sub_fd = os.open(oid[:2], _DIR_FLAGS, dir_fd=dirs.objects)
        try:
            name = oid + OBJECT_SUFFIX
            if isinstance(self.reader, PosixReader):
                return self.reader.open(name, dir_fd=sub_fd)
            return open_regular(name, dir_fd=sub_fd)
        finally:
            os.close(sub_fd)

    def _read_verify(self, dirs: _Dirs, oid: str, okey: ObjectKey, view: memoryview) -> int:
        ctx = {"tier": self.name, "key": okey.chunk.hex[:16], "group": okey.group}
        fd, st = self._open_object(dirs, oid)
        try:
            size = st.st_size
            if size < HEADER_SIZE:
                raise TruncatedObjectError(
                    f"object file is {size} bytes, shorter than its {HEADER_SIZE}-byte header",
                    **ctx,
                )
            header = getattr(_THREAD, "header", None)
            if header is None:  # one aligned header buffer per worker thread, reused
                header = _THREAD.header = aligned_buffer(HEADER_SIZE)
            # read into as much of dst as is 4 KiB aligned; objects are padded to 4 KiB
            room = len(view) - len(view) % 4096
            read_fd = getattr(self.reader, "read_fd", None)
            if read_fd is not None:
                n = int(read_fd(fd, header, view[:room]))
            else:  # a reader that opens by path: give it the file we checked
                n = self.reader.read(f"/proc/self/fd/{fd}", header, view[:room])
        finally:
            os.close(fd)
        if n < HEADER_SIZE:  # the buffer may still hold another object's header: never decode it
            raise TruncatedObjectError(f"short read: {n} bytes, less than the header", **ctx)
        plen, psum = decode_header(header, okey, where=self.name)
        if object_size(plen) != size:  # checked before the destination: a forged length is ours
            raise TruncatedObjectError(
                f"header says the object is {object_size(plen)} bytes, the file holds {size}",
                **ctx,
            )
        if plen > room:
            if plen > len(view):
                raise ConfigError(
                    f"destination holds {len(view)} bytes, object payload is {plen}", tier=self.name
                )
            raise ConfigError("destination must be 4 KiB aligned in length", tier=self.name)
        if n < HEADER_SIZE + plen:
            raise TruncatedObjectError(
                f"short read: {n} bytes, object needs {HEADER_SIZE + plen}", **ctx
            )
        verify_payload(view[:plen], plen, psum, okey, where=self.name)
        return plen

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._ensure_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.touch(oid):
            return False
        mv = as_payload_view(payload)
        reservation, victims = await self._index.reserve_waiting(object_size(len(mv)))
        renamed: list[bool] = []
        committed = False
        try:
            if victims:
                self._count(evictions=len(victims))
                await anyio.to_thread.run_sync(
                    self._unlink_victims, [v for v, _ in victims], limiter=self._limiter
                )
            try:
                await anyio.to_thread.run_sync(
                    self._write_file, okey, mv, renamed, limiter=self._limiter
                )
            except OSError as exc:
                self._count(errors=1)
                raise TierIOError(
                    f"writing {object_relpath(oid)} failed: {exc.strerror or exc}",
                    tier=self.name,
                    errno=exc.errno,
                ) from exc
            finally:
                if renamed:  # visible on disk: index it even if the caller was cancelled
                    committed = reservation.commit(oid)
        finally:
            reservation.abort()  # no-op once committed
        if committed:
            self._count(writes=1, bytes_written=len(mv))
        return committed

    def _write_file(self, okey: ObjectKey, mv: memoryview, renamed: list[bool]) -> None:
        oid = okey.object_id
        header = encode_header(okey, len(mv), payload_checksum(mv))
        pad = b"\x00" * (align_up(len(mv)) - len(mv))
        tmp = f"{oid}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        dirs = self._enter()
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=dirs.tmp,
            )
            try:
                try:
                    _write_all(fd, [header, mv, pad])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                sub_fd = self._object_dir(dirs, oid[:2])
                try:
                    os.replace(tmp, oid + OBJECT_SUFFIX, src_dir_fd=dirs.tmp, dst_dir_fd=sub_fd)
                    renamed.append(True)
                    if self.fsync:
                        os.fsync(sub_fd)
                finally:
                    os.close(sub_fd)
            finally:
                if not renamed:  # every failure path removes the temp file
                    try:
                        os.unlink(tmp, dir_fd=dirs.tmp)
                    except OSError:
                        pass
        finally:
            self._leave()

    def _object_dir(self, dirs: _Dirs, sub: str) -> int:
        try:
            os.mkdir(sub, 0o755, dir_fd=dirs.objects)
        except FileExistsError:
            pass
        try:
            return os.open(sub, _DIR_FLAGS, dir_fd=dirs.objects)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                exc.strerror = (
                    f"{OBJECTS_DIR}/{sub} is not a directory bsr made (a symlink or a file); "
                    "remove it"
                )
            raise

    def _unlink_victims(self, oids: list[str]) -> None:
        dirs = self._enter()
        try:
            self._unlink_objects(dirs, oids)
        finally:
            self._leave()

    def _unlink_objects(self, dirs: _Dirs, oids: list[str]) -> None:
        """Remove our regular files of ``oids``; a symlink or other entry in place stays."""
        for oid in oids:
            try:
                sub_fd = os.open(oid[:2], _DIR_FLAGS, dir_fd=dirs.objects)
            except OSError:
                continue
            try:
                name = oid + OBJECT_SUFFIX
                st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=sub_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._log.warning("bsr.tier.unlink_failed", object_id=oid, error=repr(exc))
            finally:
                os.close(sub_fd)

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._ensure_open()
        oid = ObjectKey(key, group).object_id
        if not self._index.discard(oid):
            return False
        await anyio.to_thread.run_sync(self._unlink_victims, [oid], limiter=self._limiter)
        return True

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        """Move a failing object aside (``quarantine/``) so later probes miss it.

        Only a regular file is moved; a symlink, FIFO or directory in its place is left where it
        is (it is not bsr's) and the object is simply forgotten.
        """
        self._ensure_open()
        oid = ObjectKey(key, group).object_id
        self._index.discard(oid)

        def _move() -> None:
            dirs = self._enter()
            try:
                sub_fd = os.open(oid[:2], _DIR_FLAGS, dir_fd=dirs.objects)
            except OSError:
                self._leave()
                return
            try:
                self._move_to_quarantine(dirs, sub_fd, oid + OBJECT_SUFFIX, oid, reason)
            finally:
                os.close(sub_fd)
                self._leave()

        await anyio.to_thread.run_sync(_move, limiter=self._limiter)


def _write_all(fd: int, bufs: list[Any]) -> None:
    want = sum(len(b) for b in bufs)
    done = 0
    while done < want:
        n = os.writev(fd, bufs)
        done += n
        if done < want:  # partial write: rebuild the remaining buffers
            flat = memoryview(b"".join(bytes(b) for b in bufs))[n:]
            bufs = [flat]
