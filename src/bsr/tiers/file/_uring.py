"""A minimal io_uring for object reads, through the raw system calls (ctypes, no extension).

Where it runs: the worker threads of :class:`~bsr.FileTier` (one ring per thread, made on its
first read, closed when the thread ends).

How it works: :class:`Ring` sets a ring up with ``io_uring_setup`` (425), maps its submission
and completion queues and its submission entries, and then does only two things: queue
``IORING_OP_READ`` requests into caller buffers (a staging slot's region: the bytes land where
they are needed, no bounce buffer) and reap their completions with ``io_uring_enter`` (426),
which releases the GIL while it waits. ``IORING_OP_ASYNC_CANCEL`` withdraws requests a stuck
read left in the ring. No submission-queue polling thread, no registered files: the submitting
thread enters the kernel itself, so the kernel reads the queue tail on the CPU that wrote it.

The queues are shared memory with the kernel. Python cannot issue memory fences, so the ring is
used only where the hardware keeps stores in order and loads in order (x86-64, TSO): an entry is
written before the tail that publishes it, and a completion's tail is read before the entry it
covers. Elsewhere :func:`uring_status` says no and FileTier reads with ``preadv`` threads.

:func:`uring_status` is the probe: Linux on x86-64, ``kernel.io_uring_disabled`` not 2, and a
ring that answers a no-op round trip (a seccomp filter or a container runtime that refuses
``io_uring_setup`` with ``EPERM``/``ENOSYS`` says no here, not during a restore).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
from dataclasses import dataclass

_NR_SETUP, _NR_ENTER = 425, 426  # the same on every architecture (asm-generic numbering)
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP = 1 << 0
_FEAT_EXT_ARG = 1 << 8
_ENTER_GETEVENTS = 1 << 0
_ENTER_EXT_ARG = 1 << 3
OP_NOP, OP_READV, OP_READ, OP_ASYNC_CANCEL = 0, 1, 22, 14
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # io_uring_cqe, 16 bytes
_CANCEL_TAG = 1 << 63  # user_data of our own cancel requests
_NO_ARG = ctypes.c_size_t(0)  # io_uring_enter's argument size when there is no argument


class _SqOffsets(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags")),
        *((n, ctypes.c_uint32) for n in ("dropped", "array", "resv1")),
        ("user_addr", ctypes.c_uint64),
    ]


class _CqOffsets(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries")),
        *((n, ctypes.c_uint32) for n in ("overflow", "cqes", "flags", "resv1")),
        ("user_addr", ctypes.c_uint64),
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu")),
        *((n, ctypes.c_uint32) for n in ("sq_thread_idle", "features", "wq_fd")),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOffsets),
        ("cq_off", _CqOffsets),
    ]


class _GeteventsArg(ctypes.Structure):
    _fields_ = [
        ("sigmask", ctypes.c_uint64),
        ("sigmask_sz", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("ts", ctypes.c_uint64),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


_libc: ctypes.CDLL | None = None


def _syscall() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released in the call
    fn = _libc.syscall
    fn.restype = ctypes.c_long
    return fn


class RingError(OSError):
    """The ring could not be set up or entered (``errno`` says why)."""


class Ring:
    """One io_uring instance: submit reads into caller buffers, reap completions.

    Not thread-safe: one thread uses a ring (FileTier keeps one per worker thread).

    Args:
        entries: submission queue size (a power of two; the kernel rounds up); at most this many
            requests may be in flight at once.
    """

    def __init__(self, entries: int) -> None:
        self._sys = _syscall()
        params = _Params()
        fd = self._sys(_NR_SETUP, ctypes.c_uint(entries), ctypes.byref(params))
        if fd < 0:
            err = ctypes.get_errno()
            raise RingError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = int(fd)
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        self.entries = params.sq_entries
        self.ext_arg = bool(params.features & _FEAT_EXT_ARG)
        self._next_tag = 1
        self.inflight = 0
        self._timeouts: dict[float, tuple[object, object, object, object]] = {}

    def _mmap(self, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(
            self.fd,
            size,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )
        self._maps.append(m)
        return m

    def _map(self, p: _Params) -> None:
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * _CQE.size
        if p.features & _FEAT_SINGLE_MMAP:
            sq = cq = self._mmap(max(sq_size, cq_size), _OFF_SQ_RING)
        else:
            sq = self._mmap(sq_size, _OFF_SQ_RING)
            cq = self._mmap(cq_size, _OFF_CQ_RING)
        self._sqes = self._mmap(p.sq_entries * _SQE.size, _OFF_SQES)
        self._sq_u32 = memoryview(sq).cast("I")  # aligned 32-bit loads and stores
        self._cq_u32 = memoryview(cq).cast("I")
        self._cq = cq
        self._sq_head = p.sq_off.head // 4
        self._sq_tail = p.sq_off.tail // 4
        self._sq_entries = p.sq_entries
        self._sq_mask = self._sq_u32[p.sq_off.ring_mask // 4]
        self._sq_array = p.sq_off.array // 4
        self._cq_head = p.cq_off.head // 4
        self._cq_tail = p.cq_off.tail // 4
        self._cq_mask = self._cq_u32[p.cq_off.ring_mask // 4]
        self._cqes = p.cq_off.cqes
        self._pending = 0  # entries queued, not yet handed to the kernel

    def close(self) -> None:
        """Unmap and close (the kernel cancels whatever is still in flight)."""
        for name in ("_sq_u32", "_cq_u32"):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
        for m in self._maps:
            m.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ submit
    def _queue(self, op: int, fd: int, off: int, addr: int, length: int, user_data: int) -> None:
        tail = self._sq_u32[self._sq_tail]
        if (tail - self._sq_u32[self._sq_head]) & 0xFFFFFFFF >= self._sq_entries:
            # full of entries the kernel has not consumed yet (an enter that returned EBUSY):
            # hand them over first; writing on would overwrite one and lose its completion
            self.enter()
            tail = self._sq_u32[self._sq_tail]
            if (tail - self._sq_u32[self._sq_head]) & 0xFFFFFFFF >= self._sq_entries:
                raise RingError(errno.EBUSY, "io_uring submission queue full")
        idx = tail & self._sq_mask
        _SQE.pack_into(self._sqes, idx * 64, op, 0, 0, fd, off, addr, length, 0, user_data,
                       0, 0, 0, 0, 0)  # fmt: skip
        self._sq_u32[self._sq_array + idx] = idx
        self._sq_u32[self._sq_tail] = (tail + 1) & 0xFFFFFFFF  # published after the entry
        self._pending += 1

    def read(self, fd: int, offset: int, addr: int, length: int) -> int:
        """Queue a read of ``length`` bytes at ``offset`` into memory at ``addr``; its tag.

        The caller keeps the memory alive and unused until the tag's completion is reaped.
        """
        tag = self._next_tag
        self._next_tag = tag + 1 if tag < _CANCEL_TAG - 1 else 1
        self._queue(OP_READ, fd, offset, addr, length, tag)
        self.inflight += 1
        return tag

    def readv(self, fd: int, offset: int, iov_addr: int, count: int) -> int:
        """Queue a vector read at ``offset`` into the ``count`` iovecs at ``iov_addr``; its
        tag. The iovecs (and their buffers) must stay unused until the completion is reaped."""
        tag = self._next_tag
        self._next_tag = tag + 1 if tag < _CANCEL_TAG - 1 else 1
        self._queue(OP_READV, fd, offset, iov_addr, count, tag)
        self.inflight += 1
        return tag

    def nop(self) -> int:
        tag = self._next_tag
        self._next_tag += 1
        self._queue(OP_NOP, -1, 0, 0, 0, tag)
        self.inflight += 1
        return tag

    def cancel(self, tag: int) -> None:
        """Ask the kernel to cancel the request ``tag`` (it then completes with ECANCELED, or
        normally if it was already under way); the cancel's own completion is dropped."""
        self._queue(OP_ASYNC_CANCEL, -1, 0, tag, 0, _CANCEL_TAG | tag)

    def unsubmit(self) -> set[int]:
        """Take back the entries queued but not handed to the kernel yet (an enter failed
        before it consumed them): they will never run, so their buffers were never the
        kernel's. Their tags (cancels' included)."""
        head = self._sq_u32[self._sq_head]
        tail = self._sq_u32[self._sq_tail]
        tags: set[int] = set()
        while tail != head:
            tail = (tail - 1) & 0xFFFFFFFF
            user_data = _SQE.unpack_from(self._sqes, (tail & self._sq_mask) * 64)[8]
            tags.add(user_data)
            if not user_data & _CANCEL_TAG:
                self.inflight -= 1
        self._sq_u32[self._sq_tail] = head
        self._pending = 0
        return tags

    # ------------------------------------------------------------------ enter and reap
    def enter(self, wait: int = 0, timeout_s: float | None = None) -> None:
        """Hand queued entries to the kernel and wait until ``wait`` completions are there (or
        ``timeout_s`` passed, where the kernel supports a timed wait)."""
        flags = _ENTER_GETEVENTS if wait else 0
        arg: object = None
        argsz: object = _NO_ARG
        if wait and timeout_s is not None and self.ext_arg:
            arg, argsz = self._timeout_arg(timeout_s)
            flags |= _ENTER_EXT_ARG
        while True:
            n = self._sys(_NR_ENTER, self.fd, self._pending, wait, flags, arg, argsz)
            if n >= 0:
                self._pending -= min(self._pending, int(n))
                return
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIME:
                return
            if err in (errno.EAGAIN, errno.EBUSY):  # completions must be reaped first
                return
            raise RingError(err, f"io_uring_enter: {os.strerror(err)}")

    def _timeout_arg(self, timeout_s: float) -> tuple[object, object]:
        """The timed wait's argument and its size (built once per timeout: a read waits with
        the same one every time; the kernel only reads it during the call)."""
        cached = self._timeouts.get(timeout_s)
        if cached is None:
            ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
            ga = _GeteventsArg(0, 0, 0, ctypes.addressof(ts))
            size = ctypes.c_size_t(ctypes.sizeof(ga))
            cached = self._timeouts[timeout_s] = (ctypes.byref(ga), size, ts, ga)
        return cached[0], cached[1]

    def reap(self) -> list[tuple[int, int]]:
        """Completions ready now, ``(tag, result)``: bytes read, or ``-errno``."""
        out: list[tuple[int, int]] = []
        head = self._cq_u32[self._cq_head]
        tail = self._cq_u32[self._cq_tail]  # read before the entries it covers
        while head != tail:
            tag, res, _ = _CQE.unpack_from(self._cq, self._cqes + (head & self._cq_mask) * 16)
            head = (head + 1) & 0xFFFFFFFF
            if not tag & _CANCEL_TAG:
                out.append((tag, res))
                self.inflight -= 1
        self._cq_u32[self._cq_head] = head
        return out


# ---------------------------------------------------------------------- probe
@dataclass(frozen=True)
class UringStatus:
    """Whether io_uring reads can be used in this process, and if not, why."""

    usable: bool
    reason: str


_status: UringStatus | None = None
_status_lock = threading.Lock()


def _probe() -> UringStatus:
    if not sys.platform.startswith("linux"):
        return UringStatus(False, f"io_uring is Linux only (this is {sys.platform})")
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return UringStatus(
            False, f"bsr's ring needs x86-64 memory ordering (this is {machine}); preadv threads"
        )
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            if f.read().strip() == "2":
                return UringStatus(False, "kernel.io_uring_disabled is 2")
    except OSError:
        pass  # older kernels have no such switch
    try:
        ring = Ring(2)
    except (OSError, AttributeError) as exc:
        return UringStatus(False, f"io_uring_setup refused: {exc}")
    try:
        tag = ring.nop()
        ring.enter(wait=1, timeout_s=5.0)
        done = ring.reap()
        if done != [(tag, 0)]:
            return UringStatus(False, f"io_uring no-op round trip answered {done!r}")
    except OSError as exc:
        return UringStatus(False, f"io_uring_enter refused: {exc}")
    finally:
        ring.close()
    return UringStatus(True, "io_uring available")


def uring_status() -> UringStatus:
    """Probe io_uring once per process (setup plus a no-op round trip); cached."""
    global _status
    with _status_lock:
        if _status is None:
            _status = _probe()
        return _status


def _reset_status_for_tests(status: UringStatus | None = None) -> None:
    global _status
    with _status_lock:
        _status = status
