"""The save path: gather full chunks from the paged cache through staging, write to tiers.

Where it runs: the engine's event loop; gathers and tier writes run in worker threads.

Each chunk takes one slot from the engine's W-slot pool (the same budget restores use), gathers
the groups some tier lacks into it, writes them to every tier missing them (at most ``io_depth``
writes in flight), and gives the slot back in ``finally``. A tier failing a write is counted and
logged; the other tiers still get the object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from .._errors import BsrError
from ..core._keys import ChunkKey, ObjectKey
from ..core._layout import StateLayout
from ..core._plan import needed_objects
from ..core._results import SaveResult
from ..tiers._base import Tier
from ._cache import PagedKVCache, gather_chunk
from ._staging import Slot, StagingAccount


async def save_chunks(
    *,
    layout: StateLayout,
    tiers: Sequence[Tier],
    account: StagingAccount,
    cache: PagedKVCache,
    ids: torch.Tensor,
    keys: Sequence[ChunkKey],
    io_depth: int,
    log: Any,
    on_written: Callable[[Tier, ObjectKey], None] | None = None,
    is_retired: Callable[[Tier, ObjectKey], bool] | None = None,
) -> SaveResult:
    """Store every object a prefix of ``len(keys)`` chunks needs into every tier lacking it.

    ``on_written(tier, object_key)`` is called after each object a tier newly stored. A copy the
    engine retired (``is_retired``: it failed a read) is replaced: deleted, then written again.
    """
    t0 = time.perf_counter()
    n = len(keys)
    written = {t.name: 0 for t in tiers}
    skipped = {t.name: 0 for t in tiers}
    nbytes = {t.name: 0 for t in tiers}
    errors = {t.name: 0 for t in tiers}
    wanted = needed_objects(layout, n)
    objs = [ObjectKey(keys[c], g) for c, g in wanted]
    missing: dict[tuple[int, str], list[Tier]] = {(c, g): [] for c, g in wanted}
    replace: set[tuple[str, int, str]] = set()
    for t in tiers:
        try:
            present = await t.contains_many(objs)
        except (BsrError, OSError) as exc:
            errors[t.name] += 1
            log.warning("bsr.save.probe_failed", tier=t.name, error=str(exc))
            present = [False] * len(objs)
        for (c, g), okey, p in zip(wanted, objs, present):
            if p and is_retired is not None and is_retired(t, okey):
                replace.add((t.name, c, g))
                missing[(c, g)].append(t)
            elif p:
                skipped[t.name] += 1
            else:
                missing[(c, g)].append(t)
    todo: dict[int, list[str]] = {}
    for (c, g), ts in missing.items():
        if ts:
            todo.setdefault(c, []).append(g)
    limiter = anyio.CapacityLimiter(io_depth)

    def gather(c: int, slot: Slot) -> None:
        blocks = cache.chunk_blocks(ids, c)
        for g in todo[c]:
            gather_chunk(cache, g, blocks, slot.tensor[layout.slot_offset(g) :])

    async def save_chunk(c: int, slot: Slot) -> None:
        try:
            await anyio.to_thread.run_sync(gather, c, slot)
            for g in todo[c]:
                off = layout.slot_offset(g)
                payload = slot.tensor[off : off + layout.group_chunk_bytes(g)]
                for t in missing[(c, g)]:
                    try:
                        async with limiter:
                            if (t.name, c, g) in replace:
                                await t.delete(keys[c], g)
                            ok = await t.write(keys[c], g, payload)
                    except (BsrError, OSError) as exc:
                        errors[t.name] += 1
                        log.warning(
                            "bsr.save.write_failed", tier=t.name, chunk=c, group=g, error=str(exc)
                        )
                        continue
                    if ok:
                        written[t.name] += 1
                        nbytes[t.name] += payload.numel()
                        if on_written is not None:
                            on_written(t, ObjectKey(keys[c], g))
                    else:
                        skipped[t.name] += 1
        finally:
            account.release(slot)

    async with anyio.create_task_group() as tg:
        for c in sorted(todo):
            slot = await account.acquire()
            tg.start_soon(save_chunk, c, slot)
    return SaveResult(
        saved_tokens=n * layout.chunk_tokens,
        chunks=n,
        objects_written=written,
        objects_skipped=skipped,
        bytes_written=nbytes,
        errors=errors,
        rws_peak_bytes=account.peak_bytes,
        duration_s=time.perf_counter() - t0,
    )
