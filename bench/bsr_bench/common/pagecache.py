"""Page-cache state of the files a measurement reads, kept the same for raw reads and restores.

After a save the object files sit in the page cache, so a buffered read measures memory, not
storage. Every measurement in a run therefore uses one :class:`CacheMode`:

- ``direct``: raw reads and restores both open the files ``O_DIRECT`` (page cache bypassed).
- ``cold``: buffered reads; before each measurement every file is dropped from the page cache
  with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (files are fsync'ed, so their pages are clean).
- ``warm``: buffered reads; before each measurement every file is read once, so both raw reads
  and restores are served from the page cache.

``auto`` picks ``direct`` where the filesystem accepts ``O_DIRECT``, else ``cold`` (``warm`` on
tmpfs/ramfs, whose pages cannot be dropped). The residency actually observed before each
measurement (``mincore``) is recorded next to the figures, so a drop that did not happen shows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import mmap
import os
import tempfile
from collections.abc import Sequence

from .stats import BenchError

_MEMORY_FS = {"tmpfs", "ramfs", "hugetlbfs"}


class CacheMode(str, enum.Enum):
    DIRECT = "direct"
    COLD = "cold"
    WARM = "warm"


def direct_io_supported(directory: str) -> bool:
    """Whether files in ``directory`` can be opened and read with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, path = tempfile.mkstemp(dir=directory, prefix=".odirect-probe-")
    try:
        os.write(fd, b"\0" * 4096)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        try:
            buf = mmap.mmap(-1, 4096)
            return os.preadv(dfd, [buf], 0) == 4096
        except OSError:
            return False
        finally:
            os.close(dfd)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def resolve_mode(requested: str, directory: str, filesystem: str) -> tuple[CacheMode, str]:
    """The cache mode to use and a one-line note on why (for the report)."""
    direct_ok = direct_io_supported(directory)
    in_memory = filesystem in _MEMORY_FS
    if requested == "auto":
        if direct_ok:
            return (
                CacheMode.DIRECT,
                "O_DIRECT accepted: raw reads and restores bypass the page cache",
            )
        if in_memory:
            return CacheMode.WARM, (
                f"{filesystem} holds files in memory (no O_DIRECT, pages cannot be dropped): "
                "raw reads and restores are both memory reads"
            )
        return CacheMode.COLD, (
            "O_DIRECT refused: buffered reads, page cache dropped with POSIX_FADV_DONTNEED "
            "before each measurement"
        )
    mode = CacheMode(requested)
    if mode is CacheMode.DIRECT and not direct_ok:
        raise BenchError(
            f"the filesystem at {directory} ({filesystem}) refuses O_DIRECT; use --cache cold "
            "or --cache warm (or --cache auto)"
        )
    notes = {
        CacheMode.DIRECT: "O_DIRECT: raw reads and restores bypass the page cache",
        CacheMode.COLD: "buffered reads, page cache dropped with POSIX_FADV_DONTNEED before "
        "each measurement" + (f" (ineffective on {filesystem})" if in_memory else ""),
        CacheMode.WARM: "buffered reads, files read once before each measurement (page cache hot)",
    }
    return mode, notes[mode]


def drop(paths: Sequence[str]) -> None:
    """Ask the kernel to drop the (clean) cached pages of ``paths``."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prime(paths: Sequence[str], block: int = 8 << 20) -> None:
    """Read every file once (buffered) so that its pages are cached."""
    buf = bytearray(block)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


class _Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.lib = lib


_LIBC: _Libc | None = None


def resident_fraction(paths: Sequence[str]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``); None where unavailable."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = _Libc()
        lib = _LIBC.lib
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = -(-size // page)
                vec = (ctypes.c_ubyte * pages)()
                if lib.mincore(addr, size, vec) != 0:
                    return None
                total += pages
                resident += sum(v & 1 for v in vec)
            finally:
                lib.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def prepare(mode: CacheMode, paths: Sequence[str]) -> float | None:
    """Put ``paths`` in the cache state of ``mode``; return the resident fraction after."""
    if mode in (CacheMode.COLD, CacheMode.DIRECT):
        drop(paths)  # with O_DIRECT this only guards against a silent buffered fallback
    elif mode is CacheMode.WARM:
        prime(paths)
    return resident_fraction(paths)
