"""FileTier's reads: one object (a fetch), and a batch with several reads in flight.

Where it runs: worker threads (the tier's own for a fetch, the transfer pipeline's for a bulk
read); :meth:`FileReads.fetch` hands its work to the tier's abandonable calls from the event loop.

How it works: an object is opened relative to its fan-out directory's kept descriptor
(``O_NOFOLLOW | O_NONBLOCK``, ``fstat``-checked), pinned in the index while it is read, and read
by the tier's reader: its 4 KiB header into a buffer of the reading thread, its payload straight
into the destination. Nothing here vouches for the bytes: the caller checks them against the
header (:meth:`~bsr.ObjectCodec.check_read`). A bulk read with an io_uring reader keeps up to
``ahead`` objects in flight on the calling thread's ring (:meth:`UringReader.stream`), each
ended as its requests complete; without one, objects are read one by one.

What an abandoned caller may rely on: a bulk read returns only once the kernel is done with
every destination it was given (a read the kernel still owns keeps the thread, and the caller
parks the memory). :meth:`FileReads.fetch`, the one-object read a caller may abandon at any
moment, reads into a buffer of its worker thread and copies into the caller's destination only
while the caller still waits: once it stopped waiting, not a byte lands there.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from ..._errors import (
    CorruptObjectError,
    ObjectError,
    ObjectNotFoundError,
    ReadWithdrawnError,
    TierIOError,
    TruncatedObjectError,
)
from ...core._keys import ChunkKey, object_id
from ...core._layout import ALIGNMENT, align_up
from .._abandon import AbandonableCalls, cancellation
from .._codec import ObjectCodec
from .._reads import Begin, Borrowed, End, Fetched, ReadItem, read_one_by_one
from .._views import as_byte_view
from ._readers import (
    NotRegularFileError,
    PosixReader,
    ReadCancelledError,
    StreamRead,
    UringReader,
    aligned_buffer,
    open_regular,
)
from ._root import OBJECT_SUFFIX, Dirs, ReadFailure, classify_read_error, object_relpath

if TYPE_CHECKING:
    from ._tier import FileTier

HEADER_SIZE = ObjectCodec.HEADER_SIZE
_THREAD = threading.local()  # per worker thread: its header buffer, its fetch buffer


def _buffer(name: str, nbytes: int) -> memoryview:
    """A 4 KiB-aligned buffer of at least ``nbytes`` kept by the calling thread."""
    buf: memoryview | None = getattr(_THREAD, name, None)
    if buf is None or len(buf) < nbytes:
        buf = aligned_buffer(max(nbytes, ALIGNMENT))
        setattr(_THREAD, name, buf)
    return buf


class _Handover:
    """Whether a fetch's caller still waits for its bytes: the worker copies into the caller's
    buffer only inside :meth:`copy`; :meth:`close` (the caller gave up) waits for a copy under
    way (a memcpy) and refuses every later one."""

    __slots__ = ("closed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def copy(self, dst: memoryview, src: memoryview, n: int) -> bool:
        with self.lock:
            if self.closed:
                return False
            dst[:n] = src[:n]
            return True

    def close(self) -> None:
        with self.lock:
            self.closed = True


class FileReads:
    """The read side of one :class:`~bsr.FileTier` (its index, root and reader)."""

    def __init__(self, tier: FileTier) -> None:
        self.tier = tier

    def _pin(self, oid: str) -> tuple[int, Any] | None:
        """Pin ``oid`` in the index; in network mode, one this node has not seen yet (another
        node wrote it, and no probe asked) is looked for on disk first (the index holds only
        what this node wrote and probed: a network root is not walked on open)."""
        tier = self.tier
        got = tier._index.pin(oid)
        if got is None and tier.options.shared == "network":
            size = tier._probe_sync([oid])[0]
            if size:
                tier._index.put_lru(oid, size, None)
                got = tier._index.pin(oid)
        return got

    # ------------------------------------------------------------------ one object
    def fetch_blocking(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        """Read ``(key, group)``: its header (a copy the caller keeps) and its payload into
        ``dst`` (as much of it as is 4 KiB aligned in length)."""
        tier = self.tier
        tier._ensure_open()
        oid = object_id(key.digest, group)
        if self._pin(oid) is None:
            tier._count(misses=1)
            raise ObjectNotFoundError(
                "object not in file tier", tier=tier.name, key=key.hex[:16], group=group
            )
        try:
            view = as_byte_view(dst)
            dirs = tier._enter()
            try:
                header = _buffer("header", HEADER_SIZE)[:HEADER_SIZE]
                n, stored = self._read(dirs, oid, key, group, header, view)
            finally:
                tier._leave()
        except (ObjectError, OSError, NotRegularFileError) as exc:
            failure = self.failure(exc, oid, key, group)
            if failure is exc:
                raise
            raise failure  # noqa: B904 - its cause is set (or suppressed) by failure()
        finally:
            tier._index.unpin(oid)
        self._count_hit(header, n)
        return Fetched(bytes(header), n, stored)

    async def fetch(self, key: ChunkKey, group: str, dst: Any) -> Fetched:
        """:meth:`fetch_blocking` in one of the tier's abandonable worker calls, through a
        buffer of the worker's own: the bytes reach ``dst`` only while this call still waits
        (an abandoned read stuck in the kernel writes into its thread's buffer, never ``dst``)."""
        self.tier._ensure_open()
        view = as_byte_view(dst)
        handover = _Handover()

        def work() -> Fetched:
            room = len(view) - len(view) % ALIGNMENT
            own = _buffer("fetch", align_up(max(room, 1)))[:room]
            with cancellation(AbandonableCalls.abandoned_here):
                fetched = self.fetch_blocking(key, group, own)
            if not handover.copy(view, own, fetched.nbytes):
                raise ReadWithdrawnError("read withdrawn: its caller stopped waiting")
            return fetched

        try:
            return await self.tier._reads.run(work)
        finally:
            handover.close()

    def _read(
        self, dirs: Dirs, oid: str, key: ChunkKey, group: str, header: memoryview, view: memoryview
    ) -> tuple[int, int]:
        """Open and read one object into ``header`` and ``view``; the payload bytes read and
        the file's size."""
        fd, st = self.open_object(dirs, oid)
        try:
            size = st.st_size
            if size < HEADER_SIZE:
                raise TruncatedObjectError(
                    f"object file is {size} bytes, shorter than its {HEADER_SIZE}-byte header",
                    tier=self.tier.name, key=key.hex[:16], group=group,
                )  # fmt: skip
            # read into as much of dst as is 4 KiB aligned; objects are padded to 4 KiB
            room = len(view) - len(view) % ALIGNMENT
            reader = self.tier.reader
            if isinstance(reader, UringReader):  # it needs the size: no second fstat
                n = reader.read_fd(fd, header, view[:room], size=size)
            elif isinstance(reader, PosixReader):
                n = reader.read_fd(fd, header, view[:room])
            else:  # a reader that opens by path: give it the file we checked
                n = reader.read(f"/proc/self/fd/{fd}", header, view[:room])
        finally:
            os.close(fd)
        return max(0, n - HEADER_SIZE), size

    def _count_hit(self, header: Any, n: int) -> None:
        stated = ObjectCodec.stated_length(header)
        self.tier._count_hit(min(n, stated) if stated >= 0 else n)

    # ------------------------------------------------------------------ a batch
    def read_many(self, begin: Begin, end: End, ahead: int) -> None:
        """The tier's bulk read (:meth:`~bsr.Tier.read_many_blocking`): up to ``ahead`` objects
        in flight on this thread's io_uring, each ended as its requests complete; one by one
        without an io_uring reader."""
        tier = self.tier
        tier._ensure_open()
        reader = tier.reader
        if not isinstance(reader, UringReader) or reader.disabled_reason is not None:
            read_one_by_one(tier, begin, end)
            return
        dirs = tier._enter()
        begun: dict[int, StreamRead] = {}  # opened and not ended (closed on the way out)

        def stream_begin() -> StreamRead | None:
            item = begin()
            return None if item is None else self._open_read(dirs, item, begun)

        def stream_end(r: StreamRead) -> bool:
            item: ReadItem = r.token
            return end(item, self._end_read(r, item, begun))

        try:
            reader.stream(stream_begin, stream_end, ahead)
        finally:
            for r in begun.values():  # only when the stream raised: every end closes its own
                if r.fd >= 0:
                    os.close(r.fd)
                item = r.token
                tier._index.unpin(object_id(item.key.digest, item.group))
            tier._leave()

    def _open_read(self, dirs: Dirs, item: ReadItem, begun: dict[int, StreamRead]) -> StreamRead:
        """Pin and open ``item``'s object for the stream (a miss or a failed open: ``error``)."""
        tier = self.tier
        r = StreamRead(item)
        if self._pin(object_id(item.key.digest, item.group)) is None:
            tier._count(misses=1)
            r.error = ObjectNotFoundError(
                "object not in file tier", tier=tier.name, key=item.key.hex[:16], group=item.group
            )
            return r  # never pinned (not in ``begun``)
        begun[id(r)] = r
        view = as_byte_view(item.dst)
        try:
            r.fd, st = self.open_object(dirs, object_id(item.key.digest, item.group))
        except (OSError, NotRegularFileError) as exc:
            r.error = exc
            return r
        r.size = st.st_size
        r.payload = view[: len(view) - len(view) % ALIGNMENT]
        if r.size < HEADER_SIZE:
            r.error = TruncatedObjectError(
                f"object file is {r.size} bytes, shorter than its {HEADER_SIZE}-byte header",
                tier=tier.name, key=item.key.hex[:16], group=item.group,
            )  # fmt: skip
        return r

    def _end_read(
        self, r: StreamRead, item: ReadItem, begun: dict[int, StreamRead]
    ) -> int | Borrowed | BaseException:
        """Close and unpin one object of the stream: the payload bytes read or the error."""
        if begun.pop(id(r), None) is None:  # never pinned: a miss
            assert r.error is not None
            return r.error
        oid = object_id(item.key.digest, item.group)
        try:
            if r.fd >= 0:
                os.close(r.fd)
                r.fd = -1
            if r.error is not None:
                raise r.error
        except Exception as exc:
            return self.failure(exc, oid, item.key, item.group)
        finally:
            self.tier._index.unpin(oid)
        item.header, item.stored = r.header, r.size
        n = max(0, r.total - HEADER_SIZE)
        self._count_hit(r.header, n)
        return n

    # ------------------------------------------------------------------ opens and failures
    def open_object(self, dirs: Dirs, oid: str) -> tuple[int, os.stat_result]:
        """Open object ``oid`` through its fan-out directory's kept descriptor (once more
        through a fresh one when it is missing there: the directory may have been made anew)."""
        sub = oid[:2]
        sub_fd = dirs.subdir(sub)
        try:
            return self._open_in(sub_fd, oid)
        except FileNotFoundError:
            fresh = dirs.reopen_subdir(sub, sub_fd)
            if fresh == sub_fd:
                raise
            return self._open_in(fresh, oid)

    def _open_in(self, sub_fd: int, oid: str) -> tuple[int, os.stat_result]:
        """Open object ``oid`` in its directory ``sub_fd`` (``objects/<id[:2]>``)."""
        name = oid + OBJECT_SUFFIX
        reader = self.tier.reader
        if isinstance(reader, PosixReader):
            return reader.open(name, dir_fd=sub_fd)
        return open_regular(name, dir_fd=sub_fd)

    def failure(self, exc: BaseException, oid: str, key: ChunkKey, group: str) -> Exception:
        """What a read of ``oid`` that failed with ``exc`` raises, counted as the tier's error
        where it is one: a damaged object as is; a withdrawn read as
        :class:`~bsr.ReadWithdrawnError` (no outcome); an I/O error or a file that is not
        regular as its typed error (caused by ``exc``); anything else as is."""
        tier = self.tier
        if isinstance(exc, ObjectError):
            tier._count(errors=1)
            return exc
        if isinstance(exc, ReadCancelledError):
            withdrawn = ReadWithdrawnError(
                "read withdrawn: its request ended", tier=tier.name, key=key.hex[:16], group=group
            )
            withdrawn.__suppress_context__ = True  # as ``raise ... from None``
            return withdrawn
        if isinstance(exc, (OSError, NotRegularFileError)):
            tier._count(errors=1)
            failure = self._error(exc, oid, key, group)
            failure.__cause__ = exc  # as ``raise ... from exc``
            return failure
        return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

    def _error(self, exc: BaseException, oid: str, key: ChunkKey, group: str) -> Exception:
        ctx = {"tier": self.tier.name, "key": key.hex[:16], "group": group}
        kind = classify_read_error(exc)
        if kind is ReadFailure.MISSING:
            self.tier._index.discard(oid)
            return ObjectNotFoundError("object file vanished", **ctx)
        if kind is ReadFailure.NOT_REGULAR:
            return CorruptObjectError(
                f"{object_relpath(oid)} is not a regular file bsr wrote ({exc}); "
                "it is never followed or read",
                **ctx,
            )
        assert isinstance(exc, OSError)
        return TierIOError(
            f"reading {object_relpath(oid)} failed: {exc.strerror or exc}", errno=exc.errno, **ctx
        )
