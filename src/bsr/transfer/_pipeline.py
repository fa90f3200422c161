"""The transfer side of a restore: stream chunks tier -> (staging slot) -> paged cache.

Where it runs: the engine's event loop; blocking reads, their checks and host copies run in
worker threads, a whole batch of chunks per thread call.

How it works::

    chunk queue --(batches of consecutive chunks)--> workers, each:
        take a slot (FIFO from the shared W-slot pool), and more that are free now, up to its
        share of the window when its tier moves batches (bulk reads)
        -> wait for one of the run's transfer turns
        -> one worker-thread call (or, small and memory-speed, on the event loop):
           ladder.read_many (the first holder's bulk read; every object checked; a failed one
           read on down its holders) -> installer.after_read per chunk as its groups end
           (copied into the cache, or its device copy enqueued), its slot free again at once
        -> the slots go back (installer completion), the installed chunks are announced
    tiers without blocking reads (Redis, Mooncake): each chunk's groups read with their async
    reads into one slot, checked, then installed in a worker thread.

The pipeline opens exactly one task group per run and decides nothing: every read attempt is
reported to the engine's :class:`~bsr.transfer._ladder.ReadGate` (quarantine and tier health
are the engine's), and what was installed is recorded in the :class:`RestoreRun`, which the
engine's commit rule reads. A slot is released in exactly two places: here when the install
that used it completed, and in the engine's ``finally`` for whatever the run still holds
(failure, deadline, cancellation). A slot whose worker thread was abandoned (a read the kernel
still owns) is parked, not released, until that thread returns, so no late write can reach a
reused slot; a copy into the cache first enters the run's :class:`InstallGate`, so none lands in
blocks the caller was told are invalid.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._log import logger
from ..core._keys import ChunkKey
from ..core._layout import StateLayout, align_up
from ..core._lifecycle import Reason
from ..core._options import Strategy
from ..core._results import Probe
from ..tiers._abandon import AbandonableCalls, cancellation
from ..tiers._base import Tier
from ..tiers._reads import ReadItem
from ._cache import PagedKVCache
from ._install import CudaInstaller, HostInstaller
from ._installers import (
    Installer,
    StreamedCudaInstall,
    StreamedHostInstall,
    WholePlanInstall,
)
from ._ladder import ReadGate, TierLadder
from ._run import Batches, ChunkFailure, OnInstalled, RestoreRun
from ._staging import Slot, SlotSource
from ._steps import BatchSteps, read_failed
from ._tables import BlockTables

#: aim for at most this many payload bytes per worker-thread call of per-object reads
BATCH_BYTES = 8 << 20
#: chunks up to this size from memory-speed tiers (``inline_reads``) move in batches on the
#: event loop: copying them costs less than the worker-thread hop they would take
INLINE_BYTES = 256 << 10
#: ... batches of up to this many bytes and :data:`INLINE_CHUNKS` chunks: each batch takes its
#: slots, a transfer turn and a task switch (about a dozen steps), so larger ones pay them for
#: more chunks, while the loop is held for at most about a millisecond of copies and checks
INLINE_BATCH_BYTES = 1 << 20
INLINE_CHUNKS = 64
#: a batch of a memory-speed first holder, or of one that moves batches: one per transfer turn,
#: up to this size when its chunks are announced as they land (``on_installed``), else one per
#: turn whatever its size. Each worker-thread hop costs both sides a wake-up, a GIL hand-over
#: and a context switch each way: 0.09-0.27 ms of CPU on the bench's 2-vCPU VM, the cost of
#: copying 1-3 MiB (a 128 MiB restore of 512 KiB chunks: 4.0 ms of CPU besides the bytes in
#: 16 MiB batches, 2.4 ms in 64 MiB ones), and about 0.6 ms after a batch emptied the caches
#: (a 256 MiB host restore of 32 MiB chunks, three alternated runs of 60: outside the worker
#: calls 0.48-0.52 ms of CPU per chunk in four batches, 0.26-0.28 in one)
MEMORY_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class _Lane:
    """How a run's batches move, from one walk over the probe's holders."""

    #: every holder of every object reads blocking (else: async reads)
    blocking: bool
    #: every holder of every object reads at memory speed, into a host cache, in chunks of up
    #: to INLINE_BYTES: the batches run on the event loop
    on_loop: bool
    #: every first holder reads at memory speed, or is one tier that moves batches its own
    #: way: few large batches, a turn each, several slots per call
    bulk: bool


@dataclass(frozen=True)
class _Job:
    """What one run needs, fixed for its length (its counters live in ``run``)."""

    run: RestoreRun
    slots: SlotSource
    probe: Probe
    gate: ReadGate
    installer: Installer
    lane: _Lane
    turns: anyio.CapacityLimiter
    host: HostInstaller | None
    #: each slot's read items, made on its first chunk and reused for the run's length
    items: dict[Slot, tuple[tuple[str, ...], list[ReadItem]]] = field(default_factory=dict)


class WindowPipeline:
    """Moves the chunks of one :class:`RestoreRun` through a slot source into a cache.

    Args:
        layout: the state layout.
        tiers: the engine's tiers, fastest first.
        window: W, the most slots one run holds.
        io_depth: transfer turns per run: worker-thread calls (or async reads) in flight.
        memory_workers: the turns of a run whose batches are memory copies or one tier's bulk
            reads into a host cache (at most ``io_depth``).
    """

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        *,
        window: int,
        io_depth: int,
        memory_workers: int = 1,
    ) -> None:
        self.layout = layout
        self.ladder = TierLadder({t.name: t for t in tiers})
        self.window = window
        self.io_depth = io_depth
        self.memory_workers = memory_workers
        self.cuda_stream: Any = None
        self._limiter = anyio.CapacityLimiter(max(2 * io_depth, 4))
        # batch reads and installs are abandonable: a cancelled request never waits on a worker
        self._calls = AbandonableCalls(limiter=self._limiter)
        self._spans = {
            g.name: (
                layout.slot_offset(g.name),
                layout.slot_offset(g.name) + align_up(layout.group_chunk_bytes(g.name)),
            )
            for g in layout.groups
        }
        self._expected = {g.name: layout.group_chunk_bytes(g.name) for g in layout.groups}
        self._abandoned_workers = 0

    @property
    def abandoned_workers(self) -> int:
        """Worker threads left running after their request ended (stuck reads)."""
        return self._abandoned_workers

    async def synchronize(self) -> None:
        """Wait for every device copy this pipeline enqueued."""
        if self.cuda_stream is not None:
            await anyio.to_thread.run_sync(self.cuda_stream.synchronize)

    async def drain(self, run: RestoreRun, grace_s: float) -> None:
        """Give ``run``'s worker threads up to ``grace_s`` to return (shielded, bounded)."""
        if not any(not done.is_set() for done in run.busy.values()):
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
            while any(not done.is_set() for done in list(run.busy.values())):  # noqa: ASYNC110
                await anyio.sleep(0.001)  # threading.Events: nothing to await

    def release_all(self, run: RestoreRun, slots: SlotSource) -> None:
        """Give back (or park, while a worker thread may still write) every slot ``run`` holds.
        Called by the engine's ``finally`` only."""
        run.abandon()
        for slot in list(run.held):
            run.held.discard(slot)
            done = run.busy.pop(slot, None)
            if done is not None and not done.is_set():
                self._abandoned_workers += 1
                slots.park(slot, done)
            else:
                slots.release(slot)

    # ------------------------------------------------------------------ RunOps
    def release(self, run: RestoreRun, slot: Slot) -> None:
        """Installer completion: the copy out of ``slot`` is done; give the slot back."""
        if slot in run.held:
            run.held.discard(slot)
            run.slots.release(slot)

    async def to_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._calls.run(lambda: fn(*args))

    # ------------------------------------------------------------------ run
    async def run(
        self,
        run: RestoreRun,
        slots: SlotSource,
        probe: Probe,
        cache: PagedKVCache,
        tables: BlockTables,
        strategy: Strategy,
        gate: ReadGate,
        on_installed: OnInstalled | None = None,
    ) -> None:
        """Stream every needed chunk into the cache, or stop early on failure.

        Failures are recorded in ``run`` (never raised); cancellation propagates.
        ``on_installed(chunk, groups)`` is called (and awaited if it returns an awaitable) on the
        event loop once each chunk is in the cache, in no particular order; if it raises, the
        chunk counts as failed to install, so the request cannot commit it.
        """
        run.slots, run.on_installed = slots, on_installed
        installer = self._installer(run, cache, tables, strategy)
        lane = self._lane(probe, installer)
        turns = self.io_depth
        if lane.bulk and installer.host is not None:  # CPU work: more threads cost more
            turns = max(1, min(self.memory_workers, self.io_depth))
        job = _Job(
            run, slots, probe, gate, installer, lane, anyio.CapacityLimiter(turns), installer.host
        )
        chunks = run.plan.to_read
        size = self._batch_size(job, len(chunks), turns, on_installed is not None)
        batches = Batches(chunks, size)
        n_batches = max(1, -(-len(chunks) // size))
        workers = turns if lane.bulk and not installer.one_per_slot else self.window
        async with anyio.create_task_group() as tg:
            for _ in range(min(workers, n_batches)):
                tg.start_soon(self._worker, job, batches, max(1, self.window // workers))
        await installer.finish(run, self)

    def _installer(
        self, run: RestoreRun, cache: PagedKVCache, tables: BlockTables, strategy: Strategy
    ) -> Installer:
        """The install mode of a run: the one place that chooses it."""
        if cache.device.type != "cuda":
            host = HostInstaller(cache.layout, cache, tables, run.first_block)
            if strategy is Strategy.WHOLE_PLAN:
                return WholePlanInstall(host=host)
            return StreamedHostInstall(host)
        if self.cuda_stream is None:
            import torch

            self.cuda_stream = torch.cuda.Stream(device=cache.device)  # type: ignore[no-untyped-call]
        device = CudaInstaller(self.layout, cache, tables, self.cuda_stream, run.first_block)
        if strategy is Strategy.WHOLE_PLAN:
            return WholePlanInstall(device=device)
        return StreamedCudaInstall(device)

    def _lane(self, probe: Probe, installer: Installer) -> _Lane:
        first: set[str] = set()
        every: set[str] = set()
        for per in probe.holders:
            for hs in per.values():
                if hs:
                    first.add(hs[0])
                    every.update(hs)
        ladder = self.ladder
        blocking = ladder.all_blocking(list(every))
        memory = ladder.all_inline(list(first))
        one_bulk = len(first) == 1 and ladder.bulk(next(iter(first)))
        bulk = blocking and not installer.one_per_slot and (memory or one_bulk)
        on_loop = (
            blocking
            and installer.host is not None
            and self.layout.chunk_bytes <= INLINE_BYTES
            and ladder.all_inline(list(every))
        )
        return _Lane(blocking, on_loop, bulk)

    def _batch_size(self, job: _Job, n: int, turns: int, announcing: bool) -> int:
        if job.installer.one_per_slot:
            return 1  # one slot per chunk: each stays staged until the install
        chunk_bytes = max(1, self.layout.chunk_bytes)
        if job.lane.on_loop:
            # these batches run one after another on the event loop: as large as an inline
            # batch may be, so the per-batch steps (slot, turn, task switch) are rare
            return max(1, min(INLINE_CHUNKS, INLINE_BATCH_BYTES // chunk_bytes))
        if job.lane.bulk:
            per_turn = math.ceil(n / turns)
            if not announcing:
                return max(1, per_turn)  # nobody waits for chunks announced per batch
            return max(1, min(per_turn, MEMORY_BATCH_BYTES // chunk_bytes))
        # two batches per worker, so chunks move roughly in chunk order across workers
        per_worker = math.ceil(n / (2 * self.window))
        return max(1, min(per_worker, BATCH_BYTES // chunk_bytes))

    async def _worker(self, job: _Job, batches: Batches, share: int) -> None:
        run = job.run
        rest: list[int] = []
        while True:
            batch = rest if rest and not run.must_stop else batches.take(run)
            if not batch:
                return
            slots = [await job.slots.acquire()]
            run.held.add(slots[0])
            while job.lane.bulk and len(slots) < min(share, len(batch)):
                try:
                    slot = job.slots.acquire_nowait()
                except anyio.WouldBlock:
                    break
                run.held.add(slot)
                slots.append(slot)
            run.touched_chunks.update(batch)
            try:
                async with job.turns:
                    rest = await self._batch(job, batch, slots)
            except Exception as exc:  # a tier's (or an installer's) bug: a failed batch
                rest = []
                c = min((c for c in batch if c < run.limit), default=batch[0])
                logger.warning("bsr.transfer.batch_failed", chunk=c, error=repr(exc))
                run.fail(ChunkFailure(c, run.needed[c][0], Reason.READ_FAILED,
                                      [f"unexpected {exc!r}"]))  # fmt: skip
            if not job.installer.keeps_slots:
                for slot in slots:
                    self.release(run, slot)
            await self.announce(run, batch)

    async def _batch(self, job: _Job, batch: list[int], slots: list[Slot]) -> list[int]:
        """Move one batch the run's way; the chunks not begun."""
        if not job.lane.blocking:
            return await self._move_async(job, batch, slots[0])
        if job.lane.on_loop:  # a host copy of at most INLINE_BATCH_BYTES (_batch_size)
            rest = self._move(job, batch, slots)
            await anyio.lowlevel.checkpoint()
            return rest
        return list(await self._thread(job, slots, self._move, job, batch, slots))

    async def _thread(self, job: _Job, slots: list[Slot], fn: Any, *args: Any) -> Any:
        """Run ``fn`` in a worker thread that may outlive a cancelled request (then parked).

        ``run.busy[slot]`` (of each slot) is set once the slots are free of the thread: when
        ``fn`` returned, or at once when the call was cancelled before the thread started."""
        done = threading.Event()
        for s in slots:
            job.run.busy[s] = done

        def call() -> Any:
            # reads the kernel owns see the run end and withdraw their requests
            with cancellation(lambda: job.run.abandoned):
                return fn(*args)

        result = await self._calls.run(call, release=done.set)
        done.set()
        for s in slots:
            job.run.busy.pop(s, None)
        return result

    async def announce(self, run: RestoreRun, chunks: Sequence[int]) -> None:
        """Tell the run's ``on_installed`` about every chunk of ``chunks`` now fully installed."""
        listener = run.on_installed
        if listener is None:
            return
        announced = run.announced
        for c in chunks:
            groups = run.needed[c]
            if c in announced or not run.wanted(c):
                continue
            if not all((c, g) in run.installed for g in groups):
                continue
            announced.add(c)
            try:
                pending = listener(c, groups)
                if pending is not None:
                    await pending
            except Exception as exc:  # the caller's work on the chunk is part of the restore
                run.withdraw(c, groups)  # its blocks no longer hold what the restore vouches for
                why = [f"on_installed: {exc!r}"]
                run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, why))

    # ------------------------------------------------------------------ moving a batch
    def _move(self, job: _Job, batch: Sequence[int], slots: list[Slot]) -> list[int]:
        """Worker thread (or the event loop): read, check and install ``batch`` through
        ``slots``; the chunks not begun (the window was wanted elsewhere), in order."""
        region = self._region
        steps = BatchSteps(job.run, job.probe, job.installer.call(), job.slots.waiters, batch,
                           slots, lambda slot, g: region(job, slot, g), self._expected,
                           job.items)  # fmt: skip
        run, holders, keys = job.run, job.probe.holders, job.probe.keys
        objects = [(keys[c], g) for c in batch for g in run.needed[c]]
        first = {holders[c][g][0] for c in batch for g in run.needed[c] if holders[c][g]}
        lend = job.installer.lends
        try:
            if len(first) == 1:
                ahead = len(slots) * len(self.layout.groups)  # a read per object of each slot
                (name,) = first
                self.ladder.read_many_blocking(job.gate, name, steps.begin, steps.end, ahead,
                                               objects=objects, lend=lend)  # fmt: skip
            else:
                while (item := steps.begin()) is not None:
                    result = self.ladder.read_one_blocking(job.gate, item, item.holders, lend=lend)
                    if not steps.end(item, result):
                        break
        finally:
            steps.finish()
        return [c for c in reversed(steps.todo) if run.wanted(c)]

    async def _move_async(self, job: _Job, batch: Sequence[int], slot: Slot) -> list[int]:
        """Event loop: each chunk's groups with the tiers' async reads, installed in a thread."""
        run = job.run
        for c in batch:
            if not run.wanted(c):
                return []
            ok = True
            for g in run.needed[c]:
                item = self._item(job, c, g, slot)
                result = await self.ladder.read_one(job.gate, item, item.holders)
                if not result.ok:
                    read_failed(run, c, g, result)
                    ok = False
                    break
                run.record_read(result)
            call = job.installer.call()
            await self._thread(job, [slot], _install_one, call, run, c, slot, ok and run.wanted(c))
            if not ok:
                return []
        return []

    def _region(self, job: _Job, slot: Slot, g: str) -> Any:
        """The slot's region of group ``g`` (a flat uint8 NumPy view)."""
        off, end = self._spans[g]
        return job.host.slot_array(slot)[off:end] if job.host else slot.tensor[off:end].numpy()

    def _item(self, job: _Job, c: int, g: str, slot: Slot) -> ReadItem:
        return ReadItem(job.probe.keys[c], g, self._region(job, slot, g), self._expected[g],
                        chunk=c, holders=job.probe.holders[c][g], token=slot)  # fmt: skip


def _install_one(call: Installer, run: RestoreRun, c: int, slot: Slot, ok: bool) -> None:
    call.after_read(run, c, slot, None, ok)
    call.drain()


__all__ = ["ChunkFailure", "ChunkKey", "RestoreRun", "WindowPipeline"]
