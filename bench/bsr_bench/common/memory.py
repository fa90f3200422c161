"""Peak resident memory (RSS) of this process during one measurement.

Linux keeps the peak RSS in ``VmHWM`` and lets a process reset it by writing ``5`` to
``/proc/self/clear_refs``; that is exact and costs nothing while the measurement runs. Where
that is not allowed, a sampler thread polls RSS (psutil) every millisecond or two, which can
miss short spikes; :attr:`PeakRss.method` says which was used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from pathlib import Path
from types import TracebackType

import psutil

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def current_rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _load_trim() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _load_trim()


def release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc ``malloc_trim``).

    Freed buffers below glibc's mmap threshold stay resident in the heap; without this a
    whole-plan buffer freed by one measurement would show up as RSS growth in the next one.
    """
    gc.collect()
    if callable(_TRIM):
        _TRIM(0)


def _hwm() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        _CLEAR.write_text("5")
    except OSError:
        return False
    return _hwm() is not None


class PeakRss:
    """Context manager: ``peak`` is the highest RSS seen inside the block.

    Usage::

        with PeakRss() as m:
            work()
        growth = m.peak - baseline
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, int(proc.memory_info().rss))

    def __enter__(self) -> PeakRss:
        self.peak = current_rss()
        if _reset_hwm():
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self._thread = threading.Thread(target=self._sample, name="bsr-bench-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        hwm = _hwm() if self.method == "VmHWM" else None
        self.peak = max(self.peak, hwm or 0, current_rss())
