"""Object readers for file-backed tiers: POSIX positional reads (default) and kvikio.

Where it runs: worker threads, called by :class:`~bsr.FileTier`. A reader fills a 4 KiB header
buffer and the caller's payload buffer from one file, in one positional vector read where it can
(``preadv``), and reports how many bytes arrived; verification is the tier's job.

With ``direct=True`` files are opened ``O_DIRECT`` (page cache bypassed); buffers must then be
4 KiB aligned, which staging slots are. A filesystem that refuses O_DIRECT (tmpfs) falls back
to buffered reads and the reader records that in :attr:`PosixReader.direct_active`.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Protocol

import numpy as np

from ..core._layout import ALIGNMENT
from ..core._object import HEADER_SIZE

_HAS_ODIRECT = hasattr(os, "O_DIRECT")


class ObjectReader(Protocol):
    name: str

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        """Fill ``header`` (HEADER_SIZE bytes) then ``payload`` from ``path``; return bytes read."""
        ...


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

    def _open(self, path: str) -> tuple[int, bool]:
        if self.direct_active:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != 22:  # EINVAL: filesystem does not support O_DIRECT
                    raise
                with self._lock:
                    self.direct_active = False
        return os.open(path, os.O_RDONLY), False

    def read(self, path: str, header: memoryview, payload: memoryview) -> int:
        fd, direct = self._open(path)
        try:
            if direct and not (is_aligned(header) and is_aligned(payload)):
                os.close(fd)
                fd, direct = os.open(path, os.O_RDONLY), False
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
        finally:
            os.close(fd)


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
        with self._kvikio.CuFile(path, "r") as f:
            n_header = f.pread(np.frombuffer(header, dtype=np.uint8), len(header), 0).get()
            if n_header < len(header):
                return int(n_header)
            n_payload = f.pread(
                np.frombuffer(payload, dtype=np.uint8), len(payload), HEADER_SIZE
            ).get()
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
