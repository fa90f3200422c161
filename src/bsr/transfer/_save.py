"""The save path: gather full chunks from the paged cache through staging, write to tiers.

Where it runs: the engine's event loop; gathers and tier writes run in worker threads.

Each chunk takes one slot from the engine's W-slot pool (the same budget restores use), gathers
the groups some tier lacks into it, writes them to every tier missing them (at most ``io_depth``
writes in flight), and gives the slot back in ``finally``. A tier failing a write is counted and
logged; the other tiers still get the object. A tier that says it is busy (``TierBusyError``:
a FileTier root whose lock another process held past its bound) is skipped for the rest of the
save, counted by reason (``SaveResult.skipped``), never waited for again; a tier the caller marks
down (its circuit breaker is open) is neither asked nor written, its objects counted the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import torch

from .._errors import BsrError, TierBusyError
from ..core._keys import ChunkKey, ObjectKey
from ..core._layout import StateLayout
from ..core._plan import plan_save
from ..core._results import SaveResult
from ..tiers._base import Tier
from ._cache import PagedKVCache, gather_chunk
from ._staging import Slot, StagingAccount
from ._tables import BlockTables


class _SavePlan:
    """Which tiers lack which objects of the prefix, and the counters of one save."""

    def __init__(
        self,
        layout: StateLayout,
        tiers: Sequence[Tier],
        keys: Sequence[ChunkKey],
        wanted: Sequence[tuple[int, str]],
        down: Mapping[str, str],
    ):
        self.layout = layout
        self.tiers = list(tiers)
        self.keys = keys
        self.wanted = list(wanted)
        self.written = {t.name: 0 for t in tiers}
        self.skipped = {t.name: 0 for t in tiers}
        self.nbytes = {t.name: 0 for t in tiers}
        self.errors = {t.name: 0 for t in tiers}
        self.busy: dict[str, str] = dict(down)  # tier -> why it is busy: skipped for the rest
        self.skipped_by: dict[str, int] = {}  # reason -> objects not written
        self.missing: dict[tuple[int, str], list[Tier]] = {(c, g): [] for c, g in self.wanted}
        self.replace: set[tuple[str, int, str]] = set()

    async def find_missing(
        self, log: Any, is_retired: Callable[[Tier, ObjectKey], bool] | None
    ) -> dict[int, list[str]]:
        """Ask every tier what it holds; return, per chunk, the groups some tier lacks."""
        objs = [ObjectKey(self.keys[c], g) for c, g in self.wanted]
        for t in self.tiers:
            if t.name in self.busy:  # down: not asked, and none of its objects written
                reason = self.busy[t.name]
                self.skipped_by[reason] = self.skipped_by.get(reason, 0) + len(objs)
                continue
            try:
                present = await t.contains_many(objs)
            except (BsrError, OSError) as exc:
                self.errors[t.name] += 1
                log.warning("bsr.save.probe_failed", tier=t.name, error=str(exc))
                present = [False] * len(objs)
            for (c, g), okey, p in zip(self.wanted, objs, present):
                if p and is_retired is not None and is_retired(t, okey):
                    self.replace.add((t.name, c, g))  # a retired copy is written again
                    self.missing[(c, g)].append(t)
                elif p:
                    self.skipped[t.name] += 1
                else:
                    self.missing[(c, g)].append(t)
        todo: dict[int, list[str]] = {}
        for (c, g), ts in self.missing.items():
            if ts:
                todo.setdefault(c, []).append(g)
        return todo

    async def write(
        self,
        t: Tier,
        c: int,
        g: str,
        payload: torch.Tensor,
        limiter: anyio.CapacityLimiter,
        log: Any,
        on_written: Callable[[Tier, ObjectKey], None] | None,
    ) -> None:
        """Write one object to one tier, counting the outcome (a failure is not raised)."""
        key = self.keys[c]
        if t.name in self.busy:  # it said it is busy: the rest of this save skips it
            self._skip(self.busy[t.name])
            return
        try:
            async with limiter:
                if (t.name, c, g) in self.replace:
                    await t.delete(key, g)
                ok = await t.write(key, g, payload)
        except TierBusyError as exc:
            reason = str(exc.fields.get("reason") or "busy")
            self.busy.setdefault(t.name, reason)
            self._skip(reason)
            log.warning("bsr.save.tier_busy", tier=t.name, chunk=c, group=g, reason=reason)
            return
        except (BsrError, OSError) as exc:
            self.errors[t.name] += 1
            log.warning("bsr.save.write_failed", tier=t.name, chunk=c, group=g, error=str(exc))
            return
        if not ok:
            self.skipped[t.name] += 1
            return
        self.written[t.name] += 1
        self.nbytes[t.name] += payload.numel()
        if on_written is not None:
            on_written(t, ObjectKey(key, g))

    def _skip(self, reason: str) -> None:
        self.skipped_by[reason] = self.skipped_by.get(reason, 0) + 1


async def save_chunks(
    *,
    layout: StateLayout,
    tiers: Sequence[Tier],
    account: StagingAccount,
    cache: PagedKVCache,
    tables: BlockTables,
    keys: Sequence[ChunkKey],
    io_depth: int,
    log: Any,
    on_written: Callable[[Tier, ObjectKey], None] | None = None,
    is_retired: Callable[[Tier, ObjectKey], bool] | None = None,
    checkpoint_chunks: int | None = None,
    down: Mapping[str, str] | None = None,
) -> SaveResult:
    """Store the objects of ``len(keys)`` chunks that ``tables`` hold into every tier lacking them.

    What is stored is planned by :func:`~bsr.core._plan.plan_save` from the chunks that lie
    wholly in real blocks of ``tables`` (an object always holds its whole chunk): the groups
    without a window their longest whole prefix, each sliding-window group its window at the
    end, at the longest prefix every group can serve and, with ``checkpoint_chunks``, at every
    window checkpoint. ``on_written(tier, object_key)`` is called after each object a tier newly
    stored. A copy the engine retired (``is_retired``: it failed a read) is replaced: deleted,
    then written again. ``down``: tiers neither asked nor written (tier name -> the reason its
    objects are counted under in ``SaveResult.skipped``).
    """
    t0 = time.perf_counter()
    shape = plan_save(layout, len(keys), tables.whole, checkpoint_chunks)
    plan = _SavePlan(layout, tiers, keys, shape.objects, down or {})
    todo = await plan.find_missing(log, is_retired)
    limiter = anyio.CapacityLimiter(io_depth)

    def gather(c: int, slot: Slot) -> None:
        for g in todo[c]:
            gather_chunk(cache, g, tables.chunk_blocks(g, c), slot.tensor[layout.slot_offset(g) :])

    async def save_chunk(c: int, slot: Slot) -> None:
        try:
            await anyio.to_thread.run_sync(gather, c, slot)
            for g in todo[c]:
                off = layout.slot_offset(g)
                payload = slot.tensor[off : off + layout.group_chunk_bytes(g)]
                for t in plan.missing[(c, g)]:
                    await plan.write(t, c, g, payload, limiter, log, on_written)
        finally:
            account.release(slot)

    async with anyio.create_task_group() as tg:
        for c in sorted(todo):
            slot = await account.acquire()
            tg.start_soon(save_chunk, c, slot)
    return SaveResult(
        saved_tokens=shape.restorable_chunks * layout.chunk_tokens,
        chunks=shape.restorable_chunks,
        objects_written=plan.written,
        objects_skipped=plan.skipped,
        bytes_written=plan.nbytes,
        errors=plan.errors,
        rws_peak_bytes=account.peak_bytes,
        duration_s=time.perf_counter() - t0,
        skipped=plan.skipped_by,
    )
