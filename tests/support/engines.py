"""The tests' one engine factory: every test that needs a :class:`bsr.RestoreEngine` over some
tiers (and is not testing the constructor itself) builds it here; the variants are parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

import bsr


def make_engine(
    layout: bsr.StateLayout,
    tiers: list[bsr.Tier],
    *,
    window: int = 2,
    io_depth: int = 2,
    model_id: str = "test-model",
    **kw: Any,
) -> bsr.RestoreEngine:
    """An engine with a small window over ``tiers``, in namespace ``model_id`` unless a
    ``namespace`` is given (extra options pass through to :class:`bsr.RestoreEngine`)."""
    kw.setdefault("namespace", bsr.Namespace(model_id))
    return bsr.RestoreEngine(layout, tiers, window=window, io_depth=io_depth, **kw)


async def restore_all_at_once(
    eng: bsr.RestoreEngine,
    prompts: Sequence[Sequence[int]],
    dst: bsr.PagedKVCache,
    ids: Sequence[Any],
) -> tuple[list[bsr.RestoreResult], int]:
    """Restore every prompt at once (prompt ``i`` into blocks ``ids[i]`` of ``dst``); the
    results in the order the restores ended, and the most staging slots seen in use while they
    ran (looked at every millisecond)."""
    results: list[bsr.RestoreResult] = []
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while len(results) < len(prompts):
            peak = max(peak, eng.staging.statistics().in_use)
            await anyio.sleep(0.001)

    async def one(i: int) -> None:
        results.append(await eng.restore(prompts[i], dst, ids[i]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results, peak


class HangingContains(bsr.TierWrapper[bsr.Tier]):
    """A tier whose metadata queries never answer while ``hang`` is set (a paused remote
    master, a hung mount), counting the calls: what bounds a lookup is what these tests check."""

    def __init__(self, inner: bsr.Tier) -> None:
        super().__init__(inner)
        self.calls = 0
        self.hang = False

    async def contains_many(self, objects: Sequence[bsr.ObjectKey]) -> list[bool]:
        self.calls += 1
        if self.hang:
            await anyio.sleep_forever()
        return await self.inner.contains_many(objects)
