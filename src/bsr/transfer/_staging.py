"""StagingPool: the W chunk-sized slots that are the only host staging memory of a restore.

How it works: one buffer of ``W x slot_bytes`` is allocated once (pinned with CUDA, page-aligned
anonymous memory otherwise) and cut into W slots. ``acquire()`` hands out a free slot or queues
the caller FIFO; ``release()`` gives a slot straight to the oldest waiter. The pool is shared by
every concurrent restore (and save) of one engine: it is a global budget, not a lock, so staging
in use can never exceed ``W x slot_bytes`` (invariant 3). Each request draws through a
:class:`StagingAccount` that records the request's own peak (its RWS).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import torch

from .._check import positive_int
from .._errors import StagingError
from .._memory import anonymous_buffer


@dataclass(frozen=True)
class StagingStatistics:
    """Snapshot of a staging pool (or of one request's account).

    Attributes:
        slots: W, the number of slots.
        slot_bytes: bytes per slot.
        in_use: slots held now (parked ones included).
        peak_in_use: the most slots held at once since creation or :meth:`StagingPool.reset_peak`.
        waits: acquires that had to queue.
        acquired: slots handed out in total.
        released: slots given back in total.
        waiting: callers queued now.
        pinned: the buffer is pinned (page-locked) host memory.
        parked: slots held back because a worker thread that may still write into them was
            abandoned by its request; each returns to the pool when its thread ends.
    """

    slots: int
    slot_bytes: int
    in_use: int
    peak_in_use: int
    waits: int
    acquired: int
    released: int
    waiting: int
    pinned: bool
    parked: int = 0

    @property
    def in_use_bytes(self) -> int:
        return self.in_use * self.slot_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_in_use * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes


class Slot:
    """One staging slot: a flat uint8 tensor of ``slot_bytes`` (pinned with CUDA)."""

    __slots__ = ("_owner", "index", "tensor")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor
        self._owner: StagingAccount | None = None

    def __repr__(self) -> str:
        return f"Slot({self.index})"


class _Waiter:
    __slots__ = ("event", "slot")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.slot: Slot | None = None


def _allocate(nbytes: int, pin: bool, prefault: bool) -> tuple[torch.Tensor, bool]:
    if pin and torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
    # anonymous pages with the huge-page advice: O_DIRECT reads pin them, and a chunk's check
    # and install read them, a 2 MiB page at a time (bsr._memory); the tensor keeps the
    # mapping alive through its array
    tensor = torch.from_numpy(anonymous_buffer(nbytes)[0])
    if prefault:
        tensor.fill_(0)  # fault every page in now, not during the first restore
    return tensor, False


class StagingPool:
    """W chunk-sized staging slots shared by every restore of an engine.

    Args:
        slots: W, the number of slots (>= 1).
        slot_bytes: bytes per slot (``layout.slot_bytes``).
        pin: use pinned host memory when CUDA is available (ignored otherwise).
        prefault: touch every page at allocation, so the first restore pays no page faults
            (pinned memory is always resident).
    """

    def __init__(
        self, slots: int, slot_bytes: int, *, pin: bool = True, prefault: bool = True
    ) -> None:
        positive_int(slots, "window W")
        positive_int(slot_bytes, "slot_bytes")
        self.slot_bytes = slot_bytes
        self._buffer, self.pinned = _allocate(slots * slot_bytes, pin, prefault)
        self._slots = [
            Slot(i, self._buffer[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(slots)
        ]
        for s in self._slots:
            s._owner = _RELEASED
        self._free: deque[Slot] = deque(self._slots)
        self._waiters: deque[_Waiter] = deque()
        self._in_use = 0
        self._peak = 0
        self._waits = 0
        self._acquired = 0
        self._released = 0
        self._parked: list[tuple[Slot, threading.Event]] = []

    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def contended(self) -> bool:
        """Whether a caller waits for a slot now (read from any thread: a hint, not a lock)."""
        return bool(self._waiters)

    @property
    def waiters(self) -> deque[Any]:
        """The callers waiting for a slot (a hint read from any thread: true while any waits;
        a hot loop keeps it and tests its truth, with no call)."""
        return self._waiters

    @property
    def buffer(self) -> torch.Tensor:
        """The whole staging buffer (for registering with a store or a DMA engine)."""
        return self._buffer

    def account(self) -> StagingAccount:
        """A per-request view that tracks the request's own use and peak."""
        return StagingAccount(self)

    # ------------------------------------------------------------------ acquire/release
    def _take(self, slot: Slot, owner: StagingAccount | None) -> Slot:
        slot._owner = owner
        self._in_use += 1
        self._acquired += 1
        self._peak = max(self._peak, self._in_use)
        if owner is not None:
            owner._on_take()
        return slot

    def park(self, slot: Slot, done: threading.Event) -> None:
        """Hold ``slot`` back until ``done`` is set (a worker thread may still write into it).

        The slot counts as in use until then; it is released by the first pool call after.
        """
        if slot not in self._slots or slot._owner is _RELEASED:
            raise StagingError(f"{slot!r} is not held from this pool (cannot park it)")
        self._parked.append((slot, done))

    def _reap(self) -> None:
        """Release parked slots whose worker thread has ended."""
        if not self._parked:
            return
        still = []
        for slot, done in self._parked:
            if done.is_set():
                self.release(slot)
            else:
                still.append((slot, done))
        self._parked = still

    def acquire_nowait(self, owner: StagingAccount | None = None) -> Slot:
        """Take a free slot or raise :class:`anyio.WouldBlock` (queued waiters go first)."""
        self._reap()
        if self._free and not self._waiters:
            return self._take(self._free.popleft(), owner)
        raise anyio.WouldBlock

    async def acquire(self, owner: StagingAccount | None = None) -> Slot:
        """Take a slot, waiting FIFO behind earlier callers when none is free."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        try:
            slot = self.acquire_nowait(owner)
        except anyio.WouldBlock:
            pass
        else:
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return slot
        waiter = _Waiter()
        self._waiters.append(waiter)
        self._waits += 1
        try:
            while self._parked and not waiter.event.is_set():
                # a parked slot comes back when its thread ends; nobody is told, so look
                with anyio.move_on_after(0.05):
                    await waiter.event.wait()
                self._reap()
            await waiter.event.wait()
        except BaseException:
            if waiter.slot is not None:  # handed a slot as we were cancelled: give it back
                self._give(waiter.slot)
            else:
                self._waiters.remove(waiter)
            raise
        assert waiter.slot is not None
        return self._take(waiter.slot, owner)

    def release(self, slot: Slot) -> None:
        """Give a slot back; exactly once per acquire."""
        if slot not in self._slots or slot._owner is _RELEASED:
            raise StagingError(f"{slot!r} is not held from this pool (double release?)")
        owner = slot._owner
        slot._owner = _RELEASED
        self._in_use -= 1
        self._released += 1
        if owner is not None:
            owner._on_give()
        self._give(slot)

    def _give(self, slot: Slot) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.slot = slot
            waiter.event.set()
            return
        self._free.append(slot)

    def statistics(self) -> StagingStatistics:
        self._reap()
        return StagingStatistics(
            slots=len(self._slots),
            slot_bytes=self.slot_bytes,
            in_use=self._in_use,
            peak_in_use=self._peak,
            waits=self._waits,
            acquired=self._acquired,
            released=self._released,
            waiting=len(self._waiters),
            pinned=self.pinned,
            parked=len(self._parked),
        )

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current use."""
        self._peak = self._in_use


class StagingAccount:
    """One request's draw on a :class:`StagingPool`; its peak is the request's RWS."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.in_use = 0
        self.peak_in_use = 0
        self.acquired = 0

    def _on_take(self) -> None:
        self.in_use += 1
        self.acquired += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def _on_give(self) -> None:
        self.in_use -= 1

    async def acquire(self) -> Slot:
        return await self.pool.acquire(self)

    def acquire_nowait(self) -> Slot:
        return self.pool.acquire_nowait(self)

    def release(self, slot: Slot) -> None:
        self.pool.release(slot)

    def park(self, slot: Slot, done: threading.Event) -> None:
        self.pool.park(slot, done)

    @property
    def contended(self) -> bool:
        """Whether another caller waits for a slot of the pool now."""
        return self.pool.contended

    @property
    def waiters(self) -> deque[Any]:
        return self.pool.waiters

    @property
    def peak_bytes(self) -> int:
        return self.peak_in_use * self.pool.slot_bytes


class _Released:
    pass


_RELEASED: StagingAccount | None = _Released()  # type: ignore[assignment]


class WholePlanBuffer:
    """Whole-plan baseline: one private host buffer holding every chunk of the plan (RWS = |S|)."""

    def __init__(self, n: int, slot_bytes: int, pin: bool) -> None:
        # the same memory as the window's slots (a fair baseline): pinned, or huge pages
        self.buffer, _ = _allocate(max(n, 1) * slot_bytes, pin, prefault=False)
        self.slot_bytes = slot_bytes
        self._next = 0
        self.peak_bytes = n * slot_bytes

    async def acquire(self) -> Slot:
        i = self._next
        self._next += 1
        await anyio.lowlevel.checkpoint()
        return Slot(i, self.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes])

    def acquire_nowait(self) -> Slot:
        """Never: a whole-plan run takes its regions one by one (:meth:`acquire`)."""
        raise anyio.WouldBlock

    #: a private buffer: nobody else waits for its regions
    contended = False
    waiters: tuple[Any, ...] = ()

    def release(self, slot: Slot) -> None:
        """Nothing to give back: the buffer lives as long as the request."""

    def park(self, slot: Slot, done: threading.Event) -> None:
        """Nothing to park: the buffer is private to the request."""


class SlotSource(Protocol):
    """Where a run takes its staging slots: the engine's shared window (a
    :class:`StagingAccount`) or a whole-plan run's private buffer (:class:`WholePlanBuffer`)."""

    @property
    def contended(self) -> bool: ...

    @property
    def waiters(self) -> Any:
        """True while another caller waits for a slot (a deque, or an empty tuple)."""
        ...

    @property
    def peak_bytes(self) -> int: ...

    async def acquire(self) -> Slot: ...

    def acquire_nowait(self) -> Slot: ...

    def release(self, slot: Slot) -> None: ...

    def park(self, slot: Slot, done: threading.Event) -> None: ...
