"""Object readers for file-backed tiers: io_uring, POSIX positional reads and kvikio.

Where it runs: worker threads, called by :class:`~bsr.FileTier`. A reader fills a 4 KiB header
buffer and the caller's payload buffer from one file and reports how many bytes arrived;
verification is the tier's job. :class:`UringReader` (the default where io_uring works) splits
an object into requests of at most ``block_bytes`` and keeps up to ``depth`` of them in flight
across all of the tier's threads, each landing straight in the caller's buffer;
:class:`PosixReader` (its fallback, and the reader where io_uring is missing or refused) reads
header and payload in one positional vector read (``preadv``) per object.

Files are opened by :func:`open_regular` only: ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is refused,
a FIFO or device cannot block the open) and ``fstat`` before any byte is read, so a path that is
not a regular file raises :class:`NotRegularFileError` instead of hanging a worker thread.
FileTier opens relative to directory descriptors of its own tree and hands readers the open
descriptor (``read_fd``); a reader without ``read_fd`` gets ``/proc/self/fd/N``, which names the
already-checked file.

With ``direct=True`` files are opened ``O_DIRECT`` (page cache bypassed); buffers must then be
4 KiB aligned, which staging slots are. A filesystem that refuses O_DIRECT (tmpfs) falls back
to buffered reads and the reader records that in :attr:`PosixReader.direct_active`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from ..._errors import ReadWithdrawnError as ReadWithdrawnError  # re-exported
from ...core._layout import ALIGNMENT, align_up
from ...core._object import HEADER_SIZE
from .._abandon import cancel_check
from .._abandon import cancellation as cancellation  # re-exported
from ._uring import Ring, RingError, uring_status

_HAS_ODIRECT = hasattr(os, "O_DIRECT")
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
#: flags every object file is opened with
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ObjectReader(Protocol):
    name: str

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        """Fill ``header`` (HEADER_SIZE bytes) then ``payload`` from ``path``; return bytes read."""
        ...


class ReadCancelledError(OSError):
    """A read whose requests were withdrawn from the ring because its caller abandoned it
    (:func:`cancellation`); nothing about the object or the device is known from it."""

    def __init__(self) -> None:
        super().__init__(errno.ECANCELED, "read withdrawn: its request was abandoned")


class NotRegularFileError(Exception):
    """The path is a symlink, FIFO, device, socket or directory, not a regular file.

    Not an ``OSError`` on purpose: it says what the entry is, not that I/O failed.
    """

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is a {kind}, not a regular file")
        self.path = path
        self.kind = kind


def file_kind(mode: int) -> str:
    """A word for the file type in ``mode`` (as ``stat`` reports it)."""
    for test, word in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return word
    return "special file"


S_ISREG = stat.S_ISREG


def _where(name: str, dir_fd: int | None) -> str:
    return name if dir_fd is None else f"<dir>/{name}"


def open_regular(
    name: str, *, dir_fd: int | None = None, direct: bool = False
) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a symlink or blocking; ``(fd, stat)``.

    Raises:
        NotRegularFileError: ``name`` is a symlink (``ELOOP`` under ``O_NOFOLLOW``), a FIFO, a
            device, a socket or a directory. Checked with ``lstat`` before the open (so a device
            is never opened) and with ``fstat`` after it (so a swap in between is caught).
        OSError: the open failed (missing file, permission denied, I/O error).
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not S_ISREG(st.st_mode):
        raise NotRegularFileError(_where(name, dir_fd), file_kind(st.st_mode))
    try:
        fd = os.open(name, OPEN_FLAGS | (_O_DIRECT if direct else 0), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(_where(name, dir_fd), "symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not S_ISREG(st.st_mode):
            raise NotRegularFileError(_where(name, dir_fd), file_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned anonymous buffer of ``nbytes`` (rounded up to a page)."""
    size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
    return memoryview(mmap.mmap(-1, size))[:nbytes]


def is_aligned(buf: memoryview, alignment: int = ALIGNMENT) -> bool:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data % alignment == 0 and len(buf) % alignment == 0


def _unaligned_buffered(fd: int, header: memoryview, payload: memoryview) -> None:
    """Drop ``O_DIRECT`` from ``fd`` when a buffer is not 4 KiB aligned (then read buffered)."""
    if _O_DIRECT and not (is_aligned(header) and is_aligned(payload)):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & _O_DIRECT:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)


class PosixReader:
    """Positional reads with ``os.preadv`` (one syscall for header + payload)."""

    name = "posix"

    def __init__(self, *, direct: bool = False) -> None:
        self.direct_requested = direct and _HAS_ODIRECT
        self.direct_active = self.direct_requested
        self._lock = threading.Lock()

    def open(self, name: str, *, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
        """:func:`open_regular` with ``O_DIRECT`` while it is active (dropped on ``EINVAL``)."""
        if self.direct_active:
            try:
                return open_regular(name, dir_fd=dir_fd, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: filesystem does not support O_DIRECT
                    raise
                with self._lock:
                    self.direct_active = False
        return open_regular(name, dir_fd=dir_fd)

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        fd, _ = self.open(path)
        try:
            return self.read_fd(fd, header, payload)
        finally:
            os.close(fd)

    def read_fd(self, fd: int, header: memoryview, payload: memoryview) -> int:
        """Fill ``header`` then ``payload`` from the open file ``fd``; return bytes read."""
        _unaligned_buffered(fd, header, payload)
        total = 0
        want = len(header) + len(payload)
        bufs: list[Any] = [header, payload]
        while total < want:
            if total == 0:
                n = os.preadv(fd, bufs, 0)
            else:  # short read: continue where it stopped
                if total < len(header):
                    rest: list[Any] = [header[total:], payload]
                else:
                    rest = [payload[total - len(header) :]]
                n = os.preadv(fd, rest, total)
            if n == 0:
                break
            total += n
        return total


class KvikioReader:
    """Reads through kvikio (cuFile / GPUDirect Storage when available, its thread pool otherwise).

    Only usable with a CUDA driver; :func:`default_reader` picks it automatically when the
    ``gpu`` extra is installed and CUDA is available.
    """

    name = "kvikio"

    def __init__(self) -> None:
        import kvikio

        self._kvikio = kvikio

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        # kvikio raises at end of file ("POSIX error on pread: EOF") where a POSIX read is short:
        # ask for no more than the file holds, so a truncated object reads short, as with POSIX,
        # and the tier reports it as truncated (corrupt), not as an unexpected error
        size = os.stat(path).st_size
        with self._kvikio.CuFile(path, "r") as f:
            want = min(len(header), size)
            n_header = f.pread(np.frombuffer(header, dtype=np.uint8), want, 0).get() if want else 0
            if n_header < len(header):
                return int(n_header)
            want = min(len(payload), size - HEADER_SIZE)
            if want <= 0:
                return int(n_header)
            n_payload = f.pread(np.frombuffer(payload, dtype=np.uint8), want, HEADER_SIZE).get()
            return int(n_header + n_payload)


def kvikio_usable() -> bool:
    """True when kvikio imports and a CUDA driver is present."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import kvikio  # noqa: F401
    except Exception:
        return False
    return True


def default_reader(
    kind: str = "auto", *, direct: bool = False, depth: int | None = None
) -> ObjectReader:
    """Choose a reader: ``"auto"`` (kvikio with a CUDA driver, else io_uring where it works,
    else POSIX), ``"uring"`` (io_uring; POSIX where it does not work), ``"posix"``, ``"kvikio"``.
    """
    if kind == "auto" and kvikio_usable():
        return KvikioReader()
    if kind in ("auto", "uring"):
        if uring_status().usable:
            return UringReader(direct=direct, depth=depth)
        return PosixReader(direct=direct)
    if kind == "posix":
        return PosixReader(direct=direct)
    if kind == "kvikio":
        return KvikioReader()
    from ..._errors import ConfigError

    raise ConfigError(f"unknown reader {kind!r}; use 'auto', 'uring', 'posix' or 'kvikio'")


# ---------------------------------------------------------------------- io_uring
#: requests in flight per FileTier when nothing chose the depth (a calibration may change it)
DEFAULT_DEPTH = 32
#: the largest request (bytes) an object read is split into
DEFAULT_BLOCK_BYTES = 1 << 20
#: the largest ring a thread makes (a read keeps at most this many requests in flight)
RING_ENTRIES_MAX = 1024
#: how often a thread waiting on the ring looks whether its read was abandoned (seconds)
CANCEL_POLL_S = 0.1


class _Depth:
    """The cap on read requests in flight, shared by every thread of one reader."""

    def __init__(self, n: int) -> None:
        self.limit = n
        self.free = n
        self.peak = 0  # the most requests in flight at once
        self._cond = threading.Condition(threading.Lock())  # never taken twice by one thread
        self._waiting = 0  # threads waiting in take (a give wakes them only if there are some)

    def take(self, want: int, block: bool, check: Callable[[], bool] | None) -> int:
        """Up to ``want`` requests; with ``block``, wait for at least one (0 if cancelled)."""
        with self._cond:
            while block and self.free <= 0:
                self._waiting += 1
                try:
                    self._cond.wait(CANCEL_POLL_S if check is not None else None)
                finally:
                    self._waiting -= 1
                if check is not None and check():
                    return 0
            k = min(want, self.free)
            if k <= 0:
                return 0
            self.free -= k
            if self.limit - self.free > self.peak:
                self.peak = self.limit - self.free
            return k

    def give(self, k: int) -> None:
        with self._cond:
            self.free += k
            if self._waiting:  # a stream gives back once per completion: most find nobody
                self._cond.notify_all()

    def resize(self, n: int) -> None:
        with self._cond:
            self.free += n - self.limit
            self.limit = n
            self._cond.notify_all()


#: one read request: ``(offset, address, length, vectors)`` (see :meth:`UringReader._run`)
Piece = tuple[int, int, int, int]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0


class UringReader(PosixReader):
    """Object reads through io_uring: up to ``depth`` requests in flight per tier.

    Where it runs: FileTier's worker threads, one ring each (made on the thread's first read).
    An object is read as one request for its header and requests of at most ``block_bytes`` for
    its payload, straight into the caller's buffers; requests are queued while the tier-wide
    depth allows and the thread waits in the kernel (GIL released) for their completions, so
    one thread keeps a whole object's requests in flight and a tier's threads share the depth.
    A ring the kernel refuses (``EPERM``, ``ENOSYS``: io_uring disabled or filtered) turns the
    reader into its :class:`PosixReader` base for good (``disabled_reason``); any other ring
    failure reads that one object with ``preadv`` (``fallback_reads``).

    Args:
        direct: open files ``O_DIRECT`` (dropped where the filesystem refuses it).
        depth: requests in flight across the reader's threads (None: :data:`DEFAULT_DEPTH`,
            which :meth:`~bsr.FileTier.open` may replace with a calibrated one).
        block_bytes: the largest single request (a multiple of 4 KiB).
    """

    name = "uring"

    def __init__(
        self,
        *,
        direct: bool = False,
        depth: int | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        super().__init__(direct=direct)
        if block_bytes < ALIGNMENT or block_bytes % ALIGNMENT:
            from ..._errors import ConfigError

            raise ConfigError(f"block_bytes must be a multiple of 4096, got {block_bytes}")
        self.depth_chosen = depth is not None
        self._depth = _Depth(depth if depth is not None else DEFAULT_DEPTH)
        self.block_bytes = block_bytes
        self.disabled_reason: str | None = None
        self.fallback_reads = 0
        #: threads waiting for the kernel to complete the requests of a ring that failed under
        #: them (their buffers stay theirs, and their callers' slots parked, until it has)
        self.settling = 0
        self._local = threading.local()

    @property
    def depth(self) -> int:
        """Requests in flight at most, across every thread of this reader."""
        return self._depth.limit

    @property
    def peak_in_flight(self) -> int:
        """The most requests this reader had in flight at once."""
        return self._depth.peak

    def set_depth(self, depth: int) -> None:
        if depth < 1:
            from ..._errors import ConfigError

            raise ConfigError(f"read depth must be >= 1, got {depth}")
        self._depth.resize(depth)

    def _ring(self) -> Ring | None:
        owned: _OwnedRing | None = getattr(self._local, "ring", None)
        if owned is not None:
            return owned.ring
        if self.disabled_reason is not None:
            return None
        try:
            ring = Ring(min(RING_ENTRIES_MAX, max(64, 1 << (self.depth - 1).bit_length())))
        except RingError as exc:
            if exc.errno in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                with self._lock:
                    self.disabled_reason = f"io_uring refused: {exc}"
            return None
        self._local.ring = _OwnedRing(ring)
        return ring

    def read_fd(
        self, fd: int, header: memoryview, payload: memoryview, *, size: int | None = None
    ) -> int:
        """Fill ``header`` then ``payload`` from ``fd`` (``size``: the file's size, from the
        caller's ``fstat``); return the bytes read contiguously from the start."""
        ring = self._ring()
        if ring is None:
            with self._lock:
                self.fallback_reads += 1
            return super().read_fd(fd, header, payload)
        cached = getattr(self._local, "head", None)  # a thread reads into one header buffer
        if cached is not None and cached[0] is header:
            head = cached[1]
        else:
            head = _address(header)
            self._local.head = (header, head)
        base = _address(payload)
        if _O_DIRECT and (head | base | len(header) | len(payload)) % ALIGNMENT:
            _unaligned_buffered(fd, header, payload)  # one of them is not 4 KiB aligned
        if size is None:
            size = os.fstat(fd).st_size
        want = min(len(payload), align_up(max(0, size - len(header))))
        # the header and the payload's first block in one vector request (one request for an
        # object of up to block_bytes: half the requests, and the device's cost, of two reads)
        first = min(want, self.block_bytes)
        iov = getattr(self._local, "iov", None)
        if iov is None:
            iov = self._local.iov = (_Iovec * 2)()
        iov[0].base, iov[0].len = head, len(header)
        iov[1].base, iov[1].len = base, first
        pieces = [(0, ctypes.addressof(iov), len(header) + first, 2 if first else 1)]
        for off in range(first, want, self.block_bytes):
            pieces.append((len(header) + off, base + off, min(self.block_bytes, want - off), 0))
        got = self._run(ring, fd, pieces)
        total = 0
        for (_, _, length, _), n in zip(pieces, got):
            total += n
            if n < length:
                break
        return total

    def _run(self, ring: Ring, fd: int, pieces: list[Piece]) -> list[int]:
        """Keep ``pieces`` in flight within the depth until each completed; bytes per piece.

        A piece is ``(offset, address, length, vectors)``: with ``vectors`` > 0, ``address`` is
        that many iovecs (one vector request), else one buffer of ``length`` bytes.

        Every request queued is reaped before this returns, whatever happens: a kernel error
        in one request (``EBADF``, ``EIO``), a short read (end of file) or an abandoned caller
        (``check``) stop the queueing of further pieces, and the loop then runs only while
        requests are in flight (the places in the depth of those reaped go back once per
        reap). Only a ring that fails under us (:class:`RingError` from ``io_uring_enter``)
        leaves requests behind: they are drained, bounded, and the ring is dropped.
        """
        check = cancel_check()
        got = [0] * len(pieces)
        tags: dict[int, int] = {}
        nxt = 0
        error = 0
        cancelled = False
        stop = False  # no further piece is queued: an error, a cancel or the end of the file
        depth = self._depth
        try:
            while tags or (nxt < len(pieces) and not stop):
                room = ring.entries - len(tags)  # the depth may exceed what this ring holds
                if nxt < len(pieces) and not stop and room > 0:
                    k = depth.take(min(len(pieces) - nxt, room), block=not tags, check=check)
                    if k == 0 and not tags:  # cancelled while waiting for the depth
                        cancelled = stop = True
                        continue
                    nxt += self._queue(ring, fd, pieces[nxt : nxt + k], nxt, tags)
                if not tags:
                    continue
                timeout = CANCEL_POLL_S if check is not None else None
                ring.enter(wait=len(tags) if stop or nxt == len(pieces) else 1, timeout_s=timeout)
                failed, ended = self._reap(ring, pieces, tags, got)
                error = error or failed
                stop = stop or ended
                if check is not None and not cancelled and check():
                    cancelled = stop = True
                    self._withdraw(ring, tags)
        except RingError:
            # the ring failed under us: wait for what is in flight, so the kernel does not
            # write into the buffers after we return, and start a new ring next time; a read
            # whose request ended meanwhile is withdrawn (no outcome), else an I/O error
            self._give_up(ring, tags)
            if check is not None and check():
                raise ReadCancelledError from None
            raise
        except BaseException:
            self._give_up(ring, tags)
            raise
        if cancelled:
            raise ReadCancelledError
        if error:
            raise OSError(error, os.strerror(error))
        return got

    def _queue(
        self, ring: Ring, fd: int, batch: list[Piece], first: int, tags: dict[int, int]
    ) -> int:
        """Queue ``batch`` (the pieces from index ``first`` on, their places in the depth
        taken), each request's tag mapped to its piece's index in ``tags``; how many were
        queued (the places of the others go back)."""
        queued = 0
        try:
            for i, (off, addr, length, vectors) in enumerate(batch, first):
                if vectors:  # addr: that many iovecs
                    tags[ring.readv(fd, off, addr, vectors)] = i
                else:
                    tags[ring.read(fd, off, addr, length)] = i
                queued += 1
        finally:
            if queued < len(batch):
                self._depth.give(len(batch) - queued)  # places taken but never used
        return queued

    def _reap(
        self, ring: Ring, pieces: list[Piece], tags: dict[int, int], got: list[int]
    ) -> tuple[int, bool]:
        """Take the completions the ring holds: each one's bytes into ``got``, its place in the
        depth back (at once); the first kernel error (0: none) and whether no further piece may
        be queued (an error, or a short read: the end of the file)."""
        error = 0
        stop = False
        back = 0
        try:
            for tag, res in ring.reap():
                i = tags.pop(tag, -1)
                if i < 0:
                    continue
                back += 1
                if res < 0:
                    error = error or -res
                    stop = True
                else:
                    got[i] = res
                    if res < pieces[i][2]:
                        stop = True  # end of file: nothing more to read
        finally:
            if back:
                self._depth.give(back)  # the places of those reaped, at once
        return error, stop

    # ------------------------------------------------------------------ streams
    def stream(
        self,
        begin: Callable[[], StreamRead | None],
        end: Callable[[StreamRead], bool],
        ahead: int,
    ) -> None:
        """Read objects one after another on this thread's ring, up to ``ahead`` at once.

        ``begin()`` gives the next object to read (opened by the caller), or None when none
        can begin now (no more objects, or no free buffer: one comes back only through
        ``end``, and ``begin`` is asked again after each). ``end(read)`` is called exactly
        once for every object begun, in the order their reads complete, with ``read.got``
        set (or ``read.error``: the open failed, the kernel failed the read, or
        :class:`ReadCancelledError`); it verifies and installs, and what it returns says
        whether to begin more. While one object is verified and copied, the kernel reads the
        others: one thread keeps the device busy without a thread, a sleep and a wake-up per
        read.

        The requests in flight stay within the reader's depth (shared with its other
        threads). Cancellation (:func:`cancellation`) withdraws the requests in flight; their
        objects still get their ``end`` (with :class:`ReadCancelledError`) once every request
        is reaped, so no buffer is written after this returns. Where the ring is unavailable,
        or fails under a stream, the objects left are read one by one with ``preadv``.
        """
        ring = self._ring()
        if ring is None:
            self._stream_posix(begin, end)
            return
        bufs: _Streams | None = getattr(self._local, "streams", None)
        if bufs is None or bufs.n < ahead:
            bufs = self._local.streams = _Streams(max(ahead, 1))
        st = _StreamState(list(range(max(1, ahead))), end)
        check = cancel_check()
        try:
            while True:
                self._stream_fill(ring, st, bufs, begin, check, block=not st.reads)
                if not st.reads:
                    if st.waiting:
                        continue
                    return  # nothing in flight, and begin() had nothing (or we stopped)
                ring.enter(wait=1, timeout_s=CANCEL_POLL_S if check is not None else None)
                self._reap_stream(ring, st)
                while st.done:
                    # before a long object's verify and copy (several requests) the ring is
                    # refilled and handed to the kernel, so the device reads on meanwhile. An
                    # object of one request is quick to end, and a syscall for each would cost
                    # more than the overlap gains (measured at 512 KiB): the objects its end
                    # frees buffers for begin together after the ends (their requests reach
                    # the kernel at the next enter either way), so their opens run back to
                    # back rather than each after a copy that left the CPU caches cold
                    r = st.done.popleft()
                    if len(r.lengths) > 1 and self._stream_fill(
                        ring, st, bufs, begin, check, block=False
                    ):
                        ring.enter()
                    st.end_read(r)
                if check is not None and not st.cancelled and check():
                    st.cancel()
                    self._withdraw(ring, st.reads)
        except RingError:
            # the ring failed under us: wait for what is in flight, end those reads with the
            # error (objects read whole end as read), and read the rest with preadv
            begun = st.begun()  # before the wait, which forgets the requests it reaps
            self._give_up(ring, st.reads)
            st.waiting = []
            exc: OSError = OSError(errno.EIO, "io_uring failed under a stream read")
            if check is not None and check():  # the request ended meanwhile: withdrawn
                exc, st.cancelled, st.more = ReadCancelledError(), True, False
            for r in begun:
                if r.left != 0:
                    r.error = r.error or exc
                st.end_read(r)
            if st.more and not st.cancelled:
                self._stream_posix(begin, end)
        except BaseException:
            self._give_up(ring, st.reads)
            raise

    def _stream_fill(
        self,
        ring: Ring,
        st: _StreamState,
        bufs: _Streams,
        begin: Callable[[], StreamRead | None],
        check: Callable[[], bool] | None,
        block: bool,
    ) -> int:
        """Begin objects while a header buffer is free, then queue their requests within the
        ring and the depth (``block``: wait for a place in the depth; nothing is in flight);
        how many were queued (handed to the kernel by the next ``enter``)."""
        while st.more and st.free and not st.cancelled:
            r = begin()
            if r is None:
                break
            if r.error is not None:
                st.more = st.end(r) and st.more
                continue
            r.slot = st.free.pop()
            st.waiting.extend(self._stream_pieces(r, bufs))
        if not st.waiting or st.cancelled:
            return 0
        room = ring.entries - len(st.reads)
        k = self._depth.take(min(len(st.waiting), room), block=block, check=check)
        if k == 0 and block:  # cancelled while waiting for the depth
            st.cancel()
            return 0
        self._queue_stream(ring, st, k)
        return k

    def _stream_pieces(self, r: StreamRead, bufs: _Streams) -> list[tuple[StreamRead, Piece, int]]:
        """The requests of object ``r``: its header and first block in one vector request,
        then requests of at most ``block_bytes`` (as :meth:`read_fd`)."""
        assert r.payload is not None
        header = r.header = bufs.headers[r.slot]
        base = _address(r.payload)
        if _O_DIRECT and (bufs.addresses[r.slot] | base | len(r.payload)) % ALIGNMENT:
            _unaligned_buffered(r.fd, header, r.payload)
        want = min(len(r.payload), align_up(max(0, r.size - HEADER_SIZE)))
        first = min(want, self.block_bytes)
        payload_iov = bufs.payload_iovs[r.slot]  # the slot's header iovec is set once
        payload_iov.base, payload_iov.len = base, first
        head_piece: Piece = (0, bufs.iov_addresses[r.slot], HEADER_SIZE + first, 2 if first else 1)
        if first == want:  # the usual object: one request (no lists built for more)
            r.got = [0]
            r.lengths = [HEADER_SIZE + first]
            r.left = 1
            return [(r, head_piece, 0)]
        pieces: list[Piece] = [head_piece]
        for off in range(first, want, self.block_bytes):
            pieces.append((HEADER_SIZE + off, base + off, min(self.block_bytes, want - off), 0))
        r.got = [0] * len(pieces)
        r.lengths = [p[2] for p in pieces]
        r.left = len(pieces)
        return [(r, p, i) for i, p in enumerate(pieces)]

    def _queue_stream(self, ring: Ring, st: _StreamState, k: int) -> None:
        """Queue the first ``k`` waiting requests (their places in the depth taken)."""
        queued = 0
        try:
            for r, (off, addr, length, vectors), i in st.waiting[:k]:
                if vectors:
                    tag = ring.readv(r.fd, off, addr, vectors)
                else:
                    tag = ring.read(r.fd, off, addr, length)
                st.reads[tag] = (r, i)
                queued += 1
        finally:
            del st.waiting[:queued]
            if queued < k:
                self._depth.give(k - queued)  # places taken but never used

    def _reap_stream(self, ring: Ring, st: _StreamState) -> None:
        """Take the completions the ring holds; end each object whose requests are all in."""
        back = 0
        try:
            for tag, res in ring.reap():
                hit = st.reads.pop(tag, None)
                if hit is None:
                    continue
                back += 1
                r, i = hit
                r.left -= 1
                if res < 0:
                    if r.error is None:
                        r.error = OSError(-res, os.strerror(-res))
                    st.drop_waiting(r)
                else:
                    r.got[i] = res
                    if res < r.lengths[i]:
                        st.drop_waiting(r)  # end of file: nothing more to read
                if r.left == 0:
                    st.done.append(r)  # ended by the caller of this reap
        finally:
            if back:
                self._depth.give(back)

    def _stream_posix(
        self, begin: Callable[[], StreamRead | None], end: Callable[[StreamRead], bool]
    ) -> None:
        """:meth:`stream` one object at a time with ``preadv`` (no ring here)."""
        header = getattr(self._local, "posix_head", None)
        if header is None:
            header = self._local.posix_head = aligned_buffer(HEADER_SIZE)
        while True:
            r = begin()
            if r is None:
                return
            if r.error is None:
                assert r.payload is not None
                r.header = header
                try:
                    n = PosixReader.read_fd(self, r.fd, header, r.payload)
                    r.got, r.lengths = [n], [n]
                except OSError as exc:
                    r.error = exc
                with self._lock:
                    self.fallback_reads += 1
            if not end(r):
                return

    @staticmethod
    def _withdraw(ring: Ring, tags: dict[int, Any]) -> None:
        """Ask the kernel to cancel every request in flight (they are still reaped after)."""
        if tags:
            for tag in tags:
                ring.cancel(tag)
            ring.enter()

    def _give_up(self, ring: Ring, tags: dict[int, Any]) -> None:
        """A ring that failed under a read: withdraw the requests in flight (``tags``) and wait
        until the kernel completed every one of them, however long that takes (a request the
        kernel still owns may write into its buffer: the calling thread stays, and a caller
        that stops waiting for it parks the buffers, never reuses them). Their places in the
        depth then go back and the ring is closed (the thread makes a new one next time).

        The wait asks the ring to enter the kernel; where entering fails (the ring's failure
        itself), it polls the completion queue, which the kernel fills without a system call.
        """
        outstanding = len(tags)
        for tag in ring.unsubmit():  # queued, never handed over: never the kernel's
            tags.pop(tag, None)
        if tags:
            with self._lock:
                self.settling += 1
            try:
                with contextlib.suppress(Exception):  # a full or failing ring: wait regardless
                    for tag in tags:
                        ring.cancel(tag)
                pause = 0.001
                while tags:
                    try:
                        ring.enter(wait=len(tags), timeout_s=CANCEL_POLL_S)
                    except Exception:
                        time.sleep(pause)
                        pause = min(2 * pause, CANCEL_POLL_S)
                    for tag, _ in ring.reap():
                        tags.pop(tag, None)
            finally:
                with self._lock:
                    self.settling -= 1
        self._depth.give(outstanding)
        self._drop_ring()

    def _drop_ring(self) -> None:
        """Close this thread's ring (nothing is in flight on it) and its iovecs."""
        owned = getattr(self._local, "ring", None)
        self._local.ring = self._local.iov = None
        if owned is not None:
            owned.ring.close()
            owned.closed = True


class StreamRead:
    """One object read of a stream (:meth:`UringReader.stream`).

    The caller fills ``token`` (its own), ``fd``, ``payload`` (4 KiB aligned for ``O_DIRECT``)
    and ``size`` (the file's size, from its ``fstat``), or ``error`` when the object could not
    be opened; the reader sets ``header`` (a buffer of its own, valid until ``end`` returns),
    and ``got`` (bytes read contiguously from the start of the file) or ``error``.
    """

    __slots__ = (
        "error", "fd", "got", "header", "left", "lengths", "payload", "size", "slot", "token",
    )  # fmt: skip

    def __init__(
        self,
        token: Any,
        fd: int = -1,
        payload: memoryview | None = None,
        size: int = 0,
        error: BaseException | None = None,
    ) -> None:
        self.token = token
        self.fd = fd
        self.payload = payload
        self.size = size
        self.error = error
        self.header: memoryview | None = None
        self.got: list[int] = []
        self.lengths: list[int] = []
        self.left = 0  # requests not reaped yet (queued or waiting)
        self.slot = -1  # the reader's header buffer it holds

    @property
    def total(self) -> int:
        """Bytes read contiguously from the start of the file."""
        if len(self.got) == 1:  # the usual object: one request
            return self.got[0]
        total = 0
        for n, length in zip(self.got, self.lengths):
            total += n
            if n < length:
                break
        return total


class _Streams:
    """A thread's buffers for :meth:`UringReader.stream`: header buffers and iovec pairs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.buffer = aligned_buffer(n * HEADER_SIZE)
        self.headers = [self.buffer[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(n)]
        self.addresses = [_address(h) for h in self.headers]
        self.iovs = [(_Iovec * 2)() for _ in range(n)]
        for iov, head in zip(self.iovs, self.addresses):
            iov[0].base, iov[0].len = head, HEADER_SIZE  # each slot's header buffer, for good
        self.iov_addresses = [ctypes.addressof(iov) for iov in self.iovs]
        self.payload_iovs = [iov[1] for iov in self.iovs]  # views into the arrays


class _StreamState:
    """The bookkeeping of one :meth:`UringReader.stream`."""

    __slots__ = ("cancelled", "done", "end", "free", "more", "reads", "waiting")

    def __init__(self, free: list[int], end: Callable[[StreamRead], bool]) -> None:
        self.free = free  # header buffers (objects that may be in flight)
        self.end = end
        self.more = True  # begin() may be asked for more
        self.cancelled = False
        self.reads: dict[int, tuple[StreamRead, int]] = {}  # tag -> (object, request index)
        self.waiting: list[tuple[StreamRead, Piece, int]] = []  # requests not queued yet
        self.done: collections.deque[StreamRead] = collections.deque()  # read whole, not ended

    def begun(self) -> list[StreamRead]:
        """Every object begun and not ended yet."""
        seen: dict[int, StreamRead] = {}
        for r, _ in self.reads.values():
            seen[id(r)] = r
        for r, _, _ in self.waiting:
            seen[id(r)] = r
        for r in self.done:
            seen[id(r)] = r
        return list(seen.values())

    def drop_waiting(self, r: StreamRead) -> None:
        """No further request of ``r`` is queued (an error or the end of its file)."""
        kept = [w for w in self.waiting if w[0] is not r]
        r.left -= len(self.waiting) - len(kept)
        self.waiting = kept

    def cancel(self) -> None:
        """Withdrawn: nothing more begins or queues; objects not in flight end now."""
        self.cancelled = True
        self.more = False
        pending = {id(r): r for r, _, _ in self.waiting}
        self.waiting = []
        for r in pending.values():
            in_flight = sum(1 for x, _ in self.reads.values() if x is r)
            r.left = in_flight
            if r.left == 0:
                self.end_read(r)

    def end_read(self, r: StreamRead) -> None:
        """Hand ``r`` to the caller's ``end`` and take its header buffer back."""
        if self.cancelled and (r.error is not None or r.total < sum(r.lengths)):
            r.error = ReadCancelledError()
        self.free.append(r.slot)
        r.left = -1  # ended
        if not self.end(r):
            self.more = False


class _OwnedRing:
    """A thread's ring, closed when the thread's locals go (the thread ended)."""

    __slots__ = ("closed", "ring")

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.closed = False

    def __del__(self) -> None:
        if not self.closed:
            self.ring.close()


# ---------------------------------------------------------------------- depth calibration
#: depths a calibration compares, and the bytes it reads at each
CALIBRATION_DEPTHS = (4, 16, 64)
CALIBRATION_BYTES = 32 << 20
#: the smallest depth within this fraction of the best calibrated bandwidth wins
CALIBRATION_FRACTION = 0.9


def calibrate_depth(
    reader: UringReader,
    open_object: Callable[[str], tuple[int, os.stat_result]],
    objects: Iterable[tuple[str, int]],
    *,
    depths: tuple[int, ...] = CALIBRATION_DEPTHS,
    budget: int = CALIBRATION_BYTES,
) -> dict[str, Any]:
    """Measure ``reader`` over ``objects`` (``(name, size)``, taken in order until there are
    ``len(depths) x budget`` bytes) at each of ``depths`` and keep the smallest depth within
    :data:`CALIBRATION_FRACTION` of the best bandwidth; return the measurements.

    Each depth reads its own run of objects (they wrap around when there are too few), so no
    depth reads what the one before it just read. Meant for ``O_DIRECT`` reads: through the
    page cache it would measure memory.
    """
    import time

    chosen: list[tuple[str, int]] = []
    total = 0
    for name, size in objects:
        chosen.append((name, size))
        total += size
        if total >= len(depths) * budget:
            break
    if not chosen:
        return {"depth": reader.depth, "source": "default", "bandwidth_Bps": {}}
    header = aligned_buffer(HEADER_SIZE)
    payload = aligned_buffer(max(ALIGNMENT, align_up(max(size for _, size in chosen))))
    room = len(payload) - len(payload) % ALIGNMENT
    results: dict[int, float] = {}
    pos = 0
    for depth in depths:
        reader.set_depth(depth)
        done = 0
        t0 = time.perf_counter()
        while done < budget and done < total:
            name, _ = chosen[pos % len(chosen)]
            pos += 1
            fd, st = open_object(name)
            try:
                done += reader.read_fd(fd, header, payload[:room], size=st.st_size)
            finally:
                os.close(fd)
        results[depth] = done / max(time.perf_counter() - t0, 1e-9)
    best = max(results.values())
    depth = min(d for d, bw in results.items() if bw >= CALIBRATION_FRACTION * best)
    reader.set_depth(depth)
    return {"depth": depth, "source": "calibrated", "bandwidth_Bps": results}
