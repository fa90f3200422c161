"""Raw read bandwidth of the very files a restore reads, measured in the same run.

Each object file of the state is read end to end, into page-aligned, pre-faulted buffers, with
one positional read per file (``preadv``; continued on a short read), ``O_DIRECT`` when the
run's cache mode is ``direct``. ``threads=1`` is the sequential figure; ``threads=io_depth``
gives the device the same number of reads in flight as the restore. No verification and no
copy: this is the ceiling a restore from these files could approach.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .stats import BenchError


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, bool]:
    """``nbytes`` (at least 1) of anonymous memory like bsr's own host buffers (its arena, a
    CPU cache, the staging slots), with the transparent huge-page advice where the platform
    has it; whether the kernel took it. The bench's own: it reads bsr only through its public
    API."""
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return buf, False
    try:
        buf.madvise(advice)
    except OSError:
        return buf, False
    return buf, True


def huge_page_share(address: int, smaps: str = "/proc/self/smaps") -> float | None:
    """The share of the mapping holding ``address`` that transparent huge pages back now
    (``AnonHugePages`` / ``Size`` of its entry in ``smaps``): whether the huge-page advice was
    not only taken but met, which the kernel decides page by page as memory is touched (a
    fragmented machine gives 4 KiB pages). None where there is no such file or no mapping
    holds the address."""
    try:
        text = Path(smaps).read_text()
    except OSError:
        return None
    size = huge = -1
    inside = False
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            if inside:
                break
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and head in ("Size:", "AnonHugePages:"):
            kib = int(rest.split()[0])
            if head == "Size:":
                size = kib
            else:
                huge = kib
    if not inside or size <= 0 or huge < 0:
        return None
    return min(1.0, huge / size)


def _buffer(nbytes: int) -> mmap.mmap:
    """A read buffer in memory like bsr's staging slots (:func:`huge_page_mapping`: an O_DIRECT
    read pins a 2 MiB page at a time), faulted in now, not while timed."""
    buf, _ = huge_page_mapping(max(4096, -(-nbytes // 4096) * 4096))
    np.frombuffer(buf, dtype=np.uint8)[:] = 0
    return buf


def _read_file(path: str, buf: memoryview, direct: bool) -> int:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        if size > len(buf):
            raise BenchError(f"{path} is larger ({size} B) than the raw read buffer")
        done = 0
        while done < size:
            n = os.preadv(fd, [buf[done:size]], done)
            if n == 0:
                raise BenchError(f"{path}: unexpected end of file at {done} of {size} bytes")
            done += n
        return done
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RawRead:
    seconds: float
    nbytes: int
    files: int
    threads: int
    direct: bool


class RawReader:
    """Reads a set of files with ``threads`` workers, each with its own buffer."""

    def __init__(self, max_file_bytes: int, threads: int, *, direct: bool) -> None:
        if threads < 1:
            raise BenchError(f"raw read threads must be >= 1, got {threads}")
        self.threads = threads
        self.direct = direct
        self._maps = [_buffer(max_file_bytes) for _ in range(threads)]
        self._views = [memoryview(m) for m in self._maps]
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="bsr-raw") if threads > 1 else None
        )

    def read(self, paths: Sequence[str]) -> RawRead:
        if self._pool is None:
            t0 = time.perf_counter()
            total = sum(_read_file(p, self._views[0], self.direct) for p in paths)
            dt = time.perf_counter() - t0
            return RawRead(dt, total, len(paths), 1, self.direct)
        it: Iterator[str] = iter(paths)
        lock = threading.Lock()

        def worker(i: int) -> int:
            n = 0
            while True:
                with lock:
                    p = next(it, None)
                if p is None:
                    return n
                n += _read_file(p, self._views[i], self.direct)

        t0 = time.perf_counter()
        futures = [self._pool.submit(worker, i) for i in range(self.threads)]
        total = sum(f.result() for f in futures)
        dt = time.perf_counter() - t0
        return RawRead(dt, total, len(paths), self.threads, self.direct)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for v in self._views:
            v.release()
        for m in self._maps:
            m.close()
