"""The transfer side of a restore: stream chunks tier -> staging slot -> paged cache.

Where it runs: the engine's event loop; blocking reads and copies run in worker threads.

How it works::

    dispatcher --(one slot per chunk, FIFO from the shared W-slot pool)--> chunk readers
    (io_depth reads in flight, each down the tier ladder, verified by the tier)
    --(bounded stream)--> installer (slot -> cache blocks; with CUDA a non-blocking copy on a side
    stream, the slot released when its event completes) -> release

Ownership of a slot moves dispatcher -> reader -> installer; whoever holds it last releases it.
Every slot a run takes is also in ``run.held``, and the engine's ``finally`` releases whatever is
still there, so a slot is given back exactly once on success, failure, deadline and cancellation.
This module decides nothing about commit: it records what was installed in ``run.installed``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from .._errors import (
    BsrError,
    CorruptObjectError,
    ObjectError,
    ObjectNotFoundError,
    TierTimeoutError,
)
from ..core._keys import ChunkKey, ObjectKey
from ..core._layout import StateLayout, align_up
from ..core._lifecycle import Reason
from ..core._plan import groups_by_chunk
from ..core._results import Policy, Strategy
from ..engine._health import TierHealth
from ..tiers._base import Tier
from ._cache import PagedKVCache, install_chunk
from ._staging import Slot, StagingAccount

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


class ChunkFailure(Exception):
    """A (chunk, group) could not be read or installed from any tier."""

    def __init__(self, chunk: int, group: str, reason: Reason, errors: list[str]) -> None:
        super().__init__(f"chunk {chunk} group {group}: {reason}")
        self.chunk = chunk
        self.group = group
        self.reason = reason
        self.errors = errors


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

    def release(self, slot: Slot) -> None:
        """Nothing to give back: the buffer lives as long as the request."""


SlotSource = StagingAccount | WholePlanBuffer


class RestoreRun:
    """Per-restore mutable state shared by the pipeline tasks and read by the engine."""

    def __init__(self, rid: str, target: int, layout: StateLayout, policy: Policy) -> None:
        self.rid = rid
        self.policy = policy
        self.target = target
        self.limit = target  # chunks >= limit are abandoned (a chunk below failed)
        self.needed = groups_by_chunk(layout, target)
        self.installed: set[tuple[int, str]] = set()
        self.touched_chunks: set[int] = set()
        self.held: set[Slot] = set()
        self.failure: ChunkFailure | None = None
        self.bytes_by_tier: dict[str, int] = {}
        self.fallbacks = 0
        self.quarantined = 0
        self.errors: list[str] = []
        self.deadline_at: float | None = None  # time.perf_counter() deadline of the request

    def fail(self, failure: ChunkFailure) -> None:
        """Record a failure; chunks from it on will not be used."""
        self.errors.extend(failure.errors)
        if self.failure is None or failure.chunk < self.failure.chunk:
            self.failure = failure
        self.limit = min(self.limit, failure.chunk)

    @property
    def must_stop(self) -> bool:
        """Whether nothing more can be committed, so the window should stop now."""
        return self.failure is not None and (
            self.limit == 0 or self.policy is Policy.ALL_OR_NOTHING
        )


Quarantine = Callable[[RestoreRun, Tier, ChunkKey, str, str, bool], Any]


class WindowPipeline:
    """Moves the chunks of one :class:`RestoreRun` through a slot source into a cache.

    Args:
        layout: the state layout.
        tiers: the engine's tiers, fastest first (indices in ``holders`` refer to it).
        window: W (bounds the stream between readers and installer).
        io_depth: reads in flight for this run.
        is_quarantined: whether (tier name, object id) is out of service.
        quarantine: coroutine ``(run, tier, key, group, why, physical)`` taking an object out of
            service after a failed read (``physical``: also remove it from the tier).
        log: structlog logger.
        health: per-tier circuit breakers (tiers whose breaker is open are skipped).
    """

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        *,
        window: int,
        io_depth: int,
        is_quarantined: Callable[[str, str], bool],
        quarantine: Quarantine,
        log: Any,
        health: TierHealth | None = None,
    ) -> None:
        self.layout = layout
        self.tiers = tiers
        self.window = window
        self.io_depth = io_depth
        self.is_quarantined = is_quarantined
        self.quarantine = quarantine
        self.log = log
        self.health = health or TierHealth([t.name for t in tiers], threshold=None)
        self.cuda_stream: Any = None

    async def synchronize(self) -> None:
        """Wait for every device copy this pipeline enqueued."""
        if self.cuda_stream is not None:
            await anyio.to_thread.run_sync(self.cuda_stream.synchronize)

    async def run(
        self,
        run: RestoreRun,
        slots: SlotSource,
        keys: Sequence[ChunkKey],
        holders: list[dict[str, list[int]]],
        cache: PagedKVCache,
        ids: torch.Tensor,
        strategy: Strategy,
    ) -> None:
        """Stream every needed chunk into the cache, or stop early on failure.

        Failures are recorded in ``run`` (never raised); cancellation propagates.
        """
        send: ObjectSendStream[tuple[int, Slot]]
        recv: ObjectReceiveStream[tuple[int, Slot]]
        chunks = sorted(run.needed)
        whole_plan = strategy is Strategy.WHOLE_PLAN
        send, recv = anyio.create_memory_object_stream(
            max(1, len(chunks)) if whole_plan else self.window
        )
        io_limit = anyio.CapacityLimiter(self.io_depth)
        reads_done = anyio.Event()
        use_cuda = cache.device.type == "cuda"
        if use_cuda and self.cuda_stream is None:
            self.cuda_stream = torch.cuda.Stream(device=cache.device)  # type: ignore[no-untyped-call]

        def give_back(slot: Slot) -> None:
            if slot in run.held:
                run.held.discard(slot)
                slots.release(slot)

        async def read_group(c: int, g: str, slot: Slot) -> None:
            off = self.layout.slot_offset(g)
            region = slot.tensor[off : off + align_up(self.layout.group_chunk_bytes(g))]
            await self.read_with_fallback(run, keys[c], c, g, holders[c][g], region, io_limit)

        async def read_chunk(c: int, slot: Slot, tx: ObjectSendStream[tuple[int, Slot]]) -> None:
            async with tx:
                groups = run.needed[c]
                if len(groups) == 1:
                    await read_group(c, groups[0], slot)
                else:  # the groups of a chunk share io_depth like any other reads
                    async with anyio.create_task_group() as tg:
                        for g in groups:
                            tg.start_soon(read_group, c, g, slot)
                if c < run.limit:
                    await tx.send((c, slot))
                else:
                    give_back(slot)

        async def dispatcher(tg: Any) -> None:
            async with send:
                for c in chunks:
                    if c >= run.limit:
                        break
                    slot = await slots.acquire()
                    run.held.add(slot)
                    if c >= run.limit:
                        give_back(slot)
                        break
                    tg.start_soon(read_chunk, c, slot, send.clone())

        async def reads() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(dispatcher, tg)
            finally:
                reads_done.set()

        async def await_device(c: int, slot: Slot, event: Any) -> None:
            # the slot may be reused only once its host-to-device copy has completed
            while not event.query():  # noqa: ASYNC110 - polling a CUDA event, not an anyio one
                await anyio.sleep(0.0005)
            for g in run.needed[c]:
                run.installed.add((c, g))
            give_back(slot)

        async def installer(tg: Any) -> None:
            if whole_plan:
                await reads_done.wait()
            async with recv:
                async for c, slot in recv:
                    run.touched_chunks.add(c)
                    blocks = cache.chunk_blocks(ids, c)
                    groups = run.needed[c]
                    try:
                        if use_cuda:
                            event = await anyio.to_thread.run_sync(
                                self._install_cuda, cache, groups, blocks, slot
                            )
                            tg.start_soon(await_device, c, slot, event)
                            continue
                        await anyio.to_thread.run_sync(
                            self._install_host, cache, groups, blocks, slot
                        )
                    except Exception as exc:  # a failed copy is a failed chunk, never a raise
                        run.fail(ChunkFailure(c, groups[0], Reason.INSTALL_FAILED, [repr(exc)]))
                        give_back(slot)
                        if run.must_stop:
                            raise run.failure from None  # type: ignore[misc]
                        continue
                    for g in groups:
                        run.installed.add((c, g))
                    give_back(slot)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(installer, tg)
                tg.start_soon(reads)
        except ChunkFailure:
            pass
        except BaseExceptionGroup as eg:
            _, rest = eg.split(ChunkFailure)
            if rest is not None:
                raise rest from None

    def _install_host(
        self, cache: PagedKVCache, groups: Sequence[str], blocks: torch.Tensor, slot: Slot
    ) -> None:
        for g in groups:
            install_chunk(cache, g, blocks, slot.tensor[self.layout.slot_offset(g) :])

    def _install_cuda(
        self, cache: PagedKVCache, groups: Sequence[str], blocks: torch.Tensor, slot: Slot
    ) -> Any:
        with torch.cuda.stream(self.cuda_stream):
            for g in groups:
                install_chunk(
                    cache, g, blocks, slot.tensor[self.layout.slot_offset(g) :], non_blocking=True
                )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.cuda_stream)
        return event

    async def read_with_fallback(
        self,
        run: RestoreRun,
        key: ChunkKey,
        chunk: int,
        group: str,
        tier_ids: list[int],
        region: torch.Tensor,
        io_limit: anyio.CapacityLimiter,
    ) -> None:
        """Read one (chunk, group) into ``region`` down the tier ladder.

        Raises :class:`ChunkFailure` when no tier can supply it and the run must stop; under
        ``truncate`` with chunks below still usable it records the failure and returns.
        """
        errors: list[str] = []
        reason = Reason.READ_FAILED
        expected = self.layout.group_chunk_bytes(group)
        oid = ObjectKey(key, group).object_id
        health = self.health
        for attempt, ti in enumerate(tier_ids):
            tier = self.tiers[ti]
            if self.is_quarantined(tier.name, oid):
                continue
            if not health.available(tier.name):
                errors.append(f"{tier.name}: skipped, circuit breaker open")
                continue
            try:
                async with io_limit:
                    n = await tier.read_into(key, group, region)
                if n != expected:
                    raise CorruptObjectError(
                        f"payload is {n} bytes, the layout says {expected}",
                        tier=tier.name,
                        group=group,
                    )
            except ObjectError as exc:
                # verified bad bytes: the object's fault; take it out of the tier too
                health.success(tier.name)
                reason = Reason.CORRUPT
                errors.append(f"{tier.name}: {exc}")
                await self.quarantine(run, tier, key, group, type(exc).__name__, True)
                continue
            except ObjectNotFoundError as exc:
                # gone since the probe (evicted, lost): a miss, the tier answered
                health.success(tier.name)
                errors.append(f"{tier.name}: {exc}")
                continue
            except TierTimeoutError as exc:
                # slow or dead tier: not the object's fault, no quarantine
                health.failure(tier.name)
                errors.append(f"{tier.name}: {exc}")
                continue
            except (BsrError, OSError) as exc:
                # an I/O error on this object: never use it again in this engine, but do not
                # ask a possibly dead tier to delete it
                health.failure(tier.name)
                errors.append(f"{tier.name}: {exc}")
                await self.quarantine(run, tier, key, group, "io_error", False)
                continue
            except Exception as exc:  # a tier's own bug: treat as a failed read, go lower
                health.failure(tier.name)
                errors.append(f"{tier.name}: unexpected {exc!r}")
                continue
            health.success(tier.name)
            if attempt > 0 or errors:
                run.fallbacks += 1
                run.errors.extend(errors)
            run.bytes_by_tier[tier.name] = run.bytes_by_tier.get(tier.name, 0) + n
            return
        failure = ChunkFailure(chunk, group, reason, errors or ["no tier holds it"])
        run.fail(failure)
        self.log.warning(
            "bsr.restore.read_failed",
            request_id=run.rid,
            chunk=chunk,
            group=group,
            reason=str(reason),
            errors=errors,
        )
        if run.must_stop:
            raise failure
