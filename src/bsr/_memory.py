"""Host memory bsr allocates itself: anonymous pages given the huge-page advice.

Where it runs: wherever a HostTier's arena, a CPU ``PagedKVCache`` or the staging window
without CUDA is made.

How it works: a large host buffer (the HostTier's arena, a ``PagedKVCache``'s tensors on the
CPU, the staging slots and the whole-plan baseline's buffer where they are not pinned) is an
anonymous mapping, committed by the OS only as it is written, for which the kernel is asked to
use transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; taken unless THP is ``never``).
A restore's hash and copy then walk the page tables once per 2 MiB, not per 4 KiB, and an
``O_DIRECT`` read pins a 2 MiB page where it pinned 512 small ones. Measured on a 2-vCPU EPYC,
three or two runs of each, alternated: a 512 KiB-chunk host restore into a cache on huge pages
took 69-73 us of CPU per chunk against 83-89 us; a FileTier restore (``O_DIRECT``) through
slots on huge pages 0.180-0.211 CPU-s/GiB at 512 KiB chunks and 0.131-0.165 at 32 MiB,
against 0.316-0.331 and 0.254-0.261 (0.270-0.302 and 0.238-0.242 on private 4 KiB pages: the
pages' size, not the mapping's kind). Where the platform has no such advice the buffer is
ordinary anonymous memory.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np

#: Linux's MAP_NORESERVE (Python's mmap module does not name it): a mapping larger than the
#: memory the kernel would promise up front is still made; pages are committed as written
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
#: a buffer smaller than this is left to the ordinary allocator (a huge page is 2 MiB)
HUGE_PAGE_MIN_BYTES = 4 << 20


def advise_huge_pages(buf: mmap.mmap) -> bool:
    """Ask the kernel to back ``buf`` with transparent huge pages; whether it took the advice
    (False where the platform has no ``MADV_HUGEPAGE`` or the kernel refused it)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        buf.madvise(advice)
    except OSError:
        return False
    return True


def anonymous_buffer(
    nbytes: int, *, huge_pages: bool = True, noreserve: bool = False
) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], bool]:
    """``nbytes`` of zeroed anonymous memory as a uint8 array (which keeps the mapping alive),
    and whether the huge-page advice was taken (``huge_pages``: ask for it). ``noreserve``:
    map more than the kernel would promise up front (pages committed as written)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_NORESERVE if noreserve else 0)
    buf = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    huge = huge_pages and advise_huge_pages(buf)
    return np.frombuffer(buf, dtype=np.uint8)[:nbytes], huge
