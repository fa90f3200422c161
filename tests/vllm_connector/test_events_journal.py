"""The worker's event journal on its own: a removal racing a save cancels its notice, an object
is announced once per tier, the bound withdraws the oldest, removals of what was never
announced say nothing."""

from __future__ import annotations

import bsr
from bsr.testing import make_keys
from bsr.vllm._events import ChunkInfo, EventJournal, TierKind

KEYS = make_keys(4)
KINDS = {"host": TierKind("CPU", "LOCAL", "host"), "file": TierKind("STORAGE", "LOCAL", "disk")}


def info(i: int) -> ChunkInfo:
    return ChunkInfo(0, (bytes([i]) * 32,), None, (1, 2), 32)


def okey(i: int) -> bsr.ObjectKey:
    return bsr.ObjectKey(KEYS[i], "kv")


def gone(i: int, tier: str = "host", cause: bsr.Removal = bsr.Removal.EVICTED) -> bsr.ObjectRemoved:
    return bsr.ObjectRemoved(tier, okey(i).object_id, cause)


def test_a_removal_while_the_save_ran_cancels_its_notice() -> None:
    j = EventJournal(KINDS)
    since = j.begin()
    j.removed(gone(0))  # evicted after the save wrote it, before the audit's answer was used
    assert not j.stored("host", okey(0), info(0), since)
    assert j.stored("file", okey(0), info(0), since)  # another tier: unaffected
    j.end(since)
    assert [(n.stored, n.tier) for n in j.take()] == [(True, "file")]
    later = j.begin()  # a new save of it, after the removal: announced again
    assert j.stored("host", okey(0), info(0), later)
    j.end(later)


def test_announced_once_per_tier_and_removed_once() -> None:
    j = EventJournal(KINDS)
    s = j.begin()
    assert j.stored("host", okey(1), info(1), s)
    assert not j.stored("host", okey(1), info(1), s)  # already announced there
    j.end(s)
    j.removed(gone(1))
    j.removed(gone(1))  # reported twice (the tier, then an audit): one notice
    j.removed(gone(2))  # never announced: nothing
    out = j.take()
    assert [(n.stored, n.cause) for n in out] == [(True, ""), (False, "evicted")]
    assert j.announced() == []


def test_the_bound_withdraws_the_least_recently_stored() -> None:
    j = EventJournal(KINDS, max_objects=2)
    s = j.begin()
    for i in range(3):
        j.stored("host", okey(i), info(i), s)
    j.end(s)
    out = j.take()
    assert [(n.stored, n.info.block_hashes[0][0], n.cause) for n in out] == [
        (True, 0, ""), (True, 1, ""), (True, 2, ""), (False, 0, "withdrawn"),
    ]  # fmt: skip
    assert {o.object_id for _, o in j.announced()} == {okey(1).object_id, okey(2).object_id}
