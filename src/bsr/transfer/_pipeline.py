"""The transfer side of a restore: stream chunks tier -> staging slot -> paged cache.

Where it runs: the engine's event loop; blocking reads, checksum verification and host copies run
in worker threads, a whole batch of chunks per thread call.

How it works::

    chunk queue --(batches of consecutive chunks)--> W workers, each:
        acquire one slot (FIFO from the shared W-slot pool; so a run holds up to W slots)
        -> wait for one of io_depth transfer turns
        -> one worker-thread call: for each chunk of the batch, read + verify every group down the
           tier ladder into the slot, then copy the slot into the cache blocks (host destination)
        -> release the slot (installer completion)
    a small batch (<= INLINE_BYTES) from memory-speed tiers (``inline_reads``, e.g. HostTier)
    runs on the event loop instead: the copy costs less than the thread hop.
    tiers without blocking reads (e.g. Mooncake): the same steps with their async reads.
    CUDA destination: one chunk per slot; the copy is enqueued on a side stream and the slot is
    released when its event completes, so up to W slots are in flight.
    whole-plan baseline: every chunk is read into its own region of one private buffer first,
    then everything is installed (RWS = |S|).

Each of those install modes is one :class:`Installer` (:class:`StreamedHostInstall`,
:class:`StreamedCudaInstall`, :class:`WholePlanInstall`), chosen once per run: what follows a
chunk's read (``after_read``, in the worker), what follows a batch (``after_batch``: release the
slot, keep it staged, or enqueue the device copy) and what ends the run (``finish``).

The pipeline opens exactly one task group per run. It decides nothing: every read attempt is
reported to the engine's :class:`~bsr.transfer._ladder.ReadGate` (which owns quarantine and tier
health), and what was installed is recorded in the :class:`RestoreRun`, which the engine's commit
rule reads. A slot is released in exactly two places: here when the install that used it
completed, and in the engine's ``finally`` for whatever the run still holds (failure, deadline,
cancellation). A slot whose worker thread was abandoned (a read stuck in the kernel) is parked, not
released, until that thread returns, so no late write can reach a reused slot; a worker checks
the run's :class:`InstallGate` before every copy into the cache, so no late
write reaches blocks the caller was told are invalid.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import anyio
import torch
from anyio.abc import TaskGroup

from ..core._keys import ChunkKey
from ..core._layout import StateLayout, align_up
from ..core._lifecycle import Reason
from ..core._options import Policy, Strategy
from ..core._plan import RestorePlan
from ..core._results import Probe
from ..tiers._abandon import AbandonableCalls
from ..tiers._base import Borrowed, LentPayloads, Tier
from ..tiers.file import cancellation
from ._cache import PagedKVCache
from ._install import CudaInstaller, HostInstaller
from ._ladder import LadderResult, Outcome, ReadGate, StreamItem, TierLadder
from ._staging import Slot, StagingAccount
from ._tables import BlockTables

#: aim for at most this many payload bytes per worker-thread call on the host path
BATCH_BYTES = 8 << 20
#: a batch from memory-speed tiers (``inline_reads``) up to this size runs on the event loop:
#: copying it costs less than the worker-thread hop it would take
INLINE_BYTES = 256 << 10
#: a batch from memory-speed tiers too large to run on the event loop: one per transfer turn, up
#: to this size. Their work is CPU only (verify and copy), where each worker-thread hop costs the
#: event loop and the worker thread a wake-up, a GIL hand-over and a context switch each way
#: (0.09 ms of CPU for an empty ``to_thread`` call on the bench's 2-vCPU VM, up to 0.27 ms
#: inside a restore, the cost of copying 1-3 MiB), so few large batches cost least (a 128 MiB
#: restore of 512 KiB chunks: 4.0 ms of CPU besides the bytes in 16 MiB batches, 2.4 ms in
#: 64 MiB ones); there is no device queue to keep in chunk order
MEMORY_BATCH_BYTES = 64 << 20
#: a batch lent in place (HostTier) is borrowed, verified and copied span by span, each span of
#: at most this many payload bytes (and at least one chunk), so each copy reads bytes its
#: checksum pass has just brought into the core's cache: a 128 MiB restore of 512 KiB chunks
#: took 1.21x the CPU of one checksum pass and one copy in 1 MiB spans, 1.29x verified whole;
#: 2 MiB spans (within a server core's L2 or its share of L3) cost 3-4% less than 1 MiB ones,
#: each span paying one tier call and its pins
LEND_SPAN_BYTES = 2 << 20


class ChunkFailure(Exception):
    """A (chunk, group) could not be read or installed from any tier."""

    def __init__(self, chunk: int, group: str, reason: Reason, errors: Sequence[str]) -> None:
        super().__init__(f"chunk {chunk} group {group}: {reason}")
        self.chunk = chunk
        self.group = group
        self.reason = reason
        self.errors = list(errors)


class WholePlanBuffer:
    """Whole-plan baseline: one private host buffer holding every chunk of the plan (RWS = |S|)."""

    def __init__(self, n: int, slot_bytes: int, pin: bool) -> None:
        pin = pin and torch.cuda.is_available()
        self.buffer = torch.empty(max(n, 1) * slot_bytes, dtype=torch.uint8, pin_memory=pin)
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

    def release(self, slot: Slot) -> None:
        """Nothing to give back: the buffer lives as long as the request."""

    def park(self, slot: Slot, done: threading.Event) -> None:
        """Nothing to park: the buffer is private to the request."""


SlotSource = StagingAccount | WholePlanBuffer

#: ``on_installed(chunk, groups)``: told on the event loop once a chunk's groups are in the cache
OnInstalled = Callable[[int, tuple[str, ...]], Awaitable[None] | None]


class InstallGate:
    """Copies into the cache enter the gate; closing it waits for those under way and refuses
    every later one (so copies of one run may run in parallel, and none lands after the end)."""

    #: the longest the close waits for copies under way (a chunk's memcpy takes milliseconds)
    CLOSE_WAIT_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # waited on only while closing
        self._active = 0
        self._closed = False

    def enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._active += 1
            return True

    @property
    def closing(self) -> bool:
        """Whether the gate is closing or closed (an entered batch of copies stops at its next
        chunk, so the close waits for one chunk's copy)."""
        return self._closed

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:
                self._idle.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: self._active == 0, self.CLOSE_WAIT_S)


class RestoreRun:
    """One restore's transfer record, shared by the pipeline's tasks and worker threads.

    The plan comes in made (:func:`~bsr.core._plan.plan_restore`); the run records what
    happened to it. The engine reads it after the window: ``installed`` feeds the commit rule,
    ``failure`` the invalidation reason, ``held``/``busy`` its ``finally``. Mutations from
    worker threads go through the methods below, which take one lock.
    """

    def __init__(self, plan: RestorePlan, policy: Policy) -> None:
        self.plan = plan
        self.policy = policy
        self.target = plan.target
        self.limit = plan.target  # chunks >= limit are abandoned (a chunk below failed)
        self.needed = plan.needed
        #: the chunks the caller already holds (:attr:`RestorePlan.skipped`) count as installed
        self.skipped = plan.skipped
        self.installed: set[tuple[int, str]] = {
            (c, g) for c in plan.skipped for g in plan.needed[c]
        }
        self.first_block = plan.first_block
        self.touched_chunks: set[int] = set()
        self.held: set[Slot] = set()
        self.busy: dict[Slot, threading.Event] = {}
        self.failure: ChunkFailure | None = None
        self.bytes_by_tier: dict[str, int] = {}
        self.fallbacks = 0
        self.quarantined = 0
        self.errors: list[str] = []
        self.abandoned = False
        self.installs = InstallGate()
        self._lock = threading.Lock()

    def fail(self, failure: ChunkFailure) -> None:
        """Record a failure; chunks from it on will not be used."""
        with self._lock:
            self.errors.extend(failure.errors)
            if self.failure is None or failure.chunk < self.failure.chunk:
                self.failure = failure
            self.limit = min(self.limit, failure.chunk)

    def record_read(self, result: LadderResult) -> None:
        with self._lock:
            assert result.tier is not None
            self.bytes_by_tier[result.tier] = self.bytes_by_tier.get(result.tier, 0) + result.nbytes
            if result.fell_back:
                self.fallbacks += 1
                self.errors.extend(result.errors)

    def record_lent(self, tier: str, nbytes: int, chunks: Sequence[int]) -> None:
        """A batch's reads served by their first holder (``nbytes`` from ``tier``) and its
        installed ``chunks`` (every needed group of each), recorded at once."""
        needed = self.needed
        with self._lock:
            if nbytes:
                self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + nbytes
            self.installed.update((c, g) for c in chunks for g in needed[c])

    def record_installed(self, chunk: int, groups: Sequence[str]) -> None:
        with self._lock:
            self.installed.update((chunk, g) for g in groups)

    def withdraw(self, chunk: int, groups: Sequence[str]) -> None:
        """The chunk's blocks no longer hold valid state (the caller's work on them failed)."""
        with self._lock:
            self.installed.difference_update((chunk, g) for g in groups)

    def abandon(self) -> None:
        """The request is over: no worker may copy into the cache from now on.

        Waits (bounded) for copies already under way, which are memory copies of one chunk.
        """
        self.installs.close()
        self.abandoned = True

    @property
    def must_stop(self) -> bool:
        """Whether nothing more can be committed, so the window should stop now."""
        return self.abandoned or (
            self.failure is not None and (self.limit == 0 or self.policy is Policy.ALL_OR_NOTHING)
        )

    def wanted(self, chunk: int) -> bool:
        return not self.must_stop and chunk < self.limit


class _Batches:
    """Hands out consecutive runs of chunks to the workers, in chunk order."""

    def __init__(self, chunks: Sequence[int], size: int) -> None:
        self._chunks = list(chunks)
        self._size = max(1, size)
        self._next = 0

    def take(self, run: RestoreRun) -> list[int]:
        chunks, start = self._chunks, self._next
        if run.must_stop:
            self._next = len(chunks)
            return []
        out = chunks[start : start + self._size]
        self._next = start + len(out)
        if out and out[-1] >= run.limit:  # chunks are ascending: those past the limit go
            out = [c for c in out if c < run.limit]
            self._next = len(chunks)
        return out


class _Job:
    """What one run needs to know, bundled so the methods below stay short."""

    def __init__(
        self,
        run: RestoreRun,
        slots: SlotSource,
        probe: Probe,
        cache: PagedKVCache,
        tables: BlockTables,
        gate: ReadGate,
        installer: Installer,
    ) -> None:
        self.run = run
        self.slots = slots
        self.probe = probe
        self.cache = cache
        self.tables = tables
        self.gate = gate
        self.installer = installer
        #: the host destination's slot views (None for a device destination)
        self.host = installer.host
        self.on_installed: OnInstalled | None = None
        self.read_ok: set[int] = set()  # chunks read and verified, waiting for their install
        self.announced: set[int] = set()
        self.turns = anyio.CapacityLimiter(1)  # io_depth transfer turns (set by the pipeline)
        #: every holder of every chunk reads at memory speed, into a host cache (set by the
        #: pipeline)
        self.all_inline = False
        #: the first holder of every object reads at memory speed and every holder blocking,
        #: into a host cache: the work is verify and copy, in worker threads (set by the pipeline)
        self.memory = False
        #: the first holder of every object is one tier that streams reads (an io_uring
        #: FileTier) and every holder reads blocking, into a host cache copied as each chunk
        #: arrives: a worker thread keeps several reads in flight on its own (set by the
        #: pipeline)
        self.stream: str | None = None


class WindowPipeline:
    """Moves the chunks of one :class:`RestoreRun` through a slot source into a cache.

    Args:
        layout: the state layout.
        tiers: the engine's tiers, fastest first.
        window: W, the most slots one run holds (one per worker).
        io_depth: transfer turns per run: worker-thread calls (or async reads) in flight.
        memory_workers: the turns of a run whose every object is first asked of a memory-speed
            tier, or of one tier that streams reads, into a host cache (at most ``io_depth``).
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
        """Give ``run``'s worker threads up to ``grace_s`` to return (shielded, bounded).

        Reads normally finish within milliseconds of a cancellation; only a read stuck in the
        kernel outlives the grace, and its slot is then parked by :meth:`release_all`.
        """
        if not any(not done.is_set() for done in run.busy.values()):
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
            while any(not done.is_set() for done in list(run.busy.values())):  # noqa: ASYNC110
                await anyio.sleep(0.001)  # threading.Events: nothing to await

    def release_all(self, run: RestoreRun, slots: SlotSource) -> None:
        """Give back (or park, while a worker thread may still write) every slot ``run`` holds.

        Called by the engine's ``finally`` only.
        """
        run.abandon()
        for slot in list(run.held):
            run.held.discard(slot)
            done = run.busy.pop(slot, None)
            if done is not None and not done.is_set():
                self._abandoned_workers += 1
                slots.park(slot, done)
            else:
                slots.release(slot)

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
        installer = self._installer(run, cache, tables, strategy)
        job = _Job(run, slots, probe, cache, tables, gate, installer)
        job.on_installed = on_installed
        job.all_inline, job.memory, job.stream = self._lanes(job)
        job.turns = anyio.CapacityLimiter(self._turns(job))
        chunks = run.plan.to_read
        size = self._batch_size(job, len(chunks))
        batches = _Batches(chunks, size)
        n_batches = max(1, -(-len(chunks) // size))
        async with anyio.create_task_group() as tg:
            if job.stream is not None:
                # a streaming worker holds several slots and keeps its reads in flight
                # itself: one per turn
                for _ in range(min(self._turns(job), n_batches)):
                    tg.start_soon(self._stream_worker, job, batches, tg)
            else:
                # one worker per batch at most: a worker holds one slot, so W workers fill
                # the window, and a short restore does not start workers that would find
                # nothing
                for _ in range(min(self.window, n_batches)):
                    tg.start_soon(self._worker, job, batches, tg)
        await installer.finish(job)

    def _installer(
        self, run: RestoreRun, cache: PagedKVCache, tables: BlockTables, strategy: Strategy
    ) -> Installer:
        """The install mode of a run: the one place that chooses it (by destination and
        strategy); the loop below only calls the installer it gets."""
        if cache.device.type != "cuda":
            host = HostInstaller(cache.layout, cache, tables, run.first_block)
            if strategy is Strategy.WHOLE_PLAN:
                return WholePlanInstall(self, host=host)
            return StreamedHostInstall(self, host)
        if self.cuda_stream is None:
            self.cuda_stream = torch.cuda.Stream(device=cache.device)  # type: ignore[no-untyped-call]
        device = CudaInstaller(self.layout, cache, tables, self.cuda_stream, run.first_block)
        if strategy is Strategy.WHOLE_PLAN:
            return WholePlanInstall(self, device=device)
        return StreamedCudaInstall(self, device)

    def _turns(self, job: _Job) -> int:
        """Transfer turns of a run: ``io_depth``, but at most ``memory_workers`` when every
        object is first asked of a memory-speed tier, into a host cache (``job.memory``; a
        slower tier below it, e.g. the FileTier under a HostTier, is read only for what the
        first one cannot give). Then a batch is CPU and memory bandwidth only (verify and
        copy), with no device queue to keep full: on the 2-vCPU machine of the bench a second
        thread cost 1.4x the CPU of one (both stall on the same memory bus) for 1.2x the
        speed."""
        if job.memory or job.stream is not None:
            return max(1, min(self.memory_workers, self.io_depth))
        return self.io_depth

    def _batch_size(self, job: _Job, n: int) -> int:
        if job.installer.one_per_slot:
            return 1  # one slot per chunk: each stays busy until its copy is done
        chunk_bytes = max(1, self.layout.chunk_bytes)
        if job.all_inline and chunk_bytes <= INLINE_BYTES:
            # these batches run one after another on the event loop anyway: as large as an
            # inline batch may be, so the per-batch steps (slot, turn, task switch) are rare
            return max(1, INLINE_BYTES // chunk_bytes)
        if job.stream is not None and job.on_installed is None:
            # a streamed batch lets the device queue run dry at its end (its thread call
            # returns once its last read is in, and the next call starts the queue again from
            # nothing): one batch per turn, as nobody waits for chunks announced per batch
            return max(1, math.ceil(n / self._turns(job)))
        if job.memory or job.stream is not None:
            # worker-thread batches of memory-speed or streamed reads: one per turn (see
            # MEMORY_BATCH_BYTES); more would only add worker-thread hops
            per_turn = math.ceil(n / self._turns(job))
            return max(1, min(per_turn, MEMORY_BATCH_BYTES // chunk_bytes))
        # two batches per worker, so chunks move roughly in chunk order across workers (each
        # batch is one worker-thread hop, whose wake-ups cost CPU on both sides)
        per_worker = math.ceil(n / (2 * self.window))
        return max(1, min(per_worker, BATCH_BYTES // chunk_bytes))

    def _lanes(self, job: _Job) -> tuple[bool, bool, str | None]:
        """Into a host cache only (else False, False, None), from one walk over the holders:
        whether every holder of every object reads at memory speed (``job.all_inline``);
        whether the first holder of every object does and every holder reads blocking, so
        batches run in worker threads (``job.memory``); and else the one tier that is the
        first holder of every object if it streams reads and every holder reads blocking, the
        chunks copied as they arrive (``job.stream``)."""
        if job.host is None:
            return False, False, None
        first: set[str] = set()
        every: set[str] = set()
        for per in job.probe.holders:
            for hs in per.values():
                if hs:
                    first.add(hs[0])
                    every.update(hs)
        ladder = self.ladder
        all_inline = ladder.all_inline(list(every))
        blocking = ladder.all_blocking(list(every))
        memory = ladder.all_inline(list(first)) and blocking
        stream = None
        if not memory and blocking and len(first) == 1 and job.installer.streams:
            (name,) = first
            stream = name if ladder.streams(name) else None
        return all_inline, memory, stream

    async def _worker(self, job: _Job, batches: _Batches, tg: TaskGroup) -> None:
        run = job.run
        while True:
            batch = batches.take(run)
            if not batch:
                return
            slot = await job.slots.acquire()
            run.held.add(slot)
            run.touched_chunks.update(batch)
            mode = self._mode(job, batch)
            # a lone large chunk: read it under a transfer turn, copy it into the cache after
            # giving the turn back, so io_depth reads stay in flight while copies run
            split = mode == "thread" and len(batch) == 1 and job.installer.lends
            split = split and not self._lent(job, batch[0])
            async with job.turns:
                if mode == "inline":
                    self._batch_blocking(job, batch, slot)
                    await anyio.lowlevel.checkpoint()
                elif mode == "thread":
                    args = (job, batch, slot, not split)
                    await self._thread(job, slot, self._batch_blocking, *args)
                else:
                    await self._batch_async(job, batch, slot)
            if split and run.wanted(batch[0]) and batch[0] in job.read_ok:
                await self._thread(job, slot, self._install_host, job, batch[0], slot)
            pending = job.installer.after_batch(job, batch, slot, tg)
            if pending is not None:
                await pending

    async def _stream_worker(self, job: _Job, batches: _Batches, tg: TaskGroup) -> None:
        """A worker of a streamed run: per batch, a slot (waited for) and up to its share of
        the window more (those free now), and one worker-thread call that keeps a read in
        flight per slot it holds (within the tier's own read depth), copying each chunk into
        the cache as it arrives. The reads in flight are bounded by the window here, not by
        ``io_depth`` (the number of calls in flight): the slots are held anyway, and each wait
        for a completion that is not there yet costs a sleep and a wake-up.

        A call that finds another caller waiting for a slot (another restore) stops beginning
        chunks once each slot it holds has taken one, and gives its slots back: the rest of
        its batch waits its turn in the window's queue (a batch may be a worker's whole run)."""
        run = job.run
        turns = self._turns(job)
        share = max(1, self.window // turns)
        rest: list[int] = []
        while True:
            batch = rest if rest and not run.must_stop else batches.take(run)
            if not batch:
                return
            slots = [await job.slots.acquire()]
            run.held.add(slots[0])
            while len(slots) < min(share, len(batch)):
                try:
                    slot = job.slots.acquire_nowait()
                except anyio.WouldBlock:
                    break
                run.held.add(slot)
                slots.append(slot)
            run.touched_chunks.update(batch)
            async with job.turns:
                rest = await self._thread(job, slots, self._batch_stream, job, batch, slots)
            for slot in slots:
                self._installed(job, slot)
            await self._announce(job, batch)
            rest = rest or []

    def _batch_stream(self, job: _Job, batch: Sequence[int], slots: list[Slot]) -> list[int]:
        """Worker thread: stream ``batch`` from ``job.stream`` through ``slots`` (each chunk
        installed as its groups arrive, its slot then reused); when the gate wants each object
        admitted on its own, the batch goes object by object through the first slot. The
        chunks of ``batch`` not begun (the window was wanted elsewhere), in order."""
        run = job.run
        holders, keys = job.probe.holders, job.probe.keys
        objects = [(keys[c], g, holders[c][g]) for c in batch for g in run.needed[c]]
        name = self.ladder.admit_batch(job.gate, objects)
        if name is None:
            self._batch_blocking(job, batch, slots[0])
            return []
        begin, end, todo = self._stream_steps(job, batch, slots)
        try:
            ahead = len(slots) * len(self.layout.groups)  # a read per object of each slot
            self.ladder.stream_admitted_blocking(job.gate, name, begin, end, ahead)
        finally:
            self.ladder.batch_ok(job.gate, name)
        return [c for c in reversed(todo) if run.wanted(c)]

    def _stream_steps(
        self, job: _Job, batch: Sequence[int], slots: list[Slot]
    ) -> tuple[
        Callable[[], StreamItem | None], Callable[[StreamItem, LadderResult], bool], list[int]
    ]:
        """The ``begin`` and ``end`` of a streamed batch, and its chunks not begun yet (last
        first): a chunk begins when a slot is free (its groups one by one), unless each slot
        has taken one and another caller waits for the window; once its last group ended it
        is installed (unless it or an earlier chunk failed) and its slot is free again."""
        run = job.run
        window = job.slots  # ``window.contended`` is read as each chunk begins
        begun = [0]
        holders, keys, needed = job.probe.holders, job.probe.keys, run.needed
        expected, after_read = self._expected, job.installer.after_read
        free = list(reversed(slots))
        todo = list(reversed(batch))
        queued: list[StreamItem] = []  # the groups of the chunk begun last, not begun yet
        left: dict[int, int] = {}  # chunk -> its groups not ended yet
        failed: set[int] = set()

        def begin() -> StreamItem | None:
            if queued:
                return queued.pop()
            if not free or not todo or not run.wanted(todo[-1]):
                return None
            if begun[0] >= len(slots) and window.contended:
                return None  # yield the window: the rest of the batch comes back to the worker
            begun[0] += 1
            c = todo.pop()
            slot = free.pop()
            groups = needed[c]
            left[c] = len(groups)
            items = [
                StreamItem(keys[c], c, g, holders[c][g], self._region(job, slot, g), expected[g],
                           slot)
                for g in groups
            ]  # fmt: skip
            queued.extend(reversed(items[1:]))
            return items[0]

        def end(item: StreamItem, result: LadderResult) -> bool:
            c = item.chunk
            if result.ok:
                run.record_read(result)
            else:
                self._read_failed(job, c, item.group, result)
                failed.add(c)
            left[c] -= 1
            if left[c] == 0:
                del left[c]
                if c not in failed and run.wanted(c):
                    after_read(job, c, item.token, None)
                free.append(item.token)
            return not run.must_stop

        return begin, end, todo

    def _mode(self, job: _Job, batch: Sequence[int]) -> str:
        """How to move ``batch``: ``inline`` (small, memory-speed tiers, host destination, on
        the event loop), ``thread`` (one worker-thread call) or ``async`` (tiers' async reads)."""
        holders = job.probe.holders
        names = [n for c in batch for g in job.run.needed[c] for n in holders[c][g]]
        if not self.ladder.all_blocking(names):
            return "async"
        small = len(batch) * self.layout.chunk_bytes <= INLINE_BYTES
        if small and job.host is not None and self.ladder.all_inline(names):
            return "inline"
        return "thread"

    async def _thread(self, job: _Job, slot: Slot | list[Slot], fn: Any, *args: Any) -> Any:
        """Run ``fn`` in a worker thread that may outlive a cancelled request (then parked).

        ``run.busy[slot]`` (of each slot given) is set once the slot is free of the thread:
        when ``fn`` returned, or at once when the call was cancelled before the thread started
        (it then never runs).
        """
        done = threading.Event()
        slots = slot if isinstance(slot, list) else [slot]
        for s in slots:
            job.run.busy[s] = done

        def call() -> Any:
            # reads stuck in an io_uring see the run end and withdraw their requests
            with cancellation(lambda: job.run.abandoned):
                return fn(*args)

        # release (done.set) runs once the worker no longer touches the slot: at once when the
        # call never started or raised, in the worker when it returns after being abandoned
        result = await self._calls.run(call, release=done.set)
        done.set()
        for s in slots:
            job.run.busy.pop(s, None)
        return result

    async def _announce(self, job: _Job, chunks: Sequence[int]) -> None:
        """Tell ``job.on_installed`` about every chunk of ``chunks`` now fully installed."""
        if job.on_installed is None:
            return
        run = job.run
        for c in chunks:
            groups = run.needed[c]
            if c in job.announced or not run.wanted(c):
                continue
            if not all((c, g) in run.installed for g in groups):
                continue
            job.announced.add(c)
            try:
                pending = job.on_installed(c, groups)
                if pending is not None:
                    await pending
            except Exception as exc:  # the caller's work on the chunk is part of the restore
                run.withdraw(c, groups)  # its blocks no longer hold what the restore vouches for
                why = [f"on_installed: {exc!r}"]
                run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, why))

    def _installed(self, job: _Job, slot: Slot) -> None:
        """Installer completion: the copy out of ``slot`` is done; give the slot back."""
        if slot in job.run.held:
            job.run.held.discard(slot)
            job.slots.release(slot)

    # ------------------------------------------------------------------ reading
    def _region(self, job: _Job, slot: Slot, group: str) -> Any:
        """The slot's region for ``group`` (a NumPy view on the host path: cheap to slice)."""
        off, end = self._spans[group]
        if job.host is not None:
            return job.host.slot_array(slot)[off:end]
        return slot.tensor[off:end]

    def _read_failed(self, job: _Job, chunk: int, group: str, result: LadderResult) -> None:
        reason = Reason.CORRUPT if result.corrupt else Reason.READ_FAILED
        job.run.fail(ChunkFailure(chunk, group, reason, result.errors))

    def _batch_blocking(
        self, job: _Job, batch: Sequence[int], slot: Slot, install: bool = True
    ) -> None:
        """Worker thread: read, verify and (host destination, ``install``) install each chunk of
        ``batch``; without ``install`` a chunk read is recorded in ``job.read_ok``.

        A host install takes a group's payload in place from a tier that lends it (HostTier:
        verified where it lies, pinned meanwhile, one copy into the cache); only the other
        groups go through the slot.
        """
        run = job.run
        lend = install and job.installer.lends
        if lend:
            batch = self._spans_lent(job, batch, slot)
            if not batch:
                return
        # a batch whose first holder is one blocking tier, admitted at once: each object is
        # read without its own admission and report (a failed one goes down the ladder)
        admitted = None
        if not lend or not all(self._lent(job, c) for c in batch):
            holders, keys = job.probe.holders, job.probe.keys
            admitted = self.ladder.admit_batch(
                job.gate, [(keys[c], g, holders[c][g]) for c in batch for g in run.needed[c]]
            )
        try:
            self._batch_chunks(job, batch, slot, install, lend, admitted)
        finally:
            if admitted is not None:
                self.ladder.batch_ok(job.gate, admitted)

    def _batch_chunks(
        self,
        job: _Job,
        batch: Sequence[int],
        slot: Slot,
        install: bool,
        lend: bool,
        admitted: str | None,
    ) -> None:
        run = job.run
        after_read = job.installer.after_read
        for c in batch:
            if not run.wanted(c):
                return
            lent: dict[str, Borrowed] = {}
            try:
                if not self._read_chunk_blocking(job, c, slot, lent if lend else None, admitted):
                    return
                if not install:
                    job.read_ok.add(c)
                elif not after_read(job, c, slot, lent):
                    return
            finally:
                for b in lent.values():
                    b.release()

    def _spans_lent(self, job: _Job, batch: Sequence[int], slot: Slot) -> Sequence[int]:
        """:meth:`_batch_lent` of ``batch`` span by span (``LEND_SPAN_BYTES``); the chunks left
        to read object by object: none when every span was lent or the request is over, else
        those from the first span that could not be lent on.

        A batch of more than one span whose objects one lending tier holds first is admitted
        by the gate once (:meth:`TierLadder.admit_batch`) and reported once at its end, not
        per span."""
        span = max(1, LEND_SPAN_BYTES // max(1, self.layout.chunk_bytes))
        admitted = None
        if len(batch) > span:
            lender = self._lender(job, batch)
            if lender is not None:
                holders = job.probe.holders
                objects = [(k, g, holders[c][g]) for k, c, g in lender[1]]
                admitted = self.ladder.admit_batch(job.gate, objects)
        served = [False]  # whether the admitted tier lent any object (its one success report)
        try:
            for i in range(0, len(batch), span):
                if not self._batch_lent(job, batch[i : i + span], slot, admitted, served):
                    return batch[i:]
                if job.run.failure is not None or job.run.abandoned:
                    return ()
            return ()
        finally:
            if admitted is not None:
                self.ladder.batch_ok(job.gate, admitted, served=served[0])

    def _batch_lent(
        self,
        job: _Job,
        batch: Sequence[int],
        slot: Slot,
        admitted: str | None = None,
        served: list[bool] | None = None,
    ) -> bool:
        """Host destination: borrow every object of ``batch`` from the one lending tier that is
        the first holder of each, in one tier call (pinned and verified together), then install
        chunk by chunk from the lent payloads. False (nothing done) when that does not apply:
        other first holders, or a gate that wants each object admitted on its own.
        ``admitted``: the tier the gate admitted the whole batch on, which reports it once
        (:meth:`_spans_lent`); ``served[0]`` is set when that tier lent any object.

        An object that tier could not lend goes down the ladder on its own (the failed attempt
        already reported) into the slot or lent by a later tier; a chunk that cannot be read or
        installed fails the run and ends the batch, as on the per-object path.
        """
        run = job.run
        needed = run.needed
        got = self._borrow_batch(job, batch, admitted, served)
        if got is None:
            return False
        name, lent, failed = got
        host = job.host
        assert host is not None
        items = lent.items
        extra: list[Borrowed] = []
        done: list[int] = []
        nbytes = 0
        i = 0
        gate = run.installs  # entered for the copies only: never across a read
        entered = False
        try:
            for c in batch:
                if (run.failure is not None or run.abandoned) and not run.wanted(c):
                    return True
                groups = needed[c]
                payloads: dict[str, Any] = {}
                for g in groups:
                    if i in failed:
                        if entered:
                            gate.leave()
                            entered = False
                        borrowed = self._read_unlent(job, c, g, slot, failed[i])
                        if borrowed is False:
                            return True
                        if borrowed is not None:
                            extra.append(borrowed)
                            payloads[g] = borrowed.payload
                    else:
                        payload = items[i]
                        payloads[g] = payload
                        nbytes += len(payload)
                    i += 1
                if not entered:
                    if not gate.enter():
                        return True  # the request is over
                    entered = True
                elif gate.closing:
                    return True  # the request is over: the close waits for us
                try:
                    host.install(c, groups, slot, payloads)
                except Exception as exc:  # a failed copy is a failed chunk, never a raise
                    run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, [repr(exc)]))
                    return True
                done.append(c)
            return True
        finally:
            if entered:
                gate.leave()
            lent.release()
            for b in extra:
                b.release()
            if done:
                run.record_lent(name, nbytes, done)

    def _borrow_batch(
        self,
        job: _Job,
        batch: Sequence[int],
        admitted: str | None,
        served: list[bool] | None,
    ) -> tuple[str, LentPayloads, dict[int, tuple[str, Outcome]]] | None:
        """The lending tier's name, what it lent of ``batch`` and what it failed to (by the
        object's index), or None when the batch is not lent (see :meth:`_batch_lent`)."""
        lender = self._lender(job, batch)
        if lender is None:
            return None
        name, objects = lender
        got = self.ladder.borrow_many_blocking(
            job.gate, name, objects, self._expected, admitted=admitted == name
        )
        if got is None:
            return None
        lent, failed = got
        if served is not None and len(failed) < len(objects):
            served[0] = True
        return name, lent, failed

    def _lender(
        self, job: _Job, batch: Sequence[int]
    ) -> tuple[str, list[tuple[ChunkKey, int, str]]] | None:
        """The one lending tier that is the first holder of every object of ``batch``, and
        those objects ``(key, chunk, group)`` in order; None when there is no such tier."""
        needed, holders, keys = job.run.needed, job.probe.holders, job.probe.keys
        name: str | None = None
        objects: list[tuple[ChunkKey, int, str]] = []
        for c in batch:
            hc = holders[c]
            for g in needed[c]:
                h = hc[g]
                if not h or (name is not None and h[0] != name):
                    return None
                name = h[0]
                objects.append((keys[c], c, g))
        if name is None or not self.ladder.lends(name):
            return None
        return name, objects

    def _read_unlent(
        self, job: _Job, c: int, g: str, slot: Slot, failed: tuple[str, Outcome]
    ) -> Borrowed | Literal[False] | None:
        """An object the lending tier could not lend (``failed``: why, and the outcome already
        reported) goes down the ladder on its own: what a later tier lent, None when it was read
        into the slot, False when it could not be read (the run failed)."""
        text, outcome = failed
        result = self.ladder.read_blocking(
            job.gate, job.probe.keys[c], c, g, job.probe.holders[c][g][1:],
            self._region(job, slot, g), self._expected[g], borrow=True, prior=(text,),
        )  # fmt: skip
        result.corrupt = result.corrupt or outcome is Outcome.CORRUPT
        if not result.ok:
            self._read_failed(job, c, g, result)
            return False
        job.run.record_read(result)
        return result.borrowed

    def _lent(self, job: _Job, c: int) -> bool:
        """Whether every group of chunk ``c`` is first asked of a tier that lends in place."""
        holders = job.probe.holders[c]
        return all(holders[g] and self.ladder.lends(holders[g][0]) for g in job.run.needed[c])

    def _read_chunk_blocking(
        self,
        job: _Job,
        c: int,
        slot: Slot,
        lent: dict[str, Borrowed] | None = None,
        admitted: str | None = None,
    ) -> bool:
        """Read (or, with ``lent``, borrow where a tier lends) every group of chunk ``c``;
        ``admitted``: the tier the gate admitted this chunk's batch on (:meth:`TierLadder.
        admit_batch`), read first without a per-object admission."""
        key = job.probe.keys[c]
        for g in job.run.needed[c]:
            if admitted is not None:
                result = self.ladder.read_admitted_blocking(
                    job.gate, admitted, key, c, g, job.probe.holders[c][g],
                    self._region(job, slot, g), self._expected[g],
                )  # fmt: skip
            else:
                result = self.ladder.read_blocking(
                    job.gate, key, c, g, job.probe.holders[c][g], self._region(job, slot, g),
                    self._expected[g], borrow=lent is not None,
                )  # fmt: skip
            if not result.ok:
                self._read_failed(job, c, g, result)
                return False
            if result.borrowed is not None and lent is not None:
                lent[g] = result.borrowed
            job.run.record_read(result)
        return True

    async def _batch_async(self, job: _Job, batch: Sequence[int], slot: Slot) -> None:
        """Event loop: read each chunk with the tiers' async reads, install in a thread."""
        run = job.run
        for c in batch:
            if not run.wanted(c):
                return
            key = job.probe.keys[c]
            for g in run.needed[c]:
                result = await self.ladder.read(
                    job.gate, key, c, g, job.probe.holders[c][g], self._region(job, slot, g),
                    self._expected[g],
                )  # fmt: skip
                if not result.ok:
                    self._read_failed(job, c, g, result)
                    return
                run.record_read(result)
            installer = job.installer
            if installer.copies:  # a copy into the cache: off the event loop
                if not await self._thread(job, slot, installer.after_read, job, c, slot, None):
                    return
            elif not installer.after_read(job, c, slot, None):
                return

    # ------------------------------------------------------------------ installing
    def _install_host(
        self, job: _Job, c: int, slot: Slot, lent: dict[str, Borrowed] | None = None
    ) -> bool:
        """Copy chunk ``c`` from ``slot`` (and the ``lent`` payloads) into the cache (any
        thread); False if it failed."""
        run = job.run
        groups = run.needed[c]
        assert job.host is not None
        if not run.installs.enter():
            return False  # the request is over
        try:
            payloads = {g: b.payload for g, b in lent.items()} if lent else None
            job.host.install(c, groups, slot, payloads)
        except Exception as exc:  # a failed copy is a failed chunk, never a raise
            run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, [repr(exc)]))
            return False
        finally:
            run.installs.leave()
        run.record_installed(c, groups)
        return True

    async def _await_device(self, job: _Job, c: int, slot: Slot, event: Any) -> None:
        """The slot may be reused only once its host-to-device copy has completed."""
        if event is None:
            return  # abandoned before the copy was enqueued; the engine's finally releases
        while not event.query():  # noqa: ASYNC110 - polling a CUDA event, not an anyio one
            await anyio.sleep(0.0005)
        job.run.record_installed(c, job.run.needed[c])
        self._installed(job, slot)
        await self._announce(job, [c])


def _enqueue_cuda(device: CudaInstaller, job: _Job, c: int, slot: Slot) -> Any:
    """Enqueue chunk ``c``'s host-to-device copy on the side stream; return its event.

    None when the request is over or the copy could not be enqueued (a CUDA error, e.g. out
    of memory for the device-side staging copy): that is a failed chunk, never a raise.
    """
    run = job.run
    if not run.installs.enter():
        return None
    groups = run.needed[c]
    try:
        return device.install(c, groups, slot)
    except Exception as exc:
        run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, [repr(exc)]))
        return None
    finally:
        run.installs.leave()


def _no_copy(job: _Job, c: int, slot: Slot, lent: dict[str, Borrowed] | None) -> bool:
    """A chunk read needs nothing more in the worker (its copy comes after the batch)."""
    return True


class Installer:
    """One install mode's rules: what follows a chunk's read, what follows a batch, what ends
    the run. :meth:`WindowPipeline._installer` picks one per run; the pipeline's loop calls it
    and never asks which mode it runs in.

    Attributes:
        host: the host destination's slot views (None for a device destination).
        one_per_slot: one chunk per batch (its slot stays busy until its copy is done).
        lends: installs take payloads lent by a tier in place, and a lone large chunk may be
            copied after its transfer turn (the streamed host path).
        copies: ``after_read`` copies into the cache (CPU work: the async-read path runs it in
            a worker thread).
        streams: ``after_read`` completes a chunk and frees its slot at once, so a worker may
            keep several chunks in flight through several slots (the streamed host path).
        after_read: ``after_read(job, chunk, slot, lent) -> bool``, in the worker thread (or on
            the event loop for a batch run inline): what follows a chunk's verified read; False
            ends the batch (the failure is recorded in the run). An attribute, not a method, so
            the hot path pays one call.
    """

    host: HostInstaller | None = None
    one_per_slot = True
    lends = False
    copies = False
    streams = False
    after_read: Callable[[_Job, int, Slot, dict[str, Borrowed] | None], bool] = staticmethod(
        _no_copy
    )

    def __init__(self, pipe: WindowPipeline) -> None:
        self.pipe = pipe

    def after_batch(
        self, job: _Job, batch: Sequence[int], slot: Slot, tg: TaskGroup
    ) -> Awaitable[None] | None:
        """On the event loop once a batch was read (and copied, where ``after_read`` copies):
        give the slot back and announce the batch (installer completion), unless the mode keeps
        the slot; what it returns is awaited."""
        self.pipe._installed(job, slot)
        return self.pipe._announce(job, batch)

    async def finish(self, job: _Job) -> None:
        """After every worker ended (the run's task group closed)."""


class StreamedHostInstall(Installer):
    """Host destination, bounded: each chunk is copied into the cache in the worker that read
    it (from the slot, or from a tier's lent payload); the slot goes back after its batch."""

    one_per_slot = False
    lends = True
    copies = True
    streams = True

    def __init__(self, pipe: WindowPipeline, host: HostInstaller) -> None:
        super().__init__(pipe)
        self.host = host
        # the pipeline's own install (looked up per run, so a patched one is used)
        self.after_read = pipe._install_host


class StreamedCudaInstall(Installer):
    """CUDA destination, bounded: one chunk per slot; after its read the copy is enqueued on
    the side stream and the slot goes back when its event completes (up to W in flight)."""

    def __init__(self, pipe: WindowPipeline, device: CudaInstaller) -> None:
        super().__init__(pipe)
        self.device = device

    def after_batch(
        self, job: _Job, batch: Sequence[int], slot: Slot, tg: TaskGroup
    ) -> Awaitable[None] | None:
        if job.run.wanted(batch[0]):
            return self._enqueue(job, batch[0], slot, tg)
        return super().after_batch(job, batch, slot, tg)

    async def _enqueue(self, job: _Job, c: int, slot: Slot, tg: TaskGroup) -> None:
        pipe = self.pipe
        event = await pipe._thread(job, slot, _enqueue_cuda, self.device, job, c, slot)
        tg.start_soon(pipe._await_device, job, c, slot, event)


class WholePlanInstall(Installer):
    """The whole-plan baseline (RWS = |S|): every chunk is read into its own region of one
    private buffer and stays staged; once every read ended, everything staged is installed in
    chunk order (host: one worker-thread call; CUDA: one copy at a time)."""

    def __init__(
        self,
        pipe: WindowPipeline,
        *,
        host: HostInstaller | None = None,
        device: CudaInstaller | None = None,
    ) -> None:
        super().__init__(pipe)
        self.host = host
        self.device = device
        #: chunks read, waiting for the install
        self.staged: dict[int, Slot] = {}
        self.after_read = self._stage

    def _stage(self, job: _Job, c: int, slot: Slot, lent: dict[str, Borrowed] | None) -> bool:
        self.staged[c] = slot
        return True

    def after_batch(
        self, job: _Job, batch: Sequence[int], slot: Slot, tg: TaskGroup
    ) -> Awaitable[None] | None:
        if batch[0] in self.staged:
            return None  # the slot's region stays staged until the install
        return super().after_batch(job, batch, slot, tg)

    async def finish(self, job: _Job) -> None:
        """Install every staged chunk, in order, then announce them."""
        if not self.staged:
            return
        await self._install_staged(job)
        await self.pipe._announce(job, sorted(self.staged))

    async def _install_staged(self, job: _Job) -> None:
        staged, run, pipe = self.staged, job.run, self.pipe
        if self.device is not None:
            for c in sorted(staged):
                if run.wanted(c):
                    event = await anyio.to_thread.run_sync(
                        _enqueue_cuda, self.device, job, c, staged[c]
                    )
                    if event is None:
                        return  # the copy failed (recorded) or the request is over
                    while not event.query():  # noqa: ASYNC110 - polling a CUDA event
                        await anyio.sleep(0.0005)
                    run.record_installed(c, run.needed[c])
            return

        def install_all() -> None:
            for c in sorted(staged):
                if not run.wanted(c) or not pipe._install_host(job, c, staged[c]):
                    return

        # abandonable: a late copy is refused by the run's install gate
        await anyio.to_thread.run_sync(install_all, abandon_on_cancel=True, limiter=pipe._limiter)
