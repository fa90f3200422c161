"""Administration of a FileTier directory: stats, listing, checksum scrub, gc, quarantine.

Where it runs: an operator's shell (``bsr store ...``) or a maintenance job, on a directory
that a :class:`~bsr.FileTier` wrote, possibly while engines have it open. Plain blocking file
I/O, no event loop. ``stats``, ``ls``, ``verify`` (without ``quarantine``) and ``quarantine
list`` only read; ``gc`` and ``verify`` with ``quarantine`` change ``objects/`` one object at a
time under the root's lock, the one every FileTier takes for its own changes (see
:mod:`bsr.tiers.file._ledger`), and keep the shared ledger exact, so running engines stay within
their capacity; they see removed objects as misses. ``quarantine purge`` deletes only files of
the quarantine's own name grammar.

How it works: the root is opened the way FileTier opens it (:mod:`bsr.tiers.file._root`):
directory descriptors opened with ``O_NOFOLLOW`` (a symlinked ``objects/``, ``quarantine/`` or
fan-out directory is refused or skipped, never followed), and only regular files of bsr's exact
name grammar are read, moved or deleted; anything else is junk, counted and left alone. An
object's header is parsed with the object format's own field table; without the engine's keys
an object cannot be matched to a token prefix, so the scrub checks what the bytes alone can
prove: magic, header checksum, format version, file size against the header's payload length,
and the payload's xxh3 checksum. An object that disappears between the listing and its read
(evicted or re-saved by a running engine) is counted as gone, not as bad. The header names its
namespace by fingerprint (model, rank, salt, layout, version) and its group by digest, so stats
group objects by namespace fingerprint (and name a group when it is one of the usual names). gc
evicts oldest modification time first, the order a FileTier rebuilds its LRU in on open.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ..._check import non_negative_int
from ..._errors import ConfigError, TierRootError
from ...core._keys import FORMAT_VERSION
from ...core._object import _FIELDS, _SUM_OFFSET, HEADER_SIZE, MAGIC, object_size
from ._ledger import SharedSpace
from ._network import JOURNAL_TMP_RE
from ._readers import NotRegularFileError, open_regular
from ._root import (
    DIR_FLAGS,
    NODES_DIR,
    OBJECT_SUFFIX,
    QUARANTINE_NAME_RE,
    TMP_NAME_RE,
    Dirs,
    Moved,
    ScanReport,
    StoreRoot,
    object_relpath,
    walk_objects,
)

#: group names whose digests ``stats`` and ``ls`` recognise (others show as a digest)
KNOWN_GROUPS = ("kv", "swa_kv", "swa", "hidden", "mla", "indexer")
#: ``bsr store gc`` on a network root: temp files older than this are a dead writer's
TMP_AGE_S = 600.0


class NotAStoreError(TierRootError):
    """The directory is not a FileTier store."""


@dataclass(frozen=True)
class ObjectInfo:
    """One visible object file, as its header describes it (``None`` fields: unreadable)."""

    path: Path
    object_id: str
    size: int
    mtime: float
    namespace: str | None = None
    group: str | None = None
    chunk_index: int | None = None
    payload_len: int | None = None


@dataclass(frozen=True)
class NamespaceStats:
    namespace: str
    objects: int
    bytes: int
    payload_bytes: int
    groups: dict[str, int]
    max_chunk_index: int


@dataclass(frozen=True)
class StoreStats:
    """What ``bsr store stats`` reports."""

    root: Path
    objects: int
    bytes: int
    payload_bytes: int
    namespaces: tuple[NamespaceStats, ...]
    unreadable: int
    quarantined: int
    quarantined_bytes: int
    temp_files: int
    #: entries that are not bsr's (foreign names, symlinks, FIFOs): never read, moved or deleted
    junk: int = 0


@dataclass(frozen=True)
class BadObject:
    path: Path
    object_id: str
    reason: str
    detail: str
    quarantined_to: Path | None = None


@dataclass
class VerifyReport:
    """What ``bsr store verify`` found."""

    checked: int = 0
    bytes: int = 0
    bad: list[BadObject] = field(default_factory=list)
    #: objects that vanished between the listing and their read (a running engine evicted,
    #: quarantined or re-saved them): not bad
    gone: int = 0

    @property
    def clean(self) -> bool:
        return not self.bad


@dataclass(frozen=True)
class GcReport:
    removed: tuple[ObjectInfo, ...]
    freed_bytes: int
    remaining_objects: int
    remaining_bytes: int
    #: temp files older than the grace removed (network roots only: ``tmp_age_s``)
    removed_temps: int = 0
    #: the root is shared in network mode (collected without a lock)
    network: bool = False
    #: objects chosen that were already gone (evicted by a node since the listing, or a stale
    #: listing: gc on a network root wants fresh directory listings)
    vanished: int = 0


@dataclass(frozen=True)
class QuarantinedFile:
    path: Path
    object_id: str
    reason: str
    size: int
    mtime: float


# --------------------------------------------------------------------- the directory
class _Quiet:
    """The admin commands report through their results (and exit codes), not log events."""

    def _drop(self, event: str, **fields: object) -> None:
        pass

    info = warning = _drop


_log = _Quiet()


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str], *, change: bool = False) -> Iterator[_Admin]:
    admin = _Admin(Path(path), change=change)
    try:
        yield admin
    finally:
        admin.close()


class _Admin:
    """An open root: its directory descriptors and, to change it, its shared ledger (lock)."""

    def __init__(self, root: Path, *, change: bool) -> None:
        self.root = root
        self.store = StoreRoot(root, "store", _log)
        self.dirs: Dirs = self.store.open_existing(NotAStoreError)
        self.space: SharedSpace | None = None
        #: shared by nodes in network mode (holds nodes/): no root lock to take, none to trust
        self.network = _exists(self.dirs.root, NODES_DIR)
        if change and not self.network:
            try:
                self.space = SharedSpace(self.store, self.dirs, None, 1, member=False, wait=True)
            except BaseException:
                self.dirs.close()
                raise

    def close(self) -> None:
        if self.space is not None:
            self.space.close()
        self.dirs.close()

    def objects(self, report: ScanReport | None = None) -> Iterator[tuple[int, str, str]]:
        if self.dirs.objects >= 0:
            yield from walk_objects(self.dirs.objects, report)

    def sub(self, oid: str) -> int:
        """A descriptor of ``oid``'s fan-out directory (OSError when it is gone or not ours)."""
        return os.open(oid[:2], DIR_FLAGS, dir_fd=self.dirs.objects)


def open_store(path: str | os.PathLike[str]) -> Path:
    """The store root, after checking it is one: FileTier's root marker, or (a store written
    before the marker existed) nothing but its ``objects/``, ``tmp/`` and ``quarantine/``.

    Raises:
        NotAStoreError: missing, not a directory, or not a FileTier root.
        TierRootError: a subdirectory of it is a symlink or a file.
    """
    with _opened(path) as admin:
        return admin.root


def _group_names() -> dict[bytes, str]:
    return {
        hashlib.blake2b(g.encode(), digest_size=16, person=b"bsr-group").digest(): g
        for g in KNOWN_GROUPS
    }


def _describe(
    admin: _Admin, sub_fd: int, name: str, oid: str, names: dict[bytes, str]
) -> ObjectInfo:
    path = admin.root / object_relpath(oid)
    fd, st = open_regular(name, dir_fd=sub_fd)
    try:
        head = os.pread(fd, _FIELDS.size, 0)
    except OSError:
        head = b""
    finally:
        os.close(fd)
    if len(head) < _FIELDS.size:
        return ObjectInfo(path, oid, st.st_size, st.st_mtime)
    magic, _v, _f, ns, _key, group, index, plen, _psum, _hsum = _FIELDS.unpack(head)
    if magic != MAGIC:
        return ObjectInfo(path, oid, st.st_size, st.st_mtime)
    return ObjectInfo(
        path,
        oid,
        st.st_size,
        st.st_mtime,
        namespace=ns.hex(),
        group=names.get(group, group.hex()[:12]),
        chunk_index=int(index),
        payload_len=int(plen),
    )


def _list(admin: _Admin, report: ScanReport | None = None) -> list[ObjectInfo]:
    names = _group_names()
    out = []
    for sub_fd, name, oid in admin.objects(report):
        try:
            out.append(_describe(admin, sub_fd, name, oid, names))
        except FileNotFoundError:
            continue  # removed meanwhile
        except NotRegularFileError:
            if report is not None:
                report.junk.append(object_relpath(oid))
        except OSError:  # EACCES, EIO: listed, without a header (verify reports it)
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
                where = admin.root / object_relpath(oid)
                out.append(ObjectInfo(where, oid, st.st_size, st.st_mtime))
    out.sort(key=lambda o: (o.mtime, o.object_id))
    return out


def list_objects(path: str | os.PathLike[str]) -> list[ObjectInfo]:
    """Every visible object, oldest modification first (FileTier's LRU order after open)."""
    with _opened(path) as admin:
        return _list(admin)


def _quarantine_files(admin: _Admin, report: ScanReport | None = None) -> list[QuarantinedFile]:
    out: list[QuarantinedFile] = []
    if admin.dirs.quarantine < 0:
        return out
    with os.scandir(admin.dirs.quarantine) as it:
        entries = list(it)
    for e in entries:
        m = QUARANTINE_NAME_RE.match(e.name)
        if m is None or not e.is_file(follow_symlinks=False):
            if report is not None:
                report.junk.append(f"quarantine/{e.name}")
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        where = admin.root / "quarantine" / e.name
        out.append(QuarantinedFile(where, m.group(1), m.group(2), st.st_size, st.st_mtime))
    out.sort(key=lambda q: (q.mtime, q.path.name))
    return out


def list_quarantine(path: str | os.PathLike[str]) -> list[QuarantinedFile]:
    """Files in ``quarantine/`` of its name grammar (``<object id>.<reason>.<8 hex>``), oldest
    first; anything else there is not bsr's and is not listed."""
    with _opened(path) as admin:
        return _quarantine_files(admin)


def store_stats(path: str | os.PathLike[str]) -> StoreStats:
    """Objects and bytes in total and per namespace fingerprint, quarantine and temp files."""
    with _opened(path) as admin:
        report = ScanReport()
        objs = _list(admin, report)
        quarantined = _quarantine_files(admin, report)
        temps = 0
        if admin.dirs.tmp >= 0:
            with os.scandir(admin.dirs.tmp) as it:
                for e in it:
                    if TMP_NAME_RE.match(e.name) and e.is_file(follow_symlinks=False):
                        temps += 1
                    else:
                        report.junk.append(f"tmp/{e.name}")
    per: dict[str, list[ObjectInfo]] = {}
    unreadable = 0
    for o in objs:
        if o.namespace is None:
            unreadable += 1
        else:
            per.setdefault(o.namespace, []).append(o)
    namespaces = []
    for ns, items in sorted(per.items(), key=lambda kv: -sum(o.size for o in kv[1])):
        groups: dict[str, int] = {}
        for o in items:
            assert o.group is not None
            groups[o.group] = groups.get(o.group, 0) + 1
        namespaces.append(
            NamespaceStats(
                namespace=ns,
                objects=len(items),
                bytes=sum(o.size for o in items),
                payload_bytes=sum(o.payload_len or 0 for o in items),
                groups=dict(sorted(groups.items())),
                max_chunk_index=max(o.chunk_index or 0 for o in items),
            )
        )
    return StoreStats(
        root=Path(path),
        objects=len(objs),
        bytes=sum(o.size for o in objs),
        payload_bytes=sum(o.payload_len or 0 for o in objs),
        namespaces=tuple(namespaces),
        unreadable=unreadable,
        quarantined=len(quarantined),
        quarantined_bytes=sum(q.size for q in quarantined),
        temp_files=temps,
        junk=len(report.junk),
    )


# --------------------------------------------------------------------- scrub
#: what :func:`check_object` returns for an object that vanished before or while it was read
GONE = ("gone", "vanished while verifying (evicted or re-saved by a running engine)")


def check_object(sub_fd: int, name: str, *, block: int = 8 << 20) -> tuple[str, str] | None:
    """``None`` if the object file ``name`` (in the fan-out directory ``sub_fd``) is intact,
    :data:`GONE` if it is not there (any more), else ``(reason, detail)``.

    Reasons are the ones a FileTier uses in quarantine file names: ``truncated``, ``badmagic``,
    ``corrupt`` (header or payload checksum), ``foreign`` (another format version),
    ``unreadable`` (an I/O error). Opened like FileTier opens it: never following a link or
    blocking on a FIFO.
    """
    try:
        fd, st = open_regular(name, dir_fd=sub_fd)
    except (FileNotFoundError, NotRegularFileError):
        return GONE  # what stands there now is not an object of ours
    except OSError as exc:
        return "unreadable", f"{exc.strerror or exc} (errno {exc.errno})"
    try:
        return _check_fd(fd, st.st_size, block)
    except OSError as exc:
        return "unreadable", f"{exc.strerror or exc} (errno {exc.errno})"
    finally:
        os.close(fd)


def _check_fd(fd: int, size: int, block: int) -> tuple[str, str] | None:
    header = os.pread(fd, HEADER_SIZE, 0)
    if len(header) < HEADER_SIZE:
        return "truncated", f"{len(header)} bytes, an object has at least {HEADER_SIZE}"
    magic, version, flags, _ns, _k, _g, _i, plen, psum, hsum = _FIELDS.unpack_from(header)
    if magic != MAGIC:
        return "badmagic", "not a bsr object (bad magic)"
    scratch = bytearray(header)
    scratch[_SUM_OFFSET : _SUM_OFFSET + 8] = b"\x00" * 8
    if xxhash.xxh3_64_intdigest(bytes(scratch)) != hsum:
        return "corrupt", "header checksum mismatch"
    if version != FORMAT_VERSION or flags != 0:
        return "foreign", f"format version {version}, this bsr reads {FORMAT_VERSION}"
    if object_size(plen) != size:
        return "truncated", f"file is {size} bytes, header says {object_size(plen)}"
    h = xxhash.xxh3_64()
    left, offset = plen, HEADER_SIZE
    while left:
        chunk = os.pread(fd, min(left, block), offset)
        if not chunk:
            return "truncated", f"payload ends {left} bytes early"
        h.update(chunk)
        left -= len(chunk)
        offset += len(chunk)
    if h.intdigest() != psum:
        return "corrupt", "payload checksum mismatch"
    return None


def verify_store(
    path: str | os.PathLike[str],
    *,
    quarantine: bool = False,
    progress: Callable[[ObjectInfo], None] | None = None,
    objects: Iterable[ObjectInfo] | None = None,
) -> VerifyReport:
    """Checksum-scrub every visible object; optionally move bad ones to ``quarantine/``.

    Args:
        path: the store root.
        quarantine: move each bad object aside (as a FileTier does on a failed read), under the
            root's lock, after checking it again there (a running engine may have saved it
            again meanwhile).
        progress: called after each object (for a progress bar).
        objects: the objects to check (default: :func:`list_objects`).
    """
    report = VerifyReport()
    with _opened(path, change=quarantine) as admin:
        for o in _list(admin) if objects is None else objects:
            report.checked += 1
            problem = _check_one(admin, o.object_id)
            moved = None
            if problem is not None and problem != GONE and quarantine:
                moved = _move_bad(admin, o.object_id, problem[0])
            if problem == GONE or moved == "":  # gone, or intact again, when moved
                report.gone += 1
            else:
                report.bytes += o.size
            if problem is not None and problem != GONE and moved != "":
                dest = None if moved is None else admin.root / moved
                report.bad.append(BadObject(o.path, o.object_id, *problem, dest))
            if progress is not None:
                progress(o)
    return report


def _check_one(admin: _Admin, oid: str) -> tuple[str, str] | None:
    try:
        sub_fd = admin.sub(oid)
    except OSError:
        return GONE
    try:
        return check_object(sub_fd, oid + OBJECT_SUFFIX)
    finally:
        os.close(sub_fd)


def _move_bad(admin: _Admin, oid: str, reason: str) -> str | None:
    """Quarantine a bad object under the root's lock: its name in the root, "" when it was gone
    or intact again by then, None when it could not be moved."""
    assert admin.space is not None
    try:
        sub_fd = admin.sub(oid)
    except OSError:
        return ""
    try:

        def still_bad() -> bool:
            problem = check_object(sub_fd, oid + OBJECT_SUFFIX)
            return problem is not None and problem != GONE

        moved, dest = admin.space.quarantine(sub_fd, oid, reason, still_bad=still_bad)
    finally:
        os.close(sub_fd)
    if moved is Moved.MOVED:
        return f"quarantine/{dest}"
    return "" if moved is Moved.MISSING else None


# --------------------------------------------------------------------- cleanup
def gc_store(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    max_bytes: int,
    *,
    dry_run: bool = False,
    tmp_age_s: float = TMP_AGE_S,
) -> GcReport:
    """Delete oldest objects (by modification time) until at most ``max_bytes`` remain.

    ``path`` is a root, or the roots of a :class:`~bsr.StripedFileTier` (a list): the budget
    then holds for them together, oldest first across all of them.

    On a root of the local shared mode each deletion takes the root's lock and updates the
    shared ledger, like an engine's own eviction. On a root shared in network mode (it holds
    ``nodes/``; :mod:`bsr.tiers.file._network`) no lock is taken or trusted: objects are
    unlinked (a node reading one then misses; a node that wrote one leaves it out of its
    count at its next eviction or open), and temp files in ``tmp/`` older than ``tmp_age_s``
    (writers killed mid-write; a live writer's file is younger) are removed too. Either way a
    running engine sees the removed objects as misses. Safe to run from one node or a cron
    job while nodes write and read.
    """
    non_negative_int(max_bytes, "max_bytes")
    if not (isinstance(tmp_age_s, (int, float)) and tmp_age_s >= 0):
        raise ConfigError(
            f"tmp_age_s: {tmp_age_s!r}; give a non-negative age in seconds (temp files older "
            "than it are a dead writer's)",
            key="tmp_age_s",
        )
    roots = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    with contextlib.ExitStack() as stack:
        admins = [stack.enter_context(_opened(p, change=not dry_run)) for p in roots]
        listed = [(o, a) for a in admins for o in _stat_list(a)]
        listed.sort(key=lambda oa: (oa[0].mtime, oa[0].object_id))
        total = sum(o.size for o, _ in listed)
        victims: dict[int, list[ObjectInfo]] = {}
        for o, a in listed:
            if total <= max_bytes:
                break
            victims.setdefault(id(a), []).append(o)
            total -= o.size
        removed: list[ObjectInfo] = []
        gone: list[ObjectInfo] = []
        temps = 0
        for a in admins:
            mine = victims.get(id(a), [])
            if dry_run:
                removed += mine
            elif a.network:
                done, went = _unlink_all(a, mine)
                removed, gone = removed + done, gone + went
            else:
                removed += _remove(a, mine)
            temps += _old_temps(a, tmp_age_s, remove=not dry_run) if a.network else 0
    removed.sort(key=lambda o: (o.mtime, o.object_id))
    out = sum(o.size for o in removed) + sum(o.size for o in gone)
    return GcReport(
        removed=tuple(removed),
        freed_bytes=sum(o.size for o in removed),
        remaining_objects=len(listed) - len(removed) - len(gone),
        remaining_bytes=sum(o.size for o, _ in listed) - out,
        removed_temps=temps,
        network=any(a.network for a in admins),
        vanished=len(gone),
    )


def _remove(admin: _Admin, victims: list[ObjectInfo], batch: int = 64) -> list[ObjectInfo]:
    """Unlink ``victims`` a batch at a time under the root's lock; those actually removed."""
    assert admin.space is not None
    removed: list[ObjectInfo] = []
    for i in range(0, len(victims), batch):
        part = victims[i : i + batch]
        with admin.space.locked() as led:  # journaled: a gc killed mid-batch is healed
            sizes = admin.space.remove_counted(led, [o.object_id for o in part])
            removed.extend(o for o, size in zip(part, sizes) if size is not None)
    for sub in sorted({o.object_id[:2] for o in removed}):
        with contextlib.suppress(OSError):
            fd = os.open(sub, DIR_FLAGS, dir_fd=admin.dirs.objects)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return removed


def _stat_list(admin: _Admin) -> list[ObjectInfo]:
    """Every object file, oldest modification first, from one ``stat`` each (no header read:
    a round trip per object less on a network filesystem)."""
    out = []
    for sub_fd, name, oid in admin.objects():
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile, or unreadable: not collected
        if stat.S_ISREG(st.st_mode):
            out.append(ObjectInfo(admin.root / object_relpath(oid), oid, st.st_size, st.st_mtime))
    out.sort(key=lambda o: (o.mtime, o.object_id))
    return out


def _unlink_all(
    admin: _Admin, victims: list[ObjectInfo]
) -> tuple[list[ObjectInfo], list[ObjectInfo]]:
    """Unlink ``victims`` without a lock (a network root): those removed, and those already
    gone (a node evicted them since the listing, or the listing was stale)."""
    removed, gone = [], []
    for o in victims:
        try:
            sub_fd = admin.sub(o.object_id)
        except FileNotFoundError:
            gone.append(o)
            continue
        except OSError:
            continue
        try:
            st = os.stat(o.path.name, dir_fd=sub_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.unlink(o.path.name, dir_fd=sub_fd)
                removed.append(o)
        except FileNotFoundError:
            gone.append(o)
        except OSError:
            continue  # not removable (EACCES, EIO): left
        finally:
            os.close(sub_fd)
    return removed, gone


def _old_temps(admin: _Admin, age_s: float, *, remove: bool) -> int:
    """Temp files of bsr's name grammars last modified more than ``age_s`` ago (removed
    unless ``remove`` is False): writes of ``tmp/`` and journal rewrites of ``nodes/`` (a
    node killed midway); how many."""
    cutoff = time.time() - age_s
    n = 0
    try:
        nodes = os.open(NODES_DIR, DIR_FLAGS, dir_fd=admin.dirs.root)
    except OSError:
        nodes = -1
    try:
        for dir_fd, grammar in ((admin.dirs.tmp, TMP_NAME_RE), (nodes, JOURNAL_TMP_RE)):
            if dir_fd < 0:
                continue
            for name in os.listdir(dir_fd):
                if not grammar.match(name):
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_mtime > cutoff:
                        continue
                    if remove:
                        os.unlink(name, dir_fd=dir_fd)
                    n += 1
                except OSError:
                    continue
    finally:
        if nodes >= 0:
            os.close(nodes)
    return n


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def purge_quarantine(
    path: str | os.PathLike[str], *, dry_run: bool = False
) -> list[QuarantinedFile]:
    """Delete the files of ``quarantine/`` that bsr put there (its name grammar, regular
    files); returns what was (or would be) deleted. Anything else there is left alone."""
    with _opened(path) as admin:
        files = _quarantine_files(admin)
        if dry_run:
            return files
        done = []
        for q in files:
            try:
                st = os.stat(q.path.name, dir_fd=admin.dirs.quarantine, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    os.unlink(q.path.name, dir_fd=admin.dirs.quarantine)
                    done.append(q)
            except FileNotFoundError:
                continue
        return done
