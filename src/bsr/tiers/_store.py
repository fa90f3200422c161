"""Offline administration of a FileTier directory: stats, listing, checksum scrub, gc, quarantine.

Where it runs: an operator's shell (``bsr store ...``) or a maintenance job, on a directory
that a :class:`~bsr.FileTier` wrote. Plain blocking file I/O, no event loop. ``stats``, ``ls``,
``verify`` (without ``quarantine``) and ``quarantine list`` only read; ``gc``, ``verify`` with
``quarantine`` and ``quarantine purge`` change the directory, so run them while no engine has the
tier open (a running FileTier keeps its index in memory and would not see the change).

How it works: the layout is FileTier's (``objects/<id[:2]>/<id>.bsr``, ``tmp/``,
``quarantine/<id>.<reason>.<rand>``). An object's header is parsed with the object format's own
field table; without the engine's keys an object cannot be matched to a token prefix, so the
scrub checks what the bytes alone can prove: magic, header checksum, format version, file size
against the header's payload length, and the payload's xxh3 checksum. The header names its
namespace by fingerprint (model, rank, salt, layout, version) and its group by digest, so stats
group objects by namespace fingerprint (and name a group when it is one of the usual names). gc
evicts oldest modification time first, the order a FileTier rebuilds its LRU in on open.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .._errors import ConfigError
from ..core._keys import FORMAT_VERSION
from ..core._object import _FIELDS, _SUM_OFFSET, HEADER_SIZE, MAGIC, object_size
from . import _file

#: group names whose digests ``stats`` and ``ls`` recognise (others show as a digest)
KNOWN_GROUPS = ("kv", "swa_kv", "swa", "hidden", "mla", "indexer")


class NotAStoreError(ConfigError):
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

    @property
    def clean(self) -> bool:
        return not self.bad


@dataclass(frozen=True)
class GcReport:
    removed: tuple[ObjectInfo, ...]
    freed_bytes: int
    remaining_objects: int
    remaining_bytes: int


@dataclass(frozen=True)
class QuarantinedFile:
    path: Path
    object_id: str
    reason: str
    size: int
    mtime: float


# --------------------------------------------------------------------- the directory
def _marker_name() -> str:
    name = getattr(_file, "MARKER_NAME", ".bsr-tier")
    return name if isinstance(name, str) else ".bsr-tier"


def open_store(path: str | os.PathLike[str]) -> Path:
    """The store root, after checking it is one: FileTier's root marker, or (a store written
    before the marker existed) nothing but its ``objects/``, ``tmp/`` and ``quarantine/``.

    Raises:
        NotAStoreError: missing, not a directory, or not a FileTier root.
    """
    root = Path(path)
    hint = "pass the directory given to FileTier(path, ...)"
    if not root.is_dir():
        raise NotAStoreError(f"{str(root)!r} is not a directory; {hint}", path=str(root))
    marker = root / _marker_name()
    if marker.is_file() and not marker.is_symlink():
        kind = getattr(_file, "MARKER_KIND", None)
        try:
            found = json.loads(marker.read_text("utf-8")).get("kind")
        except (OSError, ValueError, AttributeError):
            found = None
        if kind is None or found == kind:
            return root
        raise NotAStoreError(
            f"{str(root)!r} has a {marker.name} marker of kind {found!r}, not {kind!r}; {hint}",
            path=str(root),
        )
    entries = {e.name for e in root.iterdir()}
    if "objects" in entries and entries <= {"objects", "tmp", "quarantine"}:
        return root
    raise NotAStoreError(
        f"{str(root)!r} is not a bsr FileTier store (no {marker.name} marker, and it holds "
        f"more than objects/, tmp/ and quarantine/); {hint}",
        path=str(root),
    )


def _object_files(root: Path) -> Iterator[tuple[Path, str]]:
    """Regular files named like objects, in their fan-out directory; nothing is followed."""
    objects = root / "objects"
    if objects.is_symlink() or not objects.is_dir():
        return
    for sub in sorted(objects.iterdir()):
        if sub.is_symlink() or not sub.is_dir():
            continue
        for f in sorted(sub.iterdir()):
            oid = f.name[: -len(".bsr")] if f.name.endswith(".bsr") else ""
            if not _file._ID_RE.match(oid) or sub.name != oid[:2]:
                continue
            try:
                if stat.S_ISREG(os.lstat(f).st_mode):
                    yield f, oid
            except FileNotFoundError:
                continue


def _group_names() -> dict[bytes, str]:
    return {
        hashlib.blake2b(g.encode(), digest_size=16, person=b"bsr-group").digest(): g
        for g in KNOWN_GROUPS
    }


def _describe(path: Path, oid: str, names: dict[bytes, str]) -> ObjectInfo:
    st = path.stat()
    try:
        with open(path, "rb") as fh:
            head = fh.read(_FIELDS.size)
        magic, _v, _f, ns, _key, group, index, plen, _psum, _hsum = _FIELDS.unpack(head)
    except Exception:
        return ObjectInfo(path, oid, st.st_size, st.st_mtime)
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


def list_objects(path: str | os.PathLike[str]) -> list[ObjectInfo]:
    """Every visible object, oldest modification first (FileTier's LRU order after open)."""
    root = open_store(path)
    names = _group_names()
    out = []
    for f, oid in _object_files(root):
        try:
            out.append(_describe(f, oid, names))
        except FileNotFoundError:
            continue  # removed meanwhile
    out.sort(key=lambda o: (o.mtime, o.object_id))
    return out


def list_quarantine(path: str | os.PathLike[str]) -> list[QuarantinedFile]:
    """Files in ``quarantine/`` (named ``<object id>.<reason>.<rand>``), oldest first."""
    root = open_store(path)
    q = root / "quarantine"
    out = []
    if q.is_dir():
        for f in q.iterdir():
            if f.is_symlink() or not f.is_file():
                continue
            parts = f.name.split(".")
            reason = (
                ".".join(parts[1:-1]) if len(parts) >= 3 else (parts[1] if len(parts) > 1 else "")
            )
            st = f.stat()
            out.append(QuarantinedFile(f, parts[0], reason, st.st_size, st.st_mtime))
    out.sort(key=lambda e: (e.mtime, e.path.name))
    return out


def store_stats(path: str | os.PathLike[str]) -> StoreStats:
    """Objects and bytes in total and per namespace fingerprint, quarantine and temp files."""
    root = open_store(path)
    objs = list_objects(root)
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
    quarantined = list_quarantine(root)
    tmp = root / "tmp"
    return StoreStats(
        root=root,
        objects=len(objs),
        bytes=sum(o.size for o in objs),
        payload_bytes=sum(o.payload_len or 0 for o in objs),
        namespaces=tuple(namespaces),
        unreadable=unreadable,
        quarantined=len(quarantined),
        quarantined_bytes=sum(q.size for q in quarantined),
        temp_files=sum(1 for f in tmp.iterdir() if f.is_file()) if tmp.is_dir() else 0,
    )


# --------------------------------------------------------------------- scrub
def check_object_file(path: Path, *, block: int = 8 << 20) -> tuple[str, str] | None:
    """``None`` if the file is an intact bsr object, else ``(reason, detail)``.

    Reasons are the ones a FileTier uses in quarantine file names: ``truncated``, ``badmagic``,
    ``corrupt`` (header or payload checksum), ``foreign`` (another format version),
    ``unreadable`` (an I/O error).
    """
    try:
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            header = fh.read(HEADER_SIZE)
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
            left = plen
            buf = bytearray(min(block, max(plen, 1)))
            view = memoryview(buf)
            while left:
                n = fh.readinto(view[: min(left, len(buf))])
                if not n:
                    return "truncated", f"payload ends {left} bytes early"
                h.update(view[:n])
                left -= n
            if h.intdigest() != psum:
                return "corrupt", "payload checksum mismatch"
    except OSError as exc:
        return "unreadable", f"{exc.strerror or exc} (errno {exc.errno})"
    return None


def _quarantine_file(root: Path, path: Path, oid: str, reason: str) -> Path:
    dest = root / "quarantine" / f"{oid}.{reason}.{secrets.token_hex(4)}"
    dest.parent.mkdir(exist_ok=True)
    os.replace(path, dest)
    return dest


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
        quarantine: move each bad object aside (as a FileTier does on a failed read).
        progress: called after each object (for a progress bar).
        objects: the objects to check (default: :func:`list_objects`).
    """
    root = open_store(path)
    report = VerifyReport()
    for o in list_objects(root) if objects is None else objects:
        problem = check_object_file(o.path)
        report.checked += 1
        report.bytes += o.size
        if problem is not None:
            reason, detail = problem
            moved = None
            if quarantine and o.path.exists():
                moved = _quarantine_file(root, o.path, o.object_id, reason)
            report.bad.append(BadObject(o.path, o.object_id, reason, detail, moved))
        if progress is not None:
            progress(o)
    return report


# --------------------------------------------------------------------- cleanup
def gc_store(path: str | os.PathLike[str], max_bytes: int, *, dry_run: bool = False) -> GcReport:
    """Delete oldest objects (by modification time) until at most ``max_bytes`` remain."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    root = open_store(path)
    objs = list_objects(root)
    total = sum(o.size for o in objs)
    removed: list[ObjectInfo] = []
    for o in objs:
        if total <= max_bytes:
            break
        if not dry_run:
            o.path.unlink(missing_ok=True)
        removed.append(o)
        total -= o.size
    if removed and not dry_run:
        for d in {o.path.parent for o in removed}:
            _file._fsync_dir(d)
    return GcReport(
        removed=tuple(removed),
        freed_bytes=sum(o.size for o in removed),
        remaining_objects=len(objs) - len(removed),
        remaining_bytes=total,
    )


def purge_quarantine(
    path: str | os.PathLike[str], *, dry_run: bool = False
) -> list[QuarantinedFile]:
    """Delete every file in ``quarantine/``; returns what was (or would be) deleted."""
    files = list_quarantine(path)
    if not dry_run:
        for q in files:
            q.path.unlink(missing_ok=True)
    return files
