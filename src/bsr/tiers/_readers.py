"""Object readers for file-backed tiers: POSIX positional reads (default) and kvikio.

Where it runs: worker threads, called by :class:`~bsr.FileTier`. A reader fills a 4 KiB header
buffer and the caller's payload buffer from one file, in one positional vector read where it can
(``preadv``), and reports how many bytes arrived; verification is the tier's job.

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

import errno
import fcntl
import mmap
import os
import stat
import threading
from typing import Any, Protocol

import numpy as np

from ..core._layout import ALIGNMENT
from ..core._object import HEADER_SIZE

_HAS_ODIRECT = hasattr(os, "O_DIRECT")
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
#: flags every object file is opened with
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ObjectReader(Protocol):
    name: str

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        """Fill ``header`` (HEADER_SIZE bytes) then ``payload`` from ``path``; return bytes read."""
        ...


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
    where = name if dir_fd is None else f"<dir>/{name}"
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(where, file_kind(st.st_mode))
    try:
        fd = os.open(name, OPEN_FLAGS | (_O_DIRECT if direct else 0), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(where, "symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(where, file_kind(st.st_mode))
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
        if _O_DIRECT:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & _O_DIRECT and not (is_aligned(header) and is_aligned(payload)):
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)  # unaligned: read buffered
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


def default_reader(kind: str = "auto", *, direct: bool = False) -> ObjectReader:
    """Choose a reader: ``"auto"`` (kvikio with a CUDA driver, else POSIX), "posix", "kvikio"."""
    if kind == "posix" or (kind == "auto" and not kvikio_usable()):
        return PosixReader(direct=direct)
    if kind in ("kvikio", "auto"):
        return KvikioReader()
    from .._errors import ConfigError

    raise ConfigError(f"unknown reader {kind!r}; use 'auto', 'posix' or 'kvikio'")
