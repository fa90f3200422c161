"""FileTier: L2, one file per object in a local (SSD) directory bsr owns.

Where it runs: the serving process; every blocking step (open, scan, reads, writes, renames)
runs in worker threads, at most ``io_threads`` at once. Reads are abandonable: a read stuck in the
kernel (a hung mount) never holds its caller past a deadline or a cancellation.

How it works::

    <root>/.bsr-tier                        marker: {"kind": "bsr.FileTier", "version": 1}
    <root>/.bsr-ledger                      shared accounting; its flock is the root's lock
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

Several processes may share a root: the capacity is accounted in a ledger in the root, changed
only under the root's lock (:mod:`bsr.tiers.file._ledger`). A write reserves its bytes there
(evicting least recently used objects this process's :class:`~bsr.tiers._lru.LruIndex` holds
unpinned) and creates its temp file, is written and fsync'ed, renamed into ``objects/`` under the
lock and the directory fsync'ed; only then is it added to the index, so a probe never sees a
partial object (invariant 6) and concurrent writers, of this process or others, never overshoot
``capacity_bytes``. Every failure path removes the temp file and gives the reservation back. No
step waits for the root's lock past ``lock_timeout_s`` or its caller's cancel (a process sharing
the root may be stopped while it holds it): a write then raises :class:`~bsr.TierBusyError` and
``open`` joins without the lock; reads never take it (:mod:`bsr.tiers.file._steps`). A
probe asks the directory for objects the index lacks (another process wrote them). On open the
index is rebuilt by scanning ``objects/`` (each header is checked against the file size; damaged
files are quarantined), temp files of dead writers are removed, and the root is trimmed to
capacity (claiming the root and the scan live in :mod:`bsr.tiers.file._root`, with the layout's
names).
Files are opened relative to directory descriptors of the tree with ``O_NOFOLLOW | O_NONBLOCK``
and ``fstat``-checked (:func:`~bsr.tiers.file._readers.open_regular`): a read never leaves the
root and never blocks on a FIFO. Permission and I/O errors are I/O errors (``TierIOError``;
skipped and counted as ``unreadable`` on open), never corruption.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import anyio

from ..._check import Check, option
from ..._errors import (
    ClosedError,
    ConfigError,
    ObjectError,
    TierBusyError,
    TierIOError,
)
from ...core._keys import ChunkKey, ObjectKey, object_id
from ...core._object import decode_object
from .._abandon import AbandonableCalls
from .._base import Medium, StorageHooks, Tier, TierStatistics, TierUsage
from .._codec import ObjectCodec
from .._lru import IndexedTier, LruIndex
from .._reads import Begin, End, Fetched
from .._registry import TierOptions, takes_options
from .._views import as_payload_view
from .._watch import Removal
from ._ledger import Pending, RootBusy, SharedSpace, ledger_error
from ._network import NodeSpace, check_node
from ._readers import (
    NotRegularFileError,
    ObjectReader,
    UringReader,
    calibrate_depth,
    default_reader,
    open_regular,
)
from ._reads import FileReads
from ._root import (
    _ID_RE as _ID_RE,  # read by bsr store
)
from ._root import (
    DIR_FLAGS,
    JUNK_EXAMPLES,
    MARKER_KIND,
    MARKER_NAME,
    MARKER_VERSION,
    OBJECT_NAME_RE,
    OBJECT_SUFFIX,
    OBJECTS_DIR,
    QUARANTINE_DIR,
    QUARANTINE_NAME_RE,
    TMP_DIR,
    TMP_NAME_RE,
    Dirs,
    Moved,
    ReadFailure,
    ScanReport,
    StoreRoot,
    classify_read_error,
    object_relpath,
)
from ._steps import LockedSteps
from ._writes import FileWrites

HEADER_SIZE = ObjectCodec.HEADER_SIZE
#: a root's shared accounting: one node's processes under its lock, or nodes of a network
#: filesystem each within its own share
Space = SharedSpace | NodeSpace

#: the on-disk layout, defined in _root and re-exported here
__all__ = (
    "MARKER_KIND",
    "MARKER_NAME",
    "MARKER_VERSION",
    "OBJECTS_DIR",
    "OBJECT_NAME_RE",
    "OBJECT_SUFFIX",
    "QUARANTINE_DIR",
    "QUARANTINE_NAME_RE",
    "TMP_DIR",
    "TMP_NAME_RE",
    "FileTier",
    "ReadFailure",
    "classify_read_error",
    "object_relpath",
)

_THREAD = threading.local()
#: a tier holding at least twice this many bytes calibrates its io_uring read depth on open
CALIBRATE_MIN_BYTES = 32 << 20


READER_NAMES = ("auto", "uring", "posix", "kvikio")
SHARED_MODES = ("local", "network")


def _node_choice(value: Any, key: str) -> str | None:
    return None if value is None else check_node(value, key)


_node_choice.takes_string = True  # type: ignore[attr-defined]
_reader_name = Check.one_of(*READER_NAMES)


def _reader_choice(value: Any, key: str) -> str | ObjectReader:
    """A reader's name, or an object with the :class:`ObjectReader` methods (taken as is)."""
    if isinstance(value, str) or not callable(getattr(value, "read", None)):
        name: str = _reader_name(value, key)
        return name
    reader: ObjectReader = value
    return reader


_reader_choice.takes_string = True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FileTierOptions(TierOptions):
    """A :class:`FileTier`: ``{"kind": "file", "path": "/nvme/bsr", "capacity_bytes": N}``.

    The fields are the constructor's parameters (see there).
    """

    kind = "file"
    path: str | os.PathLike[str] = option(Check.path)
    capacity_bytes: int = option(Check.size)
    _: KW_ONLY
    name: str = option(Check.text, "file")
    #: a reader's name, or an :class:`ObjectReader` instance (which a config cannot name)
    reader: str | ObjectReader = option(_reader_choice, "auto")
    direct_io: bool = option(Check.flag, False)
    fsync: bool = option(Check.flag, True)
    io_threads: int = option(Check.positive_int, 8)
    #: io_uring requests in flight; None (unset): chosen by the tier on open
    read_depth: int | None = option(Check.optional_positive_int, None)
    #: the longest one step waits for the root's lock (or for room held by writes in progress)
    lock_timeout_s: float = option(Check.non_negative_seconds, 2.0)
    #: open a root on a filesystem whose flock may be local to each client (NFS, FUSE, ...)
    trust_locks: bool = option(Check.flag, False)
    #: "local": processes of one node share the root under its lock; "network": nodes of a
    #: network filesystem share it, each within its own share (``_network``)
    shared: str = option(Check.one_of(*SHARED_MODES), "local")
    #: this node's id (``shared="network"`` only)
    node: str | None = option(_node_choice, None)

    def build(self) -> Tier:
        return FileTier(**self.arguments())

    def for_rank(self, rank: int, world: int) -> FileTierOptions:
        """Each tensor-parallel rank gets its own root under ``path``
        (``rank-<r>-of-<world>``): one process per root's own shard."""
        if world <= 1:
            return self
        return dataclasses.replace(self, path=str(Path(self.path) / f"rank-{rank}-of-{world}"))

    def to_dict(self) -> dict[str, Any]:
        if not isinstance(self.reader, str):
            raise ConfigError(
                f"reader: an ObjectReader instance ({type(self.reader).__name__}) has no plain "
                f"form; name one of {list(READER_NAMES)} to write these options out",
                key="reader",
            )
        return super().to_dict()


class FileTier(IndexedTier):
    """L2 tier: a directory on local storage that bsr owns.

    Args:
        path: the root: an empty or missing directory (claimed with a ``.bsr-tier`` marker), or
            one this tier claimed before. Several processes may share a root (the shared
            ledger keeps them within ``capacity_bytes`` together; see ``_ledger``).
        capacity_bytes: upper bound on stored bytes (file sizes, writes in progress included);
            LRU eviction beyond it, never of an object being read or leased.
        name: tier name for statistics, logs and ``bytes_by_tier``.
        reader: ``"auto"`` (kvikio when the ``gpu`` extra and a CUDA driver are present, else
            io_uring where the kernel allows it, else POSIX ``preadv``), ``"uring"``,
            ``"posix"``, ``"kvikio"`` or an :class:`ObjectReader` instance.
        direct_io: open files with O_DIRECT for POSIX reads (falls back when unsupported).
        read_depth: io_uring requests in flight across this tier's reads (each at most 1 MiB).
            None: chosen when the tier opens by a short calibration over its own objects
            (``O_DIRECT`` and at least 64 MiB stored; else 32), or by
            :meth:`calibrate_read_depth`. Independent of the engine's W: it caps requests, the
            staging slots still cap the bytes.
        fsync: fsync each object and its directory before it becomes visible (keep True unless
            the data is disposable).
        io_threads: worker threads for this tier's blocking I/O; also the number of abandoned
            reads (stuck in the kernel) after which new reads fail fast with TierIOError.
        lock_timeout_s: the longest a write's reservation, its commit, a delete or a quarantine
            move waits for the root's lock (held by another process sharing the root: a stopped
            or frozen one holds it as long as it is stopped), and a reservation for room that
            writes in progress hold. Past it the call is skipped with :class:`~bsr.TierBusyError`
            (a save then skips this tier, counted as ``SaveResult.skipped``), and ``open`` joins
            without the lock. Never held while waiting: a caller's cancel or deadline ends the
            wait at once. Reads never take the lock.
        trust_locks: open a root on a filesystem whose ``flock`` may be local to each client
            (NFS, CIFS, Lustre, CephFS, GPFS, any FUSE filesystem such as sshfs:
            ``_fstype.NETWORK_TYPES``). By default such a root is refused with
            :class:`~bsr.UntrustedRootError`, since nodes sharing it would each hold its lock
            at once and fill it past ``capacity_bytes`` together. Set it when only this node
            opens the root, or when its locks are known to be coherent across clients.
        shared: how processes sharing the root coordinate. ``"local"`` (default): processes of
            one node, through the root's lock and ledger; the whole root stays within
            ``capacity_bytes``. ``"network"``: nodes of a network filesystem (NFS, Lustre,
            CephFS, sshfs...), with no lock across nodes: each node keeps what it wrote within
            ``capacity_bytes`` (its share of the root's budget) and evicts only that;
            ``bsr store gc --budget`` collects what no node owns (see ``_network``). A root
            once used in network mode is refused in local mode.
        node: this node's id in network mode (required there, refused in local mode): letters,
            digits, ``.``, ``_``, ``-``; every process sharing the root needs its own.
    """

    durable = True
    blocking_reads = True
    medium = Medium.DISK

    @takes_options(FileTierOptions)
    def __init__(self, options: FileTierOptions) -> None:
        o = self.options = options
        if (o.shared == "network") != (o.node is not None):
            raise ConfigError(
                "node: shared='network' needs this node's id (node='<host>-<rank>'), and only "
                "network mode takes one"
                if o.node is None
                else f"node: given ({o.node!r}) but shared={o.shared!r}; a node id is for "
                "shared='network' (drop it, or set shared='network')",
                key="node",
            )
        super().__init__(o.name)
        self.lock_timeout_s = o.lock_timeout_s
        self.capacity_bytes = o.capacity_bytes
        self.io_threads = o.io_threads
        self.root = Path(o.path)
        self.reader: ObjectReader = (
            default_reader(o.reader, direct=o.direct_io, depth=o.read_depth)
            if isinstance(o.reader, str)
            else o.reader
        )
        #: how the io_uring read depth was chosen (``calibrate_read_depth``); None: not io_uring
        self.read_calibration: dict[str, Any] | None = None
        self.fsync = o.fsync
        self._store = StoreRoot(
            self.root, o.name, self._log, trust_locks=o.trust_locks, network=o.shared == "network"
        )
        self._limiter = anyio.CapacityLimiter(o.io_threads)
        # reads are abandonable: io_threads of them stuck in the kernel and new ones fail fast
        self._reads = AbandonableCalls(
            limiter=self._limiter,
            max_stuck=o.io_threads,
            too_many=lambda stuck: TierIOError(
                f"{stuck} reads of {self.name!r} are stuck in the kernel (a hung mount or "
                f"device under {self.root}?); new reads fail fast until they return",
                tier=self.name,
            ),
            on_abandon=lambda: self._count(abandoned_reads=1),
        )
        self._index: LruIndex[None] = LruIndex(o.capacity_bytes, name=o.name)
        self._io = FileReads(self)
        self._writes = FileWrites(self)
        self._steps = LockedSteps(self)  # steps under the root's lock
        self._opened = False
        # guards _dirs and _busy: worker threads touch them
        self._lock = threading.Lock()
        self._dirs: Dirs | None = None
        self._space: Space | None = None  # the root's shared accounting (open while _dirs is)
        self._busy = 0  # worker calls using _dirs now (the descriptors close after the last)
        # closed by the last worker to leave after aclose()
        self._closing: tuple[Dirs, Space | None] | None = None

    # ------------------------------------------------------------------ paths
    def _obj_path(self, oid: str) -> Path:
        return self.root / object_relpath(oid)

    def object_path(self, key: ChunkKey, group: str) -> Path:
        """Where ``(key, group)`` is (or would be) stored; for tests and tooling."""
        return self._obj_path(ObjectKey(key, group).object_id)

    def object_paths(self) -> list[Path]:
        """Paths of every visible object, least recently used first."""
        return [self._obj_path(oid) for oid in self._index.oids()]

    def storage_hooks(self) -> StorageHooks:
        return _FileStorage(self)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        if self._opened:
            return
        report = await self._open_root()
        self._opened = True
        if isinstance(self.reader, UringReader) and not self.reader.depth_chosen:
            enough = self._index.bytes >= 2 * CALIBRATE_MIN_BYTES
            if enough and self.reader.direct_active:
                await self.calibrate_read_depth()
            else:
                self.read_calibration = {
                    "depth": self.reader.depth,
                    "source": "default",
                    "bandwidth_Bps": {},
                }
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
                examples=report.junk[:JUNK_EXAMPLES],
                hint="FileTier leaves entries it did not write alone; remove them, or give "
                "FileTier a directory only bsr uses",
            )
        if report.unreadable:
            self._log.warning(
                "bsr.tier.unreadable",
                path=str(self.root),
                count=len(report.unreadable),
                examples=report.unreadable[:JUNK_EXAMPLES],
                hint="check permissions and the device; these entries were skipped, not moved",
            )

    async def calibrate_read_depth(self) -> dict[str, Any] | None:
        """Choose the io_uring read depth from reads of this tier's own (newest) objects: the
        smallest of 4, 16 and 64 within 90% of the best bandwidth (about 32 MiB read at each).

        Runs on open when the depth is unset and the tier holds enough; call it after storing
        state into a new tier. Meaningful with ``direct_io`` (``O_DIRECT``): buffered reads
        measure the page cache. Returns the measurements (None without an io_uring reader).
        """
        self._ensure_open()
        if not isinstance(self.reader, UringReader):
            return None
        reader = self.reader

        def run() -> dict[str, Any]:
            dirs = self._enter()
            try:
                newest = reversed(self._index.oids())
                sized = ((oid, self._index.size_of(oid) or 0) for oid in newest)
                return calibrate_depth(reader, lambda oid: self._io.open_object(dirs, oid), sized)
            finally:
                self._leave()

        self.read_calibration = await anyio.to_thread.run_sync(run, limiter=self._limiter)
        self._log.info("bsr.tier.read_depth", **self.read_calibration)
        return self.read_calibration

    async def _open_root(self) -> ScanReport:
        """Claim and scan the root and join its shared ledger.

        The ledger's lock is waited for at most ``lock_timeout_s`` (or the caller's cancel):
        past it the tier joins without it (:meth:`SharedSpace.attach_unlocked`: it reads the
        objects and leaves dead writers' temp files and the ledger to the next locked step),
        so a process stopped while holding the lock never holds an open. No process holds the
        lock while it scans (:meth:`SharedSpace.attach`): a first member recounts the ledger
        afterwards a fan-out directory at a time (:meth:`SharedSpace.recount`).

        Raises:
            TierBusyError: a process claiming the root (its first step, a short one) kept the
                members' lock past ``lock_timeout_s``; nothing is held, a later open may work.
        """
        opened: list[tuple[Dirs, Space]] = []
        report = ScanReport()
        try:
            await anyio.to_thread.run_sync(self._start_sync, opened, limiter=self._limiter)
            space = opened[0][1]
            try:
                locked = True
                try:
                    await self._steps.run(space.attach, report, what="joining the root's ledger")
                except TierBusyError:
                    locked = False
                    self._log.warning(
                        "bsr.tier.open_unlocked", path=str(self.root),
                        waited_s=self.lock_timeout_s,
                        note="another process held the root's lock; joined without it",
                    )  # fmt: skip
                    await anyio.to_thread.run_sync(
                        self._attach_unlocked, space, report, limiter=self._limiter
                    )
                for _, oid, size in report.found:
                    self._index.put(oid, size, None)
                if locked and space.recounting:
                    await self._recount(space)
                evicted = 0  # without the lock: the next write makes its room
                if locked:  # a smaller capacity than the root holds now
                    with contextlib.suppress(TierBusyError):
                        evicted = await self._steps.run(space.trim, what="trimming to capacity")
            except TierBusyError:  # a typed bound, not a broken root (an OSError too)
                raise
            except OSError as exc:  # flock or the ledger failed
                raise ledger_error(self._store, exc) from exc
            space.peak = space.seen.total  # counted from here: what this process keeps
            if evicted:
                self._count(evictions=evicted)
        except BaseException:
            if opened:
                _close(*opened[0])
            self._index.clear()
            raise
        self._count(
            junk=len(report.junk),
            unreadable=len(report.unreadable),
            quarantined=report.quarantined,
        )
        with self._lock:
            self._dirs, self._space = opened[0]
        return report

    def _start_sync(self, opened: list[tuple[Dirs, Space]]) -> None:
        dirs = self._store.open()
        try:
            node = self.options.node
            space: Space = (
                SharedSpace(self._store, dirs, self._index, self.capacity_bytes)
                if node is None
                else NodeSpace(self._store, dirs, self._index, self.capacity_bytes, node)
            )
            opened.append((dirs, space))
        except BaseException:
            dirs.close()
            raise

    def _attach_unlocked(self, space: Space, report: ScanReport) -> None:
        try:
            space.attach_unlocked(report)
        except RootBusy:
            self._count(busy=1)
            raise TierBusyError(
                f"opening {self.root} failed: another process is claiming the root (the first "
                f"step of a first member's open) and held it past lock_timeout_s "
                f"({self.lock_timeout_s:g} s; stopped or frozen there?); nothing is held: open "
                "again later, or raise lock_timeout_s",
                tier=self.name,
                reason="root_locked",
                path=str(self.root),
            ) from None

    async def _recount(self, space: Space) -> None:
        """Run the recount this first member started on open to its end, a step at a time
        (each waits for the root's lock like any step). Given up past ``lock_timeout_s``
        without a step: the ledger keeps its count, a later recount settles it."""
        try:
            while not await self._steps.run(space.recount, what="recounting the root's ledger"):
                pass
        except TierBusyError:
            self._log.warning(
                "bsr.tier.recount_pending", path=str(self.root), waited_s=self.lock_timeout_s,
                note="another process held the root's lock; the ledger keeps its count",
            )  # fmt: skip

    async def aclose(self) -> None:
        self._index.clear()
        await super().aclose()
        with self._lock:
            dirs, self._dirs = self._dirs, None
            space, self._space = self._space, None
            if dirs is not None and self._busy:
                self._closing = (dirs, space)  # the last worker closes them
                dirs = None
        if dirs is not None:
            _close(dirs, space)

    def _ready(self) -> None:
        self._ensure_open()

    def _ensure_open(self) -> None:
        self._check_open()
        if not self._opened:
            raise ConfigError(
                f"FileTier {self.name!r} is not open; use 'async with tier' or await tier.open()",
                tier=self.name,
            )

    def _enter(self) -> Dirs:
        return self._enter_space()[0]

    def _enter_space(self) -> tuple[Dirs, Space]:
        with self._lock:
            if self._dirs is None or self._space is None:
                raise ClosedError(f"tier {self.name!r} is closed; open a new one", tier=self.name)
            self._busy += 1
            return self._dirs, self._space

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            closing = self._closing if not self._busy else None
            if closing is not None:
                self._closing = None
        if closing is not None:
            _close(*closing)

    # ------------------------------------------------------------------ shared accounting
    def usage(self) -> TierUsage:
        """Objects this process knows; bytes of the whole root as the shared ledger last said
        (what counts against ``capacity_bytes``, whichever process wrote them)."""
        space = self._space
        objects = len(self._index)
        if space is None:
            return TierUsage(objects, self._index.bytes, self.capacity_bytes)
        return TierUsage(objects, space.seen.nbytes, self.capacity_bytes)

    def statistics(self) -> TierStatistics:
        st = super().statistics()
        space = self._space
        return (
            st
            if space is None
            else dataclasses.replace(st, peak_bytes=max(st.peak_bytes, space.peak))
        )

    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        """From the index, and for objects it lacks, from the directory (another process may
        have written them): metadata only, in a worker thread."""
        self._ready()
        oids = [object_id(o.chunk.digest, o.group) for o in objects]
        have = self._index.contains_many(oids)
        unknown = [i for i, h in enumerate(have) if not h]
        if not unknown:
            return have
        sizes = await anyio.to_thread.run_sync(
            self._probe_sync, [oids[i] for i in unknown], limiter=self._limiter,
            abandon_on_cancel=True,
        )  # fmt: skip
        for i, size in zip(unknown, sizes):
            if size:
                self._index.put(oids[i], size, None)
                have[i] = True
        return have

    async def recheck_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        """Ask the directory (not the index) whether each object's file is there; an indexed
        object whose file is gone (``bsr store gc``, another process sharing the root) is
        forgotten and reported as vanished, unless a read holds it (that read finds it gone)."""
        self._ready()
        oids = [o.object_id for o in objects]
        sizes = await anyio.to_thread.run_sync(
            self._probe_sync, oids, limiter=self._limiter, abandon_on_cancel=True
        )
        for oid, size in zip(oids, sizes):
            if size:
                if oid not in self._index:
                    self._index.put_lru(oid, size, None)
            elif not self._index.is_pinned(oid):
                self._index.discard(oid, Removal.VANISHED)
        return [bool(size) for size in sizes]

    def _probe_sync(self, oids: list[str]) -> list[int]:
        _, space = self._enter_space()
        try:
            return space.probe(oids)
        finally:
            self._leave()

    # ------------------------------------------------------------------ reads (_reads.FileReads)
    @property
    def bulk_reads(self) -> bool:  # type: ignore[override]
        """Whether :meth:`read_many_blocking` keeps several reads in flight on one thread (an
        io_uring reader that the kernel has not refused)."""
        reader = self.reader
        return isinstance(reader, UringReader) and reader.disabled_reason is None

    async def fetch_into(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        """Read ``(key, group)`` into ``dst`` in a worker thread (unchecked: see
        :meth:`~bsr.Tier.fetch_into`; :meth:`~bsr.Tier.read_into` checks).

        Abandonable: on cancellation (a deadline, an outer scope) this returns at once even if
        the worker is stuck in the kernel; the worker reads into a buffer of its own, so not a
        byte reaches ``dst`` after this returned. Abandoned reads are counted
        (``statistics().abandoned_reads``); once ``io_threads`` of them are still stuck, new
        reads fail fast with :class:`~bsr.TierIOError`.
        """
        return await self._io.fetch(key, group, dst)

    def fetch_into_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        return self._io.fetch_blocking(key, group, dst)

    def read_many_blocking(self, begin: Begin, end: End, ahead: int, *, lend: bool = False) -> None:
        """Up to ``ahead`` objects in flight on this thread's io_uring (``read_depth`` caps
        requests across the tier), each ended as its reads complete; without io_uring, one by
        one. Returns only once the kernel is done with every destination it was given."""
        self._io.read_many(begin, end, ahead)

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._ensure_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if self._index.touch(oid):
            return False
        mv = as_payload_view(payload)
        size = ObjectCodec.stored_size(len(mv), padded=True)
        if self.options.shared == "network":
            return await self._write_network(okey, mv, size)
        pending = await self._reserve(oid, size)
        renamed: list[bool] = []
        where = object_relpath(oid)
        try:
            await anyio.to_thread.run_sync(
                self._writes.write_temp, okey, mv, pending, limiter=self._limiter
            )
            await self._steps.run(
                self._writes.commit, oid, pending, renamed, what=f"writing {where}"
            )
        except TierBusyError:
            raise
        except OSError as exc:
            self._count(errors=1)
            raise TierIOError(
                f"writing {where} failed: {exc.strerror or exc}",
                tier=self.name,
                errno=exc.errno,
            ) from exc
        finally:
            if renamed:  # visible on disk and indexed by the commit, even if cancelled since
                new = renamed[0]
            else:  # every failure path gives the bytes back and removes the temp file
                with anyio.CancelScope(shield=True):  # never waits for the lock: bounded
                    await anyio.to_thread.run_sync(self._writes.abort, pending)
        if new:
            self._count(writes=1, bytes_written=len(mv))
        return new

    async def _write_network(self, okey: ObjectKey, mv: memoryview, size: int) -> bool:
        """A write in network mode: every step (reserve, write, commit) in one abandonable
        worker call, so a hung server holds the caller no longer than its cancel or deadline
        (it counts as a stuck call, like a read). The worker writes its own copy of the
        payload (it may outlive this call, the caller's buffer not) and finishes on its own:
        the object indexed once renamed into place, else its temp file removed."""
        blob = bytes(mv)
        where = object_relpath(okey.object_id)
        try:
            new = await self._reads.run(lambda: self._writes.write_network(okey, blob, size))
        except (TierBusyError, TierIOError):
            raise
        except OSError as exc:
            self._count(errors=1)
            raise TierIOError(
                f"writing {where} failed: {exc.strerror or exc}", tier=self.name, errno=exc.errno
            ) from exc
        if new:
            self._count(writes=1, bytes_written=len(blob))
        return new

    async def _reserve(self, oid: str, size: int) -> Pending:
        """Reserve ``size`` bytes in the shared ledger (evicting), waiting at most
        ``lock_timeout_s`` for the root's lock or for room that writes in progress hold."""
        out: list[Pending] = []
        where = object_relpath(oid)
        try:
            evicted = await self._steps.run(
                self._writes.reserve, oid, size, out, what=f"reserving room for {where}"
            )
        except TierBusyError:
            raise
        except OSError as exc:
            self._count(errors=1)
            raise TierIOError(
                f"reserving room for {where} failed: {exc.strerror or exc}",
                tier=self.name,
                errno=exc.errno,
            ) from exc
        except BaseException:
            if out:  # reserved, then cancelled: give it back
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._writes.abort, out[0])
            raise
        if evicted:
            self._count(evictions=evicted)
        return out[0]

    def _unlink_victims(self, oids: list[str]) -> None:
        _, space = self._enter_space()
        try:
            space.unlink(oids)
        finally:
            self._leave()

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._ensure_open()
        oid = ObjectKey(key, group).object_id
        if not self._index.discard(oid):
            return False
        # abandonable: the index already forgot it; a hung unlink must not hold the caller
        await self._steps.run(
            self._unlink_victims, [oid], what=f"deleting {object_relpath(oid)}", abandon=True
        )
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
            dirs, space = self._enter_space()
            try:
                sub_fd = os.open(oid[:2], DIR_FLAGS, dir_fd=dirs.objects)
            except OSError:
                self._leave()
                return
            try:
                proof = (
                    (lambda: _reads_bad(sub_fd, ObjectKey(key, group)))
                    if isinstance(space, NodeSpace)
                    else None
                )
                moved, _ = space.quarantine(sub_fd, oid, reason, still_bad=proof)
                if moved is Moved.MOVED:
                    self._count(quarantined=1)
                elif moved is Moved.NOT_REGULAR:
                    self._count(junk=1)
            finally:
                os.close(sub_fd)
                self._leave()

        # abandonable, so the engine's bound on a shielded quarantine holds on a hung mount
        await self._steps.run(_move, what=f"quarantining {object_relpath(oid)}", abandon=True)


class _FileStorage:
    """FileTier's :class:`~bsr.tiers._base.StorageHooks`: its object files, by path."""

    def __init__(self, tier: FileTier) -> None:
        self._tier = tier

    def peek(self, key: ChunkKey, group: str) -> bytes | None:
        try:
            return self._tier.object_path(key, group).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def overwrite(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        try:  # in place: the same file, as damage on disk would be
            with open(self._tier.object_path(key, group), "r+b") as fh:
                fh.write(blob)
                fh.truncate(len(blob))
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    def put_raw(self, key: ChunkKey, group: str, blob: bytes) -> bool:
        path = self._tier.object_path(key, group)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".raw")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        self._tier._index.put(ObjectKey(key, group).object_id, len(blob), None)
        return True


def _reads_bad(sub_fd: int, okey: ObjectKey) -> bool:
    """Whether ``okey``'s object file, opened and read anew, fails verification (a network
    mode's proof before a quarantine: a stale view reads well the second time). A file that is
    gone or cannot be read now proves nothing."""
    try:
        fd, _ = open_regular(okey.object_id + OBJECT_SUFFIX, dir_fd=sub_fd)
    except (OSError, NotRegularFileError):
        return False
    try:
        with os.fdopen(fd, "rb", closefd=True) as fh:
            blob = fh.read()
    except OSError:
        return False
    try:
        decode_object(blob, okey)
    except ObjectError:
        return True
    return False


def _close(dirs: Dirs, space: Space | None) -> None:
    if space is not None:
        space.close()
    dirs.close()
