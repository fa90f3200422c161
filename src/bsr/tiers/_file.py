"""FileTier: L2, one file per object in a local (SSD) directory.

How it works::

    <root>/objects/<id[:2]>/<id>.bsr    visible objects (id = hex digest of key + group)
    <root>/tmp/<id>.<pid>.<rand>.tmp     objects being written (never visible)
    <root>/quarantine/<id>.<reason>      objects that failed verification, kept for inspection

A write goes to ``tmp/``, is fsync'ed, renamed into ``objects/`` and the directory fsync'ed;
only then is it added to the index, so a probe never sees a partial object (invariant 6). On open
the index is rebuilt by scanning ``objects/`` (each header is checked against the file size;
damaged ones are quarantined, not deleted) and temp files of dead writers are removed. The index
is an LRU: capacity is enforced by evicting least recently used objects, never one being read.
Reads go through an :class:`~bsr.tiers._readers.ObjectReader` in worker threads and are verified
(header, length, checksum) before the payload counts as read.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from .._check import positive_int
from .._errors import (
    ConfigError,
    ObjectError,
    ObjectNotFoundError,
    TierFullError,
    TierIOError,
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
from ._base import Tier, as_byte_view, as_payload_view
from ._readers import ObjectReader, aligned_buffer, default_reader

_ID_RE = re.compile(r"^[0-9a-f]{40}$")
_THREAD = threading.local()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileTier(Tier):
    """L2 tier: a directory on local storage.

    Args:
        path: directory (created if missing). One process should own a directory at a time.
        capacity_bytes: upper bound on stored bytes (file sizes); LRU eviction beyond it.
        name: tier name for statistics, logs and ``bytes_by_tier``.
        reader: ``"auto"`` (kvikio when the ``gpu`` extra and a CUDA driver are present, else
            POSIX), ``"posix"``, ``"kvikio"`` or an :class:`ObjectReader` instance.
        direct_io: open files with O_DIRECT for POSIX reads (falls back when unsupported).
        fsync: fsync each object and its directory before it becomes visible (keep True unless
            the data is disposable).
        io_threads: worker threads for this tier's blocking I/O.
    """

    durable = True
    default_io_depth = 4

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
        positive_int(capacity_bytes, "FileTier.capacity_bytes")
        if io_threads < 1:
            raise ConfigError(f"FileTier.io_threads must be >= 1, got {io_threads}")
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self.reader: ObjectReader = (
            default_reader(reader, direct=direct_io) if isinstance(reader, str) else reader
        )
        self.fsync = fsync
        self._limiter = anyio.CapacityLimiter(io_threads)
        self._index: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[str, int] = {}
        self._bytes = 0
        self._opened = False

    # ------------------------------------------------------------------ paths
    def _obj_path(self, oid: str) -> Path:
        return self.root / "objects" / oid[:2] / f"{oid}.bsr"

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self._check_open()
        if self._opened:
            return
        await anyio.to_thread.run_sync(self._scan)
        self._opened = True
        self._log.info(
            "bsr.tier.opened", path=str(self.root), objects=len(self._index), bytes=self._bytes
        )

    def _scan(self) -> None:
        for name in ("objects", "tmp", "quarantine"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        for tmp in (self.root / "tmp").iterdir():
            parts = tmp.name.split(".")
            pid = int(parts[1]) if len(parts) >= 4 and parts[1].isdigit() else -1
            if pid == os.getpid() or not _pid_alive(pid):
                tmp.unlink(missing_ok=True)
        found: list[tuple[float, str, int]] = []
        for sub in (self.root / "objects").iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                oid = f.name[:-4] if f.name.endswith(".bsr") else ""
                if not _ID_RE.match(oid) or sub.name != oid[:2]:
                    continue  # not ours: leave it alone
                try:
                    st = f.stat()
                    problem = self._check_file(f, st.st_size)
                except OSError as exc:
                    problem = f"unreadable:{exc.errno}"
                    st = None
                if problem:
                    self._move_to_quarantine(f, oid, problem)
                    continue
                assert st is not None
                found.append((st.st_mtime, oid, st.st_size))
        found.sort()
        self._index = OrderedDict((oid, size) for _, oid, size in found)
        self._bytes = sum(size for _, _, size in found)

    @staticmethod
    def _check_file(path: Path, size: int) -> str:
        """Cheap structural check on open: magic and length agree with the file size."""
        if size < HEADER_SIZE or size % 4096:
            return "truncated"
        with open(path, "rb") as fh:
            head = fh.read(_PLEN_OFFSET + 8)
        if head[:8] != MAGIC:
            return "badmagic"
        plen = int.from_bytes(head[_PLEN_OFFSET : _PLEN_OFFSET + 8], "little")
        if object_size(plen) != size:
            return "truncated"
        return ""

    def _move_to_quarantine(self, path: Path, oid: str, reason: str) -> None:
        dest = self.root / "quarantine" / f"{oid}.{reason}.{secrets.token_hex(4)}"
        try:
            os.replace(path, dest)
        except OSError:
            path.unlink(missing_ok=True)
        self._counters.quarantined += 1
        self._log.warning("bsr.tier.quarantine", object_id=oid, reason=reason)

    async def aclose(self) -> None:
        self._index.clear()
        await super().aclose()

    def _usage(self) -> tuple[int, int, int]:
        return len(self._index), self._bytes, self.capacity_bytes

    def _ensure_open(self) -> None:
        self._check_open()
        if not self._opened:
            raise ConfigError(
                f"FileTier {self.name!r} is not open; use 'async with tier' or await tier.open()",
                tier=self.name,
            )

    # ------------------------------------------------------------------ core
    async def contains_many(self, objects: Sequence[ObjectKey]) -> list[bool]:
        self._ensure_open()
        return [o.object_id in self._index for o in objects]

    async def read_into(self, key: ChunkKey, group: str, dst: Any) -> int:
        self._ensure_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if oid not in self._index:
            self._counters.misses += 1
            raise ObjectNotFoundError(
                "object not in file tier", tier=self.name, key=key.hex[:16], group=group
            )
        self._index.move_to_end(oid)
        view = as_byte_view(dst)
        path = str(self._obj_path(oid))
        self._pins[oid] = self._pins.get(oid, 0) + 1
        try:
            plen = await anyio.to_thread.run_sync(
                self._read_verify, path, okey, view, limiter=self._limiter
            )
        except ObjectError:
            self._counters.errors += 1
            raise
        except FileNotFoundError:
            self._counters.errors += 1
            self._drop(oid)
            raise ObjectNotFoundError(
                "object file vanished", tier=self.name, key=key.hex[:16], group=group
            ) from None
        except OSError as exc:
            self._counters.errors += 1
            raise TierIOError(
                f"reading object failed: {exc.strerror or exc}",
                tier=self.name,
                key=key.hex[:16],
                group=group,
                errno=exc.errno,
            ) from exc
        finally:
            self._pins[oid] -= 1
            if not self._pins[oid]:
                del self._pins[oid]
        self._counters.hits += 1
        self._counters.reads += 1
        self._counters.bytes_read += plen
        return plen

    def _read_verify(self, path: str, okey: ObjectKey, view: memoryview) -> int:
        header = getattr(_THREAD, "header", None)
        if header is None:  # one aligned header buffer per worker thread, reused
            header = _THREAD.header = aligned_buffer(HEADER_SIZE)
        # read into as much of dst as is 4 KiB aligned; objects are padded to 4 KiB
        room = len(view) - len(view) % 4096
        n = self.reader.read(path, header, view[:room])
        plen, psum = decode_header(header, okey, where=self.name)
        if plen > room:
            if plen > len(view):
                raise ConfigError(
                    f"destination holds {len(view)} bytes, object payload is {plen}", tier=self.name
                )
            raise ConfigError("destination must be 4 KiB aligned in length", tier=self.name)
        if n != object_size(plen) and n < HEADER_SIZE + plen:
            raise TruncatedObjectError(
                f"short read: {n} bytes, object needs {HEADER_SIZE + plen}",
                tier=self.name,
                key=okey.chunk.hex[:16],
                group=okey.group,
            )
        verify_payload(view[:plen], plen, psum, okey, where=self.name)
        return plen

    async def write(self, key: ChunkKey, group: str, payload: Any) -> bool:
        self._ensure_open()
        okey = ObjectKey(key, group)
        oid = okey.object_id
        if oid in self._index:
            self._index.move_to_end(oid)
            return False
        mv = as_payload_view(payload)
        size = object_size(len(mv))
        if size > self.capacity_bytes:
            raise TierFullError(
                f"object of {size} bytes exceeds capacity {self.capacity_bytes}; "
                "raise capacity_bytes",
                tier=self.name,
            )
        await self._make_room(size)
        try:
            await anyio.to_thread.run_sync(self._write_file, okey, mv, limiter=self._limiter)
        except OSError as exc:
            self._counters.errors += 1
            raise TierIOError(
                f"writing object failed: {exc.strerror or exc}", tier=self.name, errno=exc.errno
            ) from exc
        if oid not in self._index:
            self._index[oid] = size
            self._bytes += size
        self._counters.writes += 1
        self._counters.bytes_written += len(mv)
        self._counters.peak_bytes = max(self._counters.peak_bytes, self._bytes)
        return True

    def _write_file(self, okey: ObjectKey, mv: memoryview) -> None:
        oid = okey.object_id
        header = encode_header(okey, len(mv), payload_checksum(mv))
        pad = b"\x00" * (align_up(len(mv)) - len(mv))
        tmp = self.root / "tmp" / f"{oid}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        final = self._obj_path(oid)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            want = len(header) + len(mv) + len(pad)
            done = 0
            bufs: list[Any] = [header, mv, pad]
            while done < want:
                n = os.writev(fd, bufs)
                done += n
                if done < want:  # partial write: rebuild the remaining buffers
                    flat = memoryview(b"".join(bytes(b) for b in bufs))[n:]
                    bufs = [flat]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        final.parent.mkdir(exist_ok=True)
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(final.parent)

    async def _make_room(self, size: int) -> None:
        if self._bytes + size <= self.capacity_bytes:
            return
        victims: list[str] = []
        freed = 0
        for oid, osize in self._index.items():
            if self._bytes - freed + size <= self.capacity_bytes:
                break
            if oid in self._pins:
                continue
            victims.append(oid)
            freed += osize
        if self._bytes - freed + size > self.capacity_bytes:
            raise TierFullError(
                "file tier is full of objects being read; retry later or raise capacity_bytes",
                tier=self.name,
            )
        for oid in victims:
            self._drop(oid)
            self._counters.evictions += 1
        await anyio.to_thread.run_sync(self._unlink_many, victims, limiter=self._limiter)

    def _unlink_many(self, oids: list[str]) -> None:
        for oid in oids:
            self._obj_path(oid).unlink(missing_ok=True)

    def _drop(self, oid: str) -> None:
        size = self._index.pop(oid, None)
        if size is not None:
            self._bytes -= size

    async def delete(self, key: ChunkKey, group: str) -> bool:
        self._ensure_open()
        oid = ObjectKey(key, group).object_id
        if oid not in self._index:
            return False
        self._drop(oid)
        await anyio.to_thread.run_sync(self._unlink_many, [oid], limiter=self._limiter)
        return True

    async def quarantine(self, key: ChunkKey, group: str, reason: str) -> None:
        """Move a failing object aside (``quarantine/``) so later probes miss it."""
        self._ensure_open()
        oid = ObjectKey(key, group).object_id
        self._drop(oid)
        path = self._obj_path(oid)

        def _move() -> None:
            if path.exists():
                self._move_to_quarantine(path, oid, reason)

        await anyio.to_thread.run_sync(_move)

    # ------------------------------------------------------------------ inspection
    def object_path(self, key: ChunkKey, group: str) -> Path:
        """Where ``(key, group)`` is (or would be) stored; for tests and tooling."""
        return self._obj_path(ObjectKey(key, group).object_id)

    def object_paths(self) -> list[Path]:
        """Paths of every visible object, least recently used first."""
        return [self._obj_path(oid) for oid in self._index]
