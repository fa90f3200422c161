"""FileTier's root on disk: its names, the marker that claims it, and the scan on open.

Where it runs: worker threads (FileTier opens its root and scans it off the event loop).

How it works: :meth:`StoreRoot.open` claims the root (checks or writes the ``.bsr-tier`` marker)
and opens descriptors of ``objects/``, ``tmp/`` and ``quarantine/`` with ``O_NOFOLLOW``, so every
later name resolves inside the tree. :meth:`StoreRoot.scan` then removes dead writers' temp files
and lists intact objects; it deletes or moves only regular files of bsr's exact name grammar and
reports everything else as junk, and files it cannot read (EACCES, EIO) as unreadable. The names
and regular expressions here are the layout's single definition (``bsr store`` reads them too).
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
from pathlib import Path
from typing import Any

from .._errors import TierRootError
from ..core._object import HEADER_SIZE, MAGIC, object_size
from ..core._object import PAYLOAD_LEN_OFFSET as _PLEN_OFFSET
from ._readers import NotRegularFileError, file_kind, open_regular

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
class Dirs:
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
class ScanReport:
    junk: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)
    removed_temps: int = 0
    quarantined: int = 0
    #: (mtime_ns, object id, size) of every intact object found
    found: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)


class Moved(str, enum.Enum):
    """What :meth:`StoreRoot.move_to_quarantine` did."""

    MOVED = "moved"  #: our regular file is in quarantine/ now
    NOT_REGULAR = "not_regular"  #: something else stands there (left alone: not bsr's)
    MISSING = "missing"  #: nothing there
    FAILED = "failed"  #: the rename failed (logged)


class StoreRoot:
    """One FileTier root on disk.

    Args:
        root: the root directory.
        tier: the tier's name (for errors).
        log: the tier's bound logger.
    """

    def __init__(self, root: Path, tier: str, log: Any) -> None:
        self.root = root
        self.tier = tier
        self.log = log

    def scan(self, dirs: Dirs) -> ScanReport:
        """Remove dead writers' temp files and list the intact objects (oldest first).

        Raises:
            TierRootError: ``tmp/`` or ``objects/`` cannot be listed (names the directory).
        """
        report = ScanReport()
        for name, step in ((TMP_DIR, self._scan_tmp), (OBJECTS_DIR, self._scan_objects)):
            try:
                step(dirs, report)
            except OSError as exc:
                raise self._io_error(exc, self.root / name) from exc
        return report

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
            for name in (OBJECTS_DIR, TMP_DIR, QUARANTINE_DIR):
                fds.append(self._subdir(root_fd, name))
        except BaseException:
            for fd in (*fds, root_fd):
                os.close(fd)
            raise
        return Dirs(root_fd, *fds)

    def claim(self, root_fd: int) -> None:
        """Check the marker, or write it when the root is empty (or a bsr 0.1 store)."""
        marker = self.root / MARKER_NAME
        try:
            fd, st = open_regular(MARKER_NAME, dir_fd=root_fd)
        except FileNotFoundError:
            self._claim_unmarked(root_fd)
            return
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
        if not ok or isinstance(version, bool) or not isinstance(version, int) or version < 1:
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

    def _subdir(self, root_fd: int, name: str) -> int:
        path = self.root / name
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=root_fd)
            except FileExistsError:
                pass
            return os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
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

    def _scan_tmp(self, dirs: Dirs, report: ScanReport) -> None:
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

    def _scan_objects(self, dirs: Dirs, report: ScanReport) -> None:
        found = report.found
        with os.scandir(dirs.objects) as it:
            subs = list(it)
        for sub in subs:
            where = f"{OBJECTS_DIR}/{sub.name}"
            if not re.fullmatch(r"[0-9a-f]{2}", sub.name) or not sub.is_dir(follow_symlinks=False):
                report.junk.append(where)
                continue
            try:
                sub_fd = os.open(sub.name, DIR_FLAGS, dir_fd=dirs.objects)
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

    def _scan_one(
        self,
        dirs: Dirs,
        sub_fd: int,
        sub: str,
        f: os.DirEntry[str],
        found: list[tuple[int, str, int]],
        report: ScanReport,
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
            problem = self.check_file(fd, st.st_size)
        except OSError as exc:
            report.unreadable.append(f"{where} ({exc.strerror or exc})")
            return
        finally:
            os.close(fd)
        if problem:
            moved = self.move_to_quarantine(dirs, sub_fd, f.name, oid, problem)
            if moved is Moved.MOVED:
                report.quarantined += 1
            elif moved is Moved.NOT_REGULAR:
                report.junk.append(where)
            return
        found.append((st.st_mtime_ns, oid, st.st_size))

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

    def move_to_quarantine(self, dirs: Dirs, sub_fd: int, name: str, oid: str, why: str) -> Moved:
        """Move our regular file ``name`` aside; anything else in its place is left alone."""
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                self.log.warning("bsr.tier.junk", object_id=oid, kind=file_kind(st.st_mode))
                return Moved.NOT_REGULAR
            os.replace(
                name, _quarantine_name(oid, why), src_dir_fd=sub_fd, dst_dir_fd=dirs.quarantine
            )
        except FileNotFoundError:
            return Moved.MISSING
        except OSError as exc:
            self.log.warning(
                "bsr.tier.quarantine_failed", object_id=oid, reason=why, error=repr(exc)
            )
            return Moved.FAILED
        self.log.warning("bsr.tier.quarantine", object_id=oid, reason=why)
        return Moved.MOVED
