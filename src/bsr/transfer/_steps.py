"""One batch call's ``begin`` and ``end``: which chunk a free slot reads next, and what
follows the last of its groups.

Where it runs: the worker thread (or the event loop, for a small memory-speed batch) of one
call of :meth:`WindowPipeline._move <bsr.transfer._pipeline.WindowPipeline>`; a
:class:`BatchSteps` lives for that call only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

from ..core._lifecycle import Reason
from ..core._results import Probe
from ..tiers._reads import Borrowed, ReadItem
from ._installers import Installer
from ._ladder import LadderResult
from ._run import ChunkFailure, RestoreRun
from ._staging import Slot


def read_failed(run: RestoreRun, chunk: int, group: str, result: LadderResult) -> None:
    """Record a chunk whose group no holder could serve (nothing when the request ended)."""
    if result.withdrawn:
        return  # the request ended: nothing to record
    reason = Reason.CORRUPT if result.corrupt else Reason.READ_FAILED
    run.fail(ChunkFailure(chunk, group, reason, result.errors))


class BatchSteps:
    """The ``begin`` and ``end`` of one batch call: a chunk begins when a slot is free (its
    groups one by one), unless each slot has taken one and another caller waits for the window;
    once its last group ended it goes to the installer (unless it or an earlier chunk failed),
    which hands its slot back (at once, or once its device copy landed). What a chunk read
    from its first holder adds to the run (its bytes by tier) is kept here and recorded once,
    when the call ends (:meth:`finish`): one lock per call, not per chunk."""

    __slots__ = ("begun", "call", "expected", "failed", "free", "holders", "items", "keys",
                 "left", "lent", "nslots", "queued", "region", "run", "tier_bytes", "todo",
                 "waiters")  # fmt: skip

    def __init__(
        self,
        run: RestoreRun,
        probe: Probe,
        call: Installer,
        waiters: Sized,
        batch: Sequence[int],
        slots: list[Slot],
        region: Callable[[Slot, str], Any],
        expected: Mapping[str, int],
        items: dict[Slot, tuple[tuple[str, ...], list[ReadItem]]],
    ) -> None:
        self.run = run
        self.call = call
        self.region, self.expected = region, expected
        self.free = list(reversed(slots))
        self.nslots = len(slots)
        self.todo = list(reversed(batch))
        self.queued: list[ReadItem] = []  # the groups of the chunk begun last, not begun yet
        self.left: dict[int, int] = {}  # chunk -> its groups not ended yet
        self.lent: dict[int, dict[str, Borrowed]] = {}
        self.failed: set[int] = set()
        self.begun = 0
        # per slot, one item per group, reused chunk after chunk and batch after batch (the
        # caller keeps ``items`` for the run): an item is the tier's only between its begin and
        # its end, and its slot holds one chunk at a time
        self.items = items
        self.keys, self.holders = probe.keys, probe.holders
        self.tier_bytes: dict[str, int] = {}
        self.waiters = waiters  # true while another caller waits for a slot (a hint)

    def begin(self) -> ReadItem | None:
        if self.queued:
            return self.queued.pop()
        run, todo, free = self.run, self.todo, self.free
        if not todo:
            return None
        c = todo[-1]
        if c >= run.limit or run.stopped:
            return None
        if not free:
            free.extend(self.call.reclaim())  # a device copy in flight holds it
            if not free:
                return None
        if self.begun >= self.nslots and self.waiters:
            return None  # yield the window: the rest of the batch comes back to the worker
        self.begun += 1
        todo.pop()
        slot = free.pop()
        groups = run.needed[c]
        self.left[c] = len(groups)
        held = self.items.get(slot)
        if held is not None and held[0] == groups:
            items = held[1]
        else:
            items = self._items(slot, groups)
            self.items[slot] = (groups, items)
        key, holders = self.keys[c], self.holders[c]
        if len(items) == 1:
            item = items[0]
            item.key, item.chunk, item.holders = key, c, holders[item.group]
            item.header = None
            item.stored = -1
            return item
        for item in items:
            item.key, item.chunk, item.holders = key, c, holders[item.group]
            item.header, item.stored = None, -1
        self.queued.extend(reversed(items[1:]))
        return items[0]

    def _items(self, slot: Slot, groups: Sequence[str]) -> list[ReadItem]:
        key, region, expected = self.keys[0], self.region, self.expected
        return [ReadItem(key, g, region(slot, g), expected[g], token=slot) for g in groups]

    def end(self, item: ReadItem, result: LadderResult) -> bool:
        c = item.chunk
        run = self.run
        tier = result.tier
        if tier is not None:
            if result.attempts == 1 and not result.errors:  # its first holder served it
                tb = self.tier_bytes
                tb[tier] = tb.get(tier, 0) + result.nbytes
            else:
                run.record_read(result)
            if result.borrowed is not None:
                lent = self.lent.get(c)
                if lent is None:
                    lent = self.lent[c] = {}
                lent[item.group] = result.borrowed
        else:
            read_failed(run, c, item.group, result)
            self.failed.add(c)
        left = self.left[c] - 1
        if left:
            self.left[c] = left
            return not run.stopped
        del self.left[c]
        ok = c < run.limit and not run.stopped and c not in self.failed
        self.free.extend(self.call.after_read(run, c, item.token, self.lent.pop(c, None), ok))
        return not run.stopped

    def finish(self) -> None:
        """The call ends: copies still in flight land (and are recorded); lent payloads of
        chunks that never ended (a read that raised) go back; the bytes read are recorded."""
        try:
            self.free.extend(self.call.drain())
        finally:
            for lent in self.lent.values():
                for b in lent.values():
                    b.release()
            self.lent.clear()
            if self.tier_bytes:
                self.run.add_bytes(self.tier_bytes)
